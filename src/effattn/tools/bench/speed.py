"""Speed and peak memory of one configuration, measured in a fresh worker process, and the sweep.

A configuration is (method, length N = M, pass, batch, heads, head dim, dtype, causal, device,
method options). Each is measured in its own process (forked from a server that has imported
torch but run nothing, so the peak-memory mark starts clean and a crash, a hang or the OOM killer
only ends that worker). The worker:

1. builds the module once with ``effattn.build(name, head_dim=D, heads=H, max_len=N, seed=0)``
   and puts it in eval mode for both passes, so random features are fixed and both passes run
   the same function;
2. runs one call of the same pass at a short length (32), so that thread pools, the autograd
   engine and lazily built state exist before the memory baseline;
3. makes q, k, v (B, H, N, D) with Dv = D; for "fwdbwd" they require grad;
4. times one call under :class:`~effattn.tools.bench.memory.PeakMemory` (peak over the memory that
   already held the inputs); if that call and a second one both exceeded ``max_seconds`` it stops
   ("too slow");
5. otherwise warms up and times ``repeats`` samples (:func:`~effattn.tools.bench.timing.time_fn`);
6. times a fixed reference GEMM (:func:`~effattn.tools.bench.flops.reference_gemm`) after the first
   call, before every sample and after the last.

Before the configurations, :func:`probe_machine` measures, in a worker too, the machine's matmul
peaks and the reference GEMM's time on a quiet machine. The sweep judges every measurement
against it (:func:`~effattn.tools.bench.timing.judge`): a reference GEMM more than 1.3x slower, or
samples spread too widely, mean that other processes competed for the cores, and the
configuration is measured again (``Settings.retries`` times at most) and otherwise recorded as
``disturbed``.

"fwd" runs under ``torch.inference_mode``; "fwdbwd" runs the forward and ``out.sum().backward()``
with gradients reset to None before each call (as ``zero_grad(set_to_none=True)`` does).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

import effattn
from effattn.tools.bench.flops import (
    REFERENCE_SIZE,
    forward_flops,
    matmul_peak,
    pass_flops,
    reference_gemm,
)
from effattn.tools.bench.machine import cpu_label, gpu_label, machine_info
from effattn.tools.bench.memory import MiB, PeakMemory, cap_memory, is_oom
from effattn.tools.bench.results import ResultStore
from effattn.tools.bench.timing import (
    MAX_SLOWDOWN,
    Clock,
    judge,
    synchronizer,
    time_fn,
    time_once,
)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
PASSES = ("fwd", "fwdbwd")
# Statuses after which larger lengths of the same method and pass are not tried.
BLOCKING = ("too slow", "timeout", "oom")
WARM_LENGTH = 32


def format_options(options: Iterable[tuple[str, Any]]) -> str:
    """Canonical text of method options, e.g. ``"num_features=256,orthogonal=True"``."""
    return ",".join(f"{k}={v}" for k, v in sorted(options))


@dataclass(frozen=True)
class Config:
    """One measured point of the sweep."""

    method: str
    length: int
    pass_name: str
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    device: str = "cpu"
    options: tuple[tuple[str, Any], ...] = ()

    def fields(self) -> dict[str, Any]:
        """The identifying fields of this configuration, as stored in a record."""
        return {
            "method": self.method,
            "length": self.length,
            "pass": self.pass_name,
            "batch": self.batch,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "causal": self.causal,
            "device": self.device,
            "options": format_options(self.options),
        }


@dataclass(frozen=True)
class Settings:
    """How each configuration is measured."""

    warmup: int = 1
    repeats: int = 5
    max_seconds: float = 5.0
    max_memory_mib: float | None = None
    retries: int = 2


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify_error(err: BaseException) -> str:
    """Status text of an exception raised while measuring."""
    if is_oom(err):
        return f"oom: {_one_line(err, 160)}"
    if isinstance(err, (ValueError, TypeError)):
        return f"refused: {_one_line(err)}"
    return f"error: {type(err).__name__}: {_one_line(err)}"


def _inputs(cfg: Config, length: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator(device=device).manual_seed(length)
    shape = (cfg.batch, cfg.heads, length, cfg.head_dim)
    grad = cfg.pass_name == "fwdbwd"
    return tuple(  # type: ignore[return-value]
        torch.randn(shape, generator=gen, device=device).to(DTYPES[cfg.dtype]).requires_grad_(grad)
        for _ in range(3)
    )


def _caller(cfg: Config, module: torch.nn.Module, q: Tensor, k: Tensor,
            v: Tensor) -> Callable[[], None]:
    """The measured call: a forward under inference_mode, or forward and backward."""
    tensors = (q, k, v, *module.parameters())

    def fwd() -> None:
        with torch.inference_mode():
            module(q, k, v, causal=cfg.causal)

    def fwdbwd() -> None:
        for t in tensors:
            t.grad = None
        module(q, k, v, causal=cfg.causal).sum().backward()

    return fwdbwd if cfg.pass_name == "fwdbwd" else fwd


def warm_length(cfg: Config, module: torch.nn.Module) -> int:
    """The length of the warm-up call: ``WARM_LENGTH``, or past the module's window (a window
    hybrid shorter than its window is exact softmax, and would leave its kernelized part's
    one-time set-up, tens of MiB of resident set, to the measured call); at most the length."""
    window = getattr(module, "window", None)
    short = WARM_LENGTH if not isinstance(window, int) else max(WARM_LENGTH, 2 * window + 2)
    return min(cfg.length, short)


def _warm_up(cfg: Config, module: torch.nn.Module, device: torch.device) -> None:
    # One call at a short length starts the thread pool, the autograd engine, the CUDA context and
    # the method's lazily built state, so the measured peak is that of the call, not of one-time
    # set-up. A method that refuses the short length is simply not warmed.
    with contextlib.suppress(Exception):  # the measured call reports any problem
        _caller(cfg, module, *_inputs(cfg, warm_length(cfg, module), device))()
    synchronizer(device)()


def measure(cfg: Config, settings: Settings) -> dict[str, Any]:
    """Measure ``cfg`` in this process (meant to be a fresh worker); returns the result fields."""
    device = torch.device(cfg.device)
    options = dict(cfg.options)
    try:
        module = effattn.build(
            cfg.method, head_dim=cfg.head_dim, heads=cfg.heads, max_len=cfg.length, seed=0,
            **options,
        )
    except (ValueError, TypeError) as err:
        return {"status": f"refused: {_one_line(err)}"}
    module = module.to(device).eval()
    fwd = forward_flops(
        cfg.method, {**effattn.spec(cfg.method).options, **options}, batch=cfg.batch,
        heads=cfg.heads, n=cfg.length, m=cfg.length, head_dim=cfg.head_dim,
        value_dim=cfg.head_dim, causal=cfg.causal, module=module,
    )
    result: dict[str, Any] = {"flops": pass_flops(fwd, cfg.pass_name)}
    _warm_up(cfg, module, device)
    call = _caller(cfg, module, *_inputs(cfg, cfg.length, device))
    reference = reference_gemm(device)  # its matrices exist before the memory baseline
    if settings.max_memory_mib is not None:
        cap_memory(device, settings.max_memory_mib)
    clock = Clock(device)
    try:
        with PeakMemory(device) as mem:
            first = time_once(call, clock)
        result["peak_mib"] = mem.peak_bytes / MiB
        references = result["reference_ms"] = [reference()]
        if first > settings.max_seconds:
            # The first call at a new shape can hold one-time set-up (on an H200, SDPA's causal
            # backward at N = 16384 took over a second once, then milliseconds): a second call
            # decides.
            first = min(first, time_once(call, clock))
        if first > settings.max_seconds:
            result["status"] = (
                f"too slow: one call took {first:.3g} s > --max-seconds {settings.max_seconds:g}"
            )
            return result
        # Between the samples too: a burst of load can slow all of them evenly (a small spread)
        # and be over before a probe after them.
        timing = time_fn(
            call, repeats=settings.repeats, warmup=settings.warmup, clock=clock, estimate_s=first,
            between=lambda: references.append(reference()),
        )
        references.append(reference())
    except Exception as err:  # every failure becomes a status; the sweep goes on
        result["status"] = classify_error(err)
        return result
    result.update(
        status="ok", median_ms=timing.median * 1e3, iqr_ms=timing.iqr * 1e3,
        samples=len(timing.samples), calls_per_sample=timing.number,
    )
    return result


def probe_machine(dtypes: Sequence[str], device: str, retries: int = 2) -> dict[str, Any]:
    """The machine (:func:`~effattn.tools.bench.machine.machine_info`) with the matmul peak
    GFLOP/s of each of ``dtypes`` on ``device`` and the reference GEMM's quietest time; run in a
    worker like the configurations.

    The peaks are measured again (``retries`` times at most, keeping the highest) while the
    reference GEMM timed around them says the machine was disturbed. The reference GEMM is an
    fp32 matmul too, so its rate bounds the fp32 peak from below.
    """
    reference = reference_gemm(device)
    references = [reference()]
    peaks: dict[str, float] = {}
    for _ in range(retries + 1):
        for dtype in dtypes:
            peaks[dtype] = max(peaks.get(dtype, 0.0), matmul_peak(DTYPES[dtype], device))
        references.append(reference())
        if not judge(references[-2:], min(references)).disturbed:
            break
    quiet_ms = min(references)
    if "float32" in peaks:
        peaks["float32"] = max(peaks["float32"], 2.0 * REFERENCE_SIZE**3 / (quiet_ms * 1e-3) / 1e9)
    return {"status": "ok",
            "machine": machine_info(device) | {"matmul_peak_gflops": peaks,
                                               "reference_ms": quiet_ms}}


def _worker(conn: Any, target: Callable[..., dict[str, Any]], args: tuple) -> None:
    # Ctrl-C reaches the whole process group; the parent handles it (and kills this worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = target(*args)
    except BaseException as err:  # report it to the parent instead of dying silently
        traceback.print_exc()
        result = {"status": classify_error(err)}
    conn.send(result)
    conn.close()


_CONTEXT: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            # The server imports torch and effattn once; each worker forks from it cheaply.
            _CONTEXT.set_forkserver_preload(["effattn.tools.bench.speed"])
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def run_isolated(
    target: Callable[..., dict[str, Any]], args: tuple, timeout: float
) -> dict[str, Any]:
    """Run ``target(*args)`` in a fresh worker; its result, or a "timeout"/"oom"/"error" status.

    ``target`` must be a module-level function returning a dict with a "status".
    """
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(send, target, args), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            return {"status": f"timeout: no result within --timeout {timeout:g} s"}
        try:
            return recv.recv()
        except EOFError:
            proc.join()
            if proc.exitcode == -signal.SIGKILL:
                return {"status": "oom: worker killed by SIGKILL (likely the kernel's OOM killer)"}
            return {"status": f"error: worker died with exit code {proc.exitcode}"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()


def precheck(cfg: Config) -> str | None:
    """A refusal known without running (causal asked of a non-causal method), else None."""
    s = effattn.spec(cfg.method)
    if cfg.causal and not s.causal:
        return f"refused: {s.refusals.get('causal', 'not causal')}"
    return None


@dataclass
class SweepStats:
    measured: int = 0
    resumed: int = 0
    retried: int = 0
    disturbed: int = 0
    machine: dict[str, Any] = field(default_factory=dict)


def measure_guarded(
    run: Callable[[], dict[str, Any]], quiet_ms: float | None, retries: int
) -> tuple[dict[str, Any], float | None]:
    """Call ``run`` (one measurement, e.g. in a fresh worker) until it is not disturbed, at most
    ``1 + retries`` times; return its result and the updated quietest reference time.

    A result that carries ``reference_ms`` (timings and "too slow") is judged against
    ``quiet_ms`` (:func:`~effattn.tools.bench.timing.judge`) and gets ``disturbed``, ``slowdown``
    and ``attempts`` (the number made); if every attempt was disturbed, the least slowed one is
    returned. Without a quiet time (the machine probe failed) or references (refused, oom, ...)
    the first result is returned as it is.
    """
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    best: dict[str, Any] | None = None
    for attempt in range(1, retries + 2):
        result = run()
        reference = result.pop("reference_ms", None)
        if quiet_ms is None or not reference:
            return result, quiet_ms
        verdict = judge(reference, quiet_ms, median_ms=result.get("median_ms"),
                        iqr_ms=result.get("iqr_ms"))
        quiet_ms = min(quiet_ms, *reference)
        result.update(disturbed=verdict.disturbed, slowdown=verdict.slowdown, attempts=attempt)
        if not verdict.disturbed:
            return result, quiet_ms
        if best is None or verdict.slowdown < best["slowdown"]:
            best = result
    assert best is not None
    best["attempts"] = retries + 1
    return best, quiet_ms


def _probe(configs: Sequence[Config], timeout: float, retries: int) -> dict[str, Any]:
    devices = {c.device for c in configs}
    if len(devices) > 1:
        raise ValueError(f"configs must share one device, got {sorted(devices)}")
    dtypes = tuple(dict.fromkeys(("float32", "bfloat16", *(c.dtype for c in configs))))
    device = devices.pop() if devices else "cpu"
    res = run_isolated(probe_machine, (dtypes, device, retries), timeout)
    if res["status"] != "ok":
        # Measure without the judge rather than not at all; the summary says why.
        return machine_info(device) | {"probe_status": res["status"]}
    return res["machine"]


def sweep(
    configs: Sequence[Config],
    store: ResultStore,
    settings: Settings,
    *,
    timeout: float,
    progress: bool = True,
) -> SweepStats:
    """Measure every configuration not already in ``store`` (or recorded there as disturbed),
    saving after each one.

    ``configs`` should be ordered by length (then method, then "fwd" before "fwdbwd"): once a
    method is too slow, out of memory or timed out at length L, its larger lengths are recorded
    as skipped (a failed "fwd" also skips "fwdbwd" at L). They share one device, on which the
    machine is probed first (:func:`probe_machine`; ``SweepStats.machine``). When the quietest
    reference time seen during the sweep shows that the first probe was itself disturbed, the
    peaks are measured again at the end and the higher ones kept. On a GPU no measurement is
    judged (nor repeated).
    """
    stats = SweepStats(machine=_probe(configs, timeout, settings.retries))
    start_ms = quiet_ms = stats.machine.get("reference_ms")
    if "gpu" in stats.machine:
        # The judge tells other processes competing for CPU cores. On a GPU the reference GEMM
        # lasts microseconds and moves with the clock's boost, not with load: nothing is judged.
        start_ms = quiet_ms = None
    cpu, gpu = cpu_label(stats.machine), gpu_label(stats.machine)
    blocked: dict[tuple[str, str], str] = {}
    bar = tqdm(configs, desc="effattn bench", unit="config", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    for cfg in bar:
        bar.set_postfix_str(f"{cfg.method} N={cfg.length} {cfg.pass_name}", refresh=False)
        fields = cfg.fields()
        record = store.get(fields)
        if record is not None and not record.get("disturbed"):
            stats.resumed += 1
        else:
            reason = blocked.get((cfg.method, cfg.pass_name))
            result = {"status": f"skipped: {reason}"} if reason else None
            if result is None and (refusal := precheck(cfg)):
                result = {"status": refusal}
            if result is None:
                result, quiet_ms = measure_guarded(
                    lambda cfg=cfg: run_isolated(measure, (cfg, settings), timeout), quiet_ms,
                    settings.retries)
                stats.measured += 1
                stats.retried += result.get("attempts", 1) - 1
                stats.disturbed += bool(result.get("disturbed"))
            record = make_record(fields, result | {"cpu": cpu, "gpu": gpu})
            store.add(record)
        status = record["status"]
        if status.startswith(BLOCKING):
            why = f"{status.split(':')[0]} at N={cfg.length}"
            passes = PASSES if cfg.pass_name == "fwd" else (cfg.pass_name,)
            for p in passes:
                blocked.setdefault((cfg.method, p), why)
    bar.close()
    if start_ms and quiet_ms and quiet_ms * MAX_SLOWDOWN < start_ms:
        again = _probe(configs, timeout, settings.retries)
        peaks = stats.machine["matmul_peak_gflops"]
        for dtype, gflops in again.get("matmul_peak_gflops", {}).items():
            peaks[dtype] = max(peaks.get(dtype) or 0.0, gflops)
        stats.machine["reference_ms"] = quiet_ms
    return stats


def make_record(fields: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A result record: the configuration's fields, the measurements, the disturbance verdict,
    the CPU and a timestamp."""
    record = {**fields, "status": result["status"]}
    for key in ("median_ms", "iqr_ms", "peak_mib", "flops", "samples", "calls_per_sample",
                "disturbed", "slowdown", "attempts", "cpu", "gpu"):
        record[key] = result.get(key)
    flops, median = result.get("flops"), result.get("median_ms")
    record["gflops"] = flops / (median * 1e-3) / 1e9 if flops and median else None
    record["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    return record
