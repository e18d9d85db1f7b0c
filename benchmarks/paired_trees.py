"""Two checkouts of effattn timed against each other in one process, paired and alternating.

Each tree's ``src`` is imported as its own copy of the package (the module cache is cleared
between the two imports), each method is built from both with the same seed, and every repeat
runs the two in an order that alternates, so that a machine shared with other work slows both
alike: the ratio new / old holds where the milliseconds do not. Forward in inference mode and
forward + backward of ``out.sum()``; B = 1, H = 8, D = 64, fp32, each method's defaults. The two
outputs are compared too (``|diff|``: a change of engine should not change the answer).

    git worktree add --detach /tmp/effattn-old main
    python3 benchmarks/paired_trees.py --old /tmp/effattn-old/src --new src \\
        --methods local,local:causal,longformer --lengths 4096,16384 --threads 1

Say how loaded the machine was (``uptime``) beside the numbers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

from effattn.tools.bench.timing import paired


def load(src: Path) -> ModuleType:
    """Import the effattn package found under ``src`` as a copy of its own."""
    for name in [m for m in sys.modules if m == "effattn" or m.startswith("effattn.")]:
        del sys.modules[name]
    sys.path.insert(0, str(src))
    try:
        mod = importlib.import_module("effattn")
    finally:
        sys.path.remove(str(src))
    if not str(mod.__file__).startswith(str(src)):
        raise SystemExit(f"--old/--new: {src} holds no effattn package (imported {mod.__file__})")
    return mod


def forward(m: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool) -> None:
    with torch.inference_mode():
        m(q, k, v, causal=causal)


def backward(m: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             causal: bool) -> None:
    m(q, k, v, causal=causal).sum().backward()
    q.grad = k.grad = v.grad = None




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the baseline tree's src folder")
    p.add_argument("--new", type=Path, required=True, help="the changed tree's src folder")
    p.add_argument("--methods", default="local,local:causal",
                   help="comma list of methods, ':causal' for the causal form")
    p.add_argument("--lengths", default="4096", help="comma list of N")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    a = p.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths: expected integers, got {a.lengths!r}")
    torch.set_num_threads(a.threads)
    trees = {"old": load(a.old.resolve()), "new": load(a.new.resolve())}
    b, h, d = 1, 8, 64
    results = {}
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        for entry in a.methods.split(","):
            name, _, flag = entry.partition(":")
            causal = flag == "causal"
            mods = {t: e.build(name, head_dim=d, heads=h, seed=0) for t, e in trees.items()}

            with torch.no_grad():
                diff = (mods["old"](q, k, v, causal=causal)
                        - mods["new"](q, k, v, causal=causal)).abs().max().item()
            for pas, fn, args in (("fwd", forward, (q, k, v)), ("fwdbwd", backward, (qg, kg, vg))):
                samples = paired({t: partial(fn, m, *args, causal) for t, m in mods.items()},
                                 a.repeats)
                med = {t: statistics.median(v) for t, v in samples.items()}
                key = f"{entry} N={n} {pas}"
                results[key] = {"old_ms": med["old"] * 1e3, "new_ms": med["new"] * 1e3,
                                "new_over_old": med["new"] / med["old"], "max_abs_diff": diff}
                print(f"{key:36s} old {med['old'] * 1e3:8.1f} ms  new {med['new'] * 1e3:8.1f} ms"
                      f"  new/old {med['new'] / med['old']:5.3f}  |diff| {diff:.1e}", flush=True)
    if a.out:
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(a.out)


if __name__ == "__main__":
    main()
