"""A window hybrid's decoding step against its pure method's, paired in one process.

For each base method (hedgehog, performer) the pure module and its hybrid (``window=W``) both
prefill the same P tokens (B = 1, H = 8, D = 64, fp32, inference mode), then decode the same
next token over and over from their states, in alternating order
(``tools.bench.timing.paired``); the number is the median of the per-repeat ratios hybrid /
pure. The states are updated in place by each step, as in generation. Run with
``--threads 1`` and say the load:

    PYTHONPATH=src python3 benchmarks/window_hybrid_decode.py --threads 1
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=1024, help="tokens before the step")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/window-hybrid"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(machine_info()))
    print("load average at start:", os.getloadavg())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, args.prefill + 1, 64, generator=g) for _ in range(3))
    head, last = slice(0, args.prefill), slice(args.prefill, args.prefill + 1)
    rows = []
    for method in ("hedgehog", "performer"):
        modules = {"pure": effattn.build(method, head_dim=64, heads=8, seed=0).eval(),
                   "hybrid": effattn.build(method, head_dim=64, heads=8, seed=0,
                                           window=args.window).eval()}
        with torch.inference_mode():
            states = {name: m.prefill(q[:, :, head], k[:, :, head], v[:, :, head])[1]
                      for name, m in modules.items()}

            def step(name: str, modules: dict = modules, states: dict = states):
                def call():
                    return modules[name].step(q[:, :, last], k[:, :, last], v[:, :, last],
                                              states[name])
                return call
            samples = paired({name: step(name) for name in modules}, args.repeats)
        rows.append({"method": method, "window": args.window, "prefill": args.prefill,
                     "pure_ms": 1e3 * statistics.median(samples["pure"]),
                     "hybrid_ms": 1e3 * statistics.median(samples["hybrid"]),
                     "ratio": median_ratio(samples["hybrid"], samples["pure"])})
    print(f"{'method':>10} {'pure ms':>8} {'hybrid ms':>9} {'hybrid/pure':>11}")
    for r in rows:
        print(f"{r['method']:>10} {r['pure_ms']:8.3f} {r['hybrid_ms']:9.3f} {r['ratio']:11.2f}")
    print("load average at end:", os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "decode.json", {"machine": machine_info(),
                                          "threads": torch.get_num_threads(), "rows": rows})
    print(f"wrote {args.out / 'decode.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
