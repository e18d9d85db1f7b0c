"""The blockwise engine behind the structured sparse patterns (local, Longformer, BigBird, Sparse
Transformer).

A sparse pattern is computed as a union of disjoint pieces, each an exact softmax over a subset of
the keys that returns its normalised output and its log-sum-exp:

- :func:`block_gather_attention`: queries in blocks of C attend to a few key blocks listed in an
  index tensor (window, global, random blocks), with a per-element rule on positions applied on
  the fly; the key blocks are gathered, so the work is O(N K C D) for K blocks per query block.
- :func:`banded_attention`: a band ``-right <= i - j <= left`` (optionally dilated) on top of it.
- :func:`dense_partial`: a dense piece whose key set is small (global keys, strided columns).
- :func:`merge_partials`: softmax over a disjoint union from the pieces' (out, lse):
  ``out = sum_p exp(lse_p - lse) out_p`` with ``lse = log sum_p exp(lse_p)``.

No N x M matrix is built for the banded and block pieces. Rows with no allowed key give out = 0
and lse = -inf (never NaN, also in the gradients).

Shapes: q (B, H, N, D), k (B, H, M, D), v (B, H, M, Dv); key masks are bool (B, M), True = ignore.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Position rule: rule(i, j) -> bool allowed, for broadcasting long tensors of query positions i
# and key positions j.
Rule = Callable[[Tensor, Tensor], Tensor]

# Scores are built in slices of about this many elements: large enough for efficient batched
# matmuls, small enough that the temporaries of a forward pass stay cache-sized.
SLICE_ELEMENTS = 1 << 21


def masked_scores(q: Tensor, k: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Scores scale q.k of q (..., n, D) against k (..., m, D), -inf where ``allowed``
    (broadcastable bool) is False: (..., n, m). Every score of the engine is built here."""
    return torch.matmul(q, k.transpose(-2, -1)).mul_(scale).masked_fill_(~allowed, float("-inf"))


def masked_partial(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of q (..., n, D) over the allowed keys of k (..., m, D), v (..., m, Dv).

    ``allowed`` is bool, broadcastable to (..., n, m). Returns out (..., n, Dv) and
    lse (..., n) = log sum_allowed exp(scale q.k); rows without an allowed key give 0 and -inf.
    """
    scores = masked_scores(q, k, allowed, scale)
    # The row max only stabilises the exponent; it cancels, so it carries no gradient.
    top = scores.detach().amax(-1, keepdim=True)
    top = top.masked_fill_(~torch.isfinite(top), 0.0)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    nonempty = total > 0
    total = torch.where(nonempty, total, torch.ones_like(total))
    out = (p @ v) / total
    lse = torch.where(nonempty, top + torch.log(total), float("-inf"))
    return out, lse.squeeze(-1)


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Combine softmax pieces over disjoint key sets: [(out (..., n, Dv), lse (..., n))] -> same.

    The result is the softmax over the union of the key sets; rows empty in every piece give 0.
    """
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])
    top = lses.detach().amax(0)
    top = top.masked_fill(~torch.isfinite(top), 0.0)
    weights = torch.exp(lses - top)
    total = weights.sum(0)
    nonempty = total > 0
    total = torch.where(nonempty, total, torch.ones_like(total))
    # Normalise the (..., n) weights, not the (..., n, Dv) outputs: one pass per piece.
    weights = (weights / total)[..., None]
    out = parts[0][0] * weights[0]
    for w, (o, _) in zip(weights[1:], parts[1:], strict=True):
        out = out.addcmul(o, w)
    lse = torch.where(nonempty, top + torch.log(total), float("-inf"))
    return out, lse


def dense_partial(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Callable[[int, int], Tensor],
    *,
    scale: float,
    key_prefix: Callable[[int, int], int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax of q (..., n, D) over a small key set k (..., m, D), v (..., m, Dv).

    ``allowed(r0, r1)`` gives the bool mask of query rows r0:r1, broadcastable to
    (..., r1 - r0, m); rows are processed in slices so the scores stay cache-sized.
    ``key_prefix(r0, r1)``, when given, bounds the keys rows r0:r1 may see to the first
    ``key_prefix(r0, r1)``, so causal pieces skip the scores of future keys.
    Returns (out (..., n, Dv), lse (..., n)).
    """
    n, m = q.shape[-2], k.shape[-2]
    lead = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    rows = max(1, SLICE_ELEMENTS // max(1, lead * m))
    if key_prefix is not None:
        # At least 8 slices: the scored prefix then averages about 9/16 of the keys, not all.
        rows = min(rows, -(-n // 8))
    pieces = []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        keys = m if key_prefix is None else max(1, min(m, key_prefix(r0, r1)))
        ok = allowed(r0, r1)
        pieces.append(masked_partial(
            q[..., r0:r1, :], k[..., :keys, :], v[..., :keys, :], ok[..., :keys], scale
        ))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([o for o, _ in pieces], -2), torch.cat([lse for _, lse in pieces], -1)


def _pad_to(x: Tensor, length: int) -> Tensor:
    """Zero-pad dim 2 of (B, H, L, D) to ``length``."""
    return F.pad(x, (0, 0, 0, length - x.shape[2])) if length > x.shape[2] else x


@dataclass(frozen=True)
class _Gather:
    """Which keys each slice of query blocks sees (see :func:`block_gather_attention`).

    ``index``: (Hk, nq, K) block indices into the key blocks of dim ``dim`` (2 of (B, H, nk, C, D);
    1 of (B, H * nk, C, D) for per-head blocks, Hk = H), -1 clamped to 0; ``blocks``: the same
    before the offset per head; ``valid``: (Hk, nq, K) the slot is used; ``ignore``:
    (B, nk * C) keys to ignore.
    """

    index: Tensor
    blocks: Tensor
    valid: Tensor
    ignore: Tensor
    rule: Rule | None
    block_size: int
    step: int
    dim: int

    def keys(self, kb: Tensor, vb: Tensor, s0: int, lead: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """Keys and values of query blocks s0 .. s0 + step: (B, H, rows, K C, D) and (..., Dv)."""
        idx = self.index[:, s0 : s0 + self.step].flatten()
        rows = self.index[:, s0 : s0 + self.step].shape[1]
        # index_select copies whole blocks, much faster than advanced indexing.
        kg = kb.index_select(self.dim, idx).reshape(*lead, rows, -1, kb.shape[-1])
        vg = vb.index_select(self.dim, idx).reshape(*lead, rows, -1, vb.shape[-1])
        return kg, vg

    def allowed(self, s0: int) -> Tensor:
        """Bool (B, Hk, rows, C or 1, K C): query (row, a) may see gathered key column j."""
        c = self.block_size
        ids = self.blocks[:, s0 : s0 + self.step]
        rows = ids.shape[1]
        offsets = torch.arange(c, device=ids.device)
        kpos = (ids[..., None] * c + offsets).flatten(-2)
        ok = ~self.ignore[:, kpos] & self.valid[:, s0 : s0 + self.step].repeat_interleave(c, -1)
        ok = ok[:, :, :, None, :]
        if self.rule is not None:
            qpos = torch.arange(s0, s0 + rows, device=ids.device)[:, None] * c + offsets
            ok = ok & self.rule(qpos[None, :, :, None], kpos[:, :, None, :])
        return ok



class _BlockGatherAttention(torch.autograd.Function):
    """Softmax of every query block over its gathered key blocks, slice by slice.

    Autograd would keep, for every slice, the gathered keys and values (K times the size of k
    and v) and the scores and probabilities (N K C per head): hundreds of MiB at N = 16384,
    allocated fresh on every call. As in FlashAttention (Dao et al. 2022), the forward keeps only
    q, k, v, out and lse and the backward recomputes each slice's probabilities
    p = exp(s - lse); with dp = do v^T, ds = p (dp - rowsum(do * out) + dlse) gives
    dq = scale ds k, dk = scale ds^T q, dv = p^T do. Temporaries are slice-sized; the gathered
    key and value gradients go back to their blocks with index_add_.

    qb: (B, H, nq, C, D), kb: (B, H, nk, C, D) or (B, H * nk, C, D) (see :class:`_Gather`),
    vb likewise with Dv. Returns out (B, H, nq, C, Dv) and lse (B, H, nq, C).
    """

    @staticmethod
    def forward(ctx, qb: Tensor, kb: Tensor, vb: Tensor, plan: _Gather,
                scale: float) -> tuple[Tensor, Tensor]:
        b, h, nq, c, _ = qb.shape
        out = qb.new_empty(b, h, nq, c, vb.shape[-1])
        lse = qb.new_empty(b, h, nq, c)
        for s0 in range(0, nq, plan.step):
            kg, vg = plan.keys(kb, vb, s0, (b, h))
            p = masked_scores(qb[:, :, s0 : s0 + plan.step], kg, plan.allowed(s0), scale)
            # The row max only stabilises the exponent; rows with no allowed key keep -inf
            # scores, so exp gives 0 there and lse = -inf.
            top = p.amax(-1, keepdim=True)
            top.masked_fill_(torch.isinf(top), 0.0)
            total = p.sub_(top).exp_().sum(-1, keepdim=True)
            o = torch.matmul(p, vg).div_(total.clamp_min(torch.finfo(total.dtype).tiny))
            out[:, :, s0 : s0 + plan.step] = o
            lse[:, :, s0 : s0 + plan.step] = top.add_(total.log_()).squeeze(-1)
        ctx.save_for_backward(qb, kb, vb, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        qb, kb, vb, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        b, h, nq, c, _ = qb.shape
        # p = exp(s - lse) must be 0 in rows without keys (s = lse = -inf).
        lse = lse.masked_fill(torch.isinf(lse), 0.0)[..., None]
        shift = (dout * out).sum(-1, keepdim=True).sub_(dlse[..., None])
        dq = torch.empty_like(qb)
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        for s0 in range(0, nq, plan.step):
            sl = slice(s0, s0 + plan.step)
            qs, do = qb[:, :, sl], dout[:, :, sl]
            kg, vg = plan.keys(kb, vb, s0, (b, h))
            p = masked_scores(qs, kg, plan.allowed(s0), scale).sub_(lse[:, :, sl]).exp_()
            ds = torch.matmul(do, vg.transpose(-2, -1)).sub_(shift[:, :, sl]).mul_(p).mul_(scale)
            dq[:, :, sl] = torch.matmul(ds, kg)
            idx = plan.index[:, sl].flatten()
            dk.index_add_(plan.dim, idx, torch.matmul(ds.transpose(-2, -1), qs).reshape(
                *kb.shape[: plan.dim], -1, *kb.shape[plan.dim + 1 :]))
            dv.index_add_(plan.dim, idx, torch.matmul(p.transpose(-2, -1), do).reshape(
                *vb.shape[: plan.dim], -1, *vb.shape[plan.dim + 1 :]))
        return dq, dk, dv, None, None


def block_gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_blocks: Tensor,
    *,
    block_size: int,
    scale: float,
    key_mask: Tensor | None = None,
    rule: Rule | None = None,
) -> tuple[Tensor, Tensor]:
    """Query block b (positions b*C .. b*C + C - 1) attends to key blocks ``key_blocks[..., b, :]``.

    Args:
        q, k, v: (B, H, N, D), (B, H, M, D), (B, H, M, Dv); N and M are padded internally to
            multiples of C = ``block_size`` and the output is trimmed back to N.
        key_blocks: long (nq, K) shared by the heads, or (H, nq, K) per head, nq = ceil(N / C);
            entries index key blocks (0 .. ceil(M / C) - 1), or are -1 for an unused slot. The K
            blocks of a row must be distinct (a repeated block would be counted twice).
        key_mask: bool (B, M), True for keys to ignore (padding).
        rule: optional per-element rule(i, j) on query/key positions (window, causality).

    Returns out (B, H, N, Dv) and lse (B, H, N). Cost O(N K C D) time; memory O(N D) kept for
    the backward and O(SLICE_ELEMENTS) temporaries (the backward recomputes the scores).
    """
    b, h, n, d = q.shape
    m, c = k.shape[2], block_size
    nq, nk = -(-n // c), -(-m // c)
    if key_blocks.dim() == 2:
        key_blocks = key_blocks[None]
    if key_blocks.shape[-2] != nq or key_blocks.shape[0] not in (1, h):
        raise ValueError(
            f"key_blocks must have shape (nq, K) or (H, nq, K) with nq={nq}, H={h}, "
            f"got {tuple(key_blocks.shape)}"
        )
    qb = _pad_to(q, nq * c).reshape(b, h, nq, c, d)
    kb = _pad_to(k, nk * c).reshape(b, h, nk, c, d)
    vb = _pad_to(v, nk * c).reshape(b, h, nk, c, v.shape[-1])
    ignore = torch.ones(b, nk * c, dtype=torch.bool, device=q.device)
    ignore[:, :m] = False if key_mask is None else key_mask
    safe = key_blocks.clamp(min=0)
    index, dim = safe, 2
    if key_blocks.shape[0] == h and h > 1:
        # Per-head blocks index the (H * nk) blocks of all heads at once.
        kb, vb = kb.reshape(b, h * nk, c, d), vb.reshape(b, h * nk, c, -1)
        index, dim = safe + torch.arange(h, device=q.device)[:, None, None] * nk, 1
    step = max(1, SLICE_ELEMENTS // (b * h * c * key_blocks.shape[-1] * c))
    plan = _Gather(index, safe, key_blocks >= 0, ignore, rule, c, step, dim)
    out, lse = _BlockGatherAttention.apply(qb, kb, vb, plan, scale)
    return out.reshape(b, h, nq * c, -1)[:, :, :n], lse.reshape(b, h, nq * c)[:, :, :n]


def band_block_size(reach: int) -> int:
    """Query block size for a band reaching ``reach`` keys to one side.

    About half the reach: the band then spans a few blocks and the gathered blocks waste about
    a quarter of the work, against half or more with blocks as large as the band.
    """
    return int(min(128, max(16, 2 ** math.ceil(math.log2(max(1.0, reach / 2))))))


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    left: int,
    right: int,
    scale: float,
    dilation: int = 1,
    key_mask: Tensor | None = None,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Query i attends to keys j with ``-right <= i - j <= left`` and ``(i - j) % dilation == 0``.

    q, k, v: (B, H, N, D), (B, H, N, D), (B, H, N, Dv) (aligned positions, N == M);
    key_mask: bool (B, N), True = ignore. Returns (out (B, H, N, Dv), lse (B, H, N)).

    A dilated band is d undilated bands: positions with the same residue mod d form a
    subsequence, and i - j = d (i' - j') there, so each subsequence gets the band
    ``-(right // d) <= i' - j' <= left // d``. Work is O(N (left + right) / d D), not
    O(N (left + right) D) with most of the scores masked out.
    """
    if left < 0 or right < 0 or dilation < 1:
        raise ValueError(
            f"banded_attention needs left, right >= 0 and dilation >= 1, "
            f"got left={left}, right={right}, dilation={dilation}"
        )
    b, h, n, _ = q.shape
    dilation = min(dilation, n)
    if dilation > 1:
        length = -(-n // dilation) * dilation
        ignore = torch.ones(b, length, dtype=torch.bool, device=q.device)
        ignore[:, :n] = False if key_mask is None else key_mask

        def fold(x: Tensor) -> Tensor:
            # (B, H, L, D) -> (B * d, H, L / d, D): one sequence per residue class.
            x = _pad_to(x, length).reshape(b, h, length // dilation, dilation, x.shape[-1])
            return x.permute(0, 3, 1, 2, 4).reshape(b * dilation, h, -1, x.shape[-1])

        sub_mask = ignore.reshape(b, -1, dilation).transpose(1, 2).reshape(b * dilation, -1)
        out, lse = banded_attention(
            fold(q), fold(k), fold(v),
            left=left // dilation, right=right // dilation, scale=scale,
            key_mask=sub_mask, block_size=block_size,
        )
        out = out.reshape(b, dilation, h, -1, out.shape[-1]).permute(0, 2, 3, 1, 4)
        lse = lse.reshape(b, dilation, h, -1).permute(0, 2, 3, 1)
        return out.reshape(b, h, length, -1)[:, :, :n], lse.reshape(b, h, length)[:, :, :n]
    left, right = min(left, n - 1), min(right, n - 1)
    c = block_size or band_block_size(max(left, right))
    nq = -(-n // c)
    back, ahead = -(-left // c), -(-right // c)
    blocks = torch.arange(nq, device=q.device)[:, None] + torch.arange(
        -back, ahead + 1, device=q.device
    )
    blocks = blocks.masked_fill((blocks < 0) | (blocks >= nq), -1)

    def band(i: Tensor, j: Tensor) -> Tensor:
        offset = i - j
        return (offset <= left) & (offset >= -right)

    return block_gather_attention(
        q, k, v, blocks, block_size=c, scale=scale, key_mask=key_mask, rule=band
    )
