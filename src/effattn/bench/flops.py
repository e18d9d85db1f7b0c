"""FLOP models of the forward pass, the machine's measured matmul peak, and the reference GEMM
that tells a disturbed measurement.

Counts are matmul FLOPs (2 per multiply-add) of the useful work, for q (B, H, N, D),
k (B, H, M, D), v (B, H, M, Dv); elementwise work (exp, softmax, normalisation) is not counted.
Forward+backward is counted as 3x the forward: the backward of each matmul is two matmuls of the
same size. Methods without a clear count (sparse patterns, hashing, FFT) return None ("n/a").

- softmax:   2 B H (N M D + N M Dv); causal counts only the N (N + 1) / 2 visible pairs.
- performer, favor, rfa (P random projections, feature dimension F: F = P, or 2P after a sin/cos
  or hyperbolic doubling; F is read from the module's ``feature_dim`` when it exposes one):
  2 B H (N + M) P D for the features, 2 B H M F (Dv + 1) for phi(K)^T [V, 1] and
  2 B H N F (Dv + 1) for phi(Q) times that. Causal runs count the same (the useful work; the
  chunk-local masked products of a chunkwise kernel are extra).
- linear:    as above with F = D and no projection (the feature map is elementwise).
- linformer (k = proj_len): 2 B H (k M (D + Dv) + N k (D + Dv)).
- nystrom (m = num_landmarks, t = pinv_iterations): 2 B H (N m D + m^2 D + m M D) for the three
  kernels, 8 B H m^3 t for the iterative pseudo-inverse, 2 B H (m M Dv + m^2 Dv + N m Dv) for the
  products in the cheapest order, plus 2 B H N Dv c for a depthwise convolution of size c.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from effattn.bench.timing import synchronizer, time_fn, time_once

FWD_BWD_FACTOR = 3


def _softmax(o: Mapping[str, Any], b, h, n, m, d, dv, causal) -> float:
    pairs = n * (n + 1) / 2 if causal else n * m
    return 2.0 * b * h * pairs * (d + dv)


def _kernelized(o: Mapping[str, Any], b, h, n, m, d, dv, causal) -> float:
    projections = o["num_features"]
    features = o.get("feature_dim") or projections
    return 2.0 * b * h * ((n + m) * projections * d + (m + n) * features * (dv + 1))


def _linear(o: Mapping[str, Any], b, h, n, m, d, dv, causal) -> float:
    return 2.0 * b * h * (m + n) * d * (dv + 1)


def _linformer(o: Mapping[str, Any], b, h, n, m, d, dv, causal) -> float:
    k = min(o["proj_len"], m)
    return 2.0 * b * h * (k * m * (d + dv) + n * k * (d + dv))


def _nystrom(o: Mapping[str, Any], b, h, n, m, d, dv, causal) -> float:
    lm = min(o["num_landmarks"], n, m)
    kernels = n * lm * d + lm * lm * d + lm * m * d
    products = lm * m * dv + lm * lm * dv + n * lm * dv
    conv = n * dv * (o.get("conv_kernel") or 0)
    return 2.0 * b * h * (kernels + products + conv + 4 * lm**3 * o.get("pinv_iterations", 6))


_MODELS: dict[str, Callable[..., float]] = {
    "softmax": _softmax,
    "performer": _kernelized,
    "favor": _kernelized,
    "rfa": _kernelized,
    "linear": _linear,
    "linformer": _linformer,
    "nystrom": _nystrom,
}


def has_model(method: str) -> bool:
    return method in _MODELS


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

    ``options`` are the method's build options (defaults merged in); a ``feature_dim`` attribute
    of ``module`` overrides the feature dimension of kernelized methods.
    """
    model = _MODELS.get(method)
    if model is None:
        return None
    opts = dict(options)
    feature_dim = getattr(module, "feature_dim", None)
    if isinstance(feature_dim, int):
        opts["feature_dim"] = feature_dim
    try:
        return model(opts, batch, heads, n, m, head_dim, value_dim, causal)
    except KeyError:
        return None


def pass_flops(forward: float | None, pass_name: str) -> float | None:
    """FLOPs of a pass ("fwd" or "fwdbwd") given the forward count."""
    if forward is None:
        return None
    return forward * (FWD_BWD_FACTOR if pass_name == "fwdbwd" else 1)


def matmul_peak(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    max_size: int = 2048,
    min_call_s: float = 0.02,
    repeats: int = 10,
    budget_s: float = 0.5,
) -> float:
    """Best GFLOP/s, 2 n^3 / seconds, of (n, n) @ (n, n) matmuls in ``dtype``.

    n doubles from 256 until one call takes at least ``min_call_s`` or n reaches ``max_size``, so
    a dtype the CPU has no native instructions for (bf16 without AVX-512 BF16 or AMX runs at about
    1 GFLOP/s: 17 s for one 2048^3 product) is measured on a small matrix; then up to ``repeats``
    timed calls, stopping once ``budget_s`` seconds (the size search included) are spent. Each
    size's first call is a warm-up and its second decides whether to grow.
    """
    size = min(256, max_size)
    sync = synchronizer(device)
    spent = 0.0
    while True:
        call = partial(torch.mm, *(torch.randn(size, size, device=device).to(dtype)
                                   for _ in range(2)))
        spent += time_once(call, sync)
        t = time_once(call, sync)
        spent += t
        if t >= min_call_s or size >= max_size:
            break
        size = min(2 * size, max_size)
    best = t
    for _ in range(repeats):
        if spent > budget_s:
            break
        t = time_once(call, sync)
        best = min(best, t)
        spent += t
    return 2.0 * size**3 / best / 1e9


REFERENCE_SIZE = 512


def reference_gemm(device: torch.device | str = "cpu") -> Callable[[], float]:
    """A probe of how fast the machine is right now: a function that times a fixed fp32
    ``REFERENCE_SIZE``^3 GEMM (into a preallocated output, so it allocates nothing) and returns
    the median milliseconds per call of 3 samples (blocks of at least 2 ms: under 10 ms in all).

    Timed around and between the samples of a measurement in the same process and compared with
    its quietest time (:func:`effattn.bench.timing.judge`), it reveals other processes competing
    for the cores: with one of two cores taken, this GEMM on two threads ran 12x slower.
    """
    a = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, device=device)
    b = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, device=device)
    out = torch.empty(REFERENCE_SIZE, REFERENCE_SIZE, device=device)
    sync = synchronizer(device)

    def probe() -> float:
        return time_fn(lambda: torch.mm(a, b, out=out), repeats=3, sync=sync).median * 1e3

    return probe
