"""How far bf16 inputs take each strategy's output and gradients from the float64 result: the
relative error ||x - x64|| / ||x64|| of the output and of every input's gradient, causal, with
the inputs rounded to bf16 first (so that only the computation's rounding is measured), for
the ``triton`` strategy (which saves its output in bf16, as flash attention does), the ``gpu``
strategy (fp32 copies of the inputs, an fp32 output) and softmax SDPA in bf16.

Errors, not time: they do not depend on the machine's load. The triton strategy runs under
Triton's interpreter on the CPU (set here).

    python3 benchmarks/half_precision_error.py --out benchmarks/half-precision-error

Writes ``<out>/results.json`` and ``results.csv``; exits 2 with one line on a bad argument.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# On the CPU, Triton kernels (the triton strategy) run under the interpreter, chosen when a
# kernel is defined: before effattn imports its kernels. Only when run as a program: a process
# that imports this module (the tests) keeps its own choice, which on a GPU machine is to
# compile every Triton kernel, inductor's too.
if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import effattn  # noqa: E402
from effattn import strategy  # noqa: E402
from effattn.tools.bench.machine import describe, machine_info  # noqa: E402
from effattn.tools.bench.results import write_csv, write_json  # noqa: E402

METHODS = {"performer": {}, "linear": {}, "rfa-gated": {"gated": True}, "taylor": {}}
FIELDS = ["method", "strategy", "n", "heads", "head_dim", "out", "d_q", "d_k", "d_v", "d_gate"]


def errors(method: str, kind: str, n: int, heads: int, head_dim: int) -> dict[str, Any]:
    """One row: ``method`` a key of METHODS or "sdpa", ``kind`` a kernelized strategy."""
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, heads, n, head_dim, generator=g).to(torch.bfloat16)
              for _ in range(3)]
    if METHODS.get(method):
        logits = torch.randn(1, heads, n, generator=g) + 2.0
        inputs.append(torch.sigmoid(logits).to(torch.bfloat16))
    weights = torch.randn(1, heads, n, head_dim, generator=g, dtype=torch.float64)
    module = None if method == "sdpa" else effattn.build(
        method.removesuffix("-gated"), head_dim=head_dim, heads=heads, seed=0,
        **METHODS[method]).eval()

    def attend(args: list[torch.Tensor], used: str) -> torch.Tensor:
        if module is None:
            return torch.nn.functional.scaled_dot_product_attention(*args, is_causal=True)
        with strategy.force(kernelized=used):
            return module(*args[:3], causal=True, **({"gate": args[3]} if args[3:] else {}))

    results = {}
    # The float64 result by the gpu strategy (the strategies agree to rounding in float64).
    for dtype, used in ((torch.float64, "gpu"), (torch.bfloat16, kind)):
        args = [x.to(dtype).requires_grad_() for x in inputs]
        out = attend(args, used)
        grads = torch.autograd.grad((out.double() * weights).sum(), args)
        results[dtype] = [out.double(), *(x.double() for x in grads)]
    names = ["out", "d_q", "d_k", "d_v", "d_gate"]
    row = {"method": method, "strategy": kind, "n": n, "heads": heads, "head_dim": head_dim}
    for label, a, ref in zip(names, results[torch.bfloat16], results[torch.float64],
                             strict=False):
        row[label] = ((a - ref).norm() / ref.norm()).item()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/half-precision-error"))
    args = parser.parse_args(argv)
    for name in ("n", "heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.exit(2, f"--{name.replace('_', '-')} must be >= 1\n")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.exit(2, f"--out {args.out}: {err.strerror}\n")
    machine = machine_info()
    print(describe(machine))
    rows = []
    try:
        for method in METHODS:
            for kind in ("triton", "gpu"):
                rows.append(errors(method, kind, args.n, args.heads, args.head_dim))
        rows.append(errors("sdpa", "sdpa", args.n, args.heads, args.head_dim))
    except KeyboardInterrupt:
        print("interrupted: nothing written; run the same command again", file=sys.stderr)
        return 130
    for r in rows:
        print(f"{r['method']:10s} {r['strategy']:7s} " + " ".join(
            f"{k}={r[k]:.2e}" for k in FIELDS[5:] if k in r))
    write_json(args.out / "results.json", {"machine": machine, "rows": rows})
    write_csv(args.out / "results.csv", rows, FIELDS)
    print(f"wrote {args.out}/results.json and results.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
