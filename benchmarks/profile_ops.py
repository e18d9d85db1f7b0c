"""Where a method's time goes: torch.profiler's operator table for one forward (or forward and
backward) call, on the CPU or a GPU.

    PYTHONPATH=src python3 benchmarks/profile_ops.py --methods performer local --length 16384
    PYTHONPATH=src python3 benchmarks/profile_ops.py --device cuda --dtype bfloat16 --pass fwdbwd

Prints, per method, the operators sorted by their own device time (CUDA) or CPU time, the
number of calls of each (many short calls mean launch-bound work on a GPU) and the wall time of
the profiled call. B = 1, H = 8, D = 64 and the method's default options unless told otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import effattn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def profile_method(method: str, args: argparse.Namespace) -> str:
    """The profiler's table for ``args.calls`` calls of ``method`` after two warm-up calls."""
    device = torch.device(args.device)
    module = effattn.build(method, head_dim=args.head_dim, heads=args.heads,
                           max_len=args.length, seed=0).to(device).eval()
    shape = (args.batch, args.heads, args.length, args.head_dim)
    grad = args.pass_name == "fwdbwd"
    q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[args.dtype]).requires_grad_(grad)
               for _ in range(3))

    def call() -> None:
        if grad:
            module(q, k, v, causal=args.causal).sum().backward()
        else:
            with torch.inference_mode():
                module(q, k, v, causal=args.causal)

    for _ in range(2):
        call()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    call()
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(args.calls):
            call()
        sync()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60)
    return f"== {method}, N={args.length}, {args.pass_name}, one call {wall_ms:.2f} ms\n{table}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["performer", "local", "softmax"],
                        choices=effattn.methods(), metavar="METHOD")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pass", dest="pass_name", choices=("fwd", "fwdbwd"), default="fwd")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=3, help="profiled calls (default 3)")
    parser.add_argument("--rows", type=int, default=25, help="operators shown (default 25)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    try:
        for method in args.methods:
            print(profile_method(method, args), flush=True)
    except KeyboardInterrupt:
        print("interrupted: nothing is saved; run the command again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
