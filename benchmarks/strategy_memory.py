"""What each strategy of the kernelized engine holds and launches, accounted on the CPU.

Per method, strategy and length: the peak of the live tensor bytes above the inputs, for a
forward in inference mode and for a forward + backward of ``out.sum()``, and the ATen
operations the forward and the backward dispatch (``effattn.tools.bench.accounting``: views
excluded). Neither depends on the device or the load: a GPU strategy forced on the CPU
allocates the storages and dispatches the operations it would on a GPU, where each operation
is at least one kernel launch. ``sdpa`` rows are PyTorch's fused attention on the same q, k, v
(its CPU kernel, like flash attention, holds O(N) memory). B = 1, H = 8, D = 64, causal, each
method's defaults; ``--dtype`` the inputs' dtype (float32, the default, or bfloat16; SDPA's
too). ``--methods`` takes the kernelized methods and ``rfa-gated`` (gated RFA, with a gate
of the call's length as a fourth input). ``--backward-scales`` sweeps the GPU strategy's
backward span (``effattn.kernelized.gpu.BACKWARD_SLICE_SCALE``: a span is that many times the
CPU strategy's causal budget, capped at the forward's slice): the trade of transient memory
for launches. ``--strategies`` picks the kernelized strategies (default ``cpu,gpu``); ``triton``
is the fused kernels (``effattn.kernelized.fused``), whose launches are not ATen operations:
``launches`` counts them in one training call (1 per forward slice and 3 per backward span,
and 2 row-max launches for each of those where performer's map is formed in the kernels), 0
on the other rows.

The fused kernels allocate nothing themselves: every buffer they write is allocated by ATen
in their Python wrappers (``effattn.kernelized.fused_kernels.forward``, ``backward``) before
the launch, and what follows a launch dispatches the same operations whatever values the
kernel wrote, except the lost-row check, which raises where a denominator is 0. So the
triton rows do not depend on what the kernels compute, and ``--kernels`` chooses how they
run:

- ``dry`` (the default): each kernel is replaced, for the run, by a stand-in launched with
  the same syntax that runs nothing and fills the buffers the kernel writes (found by the
  kernel's argument names) with neutral values: denominators 1, so that no row is lost, and 0
  elsewhere (numerators, row and running scales, states, gradients). It fills them through
  NumPy's view of the buffer, which is no ATen operation and no allocation, as a kernel's
  stores are neither: the rows equal the interpreter's (``tests/test_strategy_memory.py``
  checks peaks, operations and launches on several slices and spans of linear, performer and
  gated RFA), without running the kernels, so at any N, and in bfloat16;
- ``interpret``: the kernels run under Triton's interpreter, which this script turns on
  (minutes per call at N = 4096: half an hour for performer's row on 2 cores; bfloat16 is
  refused: the interpreter does not run bf16 ``tl.dot`` correctly). It leaves each launch's
  arguments in reference cycles, so their storages would be freed at Python's next garbage
  collection, wherever it falls, rather than when the code drops them: the script collects
  them after each launch.

Every peak is taken after a garbage collection, with no automatic one within the call.

What neither measures: a kernel's registers and shared memory on a GPU, which are not tensor
allocations (``benchmarks/triton_resources.py`` reports them per kernel, compiled for sm_80
and sm_90 without a GPU).

    PYTHONPATH=src python3 benchmarks/strategy_memory.py --lengths 4096,16384,65536
    PYTHONPATH=src python3 benchmarks/strategy_memory.py --strategies gpu,triton \\
        --methods performer,linear,rfa,rfa-gated --lengths 4096,16384,65536

Writes ``<out>/results.json``, ``results.csv`` and ``peaks.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# On the CPU, Triton kernels (the triton strategy) run under the interpreter, chosen when a
# kernel is defined: before effattn imports its kernels. Only when run as a program: a process
# that imports this module (the tests) keeps its own choice, which on a GPU machine is to
# compile every Triton kernel, inductor's too.
if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import effattn
from effattn import strategy
from effattn.kernelized import gpu
from effattn.tools.bench.accounting import count_ops, live_peak_bytes
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.memory import MiB
from effattn.tools.bench.results import save_figure, write_csv, write_json

FIELDS = ["method", "strategy", "backward_scale", "n", "inputs_mib", "fwd_peak_mib",
          "train_peak_mib", "fwd_ops", "bwd_ops", "launches"]
# Every row's heads and head dim (batch 1); tests shrink them.
HEADS, HEAD_DIM = 8, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Labels of a method with options, as gpu_peers.py writes them: gated RFA is its own row, its
# gate an input of the call.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"rfa-gated": ("rfa", {"gated": True})}
# What each fused kernel writes (its arguments, by name) and the value written there in dry
# mode, per kernel module (the row core's, effattn.kernelized.fused_kernels, and the per-feature
# core's, fused_exponents_kernels): denominators of 1 (no row is lost, so the lost-row check
# passes as on real inputs), 0 elsewhere (row and running scales, shifts, numerators, states,
# gradients).
DRY_WRITES = {
    "fused_kernels": {
        "_forward_kernel": {"num_ptr": 0.0, "den_ptr": 1.0, "m_ptr": 0.0, "kv_out_ptr": 0.0,
                            "r_ptr": 0.0, "marks_ptr": 0.0},
        "_backward_queries_kernel": {"dq_ptr": 0.0, "sq_ptr": 0.0},
        "_backward_keys_kernel": {"dk_ptr": 0.0, "sk_ptr": 0.0, "dv_ptr": 0.0,
                                  "dkv_in_ptr": 0.0},
        "_row_max_kernel": {"m_ptr": 0.0},
        "_divisor_grad_kernel": {"gd_ptr": 0.0},
    },
    "fused_exponents_kernels": {
        "_shift_kernel": {"c_ptr": 0.0},
        "_forward_kernel": {"num_ptr": 0.0, "den_ptr": 1.0, "kv_out_ptr": 0.0, "r_ptr": 0.0,
                            "marks_ptr": 0.0},
        "_backward_queries_kernel": {"dq_ptr": 0.0, "dw_ptr": 0.0, "db_ptr": 0.0},
        "_backward_keys_kernel": {"dk_ptr": 0.0, "dv_ptr": 0.0, "dkv_in_ptr": 0.0,
                                  "dw_ptr": 0.0, "db_ptr": 0.0},
    },
}


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
    unknown = sorted(set(names) - set(effattn.methods()) - set(VARIANTS) - {"sdpa"})
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or text!r}")
    return names


class _Launches:
    """The fused kernels' launches since the count was last set to 0 (the stand-ins and the
    wrappers below add theirs)."""

    count = 0


class _DryKernel:
    """A fused kernel's stand-in, launched as the kernel is (``kernel[grid](*args,
    **constexprs)``): it runs nothing and fills the buffers the kernel writes (``writes``: name
    -> value)."""

    def __init__(self, arg_names: list[str], writes: dict[str, float]) -> None:
        self.arg_names, self.writes = arg_names, writes

    def __getitem__(self, grid: Any) -> Any:
        return self.launch

    def launch(self, *args: Any, **constexprs: Any) -> None:
        _Launches.count += 1
        given = {**dict(zip(self.arg_names, args, strict=False)), **constexprs}
        for name, value in self.writes.items():
            # Through NumPy's view of the buffer: no ATen operation for count_ops to count and no
            # allocation for the profiler, as the kernel's own stores are neither. The buffers
            # are the accumulators (fp32 or fp64), which NumPy has.
            given[name].numpy().fill(value)


class _Collected:
    """A fused kernel run by Triton's interpreter, launched as the kernel is, with the garbage
    of each launch collected at once: the interpreter leaves the launch's arguments in
    reference cycles, whose storages would otherwise be freed at Python's next collection,
    wherever that falls (in a later call, its accounting would count them as negative
    bytes), rather than when their last user drops them, as after a GPU launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **constexprs: Any) -> None:
            # No collection within the launch, so that its cycles are all in the youngest
            # generation, whose collection is cheap (a full one takes ~0.2 s with torch loaded).
            _Launches.count += 1
            enabled = gc.isenabled()
            gc.disable()
            try:
                self.kernel[grid](*args, **constexprs)
                gc.collect(0)
            finally:
                if enabled:
                    gc.enable()

        return launch


@contextlib.contextmanager
def kernels(mode: str) -> Iterator[None]:
    """While inside, the fused kernels (both modules') replaced by :class:`_DryKernel`
    stand-ins (``mode`` "dry") or wrapped in :class:`_Collected` ("interpret"); module
    docstring."""
    from effattn.kernelized import fused_exponents_kernels, fused_kernels

    modules = {"fused_kernels": fused_kernels, "fused_exponents_kernels": fused_exponents_kernels}
    originals = {(label, kernel.__name__): kernel
                 for label, module in modules.items() for kernel in module.KERNELS}
    try:
        for (label, name), kernel in originals.items():
            stand_in = (_DryKernel(kernel.arg_names, DRY_WRITES[label][name]) if mode == "dry"
                        else _Collected(kernel))
            setattr(modules[label], name, stand_in)
        yield
    finally:
        for (label, name), kernel in originals.items():
            setattr(modules[label], name, kernel)


def _peak(fn: Callable[[], Any]) -> int:
    """:func:`live_peak_bytes` with Python's cyclic garbage collected before the call and no
    automatic collection within it: a collection frees the storages its cycles hold whenever it
    happens to run, those allocated before the call as negative bytes."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return live_peak_bytes(fn)
    finally:
        if enabled:
            gc.enable()


def measure(method: str, n: int, kind: str, scale: int | None,
            dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One row: ``method`` a method's name, a label of ``VARIANTS`` or "sdpa" (with ``kind``
    "sdpa"), ``kind`` a kernelized strategy ("cpu", "gpu", "triton"); inputs of ``dtype``."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g, dtype=dtype).requires_grad_()
               for _ in range(3))
    inputs = [q, k, v]
    if kind == "sdpa":
        def attend() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        name, options = VARIANTS.get(method, (method, {}))
        module = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0, **options)
        extra = {}
        if options.get("gated"):
            # Mostly near 1, as a trained forget gate (gpu_peers.py's).
            logits = torch.randn(1, HEADS, n, generator=torch.Generator().manual_seed(1))
            extra["gate"] = torch.sigmoid(logits + 3.0).to(dtype).requires_grad_()
            inputs.append(extra["gate"])

        def attend() -> torch.Tensor:
            with strategy.force(kernelized=kind):
                return module(q, k, v, causal=True, **extra)

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
        # the call's; the fused kernels' launches in it are counted.
        _Launches.count = 0
        train()
        launches = _Launches.count
        _peak(forward)
        fwd_peak = _peak(forward)
        train_peak = _peak(train)
        fwd_ops = count_ops(forward)
        out = attend()
        bwd_ops = count_ops(lambda: out.sum().backward())
    finally:
        gpu.BACKWARD_SLICE_SCALE = default
    return {"method": method, "strategy": kind, "backward_scale": scale, "n": n,
            "inputs_mib": sum(x.numel() * x.element_size() for x in inputs) / MiB,
            "fwd_peak_mib": fwd_peak / MiB, "train_peak_mib": train_peak / MiB,
            "fwd_ops": fwd_ops, "bwd_ops": bwd_ops, "launches": launches}


def plot(rows: list[dict[str, Any]], path: Path, dtype: str = "float32") -> None:
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
           title=f"Live tensor bytes, causal, B=1 H={HEADS} D={HEAD_DIM} {dtype} "
                 "(accounted on the CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", type=_names, default=_names("performer,linear,hedgehog"),
                        help="kernelized methods (default performer,linear,hedgehog; also "
                             f"{', '.join(VARIANTS)})")
    parser.add_argument("--lengths", type=_positive_ints, default=[4096, 16384])
    parser.add_argument("--strategies", type=_strategies, default=_strategies("cpu,gpu"),
                        help="kernelized strategies (default cpu,gpu; also triton)")
    parser.add_argument("--backward-scales", type=_positive_ints, default=None,
                        help="GPU strategy backward spans to sweep (default: its constant)")
    parser.add_argument("--kernels", choices=("dry", "interpret"), default="dry",
                        help="the triton strategy's kernels: stand-ins that launch nothing "
                             "(default) or run by Triton's interpreter")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/strategy-memory"))
    args = parser.parse_args(argv)
    triton = "triton" in args.strategies
    if triton and args.kernels == "interpret" and args.dtype == "bfloat16":
        parser.exit(2, "--kernels interpret --dtype bfloat16: Triton's interpreter does not run "
                       "bf16 tl.dot correctly; use --kernels dry\n")
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
    dtype = DTYPES[args.dtype]
    try:
        with kernels(args.kernels) if triton else contextlib.nullcontext():
            for n in args.lengths:
                for method, kind, scale in tqdm(jobs, desc=f"N={n}", file=sys.stderr):
                    rows.append(measure(method, n, kind, scale, dtype))
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
               {"machine": machine_info(),
                "shape": f"B=1 H={HEADS} D={HEAD_DIM} {args.dtype} causal",
                "kernels": args.kernels if triton else None,
                "default_backward_scale": gpu.BACKWARD_SLICE_SCALE, "rows": rows})
    write_csv(args.out / "results.csv", rows, FIELDS)
    plot(rows, args.out / "peaks.png", args.dtype)
    print(f"wrote {args.out}/results.json, results.csv, peaks.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
