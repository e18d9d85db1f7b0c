"""Attention to a random subset of the keys, through the explicit sampled mask."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from effattn.naive.softmax import dense_mask


def random_subset_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Softmax of scale·q k^T restricted to each query's sampled keys: indices (H, N, S), -1 for
    an unused slot, become an explicit (H, N, M) mask; padded keys and (causal) j > i removed."""
    h, n, _ = indices.shape
    m = k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # Unused slots (-1) write into an extra column M that is cut off.
    column = torch.where(indices >= 0, indices.long(), m)
    sampled = torch.zeros(h, n, m + 1, dtype=torch.bool, device=q.device).scatter_(
        -1, column.to(q.device), True)[..., :m]
    allowed = sampled[None] & dense_mask(n, m, causal=causal, key_padding_mask=key_padding_mask,
                                         device=q.device)
    scores = (scale * q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v
