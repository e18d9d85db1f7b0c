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


# --- reformer, random


def reformer_candidates(
    q: Tensor,
    k: Tensor,
    rotations: Tensor,
    *,
    bucket_size: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    shared_qk: bool = False,
) -> Tensor:
    """(B, H, N, M) bool: the union over rounds of the keys each query sees in Reformer.

    Written from the rule of ``methods/reformer.py``: per round, bucket = argmax([x R; -x R])
    (one bucket when R has no columns), padded keys in bucket n_buckets; items ordered by
    (bucket, position[, key before query]); an item's slot is the number of items with a smaller
    code. Not causal: key chunk = query chunk or the one before (chunk = slot // C). Causal:
    same bucket, 0 <= slot_q - slot_k <= C, and j <= i; without shared QK key i is added. Padded
    keys and, with shared QK, the diagonal (unless it is the only candidate) are removed.
    """
    b, h, n, _ = q.shape
    m = k.shape[2]
    n_rounds = rotations.shape[1]
    n_buckets = max(1, 2 * rotations.shape[-1])

    def buckets(x: Tensor) -> Tensor:
        rounds = []
        for r in range(n_rounds):
            if n_buckets == 1:
                rounds.append(torch.zeros(b, h, x.shape[2], dtype=torch.long))
                continue
            proj = x @ rotations[None, :, r].to(x.dtype)  # (B, H, L, n_buckets/2)
            rounds.append(torch.cat([proj, -proj], dim=-1).argmax(dim=-1))
        return torch.stack(rounds, dim=2)  # (B, H, R, L)

    padded = (
        torch.zeros(b, 1, 1, m, dtype=torch.bool)
        if key_padding_mask is None
        else key_padding_mask[:, None, None, :]
    )
    pos_q, pos_k = torch.arange(n), torch.arange(m)
    if shared_qk:
        q_bucket = k_bucket = buckets(q).masked_fill(padded, n_buckets)
        q_code = k_code = every = q_bucket * n + pos_q
        chunk = bucket_size
    else:
        length = max(n, m)
        q_bucket = buckets(q)
        k_bucket = buckets(k).masked_fill(padded, n_buckets)
        q_code = (q_bucket * length + pos_q) * 2 + 1
        k_code = (k_bucket * length + pos_k) * 2
        every = torch.cat([q_code, k_code], dim=-1)
        chunk = 2 * bucket_size
    q_slot = (every[..., None, :] < q_code[..., :, None]).sum(-1)  # (B, H, R, N)
    k_slot = (every[..., None, :] < k_code[..., :, None]).sum(-1)  # (B, H, R, M)
    if causal:
        lag = q_slot[..., :, None] - k_slot[..., None, :]
        same = q_bucket[..., :, None] == k_bucket[..., None, :]
        seen = same & (lag >= 0) & (lag <= chunk)
    else:
        lag = q_slot[..., :, None] // chunk - k_slot[..., None, :] // chunk
        seen = (lag == 0) | (lag == 1)
    union = seen.any(dim=2)
    if causal and not shared_qk:
        union = union | torch.eye(n, m, dtype=torch.bool)  # key i is always a candidate of i
    allowed = union & dense_mask(n, m, causal=causal, key_padding_mask=key_padding_mask)
    if shared_qk:
        diagonal = torch.eye(n, m, dtype=torch.bool)
        others = (allowed & ~diagonal).any(dim=-1, keepdim=True)
        allowed = allowed & ~(diagonal & others)
    return allowed


def reformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rotations: Tensor,
    *,
    bucket_size: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    shared_qk: bool = False,
) -> Tensor:
    """Reformer's multi-round LSH attention with duplicate counting, written as what it equals:
    softmax of scale·q·k^T (k/|k| with shared QK) over the union of candidates of every round.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    allowed = reformer_candidates(
        q,
        k,
        rotations,
        bucket_size=bucket_size,
        causal=causal,
        key_padding_mask=key_padding_mask,
        shared_qk=shared_qk,
    )
    keys = k / k.norm(dim=-1, keepdim=True) if shared_qk else k
    scores = (scale * q @ keys.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


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
    sampled = torch.zeros(h, n, m + 1, dtype=torch.bool).scatter_(-1, column, True)[..., :m]
    allowed = sampled[None] & dense_mask(n, m, causal=causal, key_padding_mask=key_padding_mask)
    scores = (scale * q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v
