"""The structured sparse patterns (sliding window, Longformer, BigBird, Sparse Transformer).

Each reference builds the explicit N x N allowed-mask of its pattern from the definition and
takes a masked softmax; rows with no allowed key give 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _pattern_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    key_padding_mask: Tensor | None,
    scale: float | None,
) -> Tensor:
    """softmax(scale q k^T) v over ``allowed`` ((N, M) or (H, N, M)) minus padded keys."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ k.transpose(-2, -1)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def _positions(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    return torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    dilation: int = 1,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Sliding window: |i - j| <= window // 2 (causal: 0 <= i - j <= window - 1), and
    (i - j) % dilation == 0."""
    i, j = _positions(q.shape[2], q.device)
    near = (i - j >= 0) & (i - j <= window - 1) if causal else (i - j).abs() <= window // 2
    return _pattern_attention(
        q, k, v, near & ((i - j) % dilation == 0), key_padding_mask, scale
    )


def longformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    global_tokens: tuple[int, ...],
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """|i - j| <= window // 2, or i global, or j global."""
    n = q.shape[2]
    i, j = _positions(n, q.device)
    is_global = torch.zeros(n, dtype=torch.bool, device=q.device)
    is_global[list(global_tokens)] = True
    allowed = ((i - j).abs() <= window // 2) | is_global[:, None] | is_global[None, :]
    return _pattern_attention(q, k, v, allowed, key_padding_mask, scale)


def bigbird_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    random_blocks: Tensor,
    num_global_blocks: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Blocks of ``block_size``: query block a sees key block b when |a - b| <= 1, a or b is one of
    the first ``num_global_blocks`` blocks, or b is in random_blocks[h, a] ((H, nb, r), -1 unused).
    """
    n = q.shape[2]
    heads, nb, _ = random_blocks.shape
    random_blocks = random_blocks.to(q.device)
    a, b = _positions(nb, q.device)
    block_allowed = ((a - b).abs() <= 1) | (a < num_global_blocks) | (b < num_global_blocks)
    chosen = torch.zeros(heads, nb, nb + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, random_blocks.masked_fill(random_blocks < 0, nb), True)
    block_allowed = block_allowed | chosen[:, :, :nb]
    pos_block = torch.arange(n, device=q.device) // block_size
    allowed = block_allowed[:, pos_block][:, :, pos_block]
    return _pattern_attention(q, k, v, allowed, key_padding_mask, scale)


def sparse_strided_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    stride: int | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Child et al. 2019 strided: (|i - j| < s or (i - j) % s == 0), and j <= i when causal;
    s = stride, default round(sqrt(N))."""
    n = q.shape[2]
    s = max(1, round(math.sqrt(n))) if stride is None else stride
    i, j = _positions(n, q.device)
    allowed = ((i - j).abs() < s) | ((i - j) % s == 0)
    if causal:
        allowed = allowed & (j <= i)
    return _pattern_attention(q, k, v, allowed, key_padding_mask, scale)


def sparse_fixed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    stride: int | None = None,
    c: int = 8,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Child et al. 2019 fixed: (j // s == i // s or j % s >= s - c), and j <= i when causal."""
    n = q.shape[2]
    s = max(1, round(math.sqrt(n))) if stride is None else stride
    i, j = _positions(n, q.device)
    allowed = (i // s == j // s) | (j % s >= s - c)
    if causal:
        allowed = allowed & (j <= i)
    return _pattern_attention(q, k, v, allowed, key_padding_mask, scale)
