"""The kernelized core against a baseline copy of it, timed in one process, paired and alternating.

The baseline is another checkout's ``src/effattn/kernelized/core.py`` (e.g. from
``git worktree add --detach /tmp/effattn-base <commit>``) from before the CPU strategy moved
into ``kernelized/cpu.py`` (a self-contained core.py; a later one is refused), loaded under
another module name:
both cores run the same modules' feature maps on the same inputs (B = 1, H = 8, D = 64, fp32,
each method's default options), so the ratio is the core's alone. For each method, non-causal
and causal: the forward (inference mode) and forward + backward (q, k, v require grad,
``out.sum().backward()``), new / baseline as the median of per-pair ratios (each repeat runs
both, in an order that alternates), and the new core's causal / non-causal forward. A machine
shared with other work slows neighbouring samples alike, so the ratios hold where the absolute
times do not; run it with ``--threads 1`` and say how loaded the machine was.

    PYTHONPATH=src python3 benchmarks/recompute.py \\
        --baseline /tmp/effattn-base/src/effattn/kernelized/core.py --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import effattn
from effattn.kernelized import core
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_json
from effattn.tools.bench.timing import median_ratio, paired

HEADS, HEAD_DIM = 8, 64
KERNELIZED = ("performer", "favor", "rfa", "linear")


def load_baseline(path: Path) -> ModuleType:
    if (path.parent / "cpu.py").exists():
        # Such a core.py imports its strategies (cpu.py, gpu.py) by the package's name when
        # called: they would be this checkout's, and the "baseline" this one's CPU strategy.
        raise SystemExit(f"{path}: a core.py whose strategies live beside it (cpu.py) cannot be "
                         "loaded alone; give a baseline from before the CPU strategy's own module")
    spec = importlib.util.spec_from_file_location("effattn_baseline_core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module






def attend(impl: ModuleType, module: Any, causal: bool, chunk: int) -> Callable[..., torch.Tensor]:
    extra = {"feature_tensors": module.feature_tensors()} if impl is core else {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return impl.kernelized_attention(
            q, k, v, module.features, feature_dim=module.feature_dim, causal=causal,
            chunk_size=chunk, eps=module.eps, slice_elements=module.slice_elements, **extra,
        )

    return run


def timed(fn: Callable[..., torch.Tensor], n: int, backward: bool) -> Callable[[], None]:
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=backward) for _ in range(3))

    def run() -> None:
        if backward:
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v).sum().backward()
        else:
            with torch.inference_mode():
                fn(q, k, v)

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the baseline's core.py")
    p.add_argument("--baseline-chunk", type=int, default=None,
                   help="the baseline's chunk size (default: the module's)")
    p.add_argument("--methods", nargs="+", default=list(KERNELIZED))
    p.add_argument("--lengths", nargs="+", type=int, default=[4096])
    p.add_argument("--passes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/recompute/results.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    old = load_baseline(args.baseline)
    machine = machine_info()
    print(describe(machine))
    print(f"load average at start: {os.getloadavg()}")
    print(f"{'method':>10} {'N':>6} {'pass':>7} {'new/old':>8} {'new/old c':>9} "
          f"{'new ms':>8} {'new c ms':>9} {'c/non new':>9} {'c/non old':>9}")
    records = []
    for n in args.lengths:
        for name in args.methods:
            module = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0).eval()
            for pass_name in args.passes:
                backward = pass_name == "fwdbwd"
                fns = {}
                for causal in (False, True):
                    tag = "-causal" if causal else ""
                    fns["new" + tag] = timed(attend(core, module, causal, module.chunk_size), n,
                                             backward)
                    fns["old" + tag] = timed(
                        attend(old, module, causal, args.baseline_chunk or module.chunk_size), n,
                        backward)
                samples = paired(fns, args.repeats)
                rec = {
                    "method": name, "n": n, "pass": pass_name, "repeats": args.repeats,
                    "median_ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()},
                    "new_over_old": median_ratio(samples["new"], samples["old"]),
                    "new_over_old_causal": median_ratio(samples["new-causal"],
                                                        samples["old-causal"]),
                    "causal_over_noncausal_new": median_ratio(samples["new-causal"],
                                                              samples["new"]),
                    "causal_over_noncausal_old": median_ratio(samples["old-causal"],
                                                              samples["old"]),
                }
                records.append(rec)
                ms = rec["median_ms"]
                print(f"{name:>10} {n:>6} {pass_name:>7} {rec['new_over_old']:>8.3f} "
                      f"{rec['new_over_old_causal']:>9.3f} {ms['new']:>8.1f} "
                      f"{ms['new-causal']:>9.1f} {rec['causal_over_noncausal_new']:>9.2f} "
                      f"{rec['causal_over_noncausal_old']:>9.2f}", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    write_json(args.out, {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                          "baseline": str(args.baseline), "threads": torch.get_num_threads(),
                          "machine": machine, "load_average_end": os.getloadavg(),
                          "records": records})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
