"""How forward+backward time grows with N, as paired ratios that survive a noisy machine.

For each method, a short and a long length are timed alternately in one process (B = 1, H = 8,
D = 64, fp32, default options, gradients of q, k, v), and the growth is the median of the
per-pair ratios long / short: a neighbour that slows the machine slows both sides of a pair
alike, where the growth between two separately measured sweep points also measures the noise.
Linear scaling from 4096 to 16384 is 4x.

    PYTHONPATH=src python3 benchmarks/growth.py --methods local longformer bigbird --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import effattn
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_json

HEADS, HEAD_DIM = 8, 64


def fwd_bwd(method: torch.nn.Module, n: int) -> Callable[[], None]:
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))

    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        method(q, k, v).sum().backward()

    return run


def growth(name: str, short: int, long: int, pairs: int) -> dict[str, float]:
    method = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0)
    runs = {short: fwd_bwd(method, short), long: fwd_bwd(method, long)}
    for run in runs.values():
        run()  # warm-up
    samples: dict[int, list[float]] = {short: [], long: []}
    for r in range(pairs):
        for n in (short, long) if r % 2 == 0 else (long, short):
            start = time.perf_counter()
            runs[n]()
            samples[n].append(time.perf_counter() - start)
    ratio = statistics.median(b / a for a, b in zip(samples[short], samples[long], strict=True))
    return {"short_ms": 1e3 * statistics.median(samples[short]),
            "long_ms": 1e3 * statistics.median(samples[long]), "growth": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["local", "longformer", "bigbird"])
    p.add_argument("--short", type=int, default=4096)
    p.add_argument("--long", type=int, default=16384)
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/growth/results.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(machine_info()))
    print(f"{'method':>12} {args.short:>8} ms {args.long:>8} ms  growth (median of pairs)")
    rows = []
    for name in args.methods:
        row = {"method": name, **growth(name, args.short, args.long, args.pairs)}
        rows.append(row)
        print(f"{name:>12} {row['short_ms']:11.1f} {row['long_ms']:11.1f}  {row['growth']:.2f}x",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"command": "growth.py", "short": args.short, "long": args.long,
                          "pairs": args.pairs, "machine": machine_info(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
