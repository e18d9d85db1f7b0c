"""Reformer LSH attention (Kitaev, Kaiser and Levskaya 2020, "Reformer: The Efficient Transformer").

q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv); s_ij = scale · q_i·k_j.

Hashing. Round r (of R = n_hashes) has a Gaussian rotation R_r (D, n_buckets/2) per head,
shared by the batch; x falls in bucket h_r(x) = argmax([x R_r ; -x R_r]) (angular LSH: only
the direction of x counts). n_buckets = 1 when max(N, M) <= bucket_size (everything fits one
bucket, nothing is hashed), else 2·ceil(max(N, M) / (2·bucket_size)), so that a bucket holds
about bucket_size keys. Padded keys go to an extra bucket n_buckets, after every real one, so
their values can never move a real item.

Sorting, chunks and windows. Queries and keys are each sorted by (bucket, position); a chunk of
C consecutive queries meets a window of W consecutive keys (:func:`block_sizes`), one batched
(C, W) score block per chunk.
- shared_qk=True (the paper's shared-QK attention, self-attention only): token t is both the
  query q_t and the key k_t/|k_t| (k must equal q), so the two orders are one; C =
  min(bucket_size, N), and chunk c meets the window of chunks c - 1 and c (W = 2C).
- shared_qk=False: a bucket holds about bucket_size·N/L queries and bucket_size·M/L keys
  (L = max(N, M)); C = min(N, ceil(bucket_size·N/L)), W = min(M, 2·ceil(bucket_size·M/L)).
  kappa_i, the number of keys at or before query i in the (bucket, position) order (a key first
  on ties), places the query among the keys, so a window follows its queries however the two
  bucket populations differ (pairing query chunk c with key chunk c misaligns them, the reason
  the paper gives for shared QK).
  Why not one joint sort of queries and keys cut into chunks of 2·bucket_size items: with
  fixed-size blocks every (C, 2C) block would spend about 3/4 of its scores on pairs it masks
  away (key rows, query columns); the windows compute only query-key pairs.

Candidates S_r(i) of query i in round r (rank: position in its own sorted order):
- shared QK, not causal: the keys in the query's chunk and in the chunk before it (rank // C;
  no wrap-around); causal: the keys j <= i of the query's own bucket with
  rank_i - C <= rank_j <= rank_i, i.e. the most recent items of its bucket;
- not shared, not causal: queries are cut by rank into chunks of C; the chunk's window is the
  W keys ranked from (kappa_first + kappa_last) // 2 - W // 2 (first and last query of the
  chunk), kept within [0, max(M_real - W, 0)] (M_real: unpadded keys);
- not shared, causal: each bucket's queries are cut (in position order) into chunks of C, so
  a chunk never straddles buckets and a query's chunk depends on tokens <= i only; the window
  starts W // 2 keys before the chunk's first query, not before its bucket's first key, and
  query i sees the keys j <= i of its own bucket in it (every term counts items of its bucket
  at or before the first query: no future token moves it). Key i is a candidate of query i as
  well (its bucket may hold no earlier key; without it such a query would output 0). Chunks are
  laid out bucket by bucket, so there are up to (N - e) // C + e of them (e = min(n_buckets, N)).
Masking a chunk pair by position alone (as public code does) leaks: a future token changes the
ranks, hence which past keys share a chunk; both causal rules depend on tokens <= i only.
Padded keys are never candidates. With shared QK a token does not attend to itself unless it
has no other candidate in any round (then its output is v_i).

Rounds. The paper merges rounds with logsumexp weights and scores s_ij - log c_ij, c_ij the
number of rounds in which j is a candidate of i, which is exactly softmax attention over the
union U_i = ∪_r S_r(i): out_i = Σ_{j in U_i} exp(s_ij) v_j / Σ_{j in U_i} exp(s_ij) (an empty
U_i gives 0). That is what is computed, counting each pair once (in the first round that has
it) instead of dividing by c_ij: the same result with half the pairwise round checks.

Exact limit: when max(N, M) <= bucket_size there is one bucket, one chunk of every query and a
window of every key, and the result is exact softmax attention (causal or not) with
shared_qk=False; with shared_qk=True it is softmax of q against k/|k| with the diagonal removed.

Cost per round: N·W scores in chunks (up to twice that causal, chunks being per bucket), never
N x M: O(R N bucket_size D) time and memory (autograd keeps each round's chunks).

Strategies: where the banded engine runs FlexAttention (CUDA by default), every round's chunks
go through one FlexAttention call instead (:mod:`effattn.sparse.lsh_flex`: a block-diagonal
BlockMask over the gathered slots and windows, the rounds stacked on the head axis, merged by
their log-sum-exps), in the inputs' dtype; the hashing always runs on fp32 copies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from effattn.base import check_bool, check_positive_int, compute_dtype
from effattn.random import RandomizedAttention, RandomSource, normal
from effattn.registry import Budget, MethodSpec, register
from effattn.sparse.blockwise import runs_flex
from effattn.sparse.lsh import Layout

# Scores per group of chunks (1 MiB in fp32): on a CPU a group's masked elementwise passes then
# run in cache.
GROUP_ELEMENTS = 1 << 18
# On a GPU, groups as large as memory allows (128 MiB of fp32 scores, the gathered keys and
# values about as much again): a round of N = 65536 (B = 1, H = 8, chunks of 64 against windows
# of 128) is then one group, a few batched launches instead of a loop of 64 or more small ones
# per round (each launch a fraction of a millisecond of idle GPU).
GPU_GROUP_ELEMENTS = 1 << 25


def group_elements(device: torch.device) -> int:
    """Scores per group of chunks on ``device`` (see GROUP_ELEMENTS, GPU_GROUP_ELEMENTS)."""
    return GPU_GROUP_ELEMENTS if device.type == "cuda" else GROUP_ELEMENTS


def num_buckets(n: int, m: int, bucket_size: int) -> int:
    """Buckets per round for N queries and M keys: 1 if max(N, M) <= bucket_size, else
    2·ceil(max(N, M) / (2·bucket_size)) (even, as angular hashing needs)."""
    length = max(n, m)
    if length <= bucket_size:
        return 1
    return 2 * math.ceil(length / (2 * bucket_size))


def block_sizes(n: int, m: int, bucket_size: int, shared_qk: bool) -> tuple[int, int]:
    """(C, W): queries per chunk and keys per window for N queries and M keys.

    Shared QK: C = min(bucket_size, N), W = 2C (the chunk before and the own one). Otherwise a
    bucket holds about bucket_size·N/L queries and bucket_size·M/L keys (L = max(N, M)):
    C = min(N, ceil(bucket_size·N/L)) and W = min(M, 2·ceil(bucket_size·M/L)), about two
    buckets of keys; both are capped at what there is (see the module doc).
    """
    if shared_qk:
        chunk = min(bucket_size, n)
        return chunk, 2 * chunk
    length = max(n, m)
    return min(n, -(-bucket_size * n // length)), min(m, 2 * -(-bucket_size * m // length))


def draw_rotations(
    heads: int,
    n_hashes: int,
    dim: int,
    n_buckets: int,
    *,
    generator: RandomSource = None,
) -> Tensor:
    """(H, n_hashes, D, n_buckets // 2) standard Gaussian rotations, float32 on the CPU.

    One bucket needs no hashing: the last dimension is then empty.
    """
    if n_buckets != 1 and (n_buckets < 2 or n_buckets % 2):
        raise ValueError(f"n_buckets must be 1 or a positive even int, got {n_buckets}")
    return normal(generator, heads, n_hashes, dim, n_buckets // 2, dtype=torch.float32)


def lsh_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """Angular LSH bucket of every vector: x (B, H, L, D) -> (B, H, R, L) in [0, n_buckets),
    argmax([x R_r ; -x R_r]) with the first maximum on ties."""
    b, h, length, d = x.shape
    rounds, half = rotations.shape[1], rotations.shape[-1]
    if half == 0:
        return torch.zeros(b, h, rounds, length, dtype=torch.long, device=x.device)
    rotations = rotations.to(x.dtype).flatten(0, 1)  # (H R, D, n_buckets/2)
    # Every (head, round) pair's x, a view: pair p is head p // R.
    x = x.detach()[:, :, None].expand(b, h, rounds, length, d).flatten(1, 2)
    # Pairs projected together, B L n_buckets/2 values each, up to group_elements(device) values
    # at a time: one pair at a time at long lengths on a CPU (all at once would be a fresh
    # R·H·L·n_buckets/2 buffer, 268 MB at N = 16384, slower to touch there than to compute), a
    # few batched launches per call on a GPU rather than H R small ones.
    per = max(1, group_elements(x.device) // max(1, b * length * half))
    out = []
    for start in range(0, h * rounds, per):
        proj = torch.matmul(x[:, start:start + per], rotations[start:start + per])
        # The argmax over [p, -p] without building it: the top of p or the bottom of p, the +p
        # half winning a tie as it comes first.
        top, arg_top = proj.max(dim=-1)
        low, arg_low = proj.min(dim=-1)
        out.append(torch.where(top >= -low, arg_top, arg_low + half))
    return torch.cat(out, dim=1).view(b, h, rounds, length)


def _ranks(perm: Tensor) -> Tensor:
    """The inverse permutation along the last dimension: rank of each item."""
    ranks = torch.arange(perm.shape[-1], device=perm.device).expand_as(perm)
    return torch.empty_like(perm).scatter_(-1, perm, ranks)


def _window(start: Tensor, width: int, k_perm: Tensor, key_ok: Tensor) -> tuple[Tensor, Tensor]:
    """Sorted keys start + [0, W) of every chunk (B, H, R, n): their indices, and whether each
    column is a real key (rank in range, not padded)."""
    m = k_perm.shape[-1]
    ranks = start[..., None] + torch.arange(width, device=start.device)
    cols = k_perm.gather(-1, ranks.clamp(0, m - 1).flatten(-2)).view_as(ranks)
    ok = key_ok.gather(-1, cols.flatten(-2)).view_as(ranks) & (ranks >= 0) & (ranks < m)
    return cols, ok


def _layout(
    q: Tensor,
    k: Tensor,
    rotations: Tensor,
    pad: Tensor,
    bucket_size: int,
    causal: bool,
    shared_qk: bool,
) -> Layout:
    b, h, n, _ = q.shape
    m = k.shape[2]
    rounds = rotations.shape[1]
    n_buckets = max(1, 2 * rotations.shape[-1])
    dev = q.device
    padded = pad[:, None, None, :]
    key_ok = (~padded).expand(b, h, rounds, m)
    chunk, width = block_sizes(n, m, bucket_size, shared_qk)
    if shared_qk:
        bucket = lsh_buckets(q, rotations).masked_fill(padded, n_buckets)
        perm = (bucket * n + torch.arange(n, device=dev)).argsort(dim=-1)
        rank = _ranks(perm)
        n_chunks = -(-n // chunk)
        rows = torch.nn.functional.pad(perm, (0, n_chunks * chunk - n), value=-1)
        start = ((torch.arange(n_chunks, device=dev) - 1) * chunk).expand(b, h, rounds, -1)
        cols, ok = _window(start, width, perm, key_ok)
        if causal:
            stride = n + 2 * chunk + 2  # a different bucket is always out of reach
            k_code = bucket * stride + rank
            q_code, span = k_code - chunk, chunk + 1
        else:
            k_code = rank
            q_code, span = (rank // chunk - 1) * chunk, width
        return Layout(rows.unflatten(-1, (n_chunks, chunk)), rank, cols, ok, q_code, k_code, span)

    length = max(n, m)
    q_bucket = lsh_buckets(q, rotations)
    k_bucket = lsh_buckets(k, rotations).masked_fill(padded, n_buckets)
    q_sorted, q_perm = (q_bucket * length + torch.arange(n, device=dev)).sort(dim=-1)
    k_sorted, k_perm = (k_bucket * length + torch.arange(m, device=dev)).sort(dim=-1)
    k_rank = _ranks(k_perm)
    # Keys at or before each (sorted) query in the (bucket, position) order, a key first on ties.
    kappa = torch.searchsorted(k_sorted, q_sorted, right=True)
    if not causal:
        n_chunks = -(-n // chunk)
        rows = torch.nn.functional.pad(q_perm, (0, n_chunks * chunk - n), value=-1)
        q_slot = _ranks(q_perm)
        last = ((torch.arange(n_chunks, device=dev) + 1) * chunk - 1).clamp_max(n - 1)
        center = (kappa[..., ::chunk] + kappa.index_select(-1, last)) // 2
        real = (~pad).sum(-1).view(b, 1, 1, 1)
        start = torch.minimum((center - width // 2).clamp_min(0), (real - width).clamp_min(0))
        cols, ok = _window(start, width, k_perm, key_ok)
        q_code = start.gather(-1, q_slot // chunk)
        return Layout(rows.unflatten(-1, (n_chunks, chunk)), q_slot, cols, ok, q_code, k_rank,
                       width)

    # Causal: chunks never straddle buckets, so a query's chunk (its rank among its bucket's
    # queries, // C) and its window depend on tokens <= it only.
    edges = (torch.arange(n_buckets, device=dev) * length).expand(b, h, rounds, -1).contiguous()
    q_first = torch.searchsorted(q_sorted, edges)  # (B, H, R, n_buckets)
    k_first = torch.searchsorted(k_sorted, edges)
    count = torch.diff(q_first, append=torch.full_like(q_first[..., :1], n))
    chunks = (count + chunk - 1) // chunk
    chunk0 = chunks.cumsum(-1) - chunks
    sorted_bucket = q_sorted // length
    slot_sorted = (chunk0.gather(-1, sorted_bucket) * chunk + torch.arange(n, device=dev)
                   - q_first.gather(-1, sorted_bucket))
    # With e non-empty buckets, sum(ceil(count / C)) = sum(floor((count - 1) / C)) + e
    # <= (N - e) // C + e, which grows with e <= min(n_buckets, N).
    busy = min(n_buckets, n)
    n_chunks = (n - busy) // chunk + busy
    rows = torch.full((b, h, rounds, n_chunks * chunk), -1, dtype=torch.long, device=dev)
    rows = rows.scatter_(-1, slot_sorted, q_perm).unflatten(-1, (n_chunks, chunk))
    q_slot = torch.empty_like(q_perm).scatter_(-1, q_perm, slot_sorted)
    lead = rows[..., 0].clamp_min(0)  # first query of each chunk (any query if none)
    kappa_q = torch.empty_like(kappa).scatter_(-1, q_perm, kappa)
    start = torch.maximum(
        kappa_q.gather(-1, lead) - width // 2, k_first.gather(-1, q_bucket.gather(-1, lead))
    )
    cols, ok = _window(start, width, k_perm, key_ok)
    stride = m + width + 1  # a different bucket is always out of reach
    q_code = q_bucket * stride + start.gather(-1, q_slot // chunk)
    return Layout(rows, q_slot, cols, ok, q_code, k_bucket * stride + k_rank, width)


def _at(table: Tensor, index: Tensor) -> Tensor:
    """table (B, H, L) at indices (B, H, n, K) (-1 allowed) -> (B·H·n, K)."""
    flat = index.clamp_min(0).flatten(-2)
    return table.gather(-1, flat).view(-1, index.shape[-1])


def _keep(
    col_ok: Tensor, masks: list[Tensor], earlier: list[tuple[Tensor, Tensor, Tensor]]
) -> Tensor:
    """Which (query, key) pairs of g chunks count in this round: col_ok (g, 1, W), extra masks
    (g or 1, C, W) to keep, and for every earlier round the (low, high) query codes (g, C, 1)
    and key codes (g, 1, W) of its pairs, to drop."""
    keep = col_ok
    for mask in masks:
        keep = keep & mask
    # A pair seen in an earlier round is dropped: each key of the union counts once (the
    # paper's duplicate correction).
    for low, high, code in earlier:
        seen = (code >= low).logical_and_(code < high)
        keep = keep & seen.logical_not_()
    return keep.expand(col_ok.shape[0], -1, -1) if keep.shape[1] == 1 else keep


class _RoundChunks(torch.autograd.Function):
    """One round's chunks, a group at a time, with the gathers inside: q_src (B·H·N + 1, D)
    scaled queries (last row a dummy for empty slots), keys (B·H·M, D), v (B·H·M, Dv); rows
    (G, C) and cols (G, W) flat indices into them; drop (G, C, W) pairs to ignore. Returns the
    stabilised numerator (B·H·N + 1, Dv), denominator and (non-differentiable) row max
    (B·H·N + 1) of every query's candidates, -inf for a query with none in the round: a finite
    stand-in would outrank real row maxima below it when the rounds are merged (logits of
    -1e4 are ordinary at entries ~50), and their exp would underflow to a zero row.

    Scores are clamped to [-80, 0] below the row max before exp: exp of values that underflow
    (and of -inf) takes a slow path on CPU (3-10x); e^-80 is below float64 resolution next to
    the row maximum. Written as a function so that nothing of size G·W·D is ever kept or
    zero-filled: a gather per group under autograd would give every group's backward a
    full-size gradient, and gathering a whole round at once allocates (R·N·W·D) buffers whose
    first touch costs more than the arithmetic. The backward recomputes each group's weights
    from the saved row max.
    """

    @staticmethod
    def forward(ctx, q_src, keys, v, rows, cols, drop, group):
        num = q_src.new_zeros(q_src.shape[0], v.shape[-1])
        den = q_src.new_zeros(q_src.shape[0])
        top = q_src.new_zeros(q_src.shape[0])
        for start in range(0, rows.shape[0], group):
            r_i, c_i = rows[start:start + group], cols[start:start + group]
            q_g, k_g, v_g = _gather_group(q_src, keys, v, r_i, c_i)
            dropped = drop[start:start + group]
            # In place: no autograd here, and the group's buffers stay in cache.
            scores = torch.bmm(q_g, k_g.transpose(1, 2)).masked_fill_(dropped, float("-inf"))
            best = scores.amax(dim=-1, keepdim=True)
            shift = torch.where(torch.isfinite(best), best, 0.0)
            weights = scores.sub_(shift).clamp_(-80.0, 0.0).exp_().masked_fill_(dropped, 0.0)
            flat = r_i.reshape(-1)
            num.index_copy_(0, flat, torch.bmm(weights, v_g).flatten(0, 1))
            den.index_copy_(0, flat, weights.sum(-1).flatten())
            top.index_copy_(0, flat, best.flatten())
        ctx.save_for_backward(q_src, keys, v, rows, cols, drop, top)
        ctx.group = group
        ctx.mark_non_differentiable(top)
        return num, den, top

    @staticmethod
    def backward(ctx, grad_num, grad_den, _grad_top):
        q_src, keys, v, rows, cols, drop, top = ctx.saved_tensors
        grad_q, grad_k, grad_v = (torch.zeros_like(t) for t in (q_src, keys, v))
        for start in range(0, rows.shape[0], ctx.group):
            r_i, c_i = rows[start:start + ctx.group], cols[start:start + ctx.group]
            q_g, k_g, v_g = _gather_group(q_src, keys, v, r_i, c_i)
            flat, cflat = r_i.reshape(-1), c_i.reshape(-1)
            best = top.index_select(0, flat).view(*r_i.shape, 1)
            best = torch.where(torch.isfinite(best), best, 0.0)  # the forward's shift
            weights = torch.bmm(q_g, k_g.transpose(1, 2)).sub_(best).clamp_(-80.0, 0.0).exp_()
            weights.masked_fill_(drop[start:start + ctx.group], 0.0)
            g_num = grad_num.index_select(0, flat).view(*r_i.shape, -1)
            g_w = torch.bmm(g_num, v_g.transpose(1, 2))
            g_w += grad_den.index_select(0, flat).view(*r_i.shape, 1)
            g_s = g_w.mul_(weights)
            grad_q.index_add_(0, flat, torch.bmm(g_s, k_g).flatten(0, 1))
            grad_k.index_add_(0, cflat, torch.bmm(g_s.transpose(1, 2), q_g).flatten(0, 1))
            grad_v.index_add_(0, cflat, torch.bmm(weights.transpose(1, 2), g_num).flatten(0, 1))
        return grad_q, grad_k, grad_v, None, None, None, None


def _gather_group(
    q_src: Tensor, keys: Tensor, v: Tensor, rows: Tensor, cols: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries (g, C, D), keys (g, W, D) and values (g, W, Dv) of g chunks."""
    g, c = rows.shape
    w = cols.shape[1]
    q_g = q_src.index_select(0, rows.reshape(-1)).view(g, c, -1)
    k_g = keys.index_select(0, cols.reshape(-1)).view(g, w, -1)
    return q_g, k_g, v.index_select(0, cols.reshape(-1)).view(g, w, -1)


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
    """LSH attention with the given rotations (H, n_hashes, D, n_buckets/2); see the module doc.

    With ``shared_qk`` the caller guarantees k == q (the keys used are k/|k|) and N == M.
    """
    b, h, n, d = q.shape
    m = k.shape[2]
    if rotations.dim() != 4 or rotations.shape[0] != h or rotations.shape[2] != d:
        raise ValueError(
            f"rotations must be (H, n_hashes, D, n_buckets/2) with H={h}, D={d}, "
            f"got {tuple(rotations.shape)}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pad = (
        torch.zeros(b, m, dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask
    )
    # Hashed and sorted in at least fp32 whatever the inputs: the buckets are an argmax.
    dt = compute_dtype(q.dtype)
    q_h, k_h = q.to(dt), k.to(dt)
    keys = (k_h / k_h.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny) if shared_qk
            else k_h)
    layout = _layout(q_h, k_h, rotations.to(dt), pad, bucket_size, causal, shared_qk)
    if runs_flex(q.device, q.dtype) and not torch.compiler.is_compiling():
        # Imported here, as the banded engine imports its flex strategy: only where it runs.
        from effattn.sparse import lsh_flex

        return lsh_flex.attend(q, keys.to(q.dtype), v, layout, pad=pad, scale=scale,
                               causal=causal, shared_qk=shared_qk)
    q, v = q_h, v.to(dt)
    n_chunks, chunk = layout.rows.shape[-2:]
    width = layout.cols.shape[-1]
    span = layout.span

    bh = b * h
    # Flat indices into (B·H·N + 1) query rows, the last one a dummy for empty slots, and into
    # (B·H·M) key rows.
    base = torch.arange(bh, device=q.device).view(b, h, 1, 1, 1)
    q_index = torch.where(layout.rows >= 0, layout.rows + base * n, bh * n)
    k_index = layout.cols + base * m
    q_src = torch.cat([(q * scale).reshape(bh * n, d), q.new_zeros(1, d)])
    keys_flat, v_flat = keys.reshape(bh * m, d), v.reshape(bh * m, -1)
    not_self = None
    if shared_qk:
        # Query slot u of chunk c holds the same token as window column C + u: the diagonal.
        u = torch.arange(chunk, device=q.device)
        not_self = (u[:, None] + chunk != torch.arange(width, device=q.device))[None]
    # Chunks are processed in batched groups of about group_elements(device) scores: in cache
    # on a CPU, one or a few groups per round on a GPU.
    group = max(1, group_elements(q.device) // (chunk * width))
    nums, dens, tops = [], [], []
    for r in range(rotations.shape[1]):
        rows, cols = layout.rows[:, :, r], layout.cols[:, :, r]
        col_ok = layout.col_ok[:, :, r].reshape(-1, 1, width)
        codes = []
        for e in range(r + 1):
            low = _at(layout.q_code[:, :, e], rows).unsqueeze(-1)
            codes.append((low, low + span, _at(layout.k_code[:, :, e], cols).unsqueeze(-2)))
        masks: list[Tensor] = []
        if causal:
            # The round's own rule: non-causal windows hold exactly the candidates, causal
            # ones also hold keys of other buckets and, without shared QK, later keys.
            low, high, code = codes[r]
            masks.append((code >= low).logical_and_(code < high))
            if not shared_qk:
                masks.append(cols.reshape(-1, 1, width) <= rows.reshape(-1, chunk, 1))
        drop = torch.cat([
            _keep(col_ok[i:i + group],
                  [mk if mk.shape[0] == 1 else mk[i:i + group] for mk in masks]
                  + ([not_self] if not_self is not None else []),
                  [(lo[i:i + group], hi[i:i + group], co[i:i + group]) for lo, hi, co in
                   codes[:r]]).logical_not()
            for i in range(0, col_ok.shape[0], group)
        ])
        num, den, top = _RoundChunks.apply(
            q_src, keys_flat, v_flat, q_index[:, :, r].reshape(-1, chunk),
            k_index[:, :, r].reshape(-1, width), drop, group,
        )
        nums.append(num[:-1].view(b, h, n, -1))
        dens.append(den[:-1].view(b, h, n))
        tops.append(top[:-1].view(b, h, n))

    if causal and not shared_qk:
        # Key i joins the union of query i (once: unless a round already has it), so that a
        # query whose bucket holds no earlier key still attends to its own token.
        own = scale * (q * k).sum(-1)  # (B, H, N)
        gap = layout.k_code - layout.q_code  # (B, H, R, N): query i against key i
        fresh = ~pad[:, None, :] & ((gap < 0) | (gap >= span)).all(dim=2)
        nums.append(v)
        dens.append(torch.ones_like(own))
        tops.append(own.masked_fill(~fresh, float("-inf")))

    # Round stabilisers are detached; any finite shift cancels between numerator and denominator.
    best = torch.stack(tops).detach().amax(dim=0)  # (B, H, N)
    best = torch.where(torch.isfinite(best), best, 0.0)
    # Accumulated in place: every (B, H, N, Dv) temporary is a fresh allocation, whose first
    # touch costs more than the arithmetic.
    rescale = [torch.exp(top_r - best) for top_r in tops]
    num = nums[0] * rescale[0][..., None]
    den = dens[0] * rescale[0]
    for num_r, den_r, scale_r in zip(nums[1:], dens[1:], rescale[1:], strict=True):
        num = num.addcmul_(num_r, scale_r[..., None])
        den = den.addcmul_(den_r, scale_r)
    out = num / torch.where(den > 0, den, 1.0)[..., None]
    if shared_qk:
        alone = (den == 0) & ~pad[:, None, :]
        out = torch.where(alone[..., None], v, out)
    return out


class ReformerAttention(RandomizedAttention):
    """LSH attention with ``n_hashes`` rounds of angular hashing into chunks of ``bucket_size``.

    Rotations depend on the length (through n_buckets), so they are drawn at call time: in
    training mode from the module's generator (fresh every call), in eval mode from a generator
    restarted at the module's seed, so eval calls of one module always hash alike (see
    :class:`effattn.random.RandomizedAttention`, which also saves that state with the state_dict).
    """

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        n_hashes: int = 4,
        bucket_size: int = 64,
        shared_qk: bool = False,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale)
        self.n_hashes = check_positive_int("n_hashes", n_hashes)
        self.bucket_size = check_positive_int("bucket_size", bucket_size)
        self.shared_qk = check_bool("shared_qk", shared_qk)

    def rotations(self, n: int, m: int) -> Tensor:
        """The rotations (H, n_hashes, D, n_buckets/2) for N queries and M keys.

        Eval mode: always the same for (N, M). Training mode: a fresh draw (advances the
        module's generator, as each forward call does).
        """
        return draw_rotations(
            self.heads,
            self.n_hashes,
            self.head_dim,
            num_buckets(n, m, self.bucket_size),
            generator=self._call_generator(),
        )

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        n, m = q.shape[2], k.shape[2]
        if self.shared_qk:
            if n != m:
                raise ValueError(
                    f"reformer with shared_qk=True cannot do cross-attention (N={n} != M={m}): "
                    "every token is both a query and a key; use shared_qk=False"
                )
            # Comparing values is a host sync: eager only (torch.compile would break the graph).
            if k is not q and not torch.compiler.is_compiling() and not torch.equal(k, q):
                raise ValueError(
                    "reformer with shared_qk=True needs k equal to q (pass q as k): the keys "
                    "are q/|q|"
                )
        rotations = self.rotations(n, m).to(device=q.device)
        return reformer_attention(
            q,
            k,
            v,
            rotations,
            bucket_size=self.bucket_size,
            causal=causal,
            key_padding_mask=key_padding_mask,
            scale=self.scale,
            shared_qk=self.shared_qk,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_hashes={self.n_hashes}, bucket_size={self.bucket_size}, "
            f"shared_qk={self.shared_qk}"
        )


def _reference(
    module: ReformerAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Softmax over the explicit (B, H, N, M) union of the LSH candidates of every round, hashed
    with the module's eval-mode rotations."""
    from effattn import naive  # imported here: the references stay off the runtime path

    n, m = q.shape[2], k.shape[2]
    # The eval-mode draw, whatever the module's mode: rotations() would advance a training
    # module's generator.
    rotations = draw_rotations(
        module.heads, module.n_hashes, module.head_dim, num_buckets(n, m, module.bucket_size),
        generator=module._eval_generator(),
    )
    return naive.reformer_attention(
        q, k, v, rotations, bucket_size=module.bucket_size, causal=causal,
        key_padding_mask=key_padding_mask, scale=module.scale, shared_qk=module.shared_qk,
    )


register(
    MethodSpec(
        name="reformer",
        summary="LSH attention: angular hashing, sort, chunk, multi-round union",
        paper="Kitaev, Kaiser and Levskaya 2020, Reformer: The Efficient Transformer (ICLR)",
        complexity="O(n_hashes (N + M) bucket_size D) time, O((N + M) bucket_size) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=False,
        options={"n_hashes": 4, "bucket_size": 64, "shared_qk": False},
        budget=Budget("n_hashes", (1, 2, 4, 8)),
        bench_default=True,
        published={"lra_listops": 37.27},
        refusals={
            "decoding": "n_buckets is set from the whole sequence length and tokens are sorted "
            "over the whole sequence, so there is no fixed-size recurrent state",
            "sequence_parallel": "tokens are hashed and sorted over the whole sequence: a "
            "query's candidates can lie on any rank",
        },
        reference=_reference,
    ),
    ReformerAttention,
)
