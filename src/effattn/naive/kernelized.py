"""Kernelized attention written out: the true (unstabilised) features of each map and the
explicit N x M kernel matrix, with gates through their unrolled recurrence weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from effattn.naive.softmax import dense_mask


def kernel_weights(
    n: int,
    m: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
    lag: int = 0,
) -> Tensor:
    """(B or 1, H or 1, N, M) weights w_ij of the kernelized sum, from their definition.

    Gated: the recurrence S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T unrolled one step at a time,
    so w_ij = (1 - g_j) Π_{j<l<=i} g_l. Padded keys get weight 0 and (gated) do not decay.
    ``lag`` (causal): query i reads the state S_{i - lag}, row i - lag of the weights (none for
    i < lag), so it sees keys j <= i - lag.
    """
    if lag:
        w = kernel_weights(n, m, causal=causal, key_padding_mask=key_padding_mask, gate=gate,
                           dtype=dtype, device=device)
        shifted = torch.zeros_like(w)
        shifted[..., lag:, :] = w[..., :max(n - lag, 0), :]
        return shifted
    w = dense_mask(n, m, causal=causal, key_padding_mask=key_padding_mask, device=device).to(dtype)
    if gate is None:
        return w
    g = gate.to(dtype)
    if key_padding_mask is not None:
        g = torch.where(key_padding_mask[:, None, :], torch.ones_like(g), g)
    b, h = g.shape[:2]
    rows = []
    carry = torch.zeros(b, h, m, dtype=dtype, device=g.device)  # weight of key j in S_{t}
    for t in range(n):
        inject = torch.zeros(b, h, m, dtype=dtype, device=g.device)
        inject[:, :, t] = 1.0 - g[:, :, t]
        carry = g[:, :, t, None] * carry + inject
        rows.append(carry)
    return torch.stack(rows, 2) * w


def kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    gate: Tensor | None = None,
    eps: float = 1e-6,
    lag: int = 0,
) -> Tensor:
    """The kernelized core on precomputed features: the explicit N x M kernel matrix
    φ(Q) (φ(K) exp(key_log_scale))^T weighted by :func:`kernel_weights` (``lag``: see there),
    and its denominator pushed away from 0 by ``eps`` (keeping its sign), as the core does."""
    true_k = phi_k if key_log_scale is None else phi_k * torch.exp(key_log_scale)
    a = phi_q @ true_k.transpose(-2, -1)
    a = a * kernel_weights(
        phi_q.shape[2], phi_k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
        gate=gate, dtype=a.dtype, device=a.device, lag=lag,
    )
    den = a.sum(-1, keepdim=True)
    den = torch.where(den >= 0, den.clamp_min(eps), den.clamp_max(-eps))
    return (a @ v) / den


@dataclass
class WindowHybrid:
    """The window hybrid of a kernelized method (effattn.kernelized.hybrid): exact exponentials of
    ``logits`` (B, H, N, N) over each query's window of ``window`` keys, the kernel elsewhere,
    times exp(``log_factor``) (H,) when given."""

    window: int
    logits: Tensor
    log_factor: Tensor | None = None


def window_hybrid(module, logits: Tensor) -> WindowHybrid | None:
    """The :class:`WindowHybrid` of a kernelized module built with ``window`` (None without), for
    the exact ``logits`` (B, H, N, N) its features estimate the exponential of."""
    if module.window is None:
        return None
    factor = module.window_log_factor
    return WindowHybrid(module.window, logits,
                        None if factor is None else factor.to(logits.dtype))


def _explicit(phi_q: Tensor, phi_k: Tensor, v: Tensor, causal: bool, key_padding_mask, gate=None,
              hybrid: WindowHybrid | None = None):
    """Normalised kernel attention with true (unstabilised) features and no eps tricks."""
    return _normalised(phi_q @ phi_k.transpose(-2, -1), v, causal, key_padding_mask, gate, hybrid)


def _normalised(a: Tensor, v: Tensor, causal: bool, key_padding_mask, gate=None,
                hybrid: WindowHybrid | None = None) -> Tensor:
    """The kernel matrix a (B, H, N, M) weighted by :func:`kernel_weights`, normalised per query,
    times v; a query that sees no key at all gets 0. With ``hybrid``, inside each query's window
    (causal: 0 <= i - j < W; else |i - j| <= W // 2) exp(logit) replaces the weighted kernel."""
    a = a * kernel_weights(
        a.shape[2], a.shape[3], causal=causal, key_padding_mask=key_padding_mask,
        gate=gate, dtype=a.dtype, device=a.device,
    )
    if hybrid is not None:
        n, m = a.shape[2], a.shape[3]
        offset = (torch.arange(n, device=a.device)[:, None]
                  - torch.arange(m, device=a.device)[None, :])
        w = hybrid.window
        inside = (offset >= 0) & (offset < w) if causal else offset.abs() <= w // 2
        if key_padding_mask is not None:
            inside = inside & ~key_padding_mask[:, None, None, :]
        logits = hybrid.logits.masked_fill(~inside, -math.inf)
        top = logits.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
        if hybrid.log_factor is not None:
            a = a * hybrid.log_factor.exp()[:, None, None]
        # Everything at the scale of the window's largest logit.
        a = torch.where(inside, torch.exp(logits - top), a * torch.exp(-top))
    den = a.sum(-1, keepdim=True)
    sees_a_key = kernel_weights(
        a.shape[2], a.shape[3], causal=causal, key_padding_mask=key_padding_mask,
        dtype=a.dtype, device=a.device,
    ).sum(-1, keepdim=True) > 0
    # A query that sees no key at all (all padding) outputs 0, as in every fast path.
    return torch.where(sees_a_key, (a @ v) / torch.where(sees_a_key, den, 1.0), 0.0)


def performer_features(x: Tensor, projection: Tensor, feature_map: str) -> Tensor:
    """True FAVOR+ features of x̃ (already scaled by sqrt(scale)), written from the paper."""
    f = projection.shape[0]
    u = x @ projection.T
    sq = (x * x).sum(-1, keepdim=True) / 2
    if feature_map == "positive":
        return torch.exp(u - sq) / math.sqrt(f)
    if feature_map == "hyperbolic":
        return torch.cat([torch.exp(u - sq), torch.exp(-u - sq)], -1) / math.sqrt(2 * f)
    if feature_map == "trig":
        return torch.exp(sq) * torch.cat([torch.sin(u), torch.cos(u)], -1) / math.sqrt(f)
    if feature_map == "relu":
        return torch.relu(u) + 1e-3
    raise ValueError(f"unknown feature_map {feature_map!r}")


def performer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    feature_map: str = "positive",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    hybrid: WindowHybrid | None = None,
) -> Tensor:
    """Performer (FAVOR+) with the (F, D) ``projection``: the explicit kernel matrix of the true
    features φ(q̃)·φ(k̃), q̃ = q·sqrt(scale) (see :func:`performer_features`)."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    w = projection.to(q.dtype)
    return _explicit(
        performer_features(q * root, w, feature_map), performer_features(k * root, w, feature_map),
        v, causal, key_padding_mask, hybrid=hybrid,
    )


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    phase: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    hybrid: WindowHybrid | None = None,
) -> Tensor:
    """Original FAVOR with the (F, D) ``projection`` and (F,) ``phase``: the explicit kernel
    matrix of φ(x) = sqrt(2/F) exp(|x|²/2) cos(w x + b), x = q·sqrt(scale) or k·sqrt(scale)."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    w, b = projection.to(q.dtype), phase.to(q.dtype)

    def phi(x: Tensor) -> Tensor:
        x = x * root
        sq = (x * x).sum(-1, keepdim=True) / 2
        return math.sqrt(2 / w.shape[0]) * torch.exp(sq) * torch.cos(x @ w.T + b)

    return _explicit(phi(q), phi(k), v, causal, key_padding_mask, hybrid=hybrid)


def rfa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    sigma: Tensor,
    *,
    feature_map: str = "sincos",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    hybrid: WindowHybrid | None = None,
) -> Tensor:
    """RFA with the (F, D) ``projection`` and per-head ``sigma`` (H,): the explicit kernel matrix
    of φ(x̂) = F^(-1/2) [sin(w x̂ / σ), cos(w x̂ / σ)] (or sqrt(2/F) relu(w x̂ / σ), "arccos") on
    unit-length x̂, gated through the explicit recurrence weights (:func:`kernel_weights`)."""
    f = projection.shape[0]
    w = projection.to(q.dtype) / sigma.to(q.dtype)[:, None, None]  # (H, F, D)

    def phi(x: Tensor) -> Tensor:
        u = (x / x.norm(dim=-1, keepdim=True)) @ w.transpose(-2, -1)
        if feature_map == "sincos":
            return torch.cat([torch.sin(u), torch.cos(u)], -1) / math.sqrt(f)
        return math.sqrt(2 / f) * torch.relu(u)

    return _explicit(phi(q), phi(k), v, causal, key_padding_mask, gate, hybrid=hybrid)


def linear_transformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    hybrid: WindowHybrid | None = None,
) -> Tensor:
    """Linear transformer: the explicit kernel matrix (elu(q) + 1)·(elu(k) + 1)."""
    return _explicit(
        torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1, v, causal, key_padding_mask,
        hybrid=hybrid,
    )


def hedgehog_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Tensor,
    bias: Tensor,
    *,
    feature_map: str = "exp",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    hybrid: WindowHybrid | None = None,
) -> Tensor:
    """Hedgehog with per-head ``weight`` (H, D, F) and ``bias`` (H, F): the explicit kernel
    matrix of φ(x) = [exp(u), exp(-u)] (or, ``feature_map="softmax_dim"``,
    [softmax(u), softmax(-u)], each over its F features), u = x W_h + b_h on q and k as they
    are."""

    def phi(x: Tensor) -> Tensor:
        u = torch.einsum("bhld,hdf->bhlf", x, weight.to(x.dtype)) + bias.to(x.dtype)[:, None, :]
        if feature_map == "exp":
            return torch.cat([torch.exp(u), torch.exp(-u)], -1)
        if feature_map == "softmax_dim":
            return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1)
        raise ValueError(f"unknown feature_map {feature_map!r}")

    return _explicit(phi(q), phi(k), v, causal, key_padding_mask, hybrid=hybrid)


def exponent_attention(
    u_q: Tensor,
    u_k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Kernel attention of φ = exp(u) given the exponents u_q (B, H, N, F), u_k (B, H, M, F),
    in log space: log κ_ij = logsumexp_f (u_qf(i) + u_kf(j)), out_i = softmax_j(log κ_ij) v
    over the keys query i sees (0 where it sees none). Exact at any exponent (no product of
    features is ever formed), so it is the reference where exp(u) itself overflows."""
    log_kernel = torch.logsumexp(u_q[..., :, None, :] + u_k[..., None, :, :], -1)
    seen = kernel_weights(u_q.shape[2], u_k.shape[2], causal=causal,
                          key_padding_mask=key_padding_mask, dtype=u_q.dtype,
                          device=u_q.device) > 0
    log_kernel = log_kernel.masked_fill(~seen, -math.inf)
    return torch.softmax(log_kernel, -1).nan_to_num(0.0) @ v


def taylor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    hybrid: WindowHybrid | None = None,
) -> Tensor:
    """Based's Taylor kernel from its formula, not its features: the kernel matrix
    1 + t + t²/2 of t = q̃·k̃, x̃ = sqrt(scale) · x W_h, with the per-head ``projection``
    W (H, D, P)."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    w = projection.to(q.dtype) * root
    q_t = torch.einsum("bhld,hdp->bhlp", q, w)
    k_t = torch.einsum("bhld,hdp->bhlp", k, w)
    t = q_t @ k_t.transpose(-2, -1)
    return _normalised(1 + t + t * t / 2, v, causal, key_padding_mask, hybrid=hybrid)
