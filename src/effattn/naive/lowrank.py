"""Linformer and Nyströmformer through explicit mixing matrices, one sequence at a time."""

from __future__ import annotations

import math

import torch
from torch import Tensor


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

    Query landmarks skip padded positions when N == M. A sequence with at most num_landmarks
    unpadded queries and unpadded keys has single-token landmarks, s1 = s2 = s3 = S and
    S pinv(S) S V = S V: it outputs s1 times the landmark keys' values. Any other sequence uses
    the iteration of the paper with per-matrix norms. No breakdown check (see the fast path).
    """
    b, n_heads, n, d = q.shape
    m = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keep_k = (torch.ones(b, m, dtype=torch.bool, device=q.device) if key_padding_mask is None
              else ~key_padding_mask)
    outs = []
    for i in range(b):
        keep_q = keep_k[i] if n == m else torch.ones(n, dtype=torch.bool, device=q.device)
        q_land, valid_q = _segment_means(q[i], keep_q, min(num_landmarks, n))
        k_land, valid_k = _segment_means(k[i], keep_k[i], min(num_landmarks, m))
        no_key = float("-inf")
        s1 = (scale * q[i] @ k_land.transpose(-2, -1)).masked_fill(~valid_k, no_key)
        s1 = torch.softmax(s1, -1).nan_to_num(0.0)
        if keep_q.sum() <= num_landmarks and keep_k[i].sum() <= num_landmarks:
            out = s1 @ _segment_means(v[i], keep_k[i], min(num_landmarks, m))[0]
        else:
            s2 = (scale * q_land @ k_land.transpose(-2, -1)).masked_fill(~valid_k, no_key)
            s3 = (scale * q_land @ k[i].transpose(-2, -1)).masked_fill(~keep_k[i], no_key)
            s2 = torch.softmax(s2, -1).nan_to_num(0.0) * valid_q[:, None]
            s3 = torch.softmax(s3, -1).nan_to_num(0.0) * valid_q[:, None]
            max_row = s2.sum(2).max(1).values
            max_col = s2.sum(1).max(1).values
            z = s2.transpose(-2, -1) / (max_row * max_col)[:, None, None]
            eye = torch.eye(s2.shape[1], dtype=q.dtype, device=q.device)
            for _ in range(pinv_iterations):
                kz = s2 @ z
                z = z @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz))) / 4
            out = s1 @ z @ s3 @ v[i]
        if conv_weight is not None:
            r = conv_weight.shape[1] // 2
            offset = (torch.arange(m, device=q.device)[None, :]
                      - torch.arange(n, device=q.device)[:, None] + r)
            inside = (offset >= 0) & (offset <= 2 * r)
            toeplitz = conv_weight[:, offset.clamp(0, 2 * r)] * inside
            out = out + toeplitz @ (v[i] * keep_k[i][:, None])
        outs.append(out)
    return torch.stack(outs)
