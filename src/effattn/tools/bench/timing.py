"""Wall-clock timing of a callable: warm-up, then repeated samples, summarised by median and IQR.

Each sample times a block of ``number`` back-to-back calls (``number`` grows until a block lasts at
least ``min_block_s``), so very short calls are not dominated by timer overhead; a sample is the
block time divided by ``number``. A :class:`Clock` measures a block: wall time on the CPU; on CUDA
the time between two events recorded on the device's current stream around the block, after a
synchronisation, so the time covers the kernels and not only their launch.

A busy machine (other processes competing for the cores) can make every call of a measurement
several times slower with a small spread, which the samples alone cannot reveal. :func:`judge`
decides from a fixed reference GEMM timed around and between the samples (see
:func:`effattn.tools.bench.flops.reference_gemm`) and from the spread of the samples whether the
measurement was disturbed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Per-call seconds of every sample, and their median and interquartile range."""

    samples: tuple[float, ...]
    number: int

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q3 - q1


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for all queued work on ``device`` (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class Clock:
    """Seconds of the work issued between :meth:`start` and :meth:`stop` on ``device``.

    CPU: ``time.perf_counter``. CUDA: two timing events recorded on the device's current stream
    (``torch.cuda.Event(enable_timing=True)``), the device synchronised before the first, so the
    interval holds the block's kernels and none of the work queued before it.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.sync = synchronizer(self.device)
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
        self._start = 0.0

    def start(self) -> None:
        self.sync()
        if self._events is not None:
            self._events[0].record(torch.cuda.current_stream(self.device))
        else:
            self._start = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`, once the work issued since has finished."""
        if self._events is not None:
            first, last = self._events
            last.record(torch.cuda.current_stream(self.device))
            last.synchronize()
            return first.elapsed_time(last) / 1e3
        return time.perf_counter() - self._start


def time_once(fn: Callable[[], object], clock: Clock | None = None) -> float:
    """Seconds taken by one call of ``fn``, including queued device work."""
    clock = clock or Clock()
    clock.start()
    fn()
    return clock.stop()


def paired(
    fns: dict[str, Callable[[], object]], repeats: int, clock: Clock | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each function, ``repeats`` samples each, after one warm-up call of
    each; the order alternates between repeats, so that the samples of one repeat share the
    machine's load and their ratios hold where the absolute times do not (the benchmarks' paired
    comparisons: new against old, effattn against a peer)."""
    clock = clock or Clock()
    names = list(fns)
    for name in names:
        fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(time_once(fns[name], clock))
    return samples


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median of the per-repeat ratios ``num / den`` of two :func:`paired` sample lists."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def time_fn(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    clock: Clock | None = None,
    min_block_s: float = 2e-3,
    estimate_s: float | None = None,
    between: Callable[[], object] | None = None,
) -> Timing:
    """Time ``fn``: ``warmup`` untimed calls, then ``repeats`` samples.

    ``estimate_s`` (seconds of one call, if already known, e.g. from a first call) sizes the blocks;
    otherwise the last warm-up call does. ``between``, when given, is called untimed before every
    sample (a probe of the machine's speed interleaved with the samples).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    clock = clock or Clock()
    for _ in range(warmup):
        estimate_s = time_once(fn, clock)
    if estimate_s is None:
        estimate_s = time_once(fn, clock)
    number = max(1, math.ceil(min_block_s / max(estimate_s, 1e-9)))
    samples = []
    for _ in range(repeats):
        if between is not None:
            between()
        clock.start()
        for _ in range(number):
            fn()
        samples.append(clock.stop() / number)
    return Timing(tuple(samples), number)


# A reference GEMM more than this many times slower than the quietest seen in the sweep, or
# samples whose IQR exceeds this fraction of their median, mark a measurement as disturbed. On a
# quiet machine the reference varies by a few percent and the IQR stays below about 10%.
MAX_SLOWDOWN = 1.3
MAX_SPREAD = 0.25


@dataclass(frozen=True)
class Verdict:
    """Whether a measurement was disturbed, and by how much.

    ``slowdown``: the slowest reference time of the measurement over the quietest reference time
    known (the sweep's, or the measurement's own when faster); ``spread``: IQR / median of the
    samples (None without samples).
    """

    disturbed: bool
    slowdown: float
    spread: float | None


def judge(
    reference_ms: Sequence[float],
    quiet_ms: float,
    *,
    median_ms: float | None = None,
    iqr_ms: float | None = None,
    max_slowdown: float = MAX_SLOWDOWN,
    max_spread: float = MAX_SPREAD,
) -> Verdict:
    """Judge a measurement from the times of the reference GEMM taken around it
    (``reference_ms``, at least one) against ``quiet_ms``, the fastest the machine has run the
    same GEMM, and from the spread of its samples (``median_ms``, ``iqr_ms``, when it has them).

    Disturbed when max(reference) / min(quiet, *reference) > ``max_slowdown``, or when
    iqr / median > ``max_spread``.
    """
    if not reference_ms:
        raise ValueError("reference_ms must hold at least one time")
    if not quiet_ms > 0 or not all(t > 0 for t in reference_ms):
        raise ValueError(f"reference times must be positive, got quiet_ms={quiet_ms}, "
                         f"reference_ms={list(reference_ms)}")
    slowdown = max(reference_ms) / min(quiet_ms, *reference_ms)
    spread = iqr_ms / median_ms if median_ms and iqr_ms is not None else None
    disturbed = slowdown > max_slowdown or (spread is not None and spread > max_spread)
    return Verdict(disturbed, slowdown, spread)
