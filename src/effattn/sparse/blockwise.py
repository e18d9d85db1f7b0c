"""The blockwise engine behind the structured sparse patterns (local, Longformer, BigBird, Sparse
Transformer): the CPU strategy of the banded engine, and its one dispatch point.

:func:`sparse_attention` is where every banded caller arrives (softmax, local, longformer,
bigbird, sparse_transformer, the window hybrid, the sequence-parallel halos). It applies the
refusals every strategy shares (:func:`effattn.sparse.pieces.check_pieces`) and then runs the
strategy :func:`effattn.strategy.choose` picks for the device: this module's engine (``cpu``)
or FlexAttention (``flex``, :mod:`effattn.sparse.flex`). The pieces are defined once, in
:mod:`effattn.sparse.pieces`; this engine keeps them disjoint for its bookkeeping.

A pattern is a disjoint union of pieces, each a set of (query i, key j) pairs of aligned
positions:

- :class:`Band`: ``-right <= i - j <= left`` and ``(i - j) % dilation == 0``;
- :class:`Blocks`: query block a (positions a C .. a C + C - 1) with the key blocks listed for it,
  within them where a per-element ``pattern`` allows (causality);
- :class:`Columns`: ``i - j`` a nonzero multiple of ``stride`` (``j < i`` when causal);
- :class:`Summary`: keys ``j % stride >= stride - c`` of another block of ``stride`` positions than
  the query's (an earlier one when causal);
- :class:`Globals`: global rows attend to every key and every row to the global keys; the other
  pieces then skip the global keys, so no pair is counted twice.

:func:`sparse_attention` computes ``out_i = sum_j p_ij v_j`` over the union, with
``p_ij = exp(s_ij - lse_i)``, ``s_ij = scale q_i.k_j`` and ``lse_i = log sum_j exp(s_ij)``, in one
autograd function, as FlashAttention does (Dao et al. 2022): the forward merges each piece into
``out`` and ``lse`` in place (online softmax) and keeps only q, k, v, out and lse; the backward
recomputes each slice's p and adds ``dq = scale ds k``, ``dk = scale ds^T q``, ``dv = p^T do``,
with ``ds = p (do v^T - rowsum(do * out) + dlse)``, straight into the gradients it returns.
Scores are built slice by slice into reused buffers of about ``SLICE_ELEMENTS`` elements; no
N x N matrix, padded copy of q, k or v, or full-size temporary is made. Rows with no allowed key
give out = 0 and lse = -inf (never NaN, also in the gradients).

Logit soft-capping (Gemma 2, Team Gemma 2024; ``softcap=c``, band and block pieces): every score
is ``c tanh(scale q.k / c)`` instead of ``scale q.k``, capped in natural units before it is
turned into units of log2. The backward multiplies ds by the cap's slope
``1 - tanh^2 = 1 - (s / c)^2``, recomputed from the capped scores s of the slice.

Shapes: q (B, H, N, D), k (B, H, N, D), v (B, H, N, Dv); key masks are bool (B, N),
True = ignore.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn import strategy
from effattn.base import read_deferred_values
from effattn.sparse.pieces import Band, Blocks, Columns, Globals, Piece, Summary, check_pieces

# A backward slice's scores, probabilities and copied rows hold about twice this many elements
# (a forward slice's scores as many, for twice the rows): enough for efficient batched matmuls,
# few enough that a slice stays in the caches and that forward plus backward need little beyond
# q, k, v, out and the gradients (1 MiB per fp32 buffer; 2 MiB made the fwd+bwd peak of
# bigbird at N=4096 39.7 MiB against 33.9, for 2% of its time, paired).
SLICE_ELEMENTS = 1 << 18

_NEG_INF = float("-inf")
# Scores and log-sum-exps are kept in units of log2 inside the engine: ATen's exp2 of fp32 runs
# several times faster than its exp (a fifth of the forward's time went to exp).
_LOG2E = 1.0 / math.log(2.0)


def band_block_size(reach: int) -> int:
    """Query block size C for a band reaching ``reach`` keys to one side: about sqrt(8 reach),
    a power of two in 16 .. 128.

    Blocks waste the corners of their window (about C / (2 reach) of the work for a two-sided
    band, C / reach for a one-sided one), while small blocks make small matmuls and more of
    them: measured (paired, fp32, D = 64), 32 is best for reach 64 and 127, 64 for 256 and 511.
    """
    return int(min(128, max(16, 2 ** math.ceil(math.log2(math.sqrt(8.0 * max(1, reach)))))))


def _scores(out: Tensor, q: Tensor, k: Tensor, scale: float, biases: Sequence[Tensor],
            softcap: float | None = None) -> Tensor:
    """out (..., n, m) = log2(e) scale q k^T + sum(biases): scores in units of log2, with
    q (G, n, D), k (G, m, D), G the batch of out, and 0 / -inf biases broadcastable to out
    (masks as additive terms: a masked_fill pass costs about as much as the matmul). With
    ``softcap`` c, log2(e) c tanh(scale q k^T / c) + sum(biases). Every score of the engine is
    built here."""
    flat = out.view(-1, *out.shape[-2:])
    if softcap is not None:
        flat.baddbmm_(q, k.transpose(-2, -1), beta=0.0, alpha=scale / softcap)
        flat.tanh_().mul_(softcap * _LOG2E)
        for bias in biases:
            out.add_(bias)
        return flat
    alpha = scale * _LOG2E
    if not biases:
        return flat.baddbmm_(q, k.transpose(-2, -1), beta=0.0, alpha=alpha)
    if len(biases) == 1:
        out.copy_(biases[0])
    else:
        torch.add(biases[0].expand_as(out), biases[1], out=out)
    return flat.baddbmm_(q, k.transpose(-2, -1), alpha=alpha)


def _softcap_slope(scores: Tensor, softcap: float, out: Tensor) -> Tensor:
    """Into out: d(c tanh(x / c)) / dx = 1 - tanh^2 = 1 - (s / c)^2 of the capped scores
    ``scores`` (units of log2, s = scores / log2(e)); 0 where a score is masked (-inf: the
    clamp keeps 1 - inf from reaching ds as 0 * -inf = NaN)."""
    torch.mul(scores, 1.0 / (softcap * _LOG2E), out=out)
    return out.square_().neg_().add_(1.0).clamp_min_(0.0)


def _accumulate(target: Tensor, a: Tensor, b: Tensor, alpha: float,
                scratch: Tensor | None) -> None:
    """target (G, n, E) += alpha a @ b. ATen multiplies into a target whose batches are not laid
    out one after the other (a slice of rows of every head) one batch at a time: such a target
    gets the product in ``scratch`` (at least G n E elements; only such a target needs it) and
    one add."""
    if target.is_contiguous() or scratch is None:
        target.baddbmm_(a, b, alpha=alpha)
    else:
        target.add_(torch.bmm(a, b, out=scratch[: target.numel()].view(target.shape)),
                    alpha=alpha)


def _softmax_into(p: Tensor, v: Tensor, out: Tensor, lse: Tensor, merge: bool,
                  scratch: Tensor | None = None) -> None:
    """Softmax of the scores p (G, n, m) (base 2, overwritten by 2^(p - max)) applied to
    v (G, m, E).

    ``merge=False`` writes out (G, n, E) and lse (G, n, 1) (base 2). ``merge=True`` adds the
    piece to the softmax already in out and lse, over a disjoint key set: with
    t = max(row max, lse), lse' = t + log2(sum 2^(p - t) + 2^(lse - t)) and
    out' = (2^(lse - t) out + 2^(p - t) v) / 2^(lse' - t). Rows empty in both stay 0, -inf.
    ``scratch``: see :func:`_accumulate` (needed to merge into a strided out).
    """
    top = p.amax(-1, keepdim=True)
    if merge:
        top = torch.maximum(top, lse)
    # The row max only stabilises the exponent; rows with no allowed key keep -inf scores, so
    # exp2 gives 0 there and lse = -inf.
    top.masked_fill_(top == _NEG_INF, 0.0)
    total = p.sub_(top).exp2_().sum(-1, keepdim=True)
    if merge:
        kept = (lse - top).exp2_()
        total.add_(kept)
        _accumulate(out.mul_(kept), p, v, 1.0, scratch)
    else:
        torch.bmm(p, v, out=out)
    out.div_(total.clamp_min(torch.finfo(total.dtype).tiny))
    lse.copy_(top.add_(total.log2_()))


@dataclass(frozen=True)
class _Layout:
    """The engine's positions u over the rows of q, k, v (B, H, N, E) viewed flat (P = B H N, E).

    Each of the S = B H sequences is cut into ``fold`` residue classes mod ``fold``, each padded
    to ``length`` positions: u = (s fold + rho) length + i stands for row s N + rho + fold i when
    rho + fold i < N, and is missing otherwise (read as row 0 and masked as a key; written to
    the spare row P). ``fold = 1, length = N`` is the identity, read and written as views.
    """

    seqs: int
    n: int
    fold: int
    length: int

    @property
    def identity(self) -> bool:
        return self.fold == 1 and self.length == self.n

    @property
    def total(self) -> int:
        """U, the number of positions u."""
        return self.seqs * self.fold * self.length

    def rows(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """Flat rows (read, write) of positions u (long, any shape); missing positions and
        positions outside 0 .. U - 1 read row 0 and write the spare row P."""
        cls = u.div(self.length, rounding_mode="floor")
        at = cls.remainder(self.fold) + self.fold * (u - cls * self.length)
        row = cls.div(self.fold, rounding_mode="floor") * self.n + at
        ok = (u >= 0) & (u < self.total) & (at < self.n)
        return row.where(ok, 0), row.where(ok, self.seqs * self.n)


def _span(x: Tensor, u0: int, u1: int, pad: float = 0.0) -> Tensor:
    """Rows u0 .. u1 - 1 of x (L, ...), ``pad`` outside 0 .. L - 1: a view, or a slice-sized
    padded copy at the ends."""
    lo = min(max(u0, 0), x.shape[0])
    hi = max(min(u1, x.shape[0]), lo)
    part = x[lo:hi]
    if lo > u0 or hi < u1:
        widths = (0, 0) * (x.dim() - 1) + (lo - u0, u1 - hi)
        part = F.pad(part, widths, value=pad)
    return part


def _matrices(x: Tensor, ws: _Workspace, name: str) -> Tensor:
    """x (G, n, E) itself when its rows are laid out as a matmul needs them, else a copy into
    buffer ``name``: an expanded gradient (of a sum, stride 0) would send the matmuls down a
    per-matrix path."""
    if x.stride(-1) == 1 and x.stride(-2) >= x.shape[-1]:
        return x
    return ws.take(name, *x.shape).copy_(x)


class _Workspace:
    """The buffers of one pass (forward or backward): one arena, carved into each piece's named
    buffers in turn (:meth:`use`), which its slices reuse. Slices then allocate nothing: fresh
    slice-sized tensors fragment the allocator's heap, which then keeps more resident than is
    live. Pages of the arena a piece never writes are never touched, so cost no memory.

    Both passes allocate the arena of the larger of their needs (``plans``' buffers in the
    forward and the backward, and ``extra``): the backward then reuses the block the forward
    freed, where an arena of another size would leave that block resident beside it (up to
    4 MiB more at N = 4096).
    """

    def __init__(self, like: Tensor, plans: Sequence[_Plan], width: int,
                 extra: int = 0) -> None:
        needs = [sum(plan.sizes(width, forward).values())
                 for plan in plans for forward in (True, False)]
        self.arena = like.new_empty(max([extra, *needs]))
        self.buffers: dict[str, Tensor] = {}

    def use(self, sizes: dict[str, int]) -> _Workspace:
        """Carves the arena into buffers of the given elements."""
        self.buffers, start = {}, 0
        for name, size in sizes.items():
            self.buffers[name] = self.arena[start : start + size]
            start += size
        return self

    def take(self, name: str, *shape: int) -> Tensor:
        """A (shape) view of buffer ``name``."""
        return self.buffers[name][: math.prod(shape)].view(shape)


@dataclass(frozen=True)
class _Blocks:
    """Query blocks of C = ``size`` positions u of ``layout`` (R = ceil(U / C) rows), row r
    against K = ``slots`` key blocks: blocks r - back .. r - back + K - 1 read in place
    (``index`` None: bands), or the blocks ``index[r]`` (R, K) (-1: unused slot).

    Scores carry the additive ``pattern`` (C, K C) and ``keys`` (U,) (0 / -inf) terms; with
    ``crosses``, windows can reach past the end of their sequence, and those rows also mask the
    keys of other sequences. Rows are processed ``step`` at a time; ``softcap`` caps the scores
    (see :func:`_scores`).
    """

    layout: _Layout
    size: int
    slots: int
    back: int
    index: Tensor | None
    pattern: Tensor | None
    keys: Tensor | None
    crosses: bool
    step: int
    softcap: float | None = None

    @property
    def rows(self) -> int:
        return -(-self.layout.total // self.size)

    def rows_per_slice(self, forward: bool) -> int:
        """``step`` rows per backward slice; a forward slice holds the scores alone, not also
        ds, so it takes twice as many at about the same memory."""
        return 2 * self.step if forward else self.step

    def sizes(self, width: int, forward: bool) -> dict[str, int]:
        """Buffers of a pass (rows of width E = ``width``): p (rows, C, K C); the gathered keys
        and values of gathered windows; the gathered queries and output rows of a gathered
        layout; in the backward also ds, dout's rows (copied when laid out for no matmul) and
        the key-side product of gathered windows."""
        rows = min(self.rows_per_slice(forward), self.rows)
        c, kc = self.size, self.slots * self.size
        gathered = self.index is not None or not self.layout.identity
        sizes = {"p": rows * c * kc}
        if gathered:
            # A band's span of rows + K - 1 blocks is at most rows K blocks.
            sizes |= {"k": rows * kc * width, "v": rows * kc * width}
        if not self.layout.identity:
            sizes |= {"q": rows * c * width, "o": rows * c * width}
        if not forward:
            sizes |= {"ds": rows * c * kc, "do": rows * c * width}
            if gathered:
                sizes["part"] = max(rows * kc, (rows + self.slots - 1) * c) * width
        return sizes

    def _read(self, x: Tensor, u0: int, u1: int, ws: _Workspace, name: str) -> Tensor:
        """Flat rows of positions u0 .. u1 - 1 of x (P, E): (u1 - u0, E), a view where the
        layout is the identity, else gathered into buffer ``name``."""
        if self.layout.identity:
            return _span(x, u0, u1)
        read, _ = self.layout.rows(torch.arange(u0, u1, device=x.device))
        return torch.index_select(x, 0, read, out=ws.take(name, u1 - u0, x.shape[-1]))

    def _write_rows(self, r0: int, r1: int, device: torch.device) -> Tensor:
        return self.layout.rows(torch.arange(r0 * self.size, r1 * self.size, device=device))[1]

    def _key_positions(self, r0: int, r1: int) -> Tensor:
        """Positions u (rows, K, C) of the gathered key blocks of rows r0 .. r1 - 1."""
        blocks = self.index[r0:r1]
        offsets = torch.arange(self.size, device=blocks.device)
        return blocks[..., None] * self.size + offsets

    def queries(self, x: Tensor, r0: int, r1: int, ws: _Workspace, name: str) -> Tensor:
        """Rows r0 .. r1 - 1 of x (P, E): (rows, C, E)."""
        rows = self._read(x, r0 * self.size, r1 * self.size, ws, name)
        return rows.view(r1 - r0, self.size, -1)

    def window(self, x: Tensor, r0: int, r1: int, ws: _Workspace, name: str) -> Tensor:
        """The K C keys (or values) of rows r0 .. r1 - 1 from x (P, E): (rows, K C, E)."""
        c, kc, rows, e = self.size, self.slots * self.size, r1 - r0, x.shape[-1]
        if self.index is None:
            # One span of rows + K - 1 blocks; the rows' windows overlap in it, a view.
            span = self._read(x, (r0 - self.back) * c, (r1 - self.back + self.slots - 1) * c,
                              ws, name)
            return span.unfold(0, kc, c).transpose(1, 2)
        if self.layout.identity:
            # index_select of whole blocks copies much faster than gathering positions.
            blocks = self.index[r0:r1].clamp(min=0).flatten()
            return torch.index_select(x.view(-1, c, e), 0, blocks,
                                      out=ws.take(name, rows * self.slots, c, e)).view(rows, kc, e)
        read, _ = self.layout.rows(self._key_positions(r0, r1).flatten())
        return torch.index_select(x, 0, read, out=ws.take(name, rows * kc, e)).view(rows, kc, e)

    def scores(self, p: Tensor, qs: Tensor, kw: Tensor, r0: int, r1: int, scale: float) -> None:
        """The masked scores of rows r0 .. r1 - 1 into p (rows, C, K C)."""
        c, kc = self.size, self.slots * self.size
        biases = [] if self.pattern is None else [self.pattern]
        if self.keys is not None:
            if self.index is None:
                span = _span(self.keys, (r0 - self.back) * c,
                             (r1 - self.back + self.slots - 1) * c, _NEG_INF)
                keys = span.unfold(0, kc, c)
            else:
                blocks = self.index[r0:r1]
                keys = self.keys.view(-1, c)[blocks.clamp(min=0)]
                keys = keys.masked_fill_((blocks < 0)[..., None], _NEG_INF).view(r1 - r0, kc)
            biases.append(keys[:, None, :])
        _scores(p, qs, kw, scale, biases, self.softcap)
        for a, b in self._crossing(r0, r1):
            p[a - r0 : b - r0].masked_fill_(self._other_sequence(a, b, p.device), _NEG_INF)

    def _crossing(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """Ranges of rows in r0 .. r1 - 1 whose window reaches past their sequence."""
        if not self.crosses:
            return []
        c, length, back, k = self.size, self.layout.length, self.back, self.slots
        # Row r's window is (r - back) C .. (r - back + K) C - 1: it crosses the start x of a
        # sequence (x = a multiple of length, the ends included) when it holds x - 1 and x.
        lo, hi = (r0 - back) * c, (r1 - back + k - 1) * c
        starts = range(lo // length + 1, -(-hi // length))
        if len(starts) * (k + 1) >= r1 - r0:
            return [(r0, r1)]
        ranges: list[tuple[int, int]] = []
        for m in starts:
            x = m * length
            a, b = max(r0, x // c + back - k + 1), min(r1, -(-x // c) + back)
            if a >= b:
                continue
            if ranges and a <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], b))
            else:
                ranges.append((a, b))
        return ranges

    def _other_sequence(self, a: int, b: int, device: torch.device) -> Tensor:
        """Bool (b - a, C, K C): key slot j of row r lies in another sequence than query c."""
        c, length = self.size, self.layout.length
        r = torch.arange(a, b, device=device)[:, None]
        query = (r * c + torch.arange(c, device=device)).div(length, rounding_mode="floor")
        key = ((r - self.back) * c + torch.arange(self.slots * c, device=device)).div(
            length, rounding_mode="floor"
        )
        return query[:, :, None] != key[:, None, :]

    def slices(self, forward: bool) -> list[tuple[int, int]]:
        """Row ranges of at most :meth:`rows_per_slice` rows. For in-place bands, the first
        ``back`` and the last ``K - back`` rows, whose windows reach past the ends and are read
        as padded copies, get slices of their own, so those copies stay small."""
        step = self.rows_per_slice(forward)
        cuts = {0, self.rows}
        if self.index is None and self.layout.identity:
            cuts |= {min(self.back, self.rows), max(0, self.rows - self.slots + self.back)}
        bounds = sorted(cuts)
        return [(r0, min(end, r0 + step))
                for start, end in zip(bounds, bounds[1:], strict=False)
                for r0 in range(start, end, step)]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                merge: bool, ws: _Workspace) -> None:
        """Writes (or merges) the piece into out (P + spare, Dv) and lse (P + spare,)."""
        for r0, r1 in self.slices(forward=True):
            self._forward_slice(q, k, v, out, lse, scale, merge, ws, r0, r1)

    def _forward_slice(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       scale: float, merge: bool, ws: _Workspace, r0: int, r1: int) -> None:
        c, kc, e, rows = self.size, self.slots * self.size, v.shape[-1], r1 - r0
        p = ws.take("p", rows, c, kc)
        self.scores(p, self.queries(q, r0, r1, ws, "q"), self.window(k, r0, r1, ws, "k"), r0, r1,
                    scale)
        if self.layout.identity:
            o, s = out[r0 * c : r1 * c], lse[r0 * c : r1 * c]
        else:
            write = self._write_rows(r0, r1, q.device)
            o = ws.take("o", rows * c, e)
            if merge:
                torch.index_select(out, 0, write, out=o)
            s = lse.index_select(0, write)
        o, s = o.view(rows, c, e), s.view(rows, c, 1)
        _softmax_into(p, self.window(v, r0, r1, ws, "v"), o, s, merge)
        if not self.layout.identity:
            out.index_copy_(0, write, o.view(-1, e))
            lse.index_copy_(0, write, s.view(-1))

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, shift: Tensor,
                 grads: tuple[Tensor, Tensor, Tensor], scale: float, first: bool,
                 ws: _Workspace) -> None:
        """Adds the piece's gradients into grads = (dq, dk, dv) (P + spare, E); ``first``: dq is
        uninitialised and written here (every row is a query of exactly one block).

        lse (P + spare,): +inf where p must be 0; shift: rowsum(do * out) - dlse.
        """
        for r0, r1 in self.slices(forward=False):
            self._backward_slice(q, k, v, dout, lse, shift, grads, scale, first, ws, r0, r1)

    def _backward_slice(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor,
                        shift: Tensor, grads: tuple[Tensor, Tensor, Tensor], scale: float,
                        first: bool, ws: _Workspace, r0: int, r1: int) -> None:
        dq, dk, dv = grads
        c, kc, d, rows = self.size, self.slots * self.size, q.shape[-1], r1 - r0
        qs, kw = self.queries(q, r0, r1, ws, "q"), self.window(k, r0, r1, ws, "k")
        vw = self.window(v, r0, r1, ws, "v")
        do = _matrices(self.queries(dout, r0, r1, ws, "do"), ws, "do")
        if self.layout.identity:
            s, sh = lse[r0 * c : r1 * c], shift[r0 * c : r1 * c]
        else:
            write = self._write_rows(r0, r1, q.device)
            s, sh = lse.index_select(0, write), shift.index_select(0, write)
        p, ds = ws.take("p", rows, c, kc), ws.take("ds", rows, c, kc)
        self.scores(p, qs, kw, r0, r1, scale)
        if self.softcap is None:
            p.sub_(s.view(rows, c, 1)).exp2_()
        else:
            # ds holds the cap's slope until dv has taken p; p then becomes p times the slope,
            # the factor ds needs, so no third slice-sized buffer is used.
            _softcap_slope(p, self.softcap, ds)
            p.sub_(s.view(rows, c, 1)).exp2_()
            self._scatter(dv, p, do, r0, r1, 1.0, ws)
            p.mul_(ds)
        torch.bmm(do, vw.transpose(1, 2), out=ds)
        ds.sub_(sh.view(rows, c, 1)).mul_(p)
        if self.layout.identity:
            rows_dq = dq[r0 * c : r1 * c].view(rows, c, d)
            rows_dq.baddbmm_(ds, kw, beta=0.0 if first else 1.0, alpha=scale)
        else:
            part = torch.bmm(ds, kw, out=ws.take("o", rows, c, d)).view(-1, d)
            if first:
                dq.index_copy_(0, write, part.mul_(scale))
            else:
                dq.index_add_(0, write, part, alpha=scale)
        self._scatter(dk, ds, qs, r0, r1, scale, ws)
        if self.softcap is None:
            self._scatter(dv, p, do, r0, r1, 1.0, ws)

    def _scatter(self, dx: Tensor, a: Tensor, y: Tensor, r0: int, r1: int, alpha: float,
                 ws: _Workspace) -> None:
        """dx[key positions of the windows of rows r0 .. r1 - 1] += alpha a^T y, for
        a (rows, C, K C) and y (rows, C, E)."""
        c, k, e, rows = self.size, self.slots, y.shape[-1], r1 - r0
        if self.index is not None:
            part = torch.bmm(a.transpose(1, 2), y, out=ws.take("part", rows, k * c, e))
            if self.layout.identity:
                # Unused slots (-1) read block 0 with p = 0: adding their zeros changes nothing.
                blocks = self.index[r0:r1].clamp(min=0).flatten()
                dx[: self.layout.total].view(-1, c, e).index_add_(
                    0, blocks, part.view(-1, c, e), alpha=alpha
                )
            else:
                write = self.layout.rows(self._key_positions(r0, r1).flatten())[1]
                dx.index_add_(0, write, part.view(-1, e), alpha=alpha)
            return
        # Slot o of row r is block r - back + o: one product per slot, added in place.
        if self.layout.identity:
            blocks = dx[: self.rows * c].view(self.rows, c, e)
            for o in range(k):
                start = r0 - self.back + o
                # Blocks outside 0 .. R - 1 hold no key: their p and ds are 0.
                lo, hi = max(0, -start), min(rows, self.rows - start)
                if lo < hi:
                    blocks[start + lo : start + hi].baddbmm_(
                        a[lo:hi, :, o * c : (o + 1) * c].transpose(1, 2), y[lo:hi], alpha=alpha
                    )
            return
        span = ws.take("part", rows + k - 1, c, e).zero_()
        for o in range(k):
            span[o : o + rows].baddbmm_(a[:, :, o * c : (o + 1) * c].transpose(1, 2), y,
                                        alpha=alpha)
        u0 = (r0 - self.back) * c
        write = self.layout.rows(torch.arange(u0, u0 + span.shape[0] * c, device=dx.device))[1]
        dx.index_add_(0, write, span.view(-1, e))


@dataclass(frozen=True)
class _Dense:
    """Every query row against a small key set shared by the rows of a sequence: the keys at
    ``positions`` (m,) of each sequence, with the additive ``bias`` (B, 1, 1, m) or None.

    With ``block``, the keys are ``per_block`` of each block of ``block`` positions, in block
    order, and row i sees only those of the other blocks than its own (of the earlier blocks,
    a prefix of the keys, when ``causal``); a slice of rows is then one block (``step`` =
    ``block``), so its keys are one prefix and its mask one row, and the key-side products of
    the backward have a block of rows as inner dimension (slices of 43 rows made them 1.2x
    slower than autograd's, at N = 16384). Rows are processed ``step`` at a time (all
    sequences at once).
    """

    shape: tuple[int, int, int]
    positions: Tensor
    bias: Tensor | None
    block: int | None
    per_block: int
    causal: bool
    step: int

    def _biases(self, r0: int, m: int, dtype: torch.dtype) -> list[Tensor]:
        """The additive terms of a slice starting at row r0 against the first m keys."""
        biases = [] if self.bias is None else [self.bias[..., :m]]
        if self.block is not None and not self.causal:
            own = r0 // self.block * self.per_block
            mask = torch.zeros(m, dtype=dtype, device=self.positions.device)
            mask[own : own + self.per_block] = _NEG_INF
            biases.append(mask)
        return biases

    def rows_per_slice(self, forward: bool) -> int:
        """A block; else ``step`` rows per backward slice and twice as many per forward slice
        (which holds the scores alone, not also ds)."""
        if self.block is not None:
            return self.block
        return 2 * self.step if forward else self.step

    def _slices(self, n: int, forward: bool) -> list[tuple[int, int, int]]:
        """(r0, r1, m): rows r0 .. r1 - 1 see (some of) the first m keys; slices where m = 0
        are left out."""
        m = self.positions.numel()
        if self.block is None:
            step = self.rows_per_slice(forward)
            return [(r0, min(n, r0 + step), m) for r0 in range(0, n, step)]
        visible = [min(m, r0 // self.block * self.per_block) if self.causal else m
                   for r0 in range(0, n, self.block)]
        return [(r0, min(n, r0 + self.block), keys)
                for r0, keys in zip(range(0, n, self.block), visible, strict=True) if keys > 0]

    def sizes(self, width: int, forward: bool) -> dict[str, int]:
        """Buffers of a pass: p (B H, rows, m) and the products of a slice's rows; in the
        backward also ds, dout's rows and the products of the keys."""
        g, m = self.shape[0] * self.shape[1], self.positions.numel()
        rows = self.rows_per_slice(forward)
        sizes = {"p": g * rows * m, "o": g * rows * width}
        if not forward:
            sizes |= {"ds": g * rows * m, "do": g * rows * width, "part": g * m * width}
        return sizes

    def forward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                ws: _Workspace) -> None:
        """Merges the piece into out (P + spare, Dv) and lse (P + spare,)."""
        q4, k4, v4, out4, lse4 = _sequences(self.shape, q, k, v, out, lse)
        g, n = q4.shape[0] * q4.shape[1], q4.shape[2]
        km = k4.index_select(2, self.positions).view(g, -1, k4.shape[-1])
        vm = v4.index_select(2, self.positions).view(g, -1, v4.shape[-1])
        for r0, r1, m in self._slices(n, forward=True):
            p = ws.take("p", *q4.shape[:2], r1 - r0, m)
            _scores(p, q4[:, :, r0:r1].reshape(g, r1 - r0, -1), km[:, :m], scale,
                    self._biases(r0, m, q.dtype))
            o = out4[:, :, r0:r1].view(g, r1 - r0, -1)
            s = lse4[:, :, r0:r1].view(g, r1 - r0, 1)
            _softmax_into(p.view(g, r1 - r0, m), vm[:, :m], o, s, True, ws.take("o", o.numel()))

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, shift: Tensor,
                 grads: tuple[Tensor, Tensor, Tensor], scale: float, ws: _Workspace) -> None:
        """Adds the piece's gradients into grads = (dq, dk, dv) (P + spare, E)."""
        q4, k4, v4, do4, lse4, shift4, dq4, dk4, dv4 = _sequences(
            self.shape, q, k, v, dout, lse, shift, *grads
        )
        g, n, d, e = q4.shape[0] * q4.shape[1], q4.shape[2], q4.shape[-1], v4.shape[-1]
        km = k4.index_select(2, self.positions).view(g, -1, d)
        vm = v4.index_select(2, self.positions).view(g, -1, e)
        dkm, dvm = torch.zeros_like(km), torch.zeros_like(vm)
        for r0, r1, m in self._slices(n, forward=False):
            p, ds = ws.take("p", g, r1 - r0, m), ws.take("ds", g, r1 - r0, m)
            qs = q4[:, :, r0:r1].reshape(g, r1 - r0, d)
            do = _matrices(do4[:, :, r0:r1].reshape(g, r1 - r0, e), ws, "do")
            _scores(p.view(*q4.shape[:2], r1 - r0, m), qs, km[:, :m], scale,
                    self._biases(r0, m, q.dtype))
            p.sub_(lse4[:, :, r0:r1].reshape(g, r1 - r0, 1)).exp2_()
            torch.bmm(do, vm[:, :m].transpose(1, 2), out=ds)
            ds.sub_(shift4[:, :, r0:r1].reshape(g, r1 - r0, 1)).mul_(p)
            _accumulate(dq4[:, :, r0:r1].view(g, r1 - r0, d), ds, km[:, :m], scale,
                        ws.take("o", g * (r1 - r0) * d))
            _accumulate(dkm[:, :m], ds.transpose(1, 2), qs, scale, ws.take("part", g * m * d))
            _accumulate(dvm[:, :m], p.transpose(1, 2), do, 1.0, ws.take("part", g * m * e))
        dk4.index_add_(2, self.positions, dkm.view(*q4.shape[:2], -1, d))
        dv4.index_add_(2, self.positions, dvm.view(*q4.shape[:2], -1, e))


@dataclass(frozen=True)
class _GlobalRows:
    """The rows at ``tokens`` (G,) of every sequence attend to every key (additive ``bias``
    (B, 1, 1, N) of the padding): their softmax replaces whatever the other pieces gave them.

    Keys are processed ``step`` at a time for all G rows: the forward merges each slice of keys
    into the rows' softmax (online), and the backward, which knows their lse, adds each slice's
    dk and dv once (slices of rows would each pass over all of dk and dv).
    """

    shape: tuple[int, int, int]
    tokens: Tensor
    bias: Tensor | None
    step: int

    def keys_per_slice(self, forward: bool) -> int:
        """``step`` keys per backward slice, twice as many per forward slice (which holds the
        scores alone, not also ds)."""
        return 2 * self.step if forward else self.step

    def sizes(self, width: int, forward: bool) -> dict[str, int]:
        """Buffers of a pass: p (B H, G, keys); in the backward also ds and the products of a
        slice of keys."""
        b, h, _ = self.shape
        keys = self.keys_per_slice(forward)
        scores = b * h * self.tokens.numel() * keys
        return {"p": scores} if forward else {"p": scores, "ds": scores,
                                              "part": b * h * keys * width}

    def _slices(self, ws: _Workspace, name: str,
                forward: bool) -> list[tuple[int, int, Tensor]]:
        """(j0, j1, buffer (B H, G, j1 - j0)) of every slice of keys."""
        b, h, n = self.shape
        g, step = b * h, self.keys_per_slice(forward)
        spans = [(j0, min(n, j0 + step)) for j0 in range(0, n, step)]
        return [(j0, j1, ws.take(name, g, self.tokens.numel(), j1 - j0)) for j0, j1 in spans]

    def _scores(self, p: Tensor, qt: Tensor, kj: Tensor, j0: int, j1: int, scale: float) -> None:
        """Scores of the G rows against keys j0 .. j1 - 1 into p (B H, G, j1 - j0)."""
        b, h, _ = self.shape
        biases = [] if self.bias is None else [self.bias[..., j0:j1]]
        _scores(p.view(b, h, *p.shape[1:]), qt, kj, scale, biases)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                ws: _Workspace) -> None:
        """Overwrites the global rows of out (P + spare, Dv) and lse (P + spare,)."""
        q4, k4, v4, out4, lse4 = _sequences(self.shape, q, k, v, out, lse)
        b, h, n, d = q4.shape
        t, g = self.tokens.numel(), b * h
        qt = q4.index_select(2, self.tokens).view(g, t, d)
        o = q.new_zeros(g, t, v4.shape[-1])
        s = q.new_full((g, t, 1), _NEG_INF)
        for j0, j1, p in self._slices(ws, "p", forward=True):
            self._scores(p, qt, k4[:, :, j0:j1].reshape(g, j1 - j0, d), j0, j1, scale)
            _softmax_into(p, v4[:, :, j0:j1].reshape(g, j1 - j0, -1), o, s, merge=True)
        out4.index_copy_(2, self.tokens, o.view(b, h, t, -1))
        lse4.index_copy_(2, self.tokens, s.view(b, h, t))

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, shift: Tensor,
                 grads: tuple[Tensor, Tensor, Tensor], scale: float, ws: _Workspace) -> None:
        """Adds the global rows' gradients into grads = (dq, dk, dv); lse holds their own."""
        q4, k4, v4, do4, lse4, shift4, dq4, dk4, dv4 = _sequences(
            self.shape, q, k, v, dout, lse, shift, *grads
        )
        b, h, n, d = q4.shape
        t, g, e = self.tokens.numel(), b * h, v4.shape[-1]
        qt = q4.index_select(2, self.tokens).view(g, t, d)
        dot = do4.index_select(2, self.tokens).view(g, t, e)
        st = lse4.index_select(2, self.tokens).view(g, t, 1)
        sht = shift4.index_select(2, self.tokens).view(g, t, 1)
        dqt = torch.zeros_like(qt)
        for (j0, j1, p), (_, _, ds) in zip(self._slices(ws, "p", forward=False),
                                           self._slices(ws, "ds", forward=False), strict=True):
            kj, vj = k4[:, :, j0:j1].reshape(g, j1 - j0, d), v4[:, :, j0:j1].reshape(g, j1 - j0, e)
            self._scores(p, qt, kj, j0, j1, scale)
            p.sub_(st).exp2_()
            torch.bmm(dot, vj.transpose(1, 2), out=ds)
            ds.sub_(sht).mul_(p)
            dqt.baddbmm_(ds, kj, alpha=scale)
            _accumulate(dk4[:, :, j0:j1].view(g, j1 - j0, d), ds.transpose(1, 2), qt, scale,
                        ws.take("part", g * (j1 - j0) * d))
            _accumulate(dv4[:, :, j0:j1].view(g, j1 - j0, e), p.transpose(1, 2), dot, 1.0,
                        ws.take("part", g * (j1 - j0) * e))
        dq4.index_add_(2, self.tokens, dqt.view(b, h, t, d))


def _sequences(shape: tuple[int, int, int], *xs: Tensor) -> list[Tensor]:
    """Flat (P + spare, E) or (P + spare,) tensors -> (B, H, N, E) or (B, H, N) views of their
    first P = B H N rows, for shape = (B, H, N)."""
    rows = math.prod(shape)
    return [x[:rows].view(*shape, *x.shape[1:]) for x in xs]


_Plan = _Blocks | _Dense | _GlobalRows


class _Attention(torch.autograd.Function):
    """Softmax over the union of the planned pieces (see the module docstring).

    q, k, v: (B, H, N, D), (B, H, N, D), (B, H, N, Dv), contiguous. Returns out (B, H, N, Dv), a
    view of a flat tensor with ``spare`` more rows (positions a piece writes beyond the
    P = B H N rows), and lse (B, H, N). Saves q, k, v, out and lse (in base 2, as the pieces
    use it); the gradients are returned as views of flat tensors written in place by the pieces.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plans: tuple[_Plan, ...], spare: int,
                scale: float) -> tuple[Tensor, Tensor]:
        b, h, n, d = q.shape
        rows = b * h * n
        flat = q.view(rows, d), k.view(rows, d), v.view(rows, v.shape[-1])
        out = q.new_empty(rows + spare, v.shape[-1])
        lse = q.new_empty(rows + spare)
        # The spare rows are read where a piece merges missing positions: keep them empty.
        out[rows:] = 0.0
        lse[rows:] = _NEG_INF
        if not (plans and isinstance(plans[0], _Blocks)):
            # Only a block piece writes every row: the others merge into the empty softmax.
            out.zero_()
            lse.fill_(_NEG_INF)
        width = max(d, v.shape[-1])
        ws = _Workspace(q, plans, width, _product_elements(v.shape[-1]))
        for i, plan in enumerate(plans):
            if isinstance(plan, _Blocks):
                plan.forward(*flat, out, lse, scale, i > 0, ws.use(plan.sizes(width, True)))
            else:
                plan.forward(*flat, out, lse, scale, ws.use(plan.sizes(width, True)))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.scale = plans, scale
        return out[:rows].view(b, h, n, -1), lse[:rows].mul(math.log(2.0)).view(b, h, n)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plans, scale = ctx.plans, ctx.scale
        b, h, n, d = q.shape
        rows, e = b * h * n, v.shape[-1]
        flat = q.view(rows, d), k.view(rows, d), v.view(rows, e)
        do = dout.reshape(rows, e)
        width = max(d, e)
        ws = _Workspace(q, plans, width, _product_elements(e))
        shift = _shift(do, out, dlse.reshape(rows), ws.use({"product": _product_elements(e)}))
        # p = 2^(s - lse) must be 0 in rows without keys (s = lse = -inf) and in spare rows.
        safe = lse.masked_fill(lse == _NEG_INF, 0.0)
        safe[rows:] = float("inf")
        others = safe
        for plan in plans:
            if isinstance(plan, _GlobalRows):
                # The global rows' gradient comes from their own dense row alone: elsewhere
                # their p is 0.
                others = safe.clone()
                _sequences((b, h, n), others)[0].index_fill_(2, plan.tokens, float("inf"))
        dq = q.new_empty(out.shape[0], d)
        if not (plans and isinstance(plans[0], _Blocks)):
            dq.zero_()
        dk, dv = q.new_zeros(out.shape[0], d), q.new_zeros(out.shape[0], e)
        grads = dq, dk, dv
        for i, plan in enumerate(plans):
            if isinstance(plan, _Blocks):
                plan.backward(*flat, do, others, shift, grads, scale, i == 0,
                              ws.use(plan.sizes(width, False)))
            elif isinstance(plan, _Dense):
                plan.backward(*flat, do, others, shift, grads, scale,
                              ws.use(plan.sizes(width, False)))
            else:
                plan.backward(*flat, do, safe, shift, grads, scale,
                              ws.use(plan.sizes(width, False)))
        return (dq[:rows].view(q.shape), dk[:rows].view(k.shape), dv[:rows].view(v.shape),
                None, None, None)


def _product_elements(e: int) -> int:
    """Elements of :func:`_shift`'s buffer for rows of Dv = e."""
    return max(1, SLICE_ELEMENTS // e) * e


def _shift(dout: Tensor, out: Tensor, dlse: Tensor, ws: _Workspace) -> Tensor:
    """rowsum(dout * out) - dlse of (P, Dv), (P + spare, Dv), (P,): (P + spare,), 0 on the
    spare rows; slice by slice into buffer "product" (the product of whole tensors would be one
    more full-size temporary)."""
    rows, e = dout.shape
    shift = out.new_zeros(out.shape[0])
    step = max(1, SLICE_ELEMENTS // e)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        product = torch.mul(dout[r0:r1], out[r0:r1], out=ws.take("product", r1 - r0, e))
        torch.sum(product, -1, out=shift[r0:r1])
    shift[:rows].sub_(dlse)
    return shift


def _additive(masked: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive form of a bool mask: 0 where False, -inf where True."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(
        masked, _NEG_INF
    )


def _key_bias(layout: _Layout, skip: Tensor | None, heads: int,
              dtype: torch.dtype) -> Tensor | None:
    """(U,) additive bias of the keys at the positions u of ``layout``: -inf where missing or
    skipped (``skip`` bool (B, N), True = skip); None where no key is."""
    flat = None if skip is None else skip[:, None, :].expand(-1, heads, -1).reshape(-1)
    if layout.identity:
        return None if flat is None else _additive(flat, dtype)
    device = None if skip is None else skip.device
    read, write = layout.rows(torch.arange(layout.total, device=device))
    missing = write == layout.seqs * layout.n
    return _additive(missing if flat is None else missing | flat[read], dtype)


@dataclass(frozen=True)
class _Context:
    """What every plan needs to know of a call: shape (B, H, N), the keys the pieces skip
    (padding and global keys, bool (B, N) or None), dtype, device, width max(D, Dv) and the
    soft cap of the scores (None: none)."""

    shape: tuple[int, int, int]
    skip: Tensor | None
    dtype: torch.dtype
    device: torch.device
    width: int
    softcap: float | None = None

    def key_bias(self, layout: _Layout) -> Tensor | None:
        if self.skip is None and not layout.identity:
            # Missing positions are masked even without padding.
            skip = torch.zeros(self.shape[0], self.shape[2], dtype=torch.bool, device=self.device)
            return _key_bias(layout, skip, self.shape[1], self.dtype)
        return _key_bias(layout, self.skip, self.shape[1], self.dtype)

    def step(self, per_row: int) -> int:
        """Rows per backward slice when a row's temporaries (scores, probabilities, copied rows)
        hold ``per_row`` elements: about 2 SLICE_ELEMENTS per slice."""
        return max(1, 2 * SLICE_ELEMENTS // per_row)

    def copies(self, layout: _Layout) -> int:
        """Rows of width max(D, Dv) a slice copies per query: only dout, made contiguous, where
        the layout is read in place; q, k, v, dout and dq, dk, dv where it is gathered."""
        return 1 if layout.identity else 7


def _band_plan(piece: Band, ctx: _Context) -> _Blocks:
    b, h, n = ctx.shape
    d = min(piece.dilation, n)
    length = -(-n // d)
    left, right = min(piece.left // d, length - 1), min(piece.right // d, length - 1)
    c = piece.block_size or band_block_size(max(left, right))
    back, ahead = -(-left // c), -(-right // c)
    slots = back + ahead + 1
    # i - j of query a and slot j is the same in every block: (back c + a) - j.
    offset = back * c + torch.arange(c, device=ctx.device)[:, None] - torch.arange(
        slots * c, device=ctx.device
    )
    layout = _Layout(b * h, n, d, length)
    return _Blocks(
        layout, c, slots, back, None, _additive((offset > left) | (offset < -right), ctx.dtype),
        ctx.key_bias(layout), crosses=slots > 1 or length % c != 0,
        step=ctx.step(c * (2 * slots * c + ctx.copies(layout) * ctx.width)), softcap=ctx.softcap,
    )


def _blocks_plan(piece: Blocks, ctx: _Context) -> _Blocks:
    b, h, n = ctx.shape
    c = piece.block_size
    nq = -(-n // c)
    layout = _Layout(b * h, n, 1, nq * c)
    pattern = None if piece.pattern is None else _additive(~piece.pattern.to(ctx.device),
                                                            ctx.dtype)
    if piece.key_blocks is None:
        return _Blocks(layout, c, 1, 0, None, pattern, ctx.key_bias(layout), crosses=False,
                       step=ctx.step(c * (2 * c + ctx.copies(layout) * ctx.width)),
                       softcap=ctx.softcap)
    key_blocks = piece.key_blocks.to(ctx.device)
    if key_blocks.dim() == 2:
        key_blocks = key_blocks[None]
    slots = key_blocks.shape[-1]
    sequence = torch.arange(b * h, device=ctx.device).view(b, h, 1, 1)
    blocks = key_blocks.expand(b, h, nq, slots)
    index = torch.where(blocks >= 0, blocks + sequence * nq, -1).reshape(-1, slots)
    keys = ctx.key_bias(layout)
    if keys is None:
        # Unused slots are masked through the key bias.
        keys = torch.zeros(layout.total, dtype=ctx.dtype, device=ctx.device)
    # Gathered keys and values, and the key-side product of dk or dv: 3 rows of K C.
    per_row = 2 * slots * c * c + (3 * slots * c + ctx.copies(layout) * c) * ctx.width
    return _Blocks(layout, c, slots, 0, index, pattern, keys, crosses=False,
                   step=ctx.step(per_row), softcap=ctx.softcap)


def _columns_plan(piece: Columns, ctx: _Context) -> list[_Plan]:
    b, h, n = ctx.shape
    s = min(piece.stride, n)
    rows = -(-n // s)
    if rows < 2:
        return []
    # Residue class rho mod s is a sequence of `rows` positions; one block each.
    layout = _Layout(b * h, n, s, rows)
    i = torch.arange(rows, device=ctx.device)
    ok = i[None, :] < i[:, None] if piece.causal else i[None, :] != i[:, None]
    per_row = rows * (2 * rows + ctx.copies(layout) * ctx.width)
    return [_Blocks(layout, rows, 1, 0, None, _additive(~ok, ctx.dtype), ctx.key_bias(layout),
                    crosses=False, step=ctx.step(per_row), softcap=ctx.softcap)]


def _summary_plan(piece: Summary, ctx: _Context) -> list[_Plan]:
    b, h, n = ctx.shape
    s = min(piece.stride, n)
    c = min(piece.c, s)
    rows = -(-n // s)
    if rows < 2:
        return []
    # The last c positions of every block; the last block may hold fewer of them.
    last = max(0, min(c, n - (rows - 1) * s - (s - c)))
    positions = (torch.arange(rows, device=ctx.device)[:, None] * s
                 + torch.arange(s - c, s, device=ctx.device)).flatten()[: (rows - 1) * c + last]
    bias = None if ctx.skip is None else _additive(ctx.skip.index_select(1, positions),
                                                   ctx.dtype)[:, None, None, :]
    return [_Dense(ctx.shape, positions, bias, s, c, piece.causal, s)]


def _global_plans(tokens: Tensor, ctx: _Context, padding: Tensor | None) -> list[_Plan]:
    b, h, n = ctx.shape
    tokens = tokens.to(ctx.device)
    bias = None if padding is None else _additive(padding, ctx.dtype)[:, None, None, :]
    # A row holds p, ds (G each) and dout's and the merged output's rows (width each).
    columns = _Dense(ctx.shape, tokens, None if bias is None else bias[..., tokens], None, 1,
                     False, ctx.step(2 * b * h * (tokens.numel() + ctx.width)))
    return [columns, _GlobalRows(ctx.shape, tokens, bias, ctx.step(2 * b * h * tokens.numel()))]


def runs_flex(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a call on ``device`` in ``dtype`` runs the flex strategy: where it is chosen,
    inside an outer torch.compile too (the cached BlockMask comes from an operator dynamo traces
    as one opaque node, and flex_attention is traced into the outer graph). Float64 on CUDA
    stays on the banded engine, which runs there too: FlexAttention's compiled kernel has no
    float64 form (torch 2.11 with triton 3.6: its tl.dot of fp64 tiles fails to compile against
    its fp32 accumulator; seen on an H200)."""
    if dtype == torch.float64 and device.type == "cuda":
        return False
    return strategy.choose("banded", device) == "flex"


def engine_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a banded method hands :func:`sparse_attention` for inputs of ``dtype`` on
    ``device``: fp32 for half precision on the CPU engine (it merges its pieces in the dtype of
    its inputs), the input dtype itself for FlexAttention, which keeps the softmax statistics
    in fp32 as flash attention does (an upcast would double its memory traffic)."""
    if runs_flex(device, dtype):
        return dtype
    return torch.promote_types(dtype, torch.float32)


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pieces: Sequence[Piece],
    *,
    scale: float,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention over the union of disjoint ``pieces`` (see the module docstring), by
    the strategy of the banded engine chosen for q's device (:mod:`effattn.strategy`).

    q, k, v: (B, H, N, D), (B, H, N, D), (B, H, N, Dv) (aligned positions); key_mask: bool
    (B, N), True = ignore. At most one :class:`Globals`. Returns out (B, H, N, Dv) and
    lse (B, H, N) = log sum_j exp(s_ij) over the allowed keys, s_ij = scale q_i.k_j, or
    ``softcap tanh(scale q_i.k_j / softcap)`` with a soft cap (:class:`Band`, :class:`Blocks`
    and :class:`Columns` pieces only).

    Cost O(N W D) time for W allowed keys per query (plus the wasted corners of the blocks);
    memory: q, k, v, out and lse kept for the backward, temporaries of O(SLICE_ELEMENTS).
    """
    b, h, n, d = q.shape
    if k.shape[2] != n or v.shape[2] != n:
        raise ValueError(
            f"sparse_attention needs aligned positions (N == M), got N={n}, M={k.shape[2]}"
        )
    check_pieces(pieces, h, n, softcap)
    if runs_flex(q.device, q.dtype):
        # Imported here: importing effattn loads no torch module beyond torch itself, and
        # FlexAttention's only where this strategy runs.
        from effattn.sparse import flex

        return flex.sparse_attention(q, k, v, pieces, scale=scale, key_mask=key_mask,
                                     softcap=softcap)
    read_deferred_values()
    tokens = [piece.tokens for piece in pieces if isinstance(piece, Globals)]
    skip = key_mask
    if tokens:
        padding = torch.zeros(b, n, dtype=torch.bool, device=q.device) if skip is None else skip
        skip = padding.index_fill(1, tokens[0].to(q.device), True)
    ctx = _Context((b, h, n), skip, q.dtype, q.device, max(d, v.shape[-1]), softcap)
    plans: list[_Plan] = []
    for piece in pieces:
        if isinstance(piece, Band):
            plans.append(_band_plan(piece, ctx))
        elif isinstance(piece, Blocks):
            plans.append(_blocks_plan(piece, ctx))
        elif isinstance(piece, Columns):
            plans.extend(_columns_plan(piece, ctx))
        elif isinstance(piece, Summary):
            plans.extend(_summary_plan(piece, ctx))
    # Global rows replace what the other pieces gave them: last.
    if tokens:
        plans.extend(_global_plans(tokens[0], ctx, key_mask))
    spare = max([1] + [plan.size for plan in plans if isinstance(plan, _Blocks)])
    return _Attention.apply(q.contiguous(), k.contiguous(), v.contiguous(), tuple(plans), spare,
                            scale)


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
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Query i attends to keys j with ``-right <= i - j <= left`` and ``(i - j) % dilation == 0``
    (:class:`Band`), and with ``global_tokens`` (long (G,), distinct positions) to every key when
    i is global and to key j when j is global (:class:`Globals`).

    q, k, v: (B, H, N, D), (B, H, N, D), (B, H, N, Dv); key_mask: bool (B, N), True = ignore;
    ``softcap``: scores ``c tanh(scale q.k / c)`` (not with ``global_tokens``).
    Returns (out (B, H, N, Dv), lse (B, H, N)). Work O(N ((left + right) / dilation + G) D).
    """
    pieces: list[Piece] = [Band(left, right, dilation, block_size)]
    if global_tokens is not None:
        pieces.append(Globals(global_tokens))
    return sparse_attention(q, k, v, pieces, scale=scale, key_mask=key_mask, softcap=softcap)


def block_gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_blocks: Tensor | None,
    *,
    block_size: int,
    scale: float,
    key_mask: Tensor | None = None,
    pattern: Tensor | None = None,
    global_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Query block a (positions a C .. a C + C - 1) attends to key blocks ``key_blocks[..., a, :]``
    within ``pattern`` (:class:`Blocks`), and with ``global_tokens`` to and from the global
    positions (:class:`Globals`; the blocks' copies of global keys are skipped).

    q, k, v: (B, H, N, D), (B, H, N, D), (B, H, N, Dv) (aligned positions); key_mask: bool
    (B, N), True = ignore. Returns (out (B, H, N, Dv), lse (B, H, N)). Work O(N (K C + G) D).
    """
    n, m = q.shape[2], k.shape[2]
    if n != m:
        raise ValueError(
            f"key_blocks and global_tokens need aligned positions (N == M), got N={n}, M={m}"
        )
    pieces: list[Piece] = [Blocks(key_blocks, block_size, pattern)]
    if global_tokens is not None:
        pieces.append(Globals(global_tokens))
    return sparse_attention(q, k, v, pieces, scale=scale, key_mask=key_mask)
