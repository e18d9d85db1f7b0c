"""FLOPs of a measured call, and the machine's measured matmul peak.

Counts are matmul FLOPs (2 per multiply-add) of the GEMMs a method runs, from the FLOP model each
method registers with its spec (``MethodSpec.flops``; see its module for the formula); elementwise
work (exp, softmax, normalisation) is not counted. Forward+backward is counted as 3x the forward:
the backward of each matmul is two matmuls of the same size. Methods without a clear count (sparse
patterns, hashing, FFT) have no model ("n/a").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from effattn.bench.timing import synchronizer, time_once
from effattn.registry import Problem, spec

FWD_BWD_FACTOR = 3


def has_model(method: str) -> bool:
    return spec(method).flops is not None


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
    size: int = 2048,
    repeats: int = 20,
    budget_s: float = 1.5,
) -> float:
    """Best GFLOP/s of ``size``^3 matmuls: one warm-up, then up to ``repeats`` timed calls,
    stopping once ``budget_s`` seconds (warm-up included) are spent."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = synchronizer(device)
    spent = time_once(lambda: a @ b, sync)
    best = math.inf
    for _ in range(repeats):
        t = time_once(lambda: a @ b, sync)
        best = min(best, t)
        spent += t
        if spent > budget_s:
            break
    return 2.0 * size**3 / best / 1e9
