"""What each strategy of the kernelized engine holds and launches, accounted on the CPU.

Per method, strategy and length: the peak of the live tensor bytes above the inputs, for a
forward in inference mode and for a forward + backward of ``out.sum()``, and the ATen
operations the forward and the backward dispatch (``effattn.tools.bench.accounting``: views
excluded). Neither depends on the device or the load: a GPU strategy forced on the CPU
allocates the storages and dispatches the operations it would on a GPU, where each operation
is at least one kernel launch. ``sdpa`` rows are PyTorch's fused attention on the same q, k, v
(its CPU kernel, like flash attention, holds O(N) memory). B = 1, H = 8, D = 64, fp32, causal,
each method's defaults. ``--backward-scales`` sweeps the GPU strategy's backward span
(``effattn.kernelized.gpu.BACKWARD_SLICE_SCALE``: a span is that many times the CPU strategy's
causal budget, capped at the forward's slice): the trade of transient memory for launches.
``--strategies`` picks the kernelized strategies (default ``cpu,gpu``); ``triton`` (the fused
kernels, ``effattn.kernelized.fused``) runs them under Triton's interpreter here, which this
script turns on (slow: about a minute per call at N = 4096). Its kernels allocate nothing
themselves, and their launches are not ATen operations: ``launches`` counts them (1 per
forward slice, 2 per backward span), 0 on the other rows.

    PYTHONPATH=src python3 benchmarks/strategy_memory.py --lengths 4096,16384,65536
    PYTHONPATH=src python3 benchmarks/strategy_memory.py --strategies gpu,triton --lengths 4096

Writes ``<out>/results.json``, ``results.csv`` and ``peaks.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# On the CPU, Triton kernels (the triton strategy) run under the interpreter, chosen when a
# kernel is defined: before effattn imports its kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import effattn
from effattn import strategy
from effattn.kernelized import core, fused, gpu
from effattn.tools.bench.accounting import count_ops, live_peak_bytes
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.memory import MiB
from effattn.tools.bench.results import save_figure, write_csv, write_json

FIELDS = ["method", "strategy", "backward_scale", "n", "inputs_mib", "fwd_peak_mib",
          "train_peak_mib", "fwd_ops", "bwd_ops", "launches"]


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _strategies(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = sorted(set(names) - set(strategy.ENGINES["kernelized"]))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategies {unknown or text!r}; choose from {strategy.ENGINES['kernelized']}")
    return names


def _names(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = sorted(set(names) - set(effattn.methods()) - {"sdpa"})
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or text!r}")
    return names


def measure(method: str, n: int, kind: str, scale: int | None) -> dict[str, Any]:
    """One row: ``kind`` is "sdpa" or a kernelized strategy ("cpu", "gpu", "triton")."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g).requires_grad_() for _ in range(3))
    launches = 0
    if kind == "sdpa":
        def attend() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        module = effattn.build(method, head_dim=64, heads=8, seed=0)
        if kind == "triton":
            # One launch per forward slice, two per backward span (effattn.kernelized.fused).
            step = gpu.slice_tokens(8, module.feature_dim, 64, module.chunk_size,
                                    module.slice_elements)
            back = fused.backward_span_tokens(8, module.feature_dim, 64, module.chunk_size,
                                              module.slice_elements, torch.float32)
            launches = sum(1 + 2 * -(-(e - a) // back) for a, e in core._spans(n, step))

        def attend() -> torch.Tensor:
            with strategy.force(kernelized=kind):
                return module(q, k, v, causal=True)

    def forward() -> None:
        with torch.no_grad():
            attend()

    def train() -> None:
        attend().sum().backward()

    default = gpu.BACKWARD_SLICE_SCALE
    if scale is not None:
        # The sweep's one knob: a module constant, restored below.
        gpu.BACKWARD_SLICE_SCALE = scale
    try:
        # Warm-up of both paths, under the profiler: lazily built tensors (features, masks, and
        # ~16 MiB that a first profiled call of the triton strategy holds, at N = 4096) are not
        # the call's.
        train()
        live_peak_bytes(forward)
        fwd_peak = live_peak_bytes(forward)
        train_peak = live_peak_bytes(train)
        fwd_ops = count_ops(forward)
        out = attend()
        bwd_ops = count_ops(lambda: out.sum().backward())
    finally:
        gpu.BACKWARD_SLICE_SCALE = default
    return {"method": method, "strategy": kind,
            "backward_scale": scale, "n": n, "inputs_mib": 3 * q.numel() * 4 / MiB,
            "fwd_peak_mib": fwd_peak / MiB, "train_peak_mib": train_peak / MiB,
            "fwd_ops": fwd_ops, "bwd_ops": bwd_ops, "launches": launches}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    series: dict[tuple[str, str, int | None], list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault((r["method"], r["strategy"], r["backward_scale"]), []).append(
            (r["n"], r["train_peak_mib"]))
    methods = sorted({key[0] for key in series} - {"sdpa"})
    colours = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    styles = {"cpu": ":", "triton": (0, (1, 1)), 64: "--", 32: "-", 16: "-.", None: "-"}
    for (method, kind, scale), points in series.items():
        points.sort()
        label = method if kind == "sdpa" else f"{method} {kind}"
        if scale is not None:
            label += f" bwd x{scale}"
        ax.plot(*zip(*points, strict=True), marker="o", label=label,
                color=colours.get(method, "black"),
                linestyle=styles[kind] if kind in ("cpu", "triton") else styles.get(scale, "-"))
    ax.set(xscale="log", yscale="log", xlabel="N",
           ylabel="forward+backward peak above inputs (MiB)",
           title="Live tensor bytes, causal, B=1 H=8 D=64 fp32 (accounted on the CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", type=_names, default=_names("performer,linear,hedgehog"),
                        help="kernelized methods (default performer,linear,hedgehog)")
    parser.add_argument("--lengths", type=_positive_ints, default=[4096, 16384])
    parser.add_argument("--strategies", type=_strategies, default=_strategies("cpu,gpu"),
                        help="kernelized strategies (default cpu,gpu; also triton)")
    parser.add_argument("--backward-scales", type=_positive_ints, default=None,
                        help="GPU strategy backward spans to sweep (default: its constant)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/strategy-memory"))
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.exit(2, f"--out {args.out}: {err.strerror}\n")
    jobs: list[tuple[str, str, int | None]] = []
    for method in args.methods:
        if method == "sdpa":
            continue
        for kind in args.strategies:
            scales = args.backward_scales if kind == "gpu" and args.backward_scales else [None]
            jobs += [(method, kind, s) for s in scales]
    jobs.append(("sdpa", "sdpa", None))
    print(describe(machine_info()))
    rows = []
    try:
        for n in args.lengths:
            for method, kind, scale in tqdm(jobs, desc=f"N={n}", file=sys.stderr):
                rows.append(measure(method, n, kind, scale))
    except KeyboardInterrupt:
        print("interrupted: nothing written; rerun the same command", file=sys.stderr)
        return 130
    print(f"{'method':>10} {'strategy':>8} {'bwd':>4} {'N':>6} {'fwd MiB':>9} {'train MiB':>10}"
          f" {'fwd ops':>8} {'bwd ops':>8} {'launches':>8}")
    for r in rows:
        scale = "" if r["backward_scale"] is None else r["backward_scale"]
        print(f"{r['method']:>10} {r['strategy']:>8} {scale!s:>4} {r['n']:>6}"
              f" {r['fwd_peak_mib']:9.1f} {r['train_peak_mib']:10.1f} {r['fwd_ops']:8d}"
              f" {r['bwd_ops']:8d} {r['launches']:8d}")
    write_json(args.out / "results.json",
               {"machine": machine_info(), "shape": "B=1 H=8 D=64 fp32 causal",
                "default_backward_scale": gpu.BACKWARD_SLICE_SCALE, "rows": rows})
    write_csv(args.out / "results.csv", rows, FIELDS)
    plot(rows, args.out / "peaks.png")
    print(f"wrote {args.out}/results.json, results.csv, peaks.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
