"""Two checkouts of effattn timed against each other, paired and alternating.

Each tree runs in a worker process of its own, which imports that tree's ``src`` and nothing
else (two copies of effattn in one process would register its torch.library operator twice).
Every method is built in both with the same seed, on the same q, k, v, and every repeat asks the
two workers in turn, in an order that alternates, so that a machine shared with other work slows
both alike: the ratio new / old holds where the milliseconds do not. The workers time their own
calls (no pipe in the measurement). Forward in inference mode and forward + backward of
``out.sum()``; B = 1, H = 8, D = 64, fp32, each method's defaults. The two outputs are compared
too (``|diff|``: a change of engine should not change the answer).

    git worktree add --detach /tmp/effattn-old main
    python3 benchmarks/paired_trees.py --old /tmp/effattn-old/src --new src \\
        --methods local,local:causal,longformer --lengths 4096,16384 --threads 1

Say how loaded the machine was (``uptime``) beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# The worker: imports the tree at argv[1] (refusing any other effattn), then answers one JSON
# request per line: {"method", "n", "causal", "pass": "out" | "fwd" | "fwdbwd", "path"} with
# {"s": seconds of one call} (or, for "out", the forward's output saved at "path").
WORKER = r"""
import json, sys, time
from pathlib import Path
src = sys.argv[1]
sys.path.insert(0, src)
import torch
import effattn
if not str(Path(effattn.__file__).resolve()).startswith(src):
    sys.exit(f"{src} holds no effattn package (imported {effattn.__file__})")
torch.set_num_threads(int(sys.argv[2]))
built = {}


def answer(ask):
    key = (ask["method"], ask["n"])
    if key not in built:
        try:
            module = effattn.build(ask["method"], head_dim=64, heads=8, seed=0)
        except (KeyError, ValueError, TypeError) as err:
            return {"error": str(err).strip('"')}
        g = torch.Generator().manual_seed(ask["n"])
        built[key] = (module, [torch.randn(1, 8, ask["n"], 64, generator=g) for _ in range(3)])
    module, qkv = built[key]
    causal = ask["causal"]
    if ask["pass"] == "out":
        with torch.no_grad():
            torch.save(module(*qkv, causal=causal), ask["path"])
        return {}
    start = time.perf_counter()
    if ask["pass"] == "fwd":
        with torch.inference_mode():
            module(*qkv, causal=causal)
    else:
        leaves = [t.clone().requires_grad_() for t in qkv]
        module(*leaves, causal=causal).sum().backward()
    return {"s": time.perf_counter() - start}


try:
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)
except KeyboardInterrupt:  # the parent reports it
    sys.exit(130)
"""


class Tree:
    """A worker process running one tree's effattn."""

    def __init__(self, src: Path, threads: int) -> None:
        self.src = src
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(src), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the worker of {self.src} stopped (exit {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            print(f"paired_trees: --methods: {reply['error']}", file=sys.stderr)
            raise SystemExit(2)
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the baseline tree's src folder")
    p.add_argument("--new", type=Path, required=True, help="the changed tree's src folder")
    p.add_argument("--methods", default="local,local:causal",
                   help="comma list of methods, ':causal' for the causal form")
    p.add_argument("--lengths", default="4096", help="comma list of N")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    a = p.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths: expected integers, got {a.lengths!r}")
    for name in ("old", "new"):
        if not (getattr(a, name) / "effattn").is_dir():
            p.error(f"--{name}: {getattr(a, name)} holds no effattn package")
    if a.out is not None and not (a.out.parent.is_dir() and os.access(a.out.parent, os.W_OK)):
        p.error(f"--out: cannot write in {a.out.parent}")
    trees = {"old": Tree(a.old.resolve(), a.threads), "new": Tree(a.new.resolve(), a.threads)}
    try:
        results = _measure(trees, a.methods.split(","), lengths, a.repeats)
    except KeyboardInterrupt:
        print("interrupted: nothing written; run the same command again", file=sys.stderr)
        return 130
    finally:
        for tree in trees.values():
            tree.close()
    if a.out:
        tmp_out = a.out.with_suffix(".tmp")
        tmp_out.write_text(json.dumps(results, indent=1))
        tmp_out.replace(a.out)
    return 0


def _measure(trees: dict[str, Tree], entries: list[str], lengths: list[int],
             repeats: int) -> dict[str, dict[str, float]]:
    """Every method x length x pass, paired between the trees; prints a line per result."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            for entry in entries:
                name, _, flag = entry.partition(":")
                call = {"method": name, "n": n, "causal": flag == "causal"}
                outs = {}
                for t, tree in trees.items():
                    path = str(Path(tmp) / f"{t}.pt")
                    tree.ask(**call, path=path, **{"pass": "out"})
                    outs[t] = torch.load(path)
                diff = (outs["old"] - outs["new"]).abs().max().item()
                for pas in ("fwd", "fwdbwd"):
                    samples: dict[str, list[float]] = {"old": [], "new": []}
                    for r in range(repeats + 1):  # the first round warms up
                        for t in ("old", "new") if r % 2 == 0 else ("new", "old"):
                            seconds = trees[t].ask(**call, **{"pass": pas})["s"]
                            if r:
                                samples[t].append(seconds)
                    med = {t: statistics.median(v) for t, v in samples.items()}
                    ratio = statistics.median(
                        x / y for x, y in zip(samples["new"], samples["old"], strict=True))
                    key = f"{entry} N={n} {pas}"
                    results[key] = {"old_ms": med["old"] * 1e3, "new_ms": med["new"] * 1e3,
                                    "new_over_old": ratio, "max_abs_diff": diff}
                    print(f"{key:36s} old {med['old'] * 1e3:8.1f} ms  new "
                          f"{med['new'] * 1e3:8.1f} ms  new/old {ratio:5.3f}  |diff| {diff:.1e}",
                          flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
