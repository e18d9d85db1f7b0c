"""The learned and Taylor feature maps against performer, timed in one process, paired.

B = 1, H = 8, D = 64, fp32, one length (default 4096): ``performer`` with F = 256 positive
features, ``hedgehog`` with F = 128 learned projections (2F = 256 features: the same feature
count) and its default F = D = 64 (128 features), ``taylor`` at its default P = 16
(1 + 16 + 136 = 153 features) and at P = 21 (253 features, about performer's 256). Forward
(no_grad), forward+backward (of out.sum(); eval mode, gradients of q, k, v and the parameters)
and causal forward; each repeat times every configuration once, in an order that alternates, and
the ratios to performer are medians of the per-repeat ratios (see benchmarks/peers.py).

    PYTHONPATH=src python3 benchmarks/fmaps.py --threads 1 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from peers import HEAD_DIM, HEADS, call, inputs, median_ratio, paired

import effattn
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_json

CONFIGS = {  # label: (method, options)
    "performer F=256": ("performer", {"num_features": 256}),
    "hedgehog F=128 (256 features)": ("hedgehog", {"num_features": 128}),
    "hedgehog F=64 (128 features)": ("hedgehog", {"num_features": 64}),
    "taylor P=16 (153 features)": ("taylor", {"proj_dim": 16}),
    "taylor P=21 (253 features)": ("taylor", {"proj_dim": 21}),
}
BASELINE = "performer F=256"
PASSES = {"fwd": (False, False), "fwdbwd": (False, True), "causal fwd": (True, False)}


def measure(n: int, repeats: int) -> list[dict[str, Any]]:
    records = []
    print(f"\n{'pass':>10} {'configuration':>30} {'median ms':>10} {'/ performer':>12}")
    for pass_name, (causal, backward) in PASSES.items():
        args = inputs(n, backward)
        fns = {}
        for label, (name, options) in CONFIGS.items():
            module = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0, **options)
            fns[label] = call(module.eval(), args, backward, causal=causal)
        samples = paired(fns, repeats)
        for label in CONFIGS:
            rec = {"pass": pass_name, "n": n, "configuration": label, "repeats": repeats,
                   "median_ms": statistics.median(samples[label]) * 1e3,
                   "over_performer": median_ratio(samples[label], samples[BASELINE])}
            records.append(rec)
            print(f"{pass_name:>10} {label:>30} {rec['median_ms']:>10.1f} "
                  f"{rec['over_performer']:>11.2f}x", flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/fmaps/results.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    print(describe(machine))
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "shape": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "machine": machine,
        "records": measure(args.length, args.repeats),
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
