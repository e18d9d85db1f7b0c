"""Reformer's LSH attention as softmax over the explicit union of every round's candidates."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from effattn.naive.softmax import dense_mask


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

    Written from the rule of ``mechanisms/reformer.py``: per round, bucket = argmax([x R; -x R])
    (one bucket when R has no columns), padded keys in bucket n_buckets; queries and keys are
    each ordered by (bucket, position); rank = number of items of its kind with a smaller code.

    Shared QK (one sequence, C = min(bucket_size, N)): not causal, key chunk (rank // C) = query
    chunk or the one before; causal, same bucket and 0 <= rank_i - rank_j <= C.

    Otherwise, with C = min(N, ceil(bucket_size·N/L)) and W = min(M, 2·ceil(bucket_size·M/L))
    (L = max(N, M)) and kappa_i = number of keys at or before query i in (bucket, position):
    not causal, queries are cut by rank into chunks of C; a chunk's window starts at
    (kappa of its first query + kappa of its last) // 2 - W // 2, kept within
    [0, max(M_real - W, 0)] (M_real: unpadded keys), and query i sees the keys ranked in
    [start, start + W). Causal, each bucket's queries are cut (in position order) into chunks of
    C; with a = max(keys of the bucket at or before the chunk's first query - W // 2, 0), query
    i sees the keys j <= i of its bucket that have between a and a + W - 1 earlier keys in it;
    key i is added.

    Padded keys and, with shared QK, the diagonal (unless it is the only candidate) are removed.
    """
    b, h, n, _ = q.shape
    m = k.shape[2]
    n_rounds = rotations.shape[1]
    n_buckets = max(1, 2 * rotations.shape[-1])

    def buckets(x: Tensor) -> Tensor:
        rounds = []
        for r in range(n_rounds):
            if n_buckets == 1:
                rounds.append(torch.zeros(b, h, x.shape[2], dtype=torch.long, device=x.device))
                continue
            proj = x @ rotations[None, :, r].to(x)  # (B, H, L, n_buckets/2)
            rounds.append(torch.cat([proj, -proj], dim=-1).argmax(dim=-1))
        return torch.stack(rounds, dim=2)  # (B, H, R, L)

    def before(a: Tensor, c: Tensor) -> Tensor:
        """(..., len(a)) count of entries of c below each entry of a."""
        return (c[..., None, :] < a[..., :, None]).sum(-1)

    padded = (
        torch.zeros(b, 1, 1, m, dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask[:, None, None, :]
    )
    pos_q, pos_k = torch.arange(n, device=q.device), torch.arange(m, device=q.device)
    if shared_qk:
        bucket = buckets(q).masked_fill(padded, n_buckets)
        code = bucket * n + pos_q
        rank = before(code, code)  # (B, H, R, N)
        chunk = min(bucket_size, n)
        lag = rank[..., :, None] - rank[..., None, :]
        if causal:
            same = bucket[..., :, None] == bucket[..., None, :]
            seen = same & (lag >= 0) & (lag <= chunk)
        else:
            lag = rank[..., :, None] // chunk - rank[..., None, :] // chunk
            seen = (lag == 0) | (lag == 1)
    else:
        length = max(n, m)
        chunk = min(n, -(-bucket_size * n // length))
        width = min(m, 2 * -(-bucket_size * m // length))
        q_bucket = buckets(q)
        k_bucket = buckets(k).masked_fill(padded, n_buckets)
        q_code = q_bucket * length + pos_q
        k_code = k_bucket * length + pos_k
        kappa = before(q_code + 1, k_code)  # keys at or before each query
        if not causal:
            q_chunk = before(q_code, q_code) // chunk
            same_chunk = q_chunk[..., :, None] == q_chunk[..., None, :]
            first = kappa[..., None, :].masked_fill(~same_chunk, m).amin(-1)
            last = kappa[..., None, :].masked_fill(~same_chunk, -1).amax(-1)
            real = (~padded).sum(-1, keepdim=True)  # (B, 1, 1, 1)
            start = ((first + last) // 2 - width // 2).clamp_min(0)
            start = torch.minimum(start, (real - width).clamp_min(0))
            k_rank = before(k_code, k_code)[..., None, :]
            seen = (k_rank >= start[..., None]) & (k_rank < start[..., None] + width)
        else:
            same_q = q_bucket[..., :, None] == q_bucket[..., None, :]
            q_within = (same_q & (pos_q[None, :] < pos_q[:, None])).sum(-1)
            lead = same_q & (q_within[..., None, :] == (q_within // chunk * chunk)[..., :, None])
            same = q_bucket[..., :, None] == k_bucket[..., None, :]  # (B, H, R, N, M)
            # Keys of its bucket at or before the chunk's first query.
            upto = (same & (pos_k <= pos_q[:, None])).sum(-1)
            low = ((lead * upto[..., None, :]).sum(-1) - width // 2).clamp_min(0)
            k_same = k_bucket[..., :, None] == k_bucket[..., None, :]
            k_within = (k_same & (pos_k[None, :] < pos_k[:, None])).sum(-1)[..., None, :]
            seen = same & (k_within >= low[..., None]) & (k_within < low[..., None] + width)
    union = seen.any(dim=2)
    if causal and not shared_qk:
        # Key i is always a candidate of query i.
        union = union | torch.eye(n, m, dtype=torch.bool, device=q.device)
    allowed = union & dense_mask(n, m, causal=causal, key_padding_mask=key_padding_mask,
                                 device=q.device)
    if shared_qk:
        diagonal = torch.eye(n, m, dtype=torch.bool, device=q.device)
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
