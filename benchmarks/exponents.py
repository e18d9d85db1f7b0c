"""What hedgehog's per-feature stabiliser costs against the row convention it replaced, paired.

The exp form of ``hedgehog`` runs the per-feature core (``effattn.kernelized.exponents``); the
row core (``effattn.kernelized.core``, one scale per key) is what it ran before, and is still
reachable as ``dataclasses.replace(module.core(), exponents=None)``. Both run on the same q, k,
v (B = 1, H = 8, D = 64, F = 64 projections so 128 features, fp32), alternating
(``tools.bench.timing.paired``); the numbers are medians of per-repeat ratios per-feature / row:
forward (inference mode) and forward + backward, causal and non-causal, and one decoding step
after a prefill. Run with ``--threads 1`` and say the load:

    PYTHONPATH=src python3 benchmarks/exponents.py --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

import effattn
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_json
from effattn.tools.bench.timing import median_ratio, paired


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/exponents"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(machine_info()))
    print("load average at start:", os.getloadavg())
    module = effattn.build("hedgehog", head_dim=64, heads=8, num_features=64, seed=0)
    row = dataclasses.replace(module.core(), exponents=None)
    per_feature = module.core()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, args.n, 64, generator=g) for _ in range(3))
    rows = []
    for causal in (False, True):
        for passes in ("fwd", "fwdbwd"):
            def run(core, causal=causal, passes=passes):
                def call():
                    if passes == "fwd":
                        with torch.inference_mode():
                            return core.attention(q, k, v, causal=causal)
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    core.attention(qg, kg, vg, causal=causal).sum().backward()
                    return None
                return call
            samples = paired({"row": run(row), "per_feature": run(per_feature)}, args.repeats)
            rows.append({"what": passes, "causal": causal, "n": args.n,
                         "row_ms": 1e3 * statistics.median(samples["row"]),
                         "per_feature_ms": 1e3 * statistics.median(samples["per_feature"]),
                         "ratio": median_ratio(samples["per_feature"], samples["row"])})
    with torch.inference_mode():
        states = {name: core.causal(q[:, :, :1024], k[:, :, :1024], v[:, :, :1024])[1]
                  for name, core in (("row", row), ("per_feature", per_feature))}

        def decode(core, name):
            def call():
                return core.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], states[name])
            return call
        samples = paired({name: decode(core, name)
                          for name, core in (("row", row), ("per_feature", per_feature))},
                         50 * args.repeats)
    rows.append({"what": "decode step", "causal": True, "n": 1024,
                 "row_ms": 1e3 * statistics.median(samples["row"]),
                 "per_feature_ms": 1e3 * statistics.median(samples["per_feature"]),
                 "ratio": median_ratio(samples["per_feature"], samples["row"])})
    print(f"{'what':>12} {'causal':>6} {'row ms':>8} {'per-feature ms':>14} {'ratio':>6}")
    for r in rows:
        print(f"{r['what']:>12} {r['causal']!s:>6} {r['row_ms']:8.2f} {r['per_feature_ms']:14.2f}"
              f" {r['ratio']:6.2f}")
    print("load average at end:", os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "speed.json", {"machine": machine_info(),
                                         "threads": torch.get_num_threads(), "rows": rows})
    print(f"wrote {args.out / 'speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
