"""Naive dense references: explicit N x M matrices and masks, no tricks.

Used by the tests and the approximation study only. Each function has the signature of the fast
path it checks; it is written from the formula, never by calling the fast path's helpers, so that
a bug in a shared helper cannot hide in both.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def dense_mask(
    n: int,
    m: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """(B or 1, 1, N, M) bool, True where query i may attend to key j."""
    allowed = torch.ones(1, 1, n, m, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(m, device=device)[None, :]
        allowed = allowed & (j <= i)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return allowed


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(scale q k^T) v with an explicit score matrix; rows with no allowed key give 0."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ k.transpose(-2, -1)
    allowed = dense_mask(
        q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


# --- kernelized attention ---------------------------------------------------------------


def kernel_weights(
    n: int,
    m: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """(B or 1, H or 1, N, M) weights w_ij of the kernelized sum, from their definition.

    Gated: the recurrence S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T unrolled one step at a time,
    so w_ij = (1 - g_j) Π_{j<l<=i} g_l. Padded keys get weight 0 and (gated) do not decay.
    """
    w = dense_mask(n, m, causal=causal, key_padding_mask=key_padding_mask).to(dtype)
    if gate is None:
        return w
    g = gate.to(dtype)
    if key_padding_mask is not None:
        g = torch.where(key_padding_mask[:, None, :], torch.ones_like(g), g)
    b, h = g.shape[:2]
    rows = []
    carry = torch.zeros(b, h, m, dtype=dtype)  # weight of each key in the state S_{t}
    for t in range(n):
        inject = torch.zeros(b, h, m, dtype=dtype)
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
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> Tensor:
    """Reference of ``kernelized.core.linear_attention``: the explicit N x M kernel matrix.

    ``chunk_size`` is accepted for the shared signature and has no effect here.
    """
    true_k = phi_k if key_log_scale is None else phi_k * torch.exp(key_log_scale)
    a = phi_q @ true_k.transpose(-2, -1)
    a = a * kernel_weights(
        phi_q.shape[2], phi_k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
        gate=gate, dtype=a.dtype,
    )
    den = a.sum(-1, keepdim=True)
    den = torch.where(den >= 0, den.clamp_min(eps), den.clamp_max(-eps))
    return (a @ v) / den


def _explicit(phi_q: Tensor, phi_k: Tensor, v: Tensor, causal: bool, key_padding_mask, gate=None):
    """Normalised kernel attention with true (unstabilised) features and no eps tricks."""
    a = phi_q @ phi_k.transpose(-2, -1)
    a = a * kernel_weights(
        phi_q.shape[2], phi_k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
        gate=gate, dtype=a.dtype,
    )
    den = a.sum(-1, keepdim=True)
    sees_a_key = kernel_weights(
        phi_q.shape[2], phi_k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
        dtype=a.dtype,
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
    chunk_size: int = 64,
) -> Tensor:
    """Reference of ``methods.performer.performer_attention`` (chunk_size unused)."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    w = projection.to(q.dtype)
    return _explicit(
        performer_features(q * root, w, feature_map), performer_features(k * root, w, feature_map),
        v, causal, key_padding_mask,
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
    chunk_size: int = 64,
) -> Tensor:
    """Reference of ``methods.favor.favor_attention``: sqrt(2/F) exp(|x|²/2) cos(w x + b)."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    w, b = projection.to(q.dtype), phase.to(q.dtype)

    def phi(x: Tensor) -> Tensor:
        x = x * root
        sq = (x * x).sum(-1, keepdim=True) / 2
        return math.sqrt(2 / w.shape[0]) * torch.exp(sq) * torch.cos(x @ w.T + b)

    return _explicit(phi(q), phi(k), v, causal, key_padding_mask)


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
    chunk_size: int = 64,
) -> Tensor:
    """Reference of ``methods.rfa.rfa_attention``; gated through the explicit recurrence weights."""
    f = projection.shape[0]
    w = projection.to(q.dtype) / sigma.to(q.dtype)[:, None, None]  # (H, F, D)

    def phi(x: Tensor) -> Tensor:
        u = (x / x.norm(dim=-1, keepdim=True)) @ w.transpose(-2, -1)
        if feature_map == "sincos":
            return torch.cat([torch.sin(u), torch.cos(u)], -1) / math.sqrt(f)
        return math.sqrt(2 / f) * torch.relu(u)

    return _explicit(phi(q), phi(k), v, causal, key_padding_mask, gate)


def linear_transformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """Reference of ``methods.linear.linear_transformer_attention``."""
    return _explicit(
        torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1, v, causal, key_padding_mask
    )
