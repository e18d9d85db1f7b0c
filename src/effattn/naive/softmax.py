"""Exact softmax attention and the dense mask every naive reference starts from."""

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
    softcap: float | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax(s) v with an explicit score matrix s = scale q k^T; rows with no allowed key give 0.

    ``softcap`` c: s = c tanh(s / c). ``window`` (causal): query i sees key j only if
    i - j < window. ``sinks`` (H,): a column of logit sinks[h] joins every row's softmax and is
    dropped afterwards (it has no value), so
    out_i = sum_j e^{s_ij} v_j / (e^{sink} + sum_j e^{s_ij}).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ k.transpose(-2, -1)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = dense_mask(
        q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    if window is not None:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        allowed = allowed & (i - j < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    else:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.softmax(torch.cat([scores, column], -1), dim=-1)[..., :-1]
    return weights @ v
