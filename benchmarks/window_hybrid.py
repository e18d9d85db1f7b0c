"""The window hybrid's cost against its parts, timed in one process, paired and alternating.

What it answers: how much ``window=W`` adds to its pure method's cost, in units of the cost of
``local`` with that window. For each base method (performer, hedgehog) and for non-causal and
causal attention, the pure method, its hybrid (``window=W, window_factor=True``) and ``local``
with the same window run on the same q, k, v (B = 1, H = 8, D = 64, fp32, forward in inference
mode); each repeat runs all three in an order that alternates (``tools.bench.timing.paired``),
and the reported numbers are medians of per-repeat ratios: hybrid / pure, local / pure and
(hybrid - pure) / local, the window's added cost in units of ``local``'s. The load of a shared
machine slows neighbouring samples alike, so the ratios hold where the absolute times do not;
run with ``--threads 1`` and say the load.

    PYTHONPATH=src python3 benchmarks/window_hybrid.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import effattn
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_json
from effattn.tools.bench.timing import paired

HEADS, HEAD_DIM = 8, 64


def forward(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            module(q, k, v, causal=causal)

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["performer", "hedgehog"])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/window-hybrid/speed.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    print(describe(machine))
    load_start = os.getloadavg()
    print(f"load average at start: {load_start}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, args.n, HEAD_DIM) for _ in range(3))
    local = effattn.build("local", head_dim=HEAD_DIM, heads=HEADS, window=args.window).eval()
    print(f"{'method':>10} {'causal':>6} {'hyb/pure':>8} {'local/pure':>10} "
          f"{'(hyb-pure)/local':>16} {'pure ms':>8} {'hyb ms':>8} {'local ms':>8}")
    records = []
    for name in args.methods:
        pure = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0).eval()
        hybrid = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0, window=args.window,
                               window_factor=True).eval()
        for causal in (False, True):
            samples = paired({"pure": forward(pure, q, k, v, causal),
                              "hybrid": forward(hybrid, q, k, v, causal),
                              "local": forward(local, q, k, v, causal)}, args.repeats)
            per = list(zip(samples["pure"], samples["hybrid"], samples["local"], strict=True))
            rec = {
                "method": name, "causal": causal, "n": args.n, "window": args.window,
                "pass": "fwd", "repeats": args.repeats,
                "median_ms": {key: 1e3 * statistics.median(s) for key, s in samples.items()},
                "hybrid_over_pure": statistics.median(h / p_ for p_, h, _ in per),
                "local_over_pure": statistics.median(loc / p_ for p_, _, loc in per),
                "added_over_local": statistics.median((h - p_) / loc for p_, h, loc in per),
            }
            records.append(rec)
            ms = rec["median_ms"]
            print(f"{name:>10} {causal!s:>6} {rec['hybrid_over_pure']:>8.3f} "
                  f"{rec['local_over_pure']:>10.3f} {rec['added_over_local']:>16.2f} "
                  f"{ms['pure']:>8.1f} {ms['hybrid']:>8.1f} {ms['local']:>8.1f}", flush=True)
    load_end = os.getloadavg()
    print(f"load average at end: {load_end}")
    write_json(args.out, {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                          "threads": torch.get_num_threads(), "machine": machine,
                          "load_average_start": load_start, "load_average_end": load_end,
                          "records": records})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
