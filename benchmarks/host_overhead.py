"""Host time of an eager banded call on the GPU's path, measured on any machine: where the value
check's host sync falls in the call, and how much of the call's host work comes after it.

On a GPU an eager call's host sync (the NaN/inf check of q, k, v: docs/gpu.md, "Host syncs")
waits for every kernel launched before it. The host work between the sync and the call's own
launch then runs while the GPU has nothing queued: at short lengths, where a banded kernel takes
0.1 to 0.3 ms on an H200, that is the gap between effattn's call and the peer's (the peer
launches the same compiled FlexAttention kernel with no sync). This script forces the
FlexAttention strategy's compiled branch with the kernel replaced by a stub that returns empty
tensors, so it runs on a CPU, and times each call's host work in two parts:

- ``before``: from the call to the value check's read (work the previous call's kernel can
  hide; on a CPU it includes the check's own reductions, which a GPU runs as kernels);
- ``after``: from the read to the kernel's launch (work the GPU waits for).

It runs each method twice in one process: ``check``, the value check read where it is formed
(as before 2026-11-28, and as every method does whose engine does not read it:
``AttentionMethod.engine_reads_values`` off), and ``engine``, read by the engine right before
its launch. What a GPU gains is bounded by ``after`` of ``check`` minus ``after`` of ``engine``
per call: a bound, not a measurement of the GPU (a host and its device overlap as far as the
device's queue allows).

    PYTHONPATH=src python3 benchmarks/host_overhead.py --out benchmarks/host-overhead
    PYTHONPATH=src python3 benchmarks/host_overhead.py --methods local --length 16384

Writes results.json (rows: method, mode, before_us, after_us, total_us, calls, cpu) to --out.
Name the CPU beside the numbers: they are the host's, and move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import effattn
from effattn import base, strategy
from effattn.sparse import flex

# (name, method, options, causal, call inputs): the banded paths a user calls.
CASES: dict[str, tuple[str, dict[str, Any], bool, dict[str, Any]]] = {
    "local": ("local", {"window": 128}, False, {}),
    "local-causal": ("local", {"window": 128}, True, {}),
    "longformer": ("longformer", {"window": 128}, False, {}),
    "sparse-strided": ("sparse-strided", {}, True, {}),
    "softmax+window128": ("softmax", {}, True, {"sliding_window": 128}),
}


def cpu_name() -> str:
    """The host CPU's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Clock:
    """The times of the value check's read and of the kernel's launch within one call."""

    def __init__(self) -> None:
        self.read: float | None = None
        self.launch: float | None = None

    def stub(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.launch = time.perf_counter()
        return torch.empty_like(q), torch.empty(q.shape[:3])


def measure(name: str, engine_reads: bool, length: int, calls: int) -> dict[str, Any]:
    """Median host times (µs) of ``calls`` eager calls of case ``name``."""
    method, options, causal, call = CASES[name]
    module = effattn.build(method, head_dim=64, heads=8, max_len=length, seed=0, **options)
    module.eval()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64, generator=gen) for _ in range(3))
    clock = _Clock()
    read = base._read_values

    def timed_read(*args: Any) -> None:
        clock.read = time.perf_counter()
        read(*args)

    saved = (type(module).engine_reads_values, flex.compiled_on, flex._kernel,
             base._read_values)
    type(module).engine_reads_values = engine_reads
    flex.compiled_on = lambda device: True
    flex._kernel = lambda: clock.stub
    base._read_values = timed_read
    before, after, total = [], [], []
    try:
        with strategy.force(banded="flex"), torch.no_grad():
            for i in range(calls + 5):
                start = time.perf_counter()
                module(q, k, v, causal=causal, **call)
                end = time.perf_counter()
                if i >= 5:  # the first calls build and cache the BlockMask
                    before.append(clock.read - start)
                    after.append(clock.launch - clock.read)
                    total.append(end - start)
    finally:
        (type(module).engine_reads_values, flex.compiled_on, flex._kernel,
         base._read_values) = saved
    return {"method": name, "mode": "engine" if engine_reads else "check",
            "before_us": round(statistics.median(before) * 1e6, 1),
            "after_us": round(statistics.median(after) * 1e6, 1),
            "total_us": round(statistics.median(total) * 1e6, 1),
            "calls": calls, "length": length, "cpu": cpu_name(),
            "torch": torch.__version__}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(CASES), choices=list(CASES),
                        metavar="CASE", help=f"cases to run (default all: {', '.join(CASES)})")
    parser.add_argument("--length", type=int, default=256,
                        help="N (B = 1, H = 8, D = 64); short, so that the value check's "
                             "reductions, computed here on the CPU, stay small")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per case and mode")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    args = parser.parse_args(argv)
    if args.length <= 128:
        parser.error(f"--length must exceed the cases' window of 128, got {args.length}")
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    if args.out is not None:
        # Checked before measuring: a run is not spent to fail at its last line.
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--out {args.out}: cannot create the folder ({error.strerror})")
        if not os.access(args.out, os.W_OK):
            parser.error(f"--out {args.out}: the folder is not writable")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    rows = []
    try:
        for name in tqdm(args.methods, desc="cases", disable=None):
            for engine_reads in (False, True):
                rows.append(measure(name, engine_reads, args.length, args.calls))
    except KeyboardInterrupt:
        print("interrupted: nothing written; rerun the same command", file=sys.stderr)
        return 130
    print(f"host µs per eager call, kernel stubbed, N={args.length} ({rows[0]['cpu']})")
    print(f"{'case':20s} {'mode':7s} {'before':>8s} {'after':>8s} {'total':>8s}")
    for row in rows:
        print(f"{row['method']:20s} {row['mode']:7s} {row['before_us']:8.1f} "
              f"{row['after_us']:8.1f} {row['total_us']:8.1f}")
    if args.out is not None:
        target = args.out / "results.json"
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        os.replace(tmp, target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
