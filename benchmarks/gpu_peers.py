"""effattn's kernelized methods beside their GPU peers, in one process on one GPU.

Peers, each on the problem it solves:

- ``effattn``: every kernelized method at its default options (the GPU strategy,
  ``effattn.kernelized.gpu``, runs on CUDA tensors; hedgehog's exp form its per-feature form,
  ``effattn.kernelized.exponents_gpu``), computing its own features;
- ``fla``: flash-linear-attention (fla-core) on the *same* features, computed in the same
  timed call by the effattn module's map: ``chunk_linear_attn`` (normalised) for the ungated
  methods, ``chunk_simple_gla`` on [V, 1] for gated RFA, ``fused_chunk_based`` on the Taylor
  method's projected q, k. Causal only (fla's chunk kernels are causal). Without fla-core the
  rows say ``fla: not installed``;
- ``sdpa``: ``scaled_dot_product_attention`` (flash kernel in bf16);
- ``spans``: effattn's performer and linear again, causal, with the GPU strategy's backward
  spans as long as its forward slices (``gpu.BACKWARD_SLICE_SCALE = gpu.SLICE_SCALE``; methods
  ``performer-spans64``, ``linear-spans64``, impl ``effattn``): the default spans are half a
  slice, which holds less memory and launches more (docs/gpu.md, Memory); these rows say
  which is faster.
- ``chunks``: effattn's performer and linear again, causal, with ``chunk_size`` 64 and 128
  (the default is 32), with fp32 products in IEEE and again in TF32 (methods
  ``performer-chunk64``, ``performer-chunk64-tf32``, ...). The GPU strategy writes one state
  (F, Dv + 1) per chunk in fp32 and reads it back several times (accounted on the CPU,
  performer at 16384 causal: 6.35 GB moved by the forward's ATen operations at C = 32, 5.52 at
  64, 5.62 at 128; the forward+backward 23.3 and 20.2 GB at 32 and 64), and a larger C trades
  that for C x C products, cheap on tensor cores; these rows say which C a GPU wants.
- ``compiled``: every kernelized method again, the module under
  ``torch.compile(fullgraph=True, dynamic=False)`` (methods ``<method>-compiled``, impl
  ``effattn``). In eager mode the GPU strategy launches one kernel per ATen op (about 150 per
  forward, 240 per backward), so on short inputs launch overhead bounds its time; these rows say
  how much of that compilation (op fusion, one graph) takes back. Each has ``compile_s``: the
  seconds of its pass's first call, which compiles (the backward too, for ``fwdbwd``), timed once
  apart and excluded from ``ms`` (shorter where inductor's on-disk cache holds the kernels from
  an earlier run).
- ``triton``: the causal methods whose scan the kernelized engine's ``triton`` strategy fuses
  into Triton kernels (``effattn.kernelized.fused``: performer, favor, rfa and gated rfa,
  linear, Taylor; ``effattn.kernelized.fused_exponents``: hedgehog's exp map; methods
  ``<method>-triton``, impl ``effattn``), forced for the call: one kernel
  launch per slice forward and two backward in place of the GPU strategy's chunk-parallel
  operations, and no chunk states. The strategy is chosen only when forced until these rows
  say it is faster. Without triton the rows say ``triton: not installed``.
- ``segments``: the triton suite's methods again with every kernel launch
  walking its chunks in one segment (methods ``<method>-triton-unsplit``). The triton rows
  split a launch's chunks into segments walked side by side where its (feature block,
  batch-head) programs alone would leave the GPU's multiprocessors idle (at B = 1, H = 8: 8 to
  32 programs against an H100's 132; ``effattn.kernelized.fused_kernels.segments``); these
  rows say what the split gains.
- ``floor``: the triton suite's methods again with segments of at least 16 chunks rather
  than 64 (``fused_kernels.SEGMENT_CHUNKS``; methods ``<method>-triton-floor16``): on an H200
  (2026-11-28) performer's and gated RFA's backward spans, about 100 chunks at 16384 and
  65536, stayed unsplit under the default floor and gained 1.1x from segments where the other
  methods gained 1.5x to 2.7x; these rows say whether a lower floor pays.
- ``tf32``: the ``effattn`` and ``triton`` suites again with torch's fp32 CUDA matmuls on TF32
  tensor cores (``torch.backends.cuda.matmul.fp32_precision = "tf32"``, what
  ``torch.set_float32_matmul_precision("high")`` sets; methods ``<method>-tf32`` and
  ``<method>-triton-tf32``). The kernelized methods compute in fp32 whatever the inputs' dtype
  (bf16 inputs too, so that features do not overflow), and by default torch multiplies fp32 in
  IEEE, off the tensor cores that fla's bf16 products use; the triton strategy's products follow
  the same setting (``effattn.kernelized.fused_kernels.precision``). These rows say what a user
  who allows TF32 gets.

Rows (``ROW_KEYS``): ``{impl, method, feature_dim, n, batch, heads, causal, pass, dtype, ms,
peak_mib, device}`` (+ ``error`` where a point failed, + ``compile_s`` on compiled rows),
written atomically to ``<out>/results.json`` after every point, and ``<out>/results.png``.
Time: triton's ``do_bench`` when triton imports (its median, with an L2 flush between calls),
else the median of CUDA events. Peak memory: ``torch.cuda.max_memory_allocated`` during one
separate call, above what was allocated before it (the inputs), so do_bench's 256 MiB flush
buffer is not counted.

Shapes: bf16 and fp32; N = 4096, 16384, 65536 at B = 1, H = 8, D = 64, and B = 8, H = 16,
D = 64 at N = 4096; causal and not; forward and forward + backward.

    python3 benchmarks/gpu_peers.py                           # everything (one CUDA GPU)
    python3 benchmarks/gpu_peers.py --device cpu --smoke      # tiny N on the CPU (a test runs it)
    python3 benchmarks/gpu_peers.py --impls compiled --methods linear,taylor

``--methods`` (labels, as in the rows: ``rfa-gated`` for gated RFA) narrows the kernelized
methods of every suite but ``sdpa``.

Exits 2, with one line, when no CUDA device is visible (without ``--device cpu``).

Other suites share this driver: ``benchmarks/gpu_peers_banded.py`` can call
``main(argv, suites={...})`` with its own ``Suite`` functions (same row schema); a suite
yields ``Case`` objects for a point and the chosen methods, and the driver times them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import effattn
from effattn import strategy
from effattn.kernelized import gpu
from effattn.kernelized.features import project_heads
from effattn.tools.bench.machine import gpu_label, machine_info
from effattn.tools.bench.results import write_json

ROW_KEYS = ("impl", "method", "feature_dim", "n", "batch", "heads", "causal", "pass", "dtype",
            "ms", "peak_mib", "device")
HEAD_DIM = 64
# (batch, heads, lengths)
FULL_SHAPES = ((1, 8, (4096, 16384, 65536)), (8, 16, (4096,)))
SMOKE_SHAPES = ((1, 2, (40,)),)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Each kernelized method as (name, options): gated RFA is its own row.
Method = tuple[str, Mapping[str, Any]]
METHODS: tuple[Method, ...] = (("performer", {}), ("favor", {}), ("rfa", {}),
                               ("rfa", {"gated": True}), ("linear", {}), ("hedgehog", {}),
                               ("taylor", {}))
DEFAULT_OUT = Path(__file__).resolve().parent / "gpu" / "peers"


@dataclass(frozen=True)
class Point:
    """One problem: shape, dtype, causal, device."""

    n: int
    batch: int
    heads: int
    dtype: str
    causal: bool
    device: torch.device


@dataclass
class Case:
    """One implementation of one method at a :class:`Point`: ``run()`` is the forward, on
    ``inputs`` (which require grad for forward + backward); ``error`` instead where it cannot
    run (then nothing is timed). ``compiles``: the first call of each pass compiles, so it is
    timed apart (the row's ``compile_s``) before anything else."""

    impl: str
    method: str
    feature_dim: int | None
    run: Callable[[], torch.Tensor] | None = None
    inputs: tuple[torch.Tensor, ...] = ()
    error: str | None = None
    compiles: bool = False


Suite = Callable[[Point, Sequence[Method]], Iterable[Case]]


def qkv(p: Point) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=p.device).manual_seed(p.n)
    shape = (p.batch, p.heads, p.n, HEAD_DIM)
    return tuple(torch.randn(shape, generator=gen, device=p.device, dtype=DTYPES[p.dtype])
                 for _ in range(3))


def _module(name: str, options: Mapping[str, Any], p: Point) -> effattn.AttentionMethod:
    return effattn.build(name, head_dim=HEAD_DIM, heads=p.heads, seed=0, **options).to(p.device)


def _label(name: str, options: Mapping[str, Any]) -> str:
    return name + ("-gated" if options.get("gated") else "")


def _gate(p: Point) -> torch.Tensor:
    gen = torch.Generator(device=p.device).manual_seed(1)
    logits = torch.randn(p.batch, p.heads, p.n, generator=gen, device=p.device)
    return torch.sigmoid(logits + 3.0).to(DTYPES[p.dtype])


def effattn_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """Every kernelized method, its features computed in the call."""
    q, k, v = qkv(p)
    for name, options in methods:
        if options.get("gated") and not p.causal:
            continue
        module = _module(name, options, p)
        gate = _gate(p) if options.get("gated") else None
        extra = {} if gate is None else {"gate": gate}
        yield Case("effattn", _label(name, options), module.feature_dim,
                   lambda m=module, x=extra: m(q, k, v, causal=p.causal, **x), (q, k, v))


def sdpa_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """Flash SDPA, whatever the methods."""
    q, k, v = qkv(p)
    yield Case("sdpa", "softmax", None,
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=p.causal), (q, k, v))


def fla_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """fla-core's chunk kernels on the effattn module's features (causal only)."""
    if not p.causal:
        return
    try:
        from fla.ops.based import fused_chunk_based
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        for name, options in methods:
            yield Case("fla", _label(name, options), None, error="fla: not installed")
        return
    q, k, v = qkv(p)
    dt = DTYPES[p.dtype]

    def heads_second(x: torch.Tensor) -> torch.Tensor:  # fla's layout: (B, T, H, ·)
        return x.transpose(1, 2)

    for name, options in methods:
        module = _module(name, options, p)

        def features(x: torch.Tensor, is_query: bool, m=module) -> torch.Tensor:
            # The true features up to a factor shared by all keys (which cancels): fla has no
            # stabiliser, so the keys' log-scales are taken from their global max.
            phi, log_scale = m.features(x.float(), is_query=is_query)
            if log_scale is not None and not is_query:
                phi = phi * torch.exp(log_scale - log_scale.amax(2, keepdim=True))
            return heads_second(phi).to(dt)

        if name == "taylor":
            w = module.projection * module.scale ** 0.5

            def run(w=w) -> torch.Tensor:
                qp, kp = (heads_second(project_heads(x, w.to(x.dtype))) for x in (q, k))
                return heads_second(fused_chunk_based(qp, kp, heads_second(v), scale=1.0))
        elif options.get("gated"):
            gate = _gate(p)

            def run(m=module, f=features, gate=gate) -> torch.Tensor:
                g = heads_second(gate.float())
                k_in = f(k, False) * (1.0 - g[..., None]).to(dt)
                v1 = torch.cat([heads_second(v), v.new_ones(p.batch, p.n, p.heads, 1)], -1)
                o, _ = chunk_simple_gla(f(q, True), k_in, v1, g=torch.log(g), scale=1.0)
                return heads_second(o[..., :-1] / o[..., -1:])
        else:
            def run(f=features) -> torch.Tensor:
                o, _ = chunk_linear_attn(f(q, True), f(k, False), heads_second(v), scale=1.0,
                                         normalize=True)
                return heads_second(o)
        yield Case("fla", _label(name, options), module.feature_dim, run, (q, k, v))


def spans_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """performer and linear with backward spans as long as the forward's slices (causal)."""
    if not p.causal:
        return
    q, k, v = qkv(p)
    chosen = {_label(*method) for method in methods}
    for name in [name for name in ("performer", "linear") if name in chosen]:
        module = _module(name, {}, p)

        def run(m=module) -> torch.Tensor:
            # The spans are fixed by the forward (its checkpoints), so the forward is where
            # the constant must hold.
            default, gpu.BACKWARD_SLICE_SCALE = gpu.BACKWARD_SLICE_SCALE, gpu.SLICE_SCALE
            try:
                return m(q, k, v, causal=True)
            finally:
                gpu.BACKWARD_SLICE_SCALE = default

        yield Case("effattn", f"{name}-spans{gpu.SLICE_SCALE}", module.feature_dim, run,
                   (q, k, v))


# The chunk sizes of the ``chunks`` suite, beside the methods' default of 32.
CHUNK_SIZES = (64, 128)


def chunks_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """performer and linear with larger chunks (causal), in fp32 IEEE and TF32 products."""
    if not p.causal:
        return
    q, k, v = qkv(p)
    chosen = {_label(*method) for method in methods}
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        for precision in ("ieee", "tf32"):
            torch.backends.cuda.matmul.fp32_precision = precision
            for name in [name for name in ("performer", "linear") if name in chosen]:
                for chunk in CHUNK_SIZES:
                    module = _module(name, {"chunk_size": chunk}, p)
                    suffix = "" if precision == "ieee" else "-tf32"
                    yield Case("effattn", f"{name}-chunk{chunk}{suffix}", module.feature_dim,
                               lambda m=module: m(q, k, v, causal=True), (q, k, v))
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def compiled_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """Every kernelized method as in ``effattn_suite``, the call under torch.compile."""
    q, k, v = qkv(p)
    for name, options in methods:
        if options.get("gated") and not p.causal:
            continue
        module = _module(name, options, p)
        extra = {"gate": _gate(p)} if options.get("gated") else {}

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m=module,
                 x=extra) -> torch.Tensor:
            return m(q, k, v, causal=p.causal, **x)

        # Every case compiles the same code object (``call``): without a reset its guards would
        # pile up, slowing each call, until the recompile limit, past which dynamo runs it
        # eagerly. The cases before this one are measured by now: suites are iterated lazily.
        torch.compiler.reset()
        compiled = torch.compile(call, fullgraph=True, dynamic=False)
        yield Case("effattn", f"{_label(name, options)}-compiled", module.feature_dim,
                   lambda f=compiled: f(q, k, v), (q, k, v), compiles=True)


# The methods whose causal form the triton strategy runs in its kernels (the others it hands
# to the GPU strategy: the rows would repeat the effattn suite's).
FUSED = ("performer", "favor", "rfa", "linear", "hedgehog", "taylor")


def triton_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """The causal methods of ``FUSED`` (gated RFA among them) with the triton strategy
    forced."""
    if not p.causal:
        return
    q, k, v = qkv(p)
    try:
        import triton  # noqa: F401
    except ImportError:
        error = "triton: not installed"
    else:
        error = None
    for name, options in methods:
        if name not in FUSED:
            continue
        module = _module(name, options, p)
        extra = {"gate": _gate(p)} if options.get("gated") else {}

        def run(m=module, x=extra) -> torch.Tensor:
            # Forced around the call: the backward runs what the forward chose.
            with strategy.force(kernelized="triton"):
                return m(q, k, v, causal=True, **x)

        yield Case("effattn", f"{_label(name, options)}-triton", module.feature_dim, run,
                   (q, k, v), error=error)


def _triton_with(setting: str, value: int, suffix: str, p: Point,
                 methods: Sequence[Method]) -> Iterator[Case]:
    """``triton_suite``'s cases, renamed ``<method>-triton<suffix>``, with the fused kernels'
    ``setting`` at ``value`` while they are measured, backward included (the driver measures
    each case before it resumes the suite), restored after (nothing set without triton)."""
    try:
        from effattn.kernelized import fused_kernels
    except ImportError:
        fused_kernels = None
    before = None if fused_kernels is None else getattr(fused_kernels, setting)
    if fused_kernels is not None:
        setattr(fused_kernels, setting, value)
    try:
        for case in triton_suite(p, methods):
            yield replace(case, method=f"{case.method}{suffix}")
    finally:
        if fused_kernels is not None:
            setattr(fused_kernels, setting, before)


def segments_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """``triton_suite`` with every launch in one segment (``fused_kernels.SEGMENT_PROGRAMS =
    0``; methods ``<method>-triton-unsplit``), beside the triton rows, which split their chunks
    into segments where the programs alone would leave multiprocessors idle."""
    return _triton_with("SEGMENT_PROGRAMS", 0, "-unsplit", p, methods)


# The shortest segment of the ``floor`` suite, against fused_kernels.SEGMENT_CHUNKS (64).
FLOOR_CHUNKS = 16


def floor_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """``triton_suite`` with segments of at least FLOOR_CHUNKS chunks
    (``fused_kernels.SEGMENT_CHUNKS``; methods ``<method>-triton-floor16``), so that launches of
    fewer chunks than the default floor allows split too (performer's and gated RFA's backward
    at 16384 walk about 100 chunks a span: unsplit by default)."""
    return _triton_with("SEGMENT_CHUNKS", FLOOR_CHUNKS, f"-floor{FLOOR_CHUNKS}", p, methods)


def tf32_suite(p: Point, methods: Sequence[Method]) -> Iterator[Case]:
    """``effattn_suite`` and ``triton_suite`` with fp32 CUDA matmuls on TF32. The setting holds
    while the cases are measured, backward included: the driver measures each case before it
    resumes the suite, and the setting is restored when the suite ends."""
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        for suite in (effattn_suite, triton_suite):
            for case in suite(p, methods):
                yield replace(case, method=f"{case.method}-tf32")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


SUITES: dict[str, Suite] = {"effattn": effattn_suite, "fla": fla_suite, "sdpa": sdpa_suite,
                            "spans": spans_suite, "chunks": chunks_suite,
                            "compiled": compiled_suite,
                            "triton": triton_suite, "segments": segments_suite,
                            "floor": floor_suite,
                            "tf32": tf32_suite}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timer(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds per call: triton's do_bench on CUDA when available, else CUDA
    events (CUDA) or the wall clock (CPU)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, return_mode="median"))
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def peak_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory of one call above what is allocated before it (MiB); None on the CPU."""
    if device.type != "cuda":
        return None
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def first_call_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call, from a synchronised device to its end."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def passes(case: Case) -> Iterator[tuple[str, Callable[[], Any]]]:
    """The forward, and forward + backward into the inputs' gradients (freed each call)."""
    assert case.run is not None
    run = case.run

    def fwd() -> None:
        with torch.no_grad():
            run()

    def fwdbwd() -> None:
        out = run()
        out.backward(torch.ones_like(out))
        for x in case.inputs:
            x.grad = None

    yield "fwd", fwd
    yield "fwdbwd", fwdbwd


def measure(suites: Mapping[str, Suite], points: Iterable[Point], out: Path, repeats: int,
            machine: Mapping[str, Any],
            methods: Sequence[Method] = METHODS) -> list[dict[str, Any]]:
    """Every case of every suite at every point (for ``methods``), fwd and fwdbwd: the rows,
    also written (atomically, with ``machine`` and the engines' strategies) to
    ``out/results.json`` after each."""
    device_name = gpu_label(machine) or "cpu"
    rows: list[dict[str, Any]] = []
    chosen: dict[str, str] = {}
    for p in points:
        chosen = {engine: strategy.choose(engine, p.device) for engine in strategy.ENGINES}
        for suite in suites.values():
            for case in suite(p, methods):
                for pass_name, fn in (passes(case) if case.error is None
                                      else (("fwd", None), ("fwdbwd", None))):
                    row = {"impl": case.impl, "method": case.method,
                           "feature_dim": case.feature_dim, "n": p.n, "batch": p.batch,
                           "heads": p.heads, "causal": p.causal, "pass": pass_name,
                           "dtype": p.dtype, "ms": None, "peak_mib": None,
                           "device": device_name}
                    if case.compiles:
                        row["compile_s"] = None
                    if case.error is not None:
                        row["error"] = case.error
                    else:
                        for x in case.inputs:
                            x.requires_grad_(pass_name == "fwdbwd")
                        try:
                            if case.compiles:
                                row["compile_s"] = first_call_s(fn, p.device)
                            row["peak_mib"] = peak_mib(fn, p.device)
                            row["ms"] = timer(fn, p.device, repeats)
                        except Exception as err:  # a row says why, the sweep goes on
                            # One line that still names the cause: a compiler's error puts it
                            # on its third line.
                            said = " ".join(filter(None, map(str.strip, str(err).splitlines())))
                            row["error"] = f"{type(err).__name__}: {said}"[:300]
                            if p.device.type == "cuda":
                                torch.cuda.empty_cache()
                    rows.append(row)
                    print(_line(row), flush=True)
                    write_json(out / "results.json",
                               {"machine": machine, "strategies": chosen, "rows": rows})
    return rows


def _line(row: Mapping[str, Any]) -> str:
    what = (f"{row['impl']:8s} {row['method']:18s} n={row['n']:6d} B={row['batch']} "
            f"H={row['heads']} {'causal' if row['causal'] else 'full  '} {row['pass']:6s} "
            f"{row['dtype']}")
    if row.get("error"):
        return f"{what}  {row['error']}"
    mem = "" if row["peak_mib"] is None else f"  {row['peak_mib']:9.1f} MiB"
    compile_s = "" if row.get("compile_s") is None else f"  compiled in {row['compile_s']:.1f} s"
    return f"{what}  {row['ms']:9.3f} ms{mem}{compile_s}"


def plot(rows: Iterable[Mapping[str, Any]], path: Path) -> None:
    """ms against N (B = 1), one panel per (dtype, causal, pass), one line per impl/method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ms"] is not None and r["batch"] == 1]
    panels = sorted({(r["dtype"], r["causal"], r["pass"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 4),
                             squeeze=False)
    for ax, (dtype, causal, pass_name) in zip(axes[0], panels, strict=False):
        mine = [r for r in rows if (r["dtype"], r["causal"], r["pass"]) == (dtype, causal,
                                                                             pass_name)]
        for impl, method in sorted({(r["impl"], r["method"]) for r in mine}):
            line = sorted((r["n"], r["ms"]) for r in mine
                          if (r["impl"], r["method"]) == (impl, method))
            ax.plot(*zip(*line, strict=True), marker="o", label=f"{impl} {method}",
                    linestyle="-" if impl == "effattn" else "--")
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel="ms",
               title=f"{dtype} {'causal' if causal else 'non-causal'} {pass_name}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def points(device: torch.device, smoke: bool, dtypes: Iterable[str],
           only: Iterable[int] | None = None) -> Iterator[Point]:
    """The shapes of the sweep (``only``: those of these lengths)."""
    for dtype in dtypes:
        for batch, heads, lengths in SMOKE_SHAPES if smoke else FULL_SHAPES:
            for n in (n for n in lengths if only is None or n in only):
                for causal in (True, False):
                    yield Point(n, batch, heads, dtype, causal, device)


def main(argv: list[str] | None = None, suites: Mapping[str, Suite] = SUITES,
         default_out: Path = DEFAULT_OUT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda[:i] (default) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a test of the script)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument("--impls", default=",".join(suites), help="comma-separated suites")
    labels = [_label(*method) for method in METHODS]
    parser.add_argument("--methods", default=",".join(labels),
                        help="comma-separated kernelized methods (default all): "
                             + ", ".join(labels))
    full = sorted({n for _, _, lengths in FULL_SHAPES for n in lengths})
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated lengths of the sweep (default all: {full})")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls without do_bench")
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_peers: no CUDA device visible to torch; nothing measured", file=sys.stderr)
        return 2
    unknown_impls = sorted(set(args.impls.split(",")) - set(suites))
    if unknown_impls:
        print(f"gpu_peers: --impls: unknown {unknown_impls}; choose from {list(suites)}",
              file=sys.stderr)
        return 2
    chosen = {name: suites[name] for name in args.impls.split(",")}
    lengths = None
    if args.lengths is not None:
        lengths = {int(x) for x in args.lengths.split(",") if x.isdigit()}
        if not lengths or len(lengths) != len(args.lengths.split(",")) or \
                not lengths <= set(full):
            print(f"gpu_peers: --lengths: {args.lengths!r} is not a comma-separated subset of "
                  f"{full}", file=sys.stderr)
            return 2
    wanted = args.methods.split(",")
    unknown_methods = sorted(set(wanted) - set(labels))
    if unknown_methods:
        print(f"gpu_peers: --methods: unknown {unknown_methods}; choose from {labels}",
              file=sys.stderr)
        return 2
    methods = [method for method in METHODS if _label(*method) in wanted]
    dtypes = args.dtypes.split(",")
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"gpu_peers: --out {args.out}: {err.strerror}", file=sys.stderr)
        return 2
    machine = machine_info(device)
    try:
        rows = measure(chosen, points(device, args.smoke, dtypes, None if args.smoke else lengths),
                       args.out, args.repeats, machine, methods)
    except KeyboardInterrupt:
        # results.json is rewritten (atomically) after every row: the finished ones are kept.
        print("gpu_peers: interrupted: results.json holds the finished rows; the same command "
              "starts over", file=sys.stderr)
        return 130
    plot(rows, args.out / "results.png")
    print(f"wrote {args.out / 'results.json'} and results.png ({len(rows)} rows, "
          f"{gpu_label(machine) or 'cpu'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
