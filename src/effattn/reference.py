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


# --- linformer, nystrom, fnet


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e: Tensor,
    f: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(scale q k^T E^T) F v through the explicit N x M mixing matrix softmax(.) F.

    E, F: the first M columns of e, f ((H, P, L) or (P, L)), with the columns of padded keys
    zeroed (the same as zeroing padded keys and values before projecting).
    """
    n_heads, m = q.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    e = e[..., :m].expand(n_heads, -1, -1)[None]
    f = f[..., :m].expand(n_heads, -1, -1)[None]
    if key_padding_mask is not None:
        keep = (~key_padding_mask)[:, None, None, :].to(q.dtype)
        e, f = e * keep, f * keep
    scores = (scale * q @ k.transpose(-2, -1)) @ e.transpose(-2, -1)
    mixing = torch.softmax(scores, dim=-1) @ f
    return mixing @ v


def _segment_means(x: Tensor, keep: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """x (H, L, D), keep (L,) -> (means (H, m, D), valid (m,)): segment i holds the kept tokens
    of rank floor(i n / m) ... floor((i + 1) n / m) - 1 (n kept tokens); empty ones are 0."""
    kept = keep.nonzero()[:, 0]
    n = kept.numel()
    means, valid = [], []
    for i in range(m):
        members = kept[i * n // m : (i + 1) * n // m]
        valid.append(members.numel() > 0)
        means.append(x[:, members].mean(1) if valid[-1] else x.new_zeros(x.shape[0], x.shape[2]))
    return torch.stack(means, 1), torch.tensor(valid, device=x.device)


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    num_landmarks: int = 64,
    pinv_iterations: int = 6,
    conv_weight: Tensor | None = None,
) -> Tensor:
    """Nyström attention one sequence at a time, with explicit softmax kernels and pinv steps.

    Query landmarks skip padded positions when N == M; the pinv is exact (torch.linalg.pinv)
    when num_landmarks >= max(N, M), else the iteration of the paper with per-matrix norms.
    """
    b, n_heads, n, d = q.shape
    m = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keep_k = torch.ones(b, m, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    outs = []
    for i in range(b):
        keep_q = keep_k[i] if n == m else torch.ones(n, dtype=torch.bool)
        q_land, valid_q = _segment_means(q[i], keep_q, min(num_landmarks, n))
        k_land, valid_k = _segment_means(k[i], keep_k[i], min(num_landmarks, m))
        no_key = float("-inf")
        s1 = (scale * q[i] @ k_land.transpose(-2, -1)).masked_fill(~valid_k, no_key)
        s2 = (scale * q_land @ k_land.transpose(-2, -1)).masked_fill(~valid_k, no_key)
        s3 = (scale * q_land @ k[i].transpose(-2, -1)).masked_fill(~keep_k[i], no_key)
        s1 = torch.softmax(s1, -1).nan_to_num(0.0)
        s2 = torch.softmax(s2, -1).nan_to_num(0.0) * valid_q[:, None]
        s3 = torch.softmax(s3, -1).nan_to_num(0.0) * valid_q[:, None]
        if num_landmarks >= max(n, m):
            z = torch.linalg.pinv(s2)
        else:
            max_row = s2.sum(2).max(1).values
            max_col = s2.sum(1).max(1).values
            z = s2.transpose(-2, -1) / (max_row * max_col)[:, None, None]
            eye = torch.eye(s2.shape[1], dtype=q.dtype)
            for _ in range(pinv_iterations):
                kz = s2 @ z
                z = z @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz))) / 4
        out = s1 @ z @ s3 @ v[i]
        if conv_weight is not None:
            r = conv_weight.shape[1] // 2
            offset = torch.arange(m)[None, :] - torch.arange(n)[:, None] + r
            inside = (offset >= 0) & (offset <= 2 * r)
            toeplitz = conv_weight[:, offset.clamp(0, 2 * r)] * inside
            out = out + toeplitz @ (v[i] * keep_k[i][:, None])
        outs.append(out)
    return torch.stack(outs)


def fnet_mixing(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Re(W_N v W_Dv) with the explicit DFT matrices W_L[j, t] = exp(-2 pi i j t / L)."""
    def dft(length: int) -> Tensor:
        j = torch.arange(length, dtype=torch.float64)
        angle = -2 * math.pi * torch.outer(j, j).remainder(length) / length
        return torch.polar(torch.ones_like(angle), angle)

    cdtype = torch.complex128 if v.dtype == torch.float64 else torch.complex64
    w_n, w_d = dft(v.shape[2]).to(cdtype), dft(v.shape[3]).to(cdtype)
    return (w_n @ v.to(cdtype) @ w_d).real
