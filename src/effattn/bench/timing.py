"""Wall-clock timing of a callable: warm-up, then repeated samples, summarised by median and IQR.

Each sample times a block of ``number`` back-to-back calls (``number`` grows until a block lasts at
least ``min_block_s``), so very short calls are not dominated by timer overhead; a sample is the
block time divided by ``number``. On CUDA the device is synchronised before and after each block,
so the time covers the kernels and not only their launch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
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


def time_once(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Seconds taken by one call of ``fn``, including queued device work."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def time_fn(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], None] = lambda: None,
    min_block_s: float = 2e-3,
    estimate_s: float | None = None,
) -> Timing:
    """Time ``fn``: ``warmup`` untimed calls, then ``repeats`` samples.

    ``estimate_s`` (seconds of one call, if already known, e.g. from a first call) sizes the blocks;
    otherwise the last warm-up call does.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        estimate_s = time_once(fn, sync)
    if estimate_s is None:
        estimate_s = time_once(fn, sync)
    number = max(1, math.ceil(min_block_s / max(estimate_s, 1e-9)))
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / number)
    return Timing(tuple(samples), number)
