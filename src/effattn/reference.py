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


# --- kernelized attention ---------------------------------------------------------------


def kernel_weights(
    n: int,
    m: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
) -> Tensor:
    """(B or 1, H or 1, N, M) weights w_ij of the kernelized sum, from their definition.

    Gated: the recurrence S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T unrolled one step at a time,
    so w_ij = (1 - g_j) Π_{j<l<=i} g_l. Padded keys get weight 0 and (gated) do not decay.
    """
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
        gate=gate, dtype=a.dtype, device=a.device,
    )
    den = a.sum(-1, keepdim=True)
    den = torch.where(den >= 0, den.clamp_min(eps), den.clamp_max(-eps))
    return (a @ v) / den


def _explicit(phi_q: Tensor, phi_k: Tensor, v: Tensor, causal: bool, key_padding_mask, gate=None):
    """Normalised kernel attention with true (unstabilised) features and no eps tricks."""
    a = phi_q @ phi_k.transpose(-2, -1)
    a = a * kernel_weights(
        phi_q.shape[2], phi_k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
        gate=gate, dtype=a.dtype, device=a.device,
    )
    den = a.sum(-1, keepdim=True)
    sees_a_key = kernel_weights(
        phi_q.shape[2], phi_k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
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


def fnet_mixing(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Re(W_N v W_Dv) with the explicit DFT matrices W_L[j, t] = exp(-2 pi i j t / L)."""
    def dft(length: int) -> Tensor:
        j = torch.arange(length, dtype=torch.float64, device=v.device)
        angle = -2 * math.pi * torch.outer(j, j).remainder(length) / length
        return torch.polar(torch.ones_like(angle), angle)

    cdtype = torch.complex128 if v.dtype == torch.float64 else torch.complex64
    w_n, w_d = dft(v.shape[2]).to(cdtype), dft(v.shape[3]).to(cdtype)
    return (w_n @ v.to(cdtype) @ w_d).real


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


# --- structured sparse patterns
# Each reference builds the explicit N x N allowed-mask of its pattern from the definition and
# takes a masked softmax; rows with no allowed key give 0.


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
    a, b = _positions(nb, q.device)
    block_allowed = ((a - b).abs() <= 1) | (a < num_global_blocks) | (b < num_global_blocks)
    chosen = torch.zeros(heads, nb, nb + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, random_blocks.to(q.device).masked_fill(random_blocks < 0, nb), True)
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
