"""Reformer LSH attention (Kitaev, Kaiser and Levskaya 2020, "Reformer: The Efficient Transformer").

q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv); s_ij = scale · q_i·k_j.

Hashing. Round r (of R = n_hashes) has a Gaussian rotation R_r (D, n_buckets/2) per head,
shared by the batch; x falls in bucket h_r(x) = argmax([x R_r ; -x R_r]) (angular LSH: only
the direction of x counts). n_buckets = 1 when max(N, M) <= bucket_size (everything fits one
bucket, nothing is hashed), else 2·ceil(max(N, M) / (2·bucket_size)), so that a bucket holds
about bucket_size keys. Padded keys go to an extra bucket n_buckets, after every real one, so
their values can never move a real item.

Sorting and chunks. Items are sorted by (bucket, position) and the sorted sequence is cut into
chunks of C slots (the last one filled up with empty slots):
- shared_qk=True (the paper's shared-QK attention, self-attention only): token t is both the
  query q_t and the key k_t/|k_t| (k must equal q); C = min(bucket_size, N).
- shared_qk=False: queries and keys are hashed with the same rotations and sorted *together*
  (N + M items; at equal bucket and position the key comes first); C = min(2·bucket_size, N + M),
  so a chunk holds about bucket_size of each.
C is capped at the number of items (:func:`chunk_size`): a chunk that holds every item already
gives every query all its candidates under both rules below, so a larger one would change
nothing but the cost (2C slots per chunk: a bucket_size of 4096 at N = 143 meant 8192 x 16384
score blocks). Sorting them apart and pairing query chunk c with key chunk c
  (a common shortcut) misaligns the two whenever their bucket populations differ, which the
  paper names as the reason for shared QK; the joint sort keeps every query next to the keys of
  its own bucket, and it also makes cross-attention (N != M) well defined.

Candidates S_r(i) of query i in round r (ρ: slot in the sorted order, chunk = ρ // C):
- not causal: the keys in the query's chunk and in the chunk before it (no wrap-around);
- causal: the keys j <= i of the query's own bucket with ρ_i - C <= ρ_j <= ρ_i, i.e. the most
  recent items of its bucket. Masking the chunk pair by position alone (as public code does)
  leaks: a future token changes the ranks, hence which past keys share a chunk. Within one
  bucket the order is by position, so this set depends on tokens <= i only. With
  shared_qk=False key i is a candidate of query i as well (its bucket may hold no earlier key;
  without it such a query would output 0).
Padded keys are never candidates. With shared QK a token does not attend to itself unless it
has no other candidate in any round (then its output is v_i).

Rounds. The paper merges rounds with logsumexp weights and scores s_ij - log c_ij, c_ij the
number of rounds in which j is a candidate of i, which is exactly softmax attention over the
union U_i = ∪_r S_r(i): out_i = Σ_{j in U_i} exp(s_ij) v_j / Σ_{j in U_i} exp(s_ij) (an empty
U_i gives 0). That is what is computed, counting each pair once (in the first round that has
it) instead of dividing by c_ij: the same result with half the pairwise round checks.

Exact limit: when max(N, M) <= bucket_size there is one bucket and one chunk, and the result is
exact softmax attention (causal or not) with shared_qk=False; with shared_qk=True it is softmax of
q against k/|k| with the diagonal removed.

Cost per round: (N + M)·2C scores in chunks, never N x M: O(R (N + M) bucket_size D) time,
O((N + M) bucket_size) memory per round (autograd keeps each round's chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from effattn import reference
from effattn.base import (
    RandomizedAttention,
    RandomSource,
    check_bool,
    check_positive_int,
    compute_dtype,
    normal,
)
from effattn.registry import Budget, MethodSpec, register

# Scores per group of chunks (1 MiB in fp32).
GROUP_ELEMENTS = 1 << 18


def num_buckets(n: int, m: int, bucket_size: int) -> int:
    """Buckets per round for N queries and M keys: 1 if max(N, M) <= bucket_size, else
    2·ceil(max(N, M) / (2·bucket_size)) (even, as angular hashing needs)."""
    length = max(n, m)
    if length <= bucket_size:
        return 1
    return 2 * math.ceil(length / (2 * bucket_size))


def chunk_size(n: int, m: int, bucket_size: int, shared_qk: bool) -> int:
    """Slots per chunk C for N queries and M keys: min(bucket_size, N) with shared QK (N items),
    else min(2·bucket_size, N + M) (N + M items); see the module doc."""
    if shared_qk:
        return min(bucket_size, n)
    return min(2 * bucket_size, n + m)


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
    """Angular LSH bucket of every vector: x (B, H, L, D) -> (B, H, R, L) in [0, n_buckets)."""
    b, h, length, _ = x.shape
    if rotations.shape[-1] == 0:
        return torch.zeros(b, h, rotations.shape[1], length, dtype=torch.long, device=x.device)
    proj = torch.einsum("bhld,hrdk->bhrlk", x.detach(), rotations.to(x.dtype))
    return torch.cat([proj, -proj], dim=-1).argmax(dim=-1)


@dataclass
class _Layout:
    """Where every query and key sits in each round's sorted, chunked order.

    q_at, k_at: (B, H, R, P) query / key index held by each of the P = n_chunks·C slots, -1 if
    none; q_slot (B, H, R, N): slot of each query. q_key (B, H, R, N), k_key (B, H, R, M): int32
    codes such that key j is a candidate of query i in round r (hash part of the rule) iff
    d = q_key - k_key satisfies: not causal, d in {0, 1} (chunk ids); causal, 0 <= d <= C
    (bucket·stride + slot, so a different bucket is always far away).
    """

    chunk: int
    q_at: Tensor
    k_at: Tensor
    q_slot: Tensor
    q_key: Tensor
    k_key: Tensor


def _sort(codes: Tensor, item_q: Tensor, item_k: Tensor, chunk: int) -> tuple[Tensor, ...]:
    """Sort items by their (distinct) codes (B, H, R, I); returns slot->query, slot->key
    (padded to a multiple of ``chunk`` with -1) and item->slot."""
    perm = codes.argsort(dim=-1)
    items = codes.shape[-1]
    slot = torch.empty_like(perm).scatter_(
        -1, perm, torch.arange(items, device=codes.device).expand_as(perm)
    )
    fill = -items % chunk
    q_at = torch.nn.functional.pad(item_q[perm], (0, fill), value=-1)
    k_at = torch.nn.functional.pad(item_k[perm], (0, fill), value=-1)
    return q_at, k_at, slot


def _relation_key(bucket: Tensor, slot: Tensor, chunk: int, causal: bool) -> Tensor:
    if not causal:
        return slot.div(chunk, rounding_mode="floor").int()
    stride = slot.shape[-1] + 2 * chunk + 1
    return (bucket * stride + slot).int()


def _layout(
    q: Tensor,
    k: Tensor,
    rotations: Tensor,
    pad: Tensor,
    bucket_size: int,
    causal: bool,
    shared_qk: bool,
) -> _Layout:
    n, m = q.shape[2], k.shape[2]
    n_buckets = max(1, 2 * rotations.shape[-1])
    dev = q.device
    padded = pad[:, None, None, :]
    if shared_qk:
        bucket = lsh_buckets(q, rotations).masked_fill(padded, n_buckets)
        tokens = torch.arange(n, device=dev)
        chunk = chunk_size(n, m, bucket_size, shared_qk)
        q_at, k_at, slot = _sort(bucket * n + tokens, tokens, tokens, chunk)
        key = _relation_key(bucket, slot, chunk, causal)
        return _Layout(chunk, q_at, k_at, slot, key, key)
    length = max(n, m)
    q_bucket = lsh_buckets(q, rotations)
    k_bucket = lsh_buckets(k, rotations).masked_fill(padded, n_buckets)
    # (bucket, position, kind): keys (kind 0) sort before the query at the same position.
    q_codes = (q_bucket * length + torch.arange(n, device=dev)) * 2 + 1
    k_codes = (k_bucket * length + torch.arange(m, device=dev)) * 2
    none_n = torch.full((n,), -1, dtype=torch.long, device=dev)
    none_m = torch.full((m,), -1, dtype=torch.long, device=dev)
    item_q = torch.cat([none_m, torch.arange(n, device=dev)])
    item_k = torch.cat([torch.arange(m, device=dev), none_n])
    chunk = chunk_size(n, m, bucket_size, shared_qk)
    q_at, k_at, slot = _sort(torch.cat([k_codes, q_codes], -1), item_q, item_k, chunk)
    q_slot, k_slot = slot[..., m:], slot[..., :m]
    return _Layout(
        chunk,
        q_at,
        k_at,
        q_slot,
        _relation_key(q_bucket, q_slot, chunk, causal),
        _relation_key(k_bucket, k_slot, chunk, causal),
    )


def _take(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, L, E) at per-(batch, head) indices (B, H, ...) (-1 allowed) -> (B, H, ..., E)."""
    b, h, length, e = x.shape
    offset = (torch.arange(b * h, device=x.device) * length).view(b, h, *[1] * (index.dim() - 2))
    flat = (index.clamp_min(0) + offset).reshape(-1)
    return x.reshape(b * h * length, e).index_select(0, flat).view(*index.shape, e)


def _take1(x: Tensor, index: Tensor) -> Tensor:
    """:func:`_take` for per-item tables x (B, H, L)."""
    return _take(x.unsqueeze(-1), index).squeeze(-1)


def _related(
    layout: _Layout, r: int, rows: Tensor, cols: Tensor, causal: bool, *, negate: bool = False
) -> Tensor:
    """(B, H, n, C, 2C) bool: is key ``cols`` a candidate of query ``rows`` in round r (by the
    hash-dependent part of the rule)? ``negate`` gives the complement in as many passes."""
    d = _take1(layout.q_key[:, :, r], rows)[..., :, None] - _take1(
        layout.k_key[:, :, r], cols
    )[..., None, :]
    if causal:
        inside = (d >= 0).logical_and_(d <= layout.chunk)
        return inside.logical_not_() if negate else inside
    near = torch.bitwise_right_shift(d, 1)  # 0 iff d in {0, 1}
    return near != 0 if negate else near == 0


def _exp_clamped(x: Tensor) -> Tensor:
    """exp of x clamped to [-80, 0]: exp of values that underflow (and of -inf) takes a slow
    path on CPU (3-10x); e^-80 is below float64 resolution next to the row maximum, e^0 = 1. The
    caller zeroes masked entries and guarantees kept ones are <= 0."""
    return x.clamp(-80.0, 0.0).exp()


def _round_chunks(
    layout: _Layout,
    r: int,
    rows: Tensor,
    cols: Tensor,
    q_rows: Tensor,
    k_cols: Tensor,
    v_cols: Tensor,
    key_ok: Tensor,
    causal: bool,
    not_self: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Round r over a group of g chunks: rows (B, H, g, C) query slots, cols (B, H, g, 2C) key
    slots, and the (scaled) queries (B, H, g, C, D), keys (B, H, g, 2C, D) and values
    (B, H, g, 2C, Dv) they hold. Returns the stabilised numerator (B, H, g, C, Dv), denominator
    and row max (B, H, g, C, 1) of every slot's candidates."""
    scores = torch.einsum("bhncd,bhnkd->bhnck", q_rows, k_cols)
    keep = ((cols >= 0) & _take1(key_ok, cols))[..., None, :]
    if causal:
        # Same bucket, within C slots before: keys j <= i only (the bucket is in position
        # order), chosen among tokens <= i only.
        keep = keep & _related(layout, r, rows, cols, causal=True)
    if not_self is not None:
        keep = keep & not_self
    keep = keep.expand_as(scores).clone() if keep.shape != scores.shape else keep
    # A pair seen in an earlier round is dropped: each key of the union counts once (the
    # paper's duplicate correction).
    for earlier in range(r):
        keep.logical_and_(_related(layout, earlier, rows, cols, causal, negate=True))
    drop = keep.logical_not_()
    top = scores.detach().masked_fill(drop, float("-inf")).amax(dim=-1, keepdim=True)
    weights = _exp_clamped(scores - torch.where(torch.isfinite(top), top, 0.0)).masked_fill(
        drop, 0.0
    )
    num = torch.einsum("bhnck,bhnke->bhnce", weights, v_cols)
    return num, weights.sum(-1, keepdim=True), top


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
    keys = k / k.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(k.dtype).tiny) if shared_qk else k
    layout = _layout(q, k, rotations, pad, bucket_size, causal, shared_qk)
    chunk = layout.chunk
    key_ok = ~pad[:, None, :].expand(b, h, m)
    not_self = None
    if shared_qk:
        # Query slot u of a chunk holds the same token as key column C + u: the diagonal.
        u = torch.arange(chunk, device=q.device)
        not_self = u[:, None] + chunk != torch.arange(2 * chunk, device=q.device)[None, :]

    # Chunks are processed in groups of about GROUP_ELEMENTS scores: the dozen masked
    # elementwise passes over a group's (C, 2C) blocks then run in cache, not in memory.
    per_chunk = b * h * chunk * 2 * chunk
    group = max(1, GROUP_ELEMENTS // per_chunk)
    q_scaled = q * scale
    nums, dens, tops = [], [], []
    for r in range(rotations.shape[1]):
        rows = layout.q_at[:, :, r].unflatten(-1, (-1, chunk))  # (B, H, n, C)
        own = layout.k_at[:, :, r].unflatten(-1, (-1, chunk))
        before = torch.nn.functional.pad(own[:, :, :-1], (0, 0, 1, 0), value=-1)
        cols = torch.cat([before, own], dim=-1)  # (B, H, n, 2C): previous chunk, own chunk
        # Gathered once per round and cut with split: a gather or a narrow per group would
        # give every group's backward a full-size zero-filled gradient.
        pieces = [t.split(group, dim=2) for t in
                  (rows, cols, _take(q_scaled, rows), _take(keys, cols), _take(v, cols))]
        parts = [_round_chunks(layout, r, *group_tensors, key_ok, causal, not_self)
                 for group_tensors in zip(*pieces, strict=True)]
        num, den, top = (torch.cat(t, dim=2) if len(t) > 1 else t[0]
                         for t in zip(*parts, strict=True))
        slot = layout.q_slot[:, :, r]  # (B, H, N): every query back to its own position
        nums.append(_take(num.flatten(2, 3), slot))
        dens.append(_take1(den.flatten(2, 4), slot))
        tops.append(_take1(top.flatten(2, 4), slot))

    if causal and not shared_qk:
        # Key i joins the union of query i (once: unless a round already has it), so that a
        # query whose bucket holds no earlier key still attends to its own token.
        own = scale * (q * k).sum(-1)  # (B, H, N)
        fresh = ~pad[:, None, :]
        for r in range(rotations.shape[1]):
            lag = layout.q_key[:, :, r] - layout.k_key[:, :, r]
            fresh = fresh & ((lag < 0) | (lag > chunk))
        nums.append(v)
        dens.append(torch.ones_like(own))
        tops.append(own.masked_fill(~fresh, float("-inf")))

    # Round stabilisers are detached; any finite shift cancels between numerator and denominator.
    top_r = torch.stack(tops, dim=2)  # (B, H, R, N)
    best = top_r.detach().amax(dim=2, keepdim=True)
    rescale = torch.exp(top_r - torch.where(torch.isfinite(best), best, 0.0))
    num = (torch.stack(nums, dim=2) * rescale[..., None]).sum(2)
    den = (torch.stack(dens, dim=2) * rescale).sum(2)
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
    :class:`effattn.base.RandomizedAttention`, which also saves that state with the state_dict).
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
        dt = compute_dtype(q.dtype)
        rotations = self.rotations(n, m).to(device=q.device, dtype=dt)
        return reformer_attention(
            q.to(dt),
            k.to(dt),
            v.to(dt),
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
    n, m = q.shape[2], k.shape[2]
    # The eval-mode draw, whatever the module's mode: rotations() would advance a training
    # module's generator.
    rotations = draw_rotations(
        module.heads, module.n_hashes, module.head_dim, num_buckets(n, m, module.bucket_size),
        generator=module._eval_generator(),
    )
    return reference.reformer_attention(
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
