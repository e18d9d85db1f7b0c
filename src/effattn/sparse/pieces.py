"""The pieces of a structured sparse pattern: the one definition of what a pattern allows.

A pattern is a union of pieces, each a set of (query i, key j) pairs of aligned positions
(N == M). Every strategy of the banded engine computes the same union from these definitions:

- the CPU engine (:mod:`effattn.sparse.blockwise`) turns each piece into blocks of work and,
  for its bookkeeping, keeps the pieces disjoint (the pieces after a :class:`Globals` skip the
  global keys);
- the FlexAttention strategy (:mod:`effattn.sparse.flex`) evaluates :meth:`rule`, each piece's
  predicate ``allowed(h, i, j)``, as its ``mask_mod`` and builds its BlockMask from the same
  predicate; a union needs no disjointness there.

A rule takes long tensors h (head), i (query), j (key) of broadcastable shapes (index grids, or
the 0-d tensors of FlexAttention's vmap) and returns bool of their broadcast shape, using only
elementwise arithmetic and gathers from small tables, so that FlexAttention can compile it.
Those tables (:meth:`Blocks.tables`, :meth:`Globals.tables`: one per tensor field that is set,
in field order) can be built apart from the rule and handed to it, so that the flex strategy
builds them once per pattern and N, with its BlockMask.

:func:`check_pieces` holds the refusals every strategy shares, so that what a method can do
never depends on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Rule = Callable[[Tensor, Tensor, Tensor], Tensor]
"""allowed(h, i, j) -> bool: may query i of head h attend to key j?"""


@dataclass(frozen=True)
class Band:
    """``-right <= i - j <= left`` and ``(i - j) % dilation == 0``; ``block_size`` None picks
    :func:`effattn.sparse.blockwise.band_block_size` (the CPU engine's query block; no part of
    the pattern). A dilated band is computed on the CPU as ``dilation`` undilated bands over the
    residue classes mod ``dilation`` (``i - j = d (i' - j')`` there), so the work is
    O(N (left + right) / dilation D). A banded method describes its pattern by one (see
    :class:`effattn.sparse.parallel.Halo`)."""

    left: int
    right: int
    dilation: int = 1
    block_size: int | None = None

    def tables(self, n: int, device: torch.device) -> tuple[Tensor, ...]:
        """None: the rule is arithmetic."""
        return ()

    def rule(self, n: int, device: torch.device,
             tables: tuple[Tensor, ...] | None = None) -> Rule:
        left, right, dilation = self.left, self.right, self.dilation

        def allowed(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            d = i - j
            return (d <= left) & (d >= -right) & (d % dilation == 0)

        return allowed


@dataclass(frozen=True)
class Blocks:
    """Query block a (positions a C .. a C + C - 1, C = ``block_size``) attends to key blocks
    ``key_blocks[..., a, :]``: long (nq, K) shared by the heads or (H, nq, K), nq = ceil(N / C),
    distinct entries or -1 for an unused slot; ``key_blocks=None``: its own block alone.
    ``pattern`` (bool (C, K C)): query c of a block may see key j of its K blocks only where
    ``pattern[c, j]``."""

    key_blocks: Tensor | None
    block_size: int
    pattern: Tensor | None = None

    def tables(self, n: int, device: torch.device) -> tuple[Tensor, ...]:
        """The slot table slot[h, a, b] (int32 (H or 1, nq, nq)): the slot of key block b among
        query block a's, -1 if not one of them (a gather, where a search over the K slots would
        be a reduction inside the mask), when ``key_blocks`` is set; then ``pattern`` on
        ``device``, when set."""
        found = []
        if self.key_blocks is not None:
            blocks = self.key_blocks.to(device)
            blocks = blocks[None] if blocks.dim() == 2 else blocks
            heads, nq, k = blocks.shape
            slot = torch.full((heads, nq, nq + 1), -1, dtype=torch.int32, device=device)
            slots = torch.arange(k, dtype=torch.int32, device=device).expand(heads, nq, k)
            # Unused slots (-1) land in the spare column nq, dropped.
            slot.scatter_(2, blocks.masked_fill(blocks < 0, nq), slots)
            found.append(slot[..., :nq].contiguous())
        if self.pattern is not None:
            found.append(self.pattern.to(device))
        return tuple(found)

    def rule(self, n: int, device: torch.device,
             tables: tuple[Tensor, ...] | None = None) -> Rule:
        c = self.block_size
        tables = self.tables(n, device) if tables is None else tables
        pattern = None if self.pattern is None else tables[-1]
        if self.key_blocks is None:

            def own(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                same = i // c == j // c
                return same if pattern is None else same & pattern[i % c, j % c]

            return own
        slot = tables[0]
        heads = slot.shape[0]

        def listed(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            s = slot[h % heads, i // c, j // c]
            if pattern is None:
                return s >= 0
            return (s >= 0) & pattern[i % c, s.clamp_min(0) * c + j % c]

        return listed


@dataclass(frozen=True)
class Columns:
    """``i - j`` a nonzero multiple of ``stride`` (``j < i`` when ``causal``)."""

    stride: int
    causal: bool = False

    def tables(self, n: int, device: torch.device) -> tuple[Tensor, ...]:
        """None: the rule is arithmetic."""
        return ()

    def rule(self, n: int, device: torch.device,
             tables: tuple[Tensor, ...] | None = None) -> Rule:
        s, causal = min(self.stride, n), self.causal

        def allowed(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            other = (j < i) if causal else (j != i)
            return ((i - j) % s == 0) & other

        return allowed


@dataclass(frozen=True)
class Summary:
    """The last ``c`` positions of every block of ``stride`` (``j % stride >= stride - c``) other
    than the query's own block (an earlier one when ``causal``)."""

    stride: int
    c: int
    causal: bool = False

    def tables(self, n: int, device: torch.device) -> tuple[Tensor, ...]:
        """None: the rule is arithmetic."""
        return ()

    def rule(self, n: int, device: torch.device,
             tables: tuple[Tensor, ...] | None = None) -> Rule:
        s = min(self.stride, n)
        c, causal = min(self.c, s), self.causal

        def allowed(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            other = (j // s < i // s) if causal else (j // s != i // s)
            return (j % s >= s - c) & other

        return allowed


@dataclass(frozen=True)
class Globals:
    """Distinct positions ``tokens`` (long (G,)): row i attends to every key when i is global,
    and to key j when j is global (on the CPU the other pieces then skip the global keys).
    O(N G D) work."""

    tokens: Tensor

    def tables(self, n: int, device: torch.device) -> tuple[Tensor, ...]:
        """is_global (bool (N,)): True at the global positions."""
        is_global = torch.zeros(n, dtype=torch.bool, device=device)
        is_global[self.tokens.to(device)] = True
        return (is_global,)

    def rule(self, n: int, device: torch.device,
             tables: tuple[Tensor, ...] | None = None) -> Rule:
        (is_global,) = self.tables(n, device) if tables is None else tables

        def allowed(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return is_global[i] | is_global[j]

        return allowed


Piece = Band | Blocks | Columns | Summary | Globals


def union(pieces: Sequence[Piece], n: int, device: torch.device,
          tables: Sequence[tuple[Tensor, ...]] | None = None) -> Rule:
    """The rule of the union of ``pieces`` over N = ``n`` aligned positions, reading each
    piece's ``tables`` (:meth:`Blocks.tables`; built here when None)."""
    if tables is None:
        tables = [piece.tables(n, device) for piece in pieces]
    rules = [piece.rule(n, device, found) for piece, found in zip(pieces, tables, strict=True)]

    def allowed(h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        ok = rules[0](h, i, j)
        for rule in rules[1:]:
            ok = ok | rule(h, i, j)
        return ok

    return allowed


def dense_mask(pieces: Sequence[Piece], heads: int, n: int,
               device: torch.device | None = None) -> Tensor:
    """The union of ``pieces`` as an explicit bool (H, N, N) mask (for tests and small N)."""
    device = torch.device("cpu") if device is None else device
    pos = torch.arange(n, device=device)
    h = torch.arange(heads, device=device)[:, None, None]
    return union(pieces, n, device)(h, pos[None, :, None], pos[None, None, :]).expand(
        heads, n, n)


def check_pieces(pieces: Sequence[Piece], heads: int, n: int, softcap: float | None) -> None:
    """The refusals every strategy shares: a ValueError for a bad band, key blocks of the wrong
    shape, more than one :class:`Globals`, or a soft cap with :class:`Summary` or
    :class:`Globals` pieces (the CPU engine's dense pieces have no capped backward); TypeError
    for a non-piece."""
    for piece in pieces:
        if not isinstance(piece, Piece):
            raise TypeError(f"not a piece of a sparse pattern: {piece!r}")
        if isinstance(piece, Band) and (piece.left < 0 or piece.right < 0 or piece.dilation < 1):
            raise ValueError(
                f"banded_attention needs left, right >= 0 and dilation >= 1, got "
                f"left={piece.left}, right={piece.right}, dilation={piece.dilation}"
            )
        if isinstance(piece, Blocks) and piece.key_blocks is not None:
            nq = -(-n // piece.block_size)
            shape = piece.key_blocks.shape
            if piece.key_blocks.dim() not in (2, 3) or shape[-2] != nq or (
                piece.key_blocks.dim() == 3 and shape[0] not in (1, heads)
            ):
                raise ValueError(
                    f"key_blocks must have shape (nq, K) or (H, nq, K) with nq={nq}, H={heads}, "
                    f"got {tuple(shape)}"
                )
    tokens = [piece for piece in pieces if isinstance(piece, Globals)]
    if len(tokens) > 1:
        raise ValueError(f"sparse_attention takes at most one Globals piece, got {len(tokens)}")
    dense = [type(piece).__name__ for piece in pieces if isinstance(piece, Summary | Globals)]
    if softcap is not None and dense:
        raise ValueError(f"sparse_attention: softcap={softcap} is not supported with "
                         f"{' or '.join(dense)} pieces")
