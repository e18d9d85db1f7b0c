"""The blockwise engine behind the structured sparse patterns (local, Longformer, BigBird, Sparse
Transformer).

A sparse pattern is computed as a union of disjoint pieces, each an exact softmax over a subset of
the keys that returns its normalised output and its log-sum-exp:

- :func:`block_gather_attention`: queries in blocks of C attend to a few key blocks listed in an
  index tensor (window, global, random blocks), with a per-element pattern within the blocks
  (causality); the key blocks are gathered, so the work is O(N K C D) for K blocks per query block.
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
class _Slices:
    """Query blocks in a flat layout: R rows of C queries, row r of batch ``batch[r]`` attending
    to the K key blocks ``keyblock[r]`` of its sequence (-1: unused slot), query a of the row to
    key j of those K C only where ``pattern[a, j]`` (bool (C or 1, K C); None: all). Rows are
    processed ``step`` at a time.

    Keys and values are flat blocks (L, C, E). ``index`` (R, K) gives the flat blocks each row
    gathers; None for a band: row r reads the K consecutive flat blocks r - back ..
    r - back + K - 1 in place (an overlapping view, no copy; blocks outside 0 .. L - 1 are
    zeros, masked by ``keyblock``).
    """

    keyblock: Tensor
    batch: Tensor
    ignore: Tensor
    index: Tensor | None
    back: int
    pattern: Tensor | None
    block_size: int
    step: int

    def window(self, x: Tensor, r0: int) -> Tensor:
        """The keys (or values) of rows r0 .. r0 + step: (rows, K C, E) from flat blocks x."""
        rows, slots = self.keyblock[r0 : r0 + self.step].shape
        c, e = self.block_size, x.shape[-1]
        if self.index is not None:
            # index_select copies whole blocks, much faster than advanced indexing.
            return x.index_select(0, self.index[r0 : r0 + rows].flatten()).view(rows, -1, e)
        lo, hi = r0 - self.back, r0 - self.back + rows + slots - 1
        span = x[max(lo, 0) : hi]
        if lo < 0 or hi > x.shape[0]:
            # Only the first and last slices reach past the ends: a slice-sized padded copy.
            span = F.pad(span, (0, 0, 0, 0, max(-lo, 0), max(hi - x.shape[0], 0)))
        return span.reshape(-1, e).unfold(0, slots * c, c).transpose(1, 2)

    def scatter(self, dx: Tensor, grad: Tensor, r0: int) -> None:
        """Add the gradient (rows, K C, E) of :meth:`window` (r0) into the flat blocks dx."""
        rows, slots = self.keyblock[r0 : r0 + self.step].shape
        c = self.block_size
        if self.index is not None:
            dx.index_add_(0, self.index[r0 : r0 + rows].flatten(), grad.view(-1, c, dx.shape[-1]))
            return
        for o in range(slots):
            # Rows r0 + i, i in [first, last), have block r0 + i - back + o inside dx.
            start = r0 - self.back + o
            first, last = max(0, -start), min(rows, dx.shape[0] - start)
            if first < last:
                dx[start + first : start + last].add_(grad[first:last, o * c : (o + 1) * c])

    def allowed(self, r0: int) -> Tensor:
        """Bool (rows, C or 1, K C): query a of row r may see key slot j of its window."""
        c = self.block_size
        blocks = self.keyblock[r0 : r0 + self.step]
        offsets = torch.arange(c, device=blocks.device)
        kpos = (blocks[..., None] * c + offsets).flatten(-2)
        batch = self.batch[r0 : r0 + self.step, None]
        ok = (blocks >= 0).repeat_interleave(c, -1) & ~self.ignore[batch, kpos.clamp(min=0)]
        return ok[:, None, :] if self.pattern is None else ok[:, None, :] & self.pattern


def _block_forward(qf: Tensor, kf: Tensor, vf: Tensor, plan: _Slices,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Softmax of every query block over its K key blocks: out (R, C, Dv), lse (R, C)."""
    out = qf.new_empty(*qf.shape[:2], vf.shape[-1])
    lse = qf.new_empty(qf.shape[:2])
    for r0 in range(0, qf.shape[0], plan.step):
        r1 = r0 + plan.step
        p = masked_scores(qf[r0:r1], plan.window(kf, r0), plan.allowed(r0), scale)
        # The row max only stabilises the exponent; rows with no allowed key keep -inf
        # scores, so exp gives 0 there and lse = -inf.
        top = p.amax(-1, keepdim=True)
        top.masked_fill_(torch.isinf(top), 0.0)
        total = p.sub_(top).exp_().sum(-1, keepdim=True)
        torch.matmul(p, plan.window(vf, r0), out=out[r0:r1])
        out[r0:r1].div_(total.clamp_min(torch.finfo(total.dtype).tiny))
        lse[r0:r1] = top.add_(total.log_()).squeeze(-1)
    return out, lse


def _block_backward(
    qf: Tensor, kf: Tensor, vf: Tensor, plan: _Slices, scale: float,
    dout: Tensor, shift: Tensor, lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of the block softmax, from p = exp(s - lse) and
    ds = p (do v^T - shift) (see :class:`_BlockAttention`).

    dout (R, C, Dv) contiguous; shift, lse (R, C, 1), lse finite or +inf (rows whose p is 0).
    """
    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    # One buffer for every slice's key-side gradient: a fresh (step, K C, E) result per slice
    # (16 MiB at the default slice size) costs page faults comparable to the matmul itself.
    slots = plan.keyblock.shape[-1] * plan.block_size
    work = qf.new_empty(min(plan.step, qf.shape[0]) * slots * max(kf.shape[-1], vf.shape[-1]))
    for r0 in range(0, qf.shape[0], plan.step):
        r1 = r0 + plan.step
        qs, do, kg = qf[r0:r1], dout[r0:r1], plan.window(kf, r0)
        p = masked_scores(qs, kg, plan.allowed(r0), scale).sub_(lse[r0:r1]).exp_()
        ds = torch.matmul(do, plan.window(vf, r0).transpose(-2, -1))
        ds.sub_(shift[r0:r1]).mul_(p).mul_(scale)
        torch.matmul(ds, kg, out=dq[r0:r1])
        for grad, x, y in ((dk, ds, qs), (dv, p, do)):
            part = work[: x.shape[0] * slots * y.shape[-1]].view(x.shape[0], slots, y.shape[-1])
            plan.scatter(grad, torch.matmul(x.transpose(-2, -1), y, out=part), r0)
    return dq, dk, dv


def _shift(dout: Tensor, out: Tensor, dlse: Tensor, step: int) -> Tensor:
    """rowsum(dout * out) - dlse of (R, C, Dv), (R, C): (R, C, 1), ``step`` rows at a time (the
    product of whole tensors would be one more full-size temporary)."""
    shift = torch.empty_like(dlse)
    for r0 in range(0, out.shape[0], step):
        r1 = r0 + step
        torch.sum(dout[r0:r1] * out[r0:r1], -1, out=shift[r0:r1])
    return shift.sub_(dlse)[..., None]


class _BlockAttention(torch.autograd.Function):
    """Softmax of every query block over its K key blocks, ``step`` rows at a time.

    Autograd would keep, for every slice, the gathered keys and values (K times the size of k
    and v) and the scores and probabilities (N K C per head): hundreds of MiB at N = 16384,
    allocated fresh on every call. As in FlashAttention (Dao et al. 2022), the forward keeps only
    q, k, v, out and lse and the backward recomputes each slice's probabilities
    p = exp(s - lse); with dp = do v^T, ds = p (dp - rowsum(do * out) + dlse) gives
    dq = scale ds k, dk = scale ds^T q, dv = p^T do. Temporaries are slice-sized.

    qf: (R, C, D); kf, vf: flat blocks (L, C, D), (L, C, Dv) (see :class:`_Slices`).
    Returns out (R, C, Dv) and lse (R, C).
    """

    @staticmethod
    def forward(ctx, qf: Tensor, kf: Tensor, vf: Tensor, plan: _Slices,
                scale: float) -> tuple[Tensor, Tensor]:
        out, lse = _block_forward(qf, kf, vf, plan, scale)
        ctx.save_for_backward(qf, kf, vf, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        qf, kf, vf, out, lse = ctx.saved_tensors
        # An expanded gradient (of a sum) would send every matmul down a per-matrix path.
        dout = dout.contiguous()
        shift = _shift(dout, out, dlse, ctx.plan.step)
        # p = exp(s - lse) must be 0 in rows without keys (s = lse = -inf).
        lse = lse.masked_fill(torch.isinf(lse), 0.0)[..., None]
        dq, dk, dv = _block_backward(qf, kf, vf, ctx.plan, ctx.scale, dout, shift, lse)
        return dq, dk, dv, None, None


def _spans(total: int, per: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most ``per`` (at least 1) covering 0 .. total."""
    per = max(1, per)
    return [(a, min(total, a + per)) for a in range(0, total, per)]


@dataclass(frozen=True)
class _Globals:
    """Global positions ``tokens`` (G,), distinct, of sequences of ``length`` L in ``heads`` H:
    each attends to every key, and every query attends to each; ``ignore`` (B, L) masks padding
    only (the band's own ``ignore`` also excludes the tokens, so no key is counted twice)."""

    tokens: Tensor
    ignore: Tensor
    heads: int
    length: int

    def seq(self, x: Tensor) -> Tensor:
        """Flat (R, C, E) or (R, C) -> (B, H, L, E) or (B, H, L), a view."""
        return x.view(-1, self.heads, self.length, *x.shape[2:])

    def batched(self, x: Tensor) -> Tensor:
        """(B, H, n, E) -> (B H, n, E) for the in-place batched matmuls."""
        return x.reshape(-1, *x.shape[2:])


class _BandGlobalAttention(torch.autograd.Function):
    """:class:`_BlockAttention` of a band or of gathered blocks, plus global tokens (see
    :class:`_Globals`); the block piece must exclude the global keys (its ``ignore``).

    Every row's softmax is over its band keys and the G global keys: the forward merges the
    global piece into the band's (out, lse) in place, ``lse = log(exp(lse_band) + exp(lse_g))``,
    ``out = exp(lse_band - lse) out_band + exp(s_g - lse) v_g``, then overwrites the G global
    rows with their dense softmax over all keys. The backward is FlashAttention's on the merged
    (out, lse): the band engine recomputes its p = exp(s - lse) with the merged lse (+inf on the
    global rows, whose p there is 0), and the global pieces add their dq, dk, dv in place, so no
    full-size temporary is allocated beyond dq, dk and dv. Work O(N (band + G) D).
    """

    @staticmethod
    def forward(ctx, qf: Tensor, kf: Tensor, vf: Tensor, plan: _Slices, glob: _Globals,
                scale: float) -> tuple[Tensor, Tensor]:
        out, lse = _block_forward(qf, kf, vf, plan, scale)
        q, k, v, out4, lse4 = (glob.seq(x) for x in (qf, kf, vf, out, lse))
        b, h, length, _ = q.shape
        tokens = glob.tokens
        kg, vg = k.index_select(2, tokens), v.index_select(2, tokens)
        key_ok = ~glob.ignore[:, None, None, :]
        token_ok = key_ok.index_select(-1, tokens)
        out3 = glob.batched(out4)
        # Bounded by Dv too: the global piece's (rows, Dv) output is added slice by slice.
        per = SLICE_ELEMENTS // (b * h * max(tokens.numel(), vf.shape[-1]))
        for r0, r1 in _spans(length, per):
            s = masked_scores(q[:, :, r0:r1], kg, token_ok, scale)
            band = lse4[:, :, r0:r1]
            total = torch.logaddexp(band, torch.logsumexp(s, -1))
            # Rows with no key at all stay 0 with lse = -inf.
            safe = total.masked_fill(torch.isinf(total), 0.0)
            out4[:, :, r0:r1].mul_(band.sub(safe).exp_()[..., None])
            p = s.sub_(safe[..., None]).exp_()
            out3[:, r0:r1].baddbmm_(glob.batched(p), glob.batched(vg))
            band.copy_(total)
        for t0, t1 in _spans(tokens.numel(), SLICE_ELEMENTS // (b * h * length)):
            rows = tokens[t0:t1]
            o, lse_rows = masked_partial(q.index_select(2, rows), k, v, key_ok, scale)
            out4.index_copy_(2, rows, o)
            lse4.index_copy_(2, rows, lse_rows)
        ctx.save_for_backward(qf, kf, vf, out, lse)
        ctx.plan, ctx.glob, ctx.scale = plan, glob, scale
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        qf, kf, vf, out, lse = ctx.saved_tensors
        plan, glob, scale = ctx.plan, ctx.glob, ctx.scale
        dout = dout.contiguous()
        shift = _shift(dout, out, dlse, plan.step)
        lse = lse.masked_fill(torch.isinf(lse), 0.0)
        tokens = glob.tokens
        # The global rows' gradient comes from their dense row alone: elsewhere their p is 0.
        others = lse.clone()
        glob.seq(others).index_fill_(2, tokens, float("inf"))
        dq, dk, dv = _block_backward(qf, kf, vf, plan, scale, dout, shift, others[..., None])
        q, k, v, do, dq4, dk4, dv4 = (glob.seq(x) for x in (qf, kf, vf, dout, dq, dk, dv))
        shift, others, lse = glob.seq(shift), glob.seq(others), glob.seq(lse)
        b, h, length, _ = q.shape
        kg, vg = k.index_select(2, tokens), v.index_select(2, tokens)
        key_ok = ~glob.ignore[:, None, None, :]
        token_ok = key_ok.index_select(-1, tokens)
        dkg, dvg = torch.zeros_like(kg), torch.zeros_like(vg)
        dq3 = glob.batched(dq4)
        per = SLICE_ELEMENTS // (b * h * max(tokens.numel(), vf.shape[-1]))
        for r0, r1 in _spans(length, per):
            qs, dos = q[:, :, r0:r1], do[:, :, r0:r1]
            p = masked_scores(qs, kg, token_ok, scale).sub_(others[:, :, r0:r1, None]).exp_()
            ds = torch.matmul(dos, vg.transpose(-2, -1))
            ds.sub_(shift[:, :, r0:r1]).mul_(p).mul_(scale)
            dq3[:, r0:r1].baddbmm_(glob.batched(ds), glob.batched(kg))
            dkg.add_(torch.matmul(ds.transpose(-2, -1), qs))
            dvg.add_(torch.matmul(p.transpose(-2, -1), dos))
        dk4.index_add_(2, tokens, dkg)
        dv4.index_add_(2, tokens, dvg)
        dk3, dv3 = glob.batched(dk4), glob.batched(dv4)
        for t0, t1 in _spans(tokens.numel(), SLICE_ELEMENTS // (b * h * length)):
            rows = tokens[t0:t1]
            qt, dot = q.index_select(2, rows), do.index_select(2, rows)
            p = masked_scores(qt, k, key_ok, scale)
            p.sub_(lse.index_select(2, rows)[..., None]).exp_()
            ds = torch.matmul(dot, v.transpose(-2, -1))
            ds.sub_(shift.index_select(2, rows)).mul_(p).mul_(scale)
            dq4.index_add_(2, rows, torch.matmul(ds, k))
            dk3.baddbmm_(glob.batched(ds).transpose(1, 2), glob.batched(qt))
            dv3.baddbmm_(glob.batched(p).transpose(1, 2), glob.batched(dot))
        return dq, dk, dv, None, None, None


def _block_attention(
    q: Tensor,
    kf: Tensor,
    vf: Tensor,
    keyblock: Tensor,
    index: Tensor | None,
    *,
    back: int = 0,
    rows_per_sequence: int,
    block_size: int,
    scale: float,
    ignore: Tensor,
    pattern: Tensor | None,
    tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Runs :class:`_BlockAttention` on q (B, H, N, D) cut into ``rows_per_sequence`` blocks per
    (batch, head) (the tail zero-padded); returns out (B, H, N, Dv) and lse (B, H, N).
    With global ``tokens``, :class:`_BandGlobalAttention` instead: the blocks then skip the
    global keys (``ignore`` holds the padding alone), as the global piece holds them."""
    b, h, n, d = q.shape
    c, per = block_size, rows_per_sequence
    qf = _pad_to(q, per * c).reshape(-1, c, d)
    batch = torch.arange(b, device=q.device).repeat_interleave(h * per)
    step = max(1, SLICE_ELEMENTS // (c * keyblock.shape[-1] * c))
    if tokens is None:
        plan = _Slices(keyblock, batch, ignore, index, back, pattern, c, step)
        out, lse = _BlockAttention.apply(qf, kf, vf, plan, scale)
    else:
        blocks_ignore = ignore.index_fill(1, tokens, True)
        plan = _Slices(keyblock, batch, blocks_ignore, index, back, pattern, c, step)
        glob = _Globals(tokens, ignore, h, per * c)
        out, lse = _BandGlobalAttention.apply(qf, kf, vf, plan, glob, scale)
    out = out.view(b, h, per * c, -1)[:, :, :n]
    return out, lse.view(b, h, per * c)[:, :, :n]


def _key_ignore(
    key_mask: Tensor | None, b: int, m: int, length: int, device: torch.device
) -> Tensor:
    """Bool (B, length): padding beyond the M keys, and ``key_mask`` (B, M), are ignored."""
    ignore = torch.ones(b, length, dtype=torch.bool, device=device)
    ignore[:, :m] = False if key_mask is None else key_mask
    return ignore


def block_gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_blocks: Tensor,
    *,
    block_size: int,
    scale: float,
    key_mask: Tensor | None = None,
    pattern: Tensor | None = None,
    global_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Query block b (positions b*C .. b*C + C - 1) attends to key blocks ``key_blocks[..., b, :]``.

    Args:
        q, k, v: (B, H, N, D), (B, H, M, D), (B, H, M, Dv); N and M are padded internally to
            multiples of C = ``block_size`` and the output is trimmed back to N.
        key_blocks: long (nq, K) shared by the heads, or (H, nq, K) per head, nq = ceil(N / C);
            entries index key blocks (0 .. ceil(M / C) - 1), or are -1 for an unused slot. The K
            blocks of a row must be distinct (a repeated block would be counted twice).
        key_mask: bool (B, M), True for keys to ignore (padding).
        pattern: optional bool (C, K C): query a of every block may only see the keys j of
            its K gathered blocks where ``pattern[a, j]`` (causality within a block).
        global_tokens: optional long (G,), distinct positions (aligned positions, N == M):
            besides its blocks, query i also attends to every key j when i is global, and to key
            j when j is global (the blocks' copies of global keys are skipped, so a key is never
            counted twice); O(N G D) more work, merged inside the engine
            (:class:`_BandGlobalAttention`).

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
    if global_tokens is not None and n != m:
        raise ValueError(f"global_tokens need aligned positions (N == M), got N={n}, M={m}")
    keyblock = key_blocks.expand(b, h, -1, -1)
    sequence = torch.arange(b * h, device=q.device).view(b, h, 1, 1)
    index = keyblock.clamp(min=0) + sequence * nk
    return _block_attention(
        q, _pad_to(k, nk * c).reshape(-1, c, d), _pad_to(v, nk * c).reshape(-1, c, v.shape[-1]),
        keyblock.reshape(-1, keyblock.shape[-1]), index.reshape(-1, keyblock.shape[-1]),
        rows_per_sequence=nq, block_size=c, scale=scale,
        ignore=_key_ignore(key_mask, b, m, nk * c, q.device), pattern=pattern,
        tokens=global_tokens,
    )


@dataclass(frozen=True)
class Band:
    """The band of :func:`banded_attention`: query i sees key j when ``-right <= i - j <= left``
    and ``(i - j) % dilation == 0``. A banded method describes its pattern by one (see
    :class:`effattn.sparse.parallel.Halo`)."""

    left: int
    right: int
    dilation: int = 1


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
    global_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Query i attends to keys j with ``-right <= i - j <= left`` and ``(i - j) % dilation == 0``.

    q, k, v: (B, H, N, D), (B, H, N, D), (B, H, N, Dv) (aligned positions, N == M);
    key_mask: bool (B, N), True = ignore. Returns (out (B, H, N, Dv), lse (B, H, N)).

    ``global_tokens`` (long (G,), distinct positions; dilation 1 only): besides the band, query i
    also attends to every key j when i is global, and to key j when j is global; O(N G D) more
    work, merged inside the engine (:class:`_BandGlobalAttention`).

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
    if global_tokens is not None and dilation > 1:
        raise ValueError("banded_attention supports global_tokens only with dilation=1")
    dilation = min(dilation, n)
    if dilation > 1:
        length = -(-n // dilation) * dilation
        ignore = _key_ignore(key_mask, b, n, length, q.device)

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
    # Query block r of the flat blocks of all sequences reads flat key blocks r - back ..
    # r + ahead in place; blocks of a neighbouring sequence are masked as out of range.
    row = torch.arange(nq, device=q.device)[:, None]
    keyblock = row + torch.arange(-back, ahead + 1, device=q.device)
    keyblock = keyblock.masked_fill((keyblock < 0) | (keyblock >= nq), -1)
    # i - j of query a and slot j is the same in every block: (back c + a) - j.
    offset = back * c + torch.arange(c, device=q.device)[:, None] - torch.arange(
        keyblock.shape[1] * c, device=q.device
    )

    def flat(x: Tensor) -> Tensor:
        return _pad_to(x, nq * c).reshape(-1, c, x.shape[-1])

    return _block_attention(
        q, flat(k), flat(v), keyblock.repeat(b * h, 1), None, back=back, rows_per_sequence=nq,
        block_size=c, scale=scale, ignore=_key_ignore(key_mask, b, n, nq * c, q.device),
        pattern=(offset <= left) & (offset >= -right), tokens=global_tokens,
    )
