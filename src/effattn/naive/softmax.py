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
