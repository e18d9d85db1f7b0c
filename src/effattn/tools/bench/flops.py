"""FLOPs of a measured call, the machine's measured matmul peak, and the reference GEMM that
tells a disturbed measurement.

Counts are matmul FLOPs (2 per multiply-add) of the GEMMs a method runs, from the FLOP model each
method registers with its spec (``MethodSpec.flops``; see its module for the formula); elementwise
work (exp, softmax, normalisation) is not counted. Forward+backward is counted as 3x the forward:
the backward of each matmul is two matmuls of the same size. Methods without a clear count (sparse
patterns, hashing, FFT) have no model ("n/a").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from effattn.registry import Problem, spec
from effattn.tools.bench.timing import Clock, time_fn, time_once

FWD_BWD_FACTOR = 3


def forward_flops(
    method: str,
    options: Mapping[str, Any],
    *,
    batch: int,
    heads: int,
    n: int,
    m: int,
    head_dim: int,
    value_dim: int,
    causal: bool,
    module: torch.nn.Module | None = None,
) -> float | None:
    """FLOPs of one forward call, or None when ``method`` has no model.

    ``options`` override the method's defaults; a ``feature_dim`` attribute of ``module``
    overrides the feature dimension of kernelized methods.
    """
    method_spec = spec(method)
    if method_spec.flops is None:
        return None
    feature_dim = getattr(module, "feature_dim", None)
    problem = Problem(batch, heads, n, m, head_dim, value_dim, causal,
                      feature_dim if isinstance(feature_dim, int) else None)
    return method_spec.flops({**method_spec.options, **options}, problem)


def pass_flops(forward: float | None, pass_name: str) -> float | None:
    """FLOPs of a pass ("fwd" or "fwdbwd") given the forward count."""
    if forward is None:
        return None
    return forward * (FWD_BWD_FACTOR if pass_name == "fwdbwd" else 1)


def matmul_peak(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    max_size: int | None = None,
    min_call_s: float = 0.02,
    repeats: int = 10,
    budget_s: float = 0.5,
) -> float:
    """Best GFLOP/s, 2 n^3 / seconds, of (n, n) @ (n, n) matmuls in ``dtype``.

    n doubles from 256 until one call takes at least ``min_call_s`` or n reaches ``max_size``
    (default 2048 on the CPU, 8192 on a GPU, whose 2048^3 products last microseconds), so
    a dtype the CPU has no native instructions for (bf16 without AVX-512 BF16 or AMX runs at about
    1 GFLOP/s: 17 s for one 2048^3 product) is measured on a small matrix; then up to ``repeats``
    timed calls, stopping once ``budget_s`` seconds (the size search included) are spent. Each
    size's first call is a warm-up and its second decides whether to grow.
    """
    if max_size is None:
        max_size = 8192 if torch.device(device).type == "cuda" else 2048
    size = min(256, max_size)
    clock = Clock(device)
    spent = 0.0
    while True:
        call = partial(torch.mm, *(torch.randn(size, size, device=device).to(dtype)
                                   for _ in range(2)))
        spent += time_once(call, clock)
        t = time_once(call, clock)
        spent += t
        if t >= min_call_s or size >= max_size:
            break
        size = min(2 * size, max_size)
    best = t
    for _ in range(repeats):
        if spent > budget_s:
            break
        t = time_once(call, clock)
        best = min(best, t)
        spent += t
    return 2.0 * size**3 / best / 1e9


REFERENCE_SIZE = 512


def reference_gemm(device: torch.device | str = "cpu") -> Callable[[], float]:
    """A probe of how fast the machine is right now: a function that times a fixed fp32
    ``REFERENCE_SIZE``^3 GEMM (into a preallocated output, so it allocates nothing) and returns
    the median milliseconds per call of 3 samples (blocks of at least 2 ms: under 10 ms in all).

    Timed around and between the samples of a measurement in the same process and compared with
    its quietest time (:func:`effattn.tools.bench.timing.judge`), it reveals other processes
    competing for the cores: with one of two cores taken, this GEMM on two threads ran 12x slower.
    """
    a = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, device=device)
    b = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, device=device)
    out = torch.empty(REFERENCE_SIZE, REFERENCE_SIZE, device=device)
    clock = Clock(device)

    def probe() -> float:
        return time_fn(lambda: torch.mm(a, b, out=out), repeats=3, clock=clock).median * 1e3

    return probe
