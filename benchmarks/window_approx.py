"""Output error of the window hybrids beside their pure methods, on the data of ``effattn approx``.

``effattn approx`` sweeps one budget option per method and takes no other option, so the
``window=W`` hybrid cannot be one of its rows; this script measures it with the study's own
pieces (``effattn.tools.approx``: the same Gaussian and peaked q, k, v in float64, the relative
error ``|out - exact| / |exact|`` against exact softmax, the same seeds, and ``distill`` fitting
learned maps on each seed's q, k). Non-causal, so the window is |i - j| <= W // 2. The hybrids
run without the per-head factor (``window_factor=False``): a random-feature kernel estimates
e^s, so a factor of 1 is the right balance, and the study trains nothing but the feature maps.

    PYTHONPATH=src python3 benchmarks/window_approx.py --fit-steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

import effattn
from effattn import naive
from effattn.tools import approx
from effattn.tools.bench.machine import machine_info
from effattn.tools.bench.results import write_csv, write_json

ROWS: list[tuple[str, dict[str, Any]]] = [
    ("performer", {"num_features": 256}),
    ("performer", {"num_features": 256, "window": 64}),
    ("hedgehog", {"num_features": 128}),
    ("hedgehog", {"num_features": 128, "window": 64}),
]
FIELDS = ("method", "options", "dataset", "mean", "std", "min", "max", "seeds", "fit_steps")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--fit-steps", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("benchmarks/window-hybrid/approx"))
    args = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()}")
    records = []
    for name, kw in approx.datasets([1.0], 8.0):
        inputs = [approx.make_inputs(heads=args.heads, n=args.length, d=args.head_dim, seed=s,
                                     **kw) for s in range(args.seeds)]
        for method, options in ROWS:
            errors, fitted = [], 0
            for s, (q, k, v) in enumerate(inputs):
                module = effattn.build(method, head_dim=args.head_dim, heads=args.heads,
                                       max_len=args.length, seed=s, **options).eval()
                if args.fit_steps and list(getattr(module, "feature_parameters", tuple)()):
                    approx.distill(module.float(), q.float(), k.float(), steps=args.fit_steps)
                    module.double()
                    fitted = args.fit_steps
                with torch.no_grad():
                    out = module(q, k, v)
                target = naive.softmax_attention(q, k, v, scale=module.scale)
                errors.append(approx.relative_error(out, target))
            t = torch.tensor(errors, dtype=torch.float64)
            rec = {"method": method, "options": options, "dataset": name,
                   "mean": float(t.mean()), "std": float(t.std()) if len(errors) > 1 else 0.0,
                   "min": float(t.min()), "max": float(t.max()), "seeds": len(errors),
                   "fit_steps": fitted}
            records.append(rec)
            print(f"{name:>20} {method:>10} {options!s:>42} {rec['mean']:.4f} ± {rec['std']:.4f}",
                  flush=True)
    print(f"load average at end: {os.getloadavg()}")
    write_json(args.out / "approx.json",
               {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                "length": args.length, "heads": args.heads, "head_dim": args.head_dim,
                "machine": machine_info(), "records": records})
    write_csv(args.out / "approx.csv", [{**r, "options": str(r["options"])} for r in records],
              FIELDS)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
