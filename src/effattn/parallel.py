"""The contract between a method's sequence-parallel strategy and ``effattn.distributed``.

A sequence of N tokens is split across P ranks: rank r holds the contiguous slice r of q, k, v
(B, H, n_r, D), of the key padding mask (B, n_r) and of the call inputs, and receives its slice
of the output. How a method computes its slice is its spec's ``sequence_parallel``, a
:class:`SequenceStrategy` that the method's engine provides (the kernelized core exchanges
fixed-size key states, the banded engine exchanges halos, exact softmax gathers the keys);
``effattn.distributed.SequenceParallel`` checks that the ranks agree, then hands the strategy a
:class:`SequenceGroup`: where the slices lie and the collectives over the ranks. So neither side
knows the other: no strategy imports torch.distributed, and the distributed package names no
method or engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from effattn.base import AttentionMethod


class SequenceGroup(ABC):
    """The ranks one sequence is split over, as a strategy sees them.

    ``rank`` is this rank's index and ``lengths`` every rank's slice length n_r, in order.
    Every rank must make the same collective calls in the same order: each one waits for its
    partners. The differentiable collectives pass gradients back to the rank that sent: the
    gradient of what rank r sent is the sum, over the ranks, of the gradients of what they
    received from it.
    """

    def __init__(self, rank: int, lengths: tuple[int, ...]) -> None:
        self.rank = rank
        self.lengths = lengths

    @property
    def size(self) -> int:
        """P, the number of ranks."""
        return len(self.lengths)

    @property
    def offset(self) -> int:
        """Position of this rank's first token in the whole sequence."""
        return sum(self.lengths[: self.rank])

    @property
    def total(self) -> int:
        """N, the length of the whole sequence."""
        return sum(self.lengths)

    @abstractmethod
    def all_gather(self, x: Tensor) -> Tensor:
        """(P, *x.shape): rank r's x at index r, on every rank; differentiable when x is
        floating point (a bool or integer x travels without gradient)."""

    @abstractmethod
    def all_reduce_sum(self, x: Tensor) -> Tensor:
        """Σ_r x_r, the same on every rank; differentiable."""

    @abstractmethod
    def all_reduce_max(self, x: Tensor) -> Tensor:
        """max_r x_r elementwise, without gradient (for stabiliser scales, which cancel)."""


class SequenceStrategy(ABC):
    """How a method computes attention over a sequence split across ranks: the value of its
    spec's ``sequence_parallel`` (None there: it cannot be split, for the reason in
    ``refusals["sequence_parallel"]``).
    """

    @abstractmethod
    def attend(
        self,
        attn: AttentionMethod,
        group: SequenceGroup,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        **call: Tensor,
    ) -> Tensor:
        """This rank's slice (B, H, n_r, Dv) of ``attn`` over the whole sequence.

        q, k (B, H, n_r, D), v (B, H, n_r, Dv), key_padding_mask (B, n_r) and the call inputs
        given (``call``) are this rank's slices, already validated (``attn.validate``) and
        agreed between the ranks; ``attn.prepare_call`` has run. The result equals the slice
        of ``attn(q, k, v, ...)`` on the whole sequence, up to rounding, in any dtype (the
        caller casts it to q's).
        """
