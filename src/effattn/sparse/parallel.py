"""Sequence parallelism of banded attention: the ranks exchange the tokens at their borders.

Rank r of P holds the contiguous slice r of the sequence (see :mod:`effattn.parallel`). Query i
of a band needs keys i - left .. i + right: every rank all-gathers the last ``left`` and the
first ``right`` tokens of every slice (a halo, O(P (left + right)) tokens per rank, independent
of N) and attends over [halo before, own slice, halo after]. Slices shorter than the band take
their context from several neighbouring ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.base import compute_dtype
from effattn.parallel import SequenceGroup, SequenceStrategy
from effattn.sparse.blockwise import Band, banded_attention


class Banded(Protocol):
    """A module whose forward is :func:`banded_attention` over ``band(causal)`` at ``scale``."""

    scale: float

    def band(self, causal: bool) -> Band: ...


class Halo(SequenceStrategy):
    """The strategy of a :class:`Banded` method (see the module docstring)."""


    def attend(
        self,
        attn: Banded,
        group: SequenceGroup,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        sliding_window: int | None = None,
    ) -> Tensor:
        """The band over [halo before, own slice, halo after]. The halo queries are zeros whose
        outputs are dropped: the banded kernel needs aligned queries and keys, and they cost
        (left + right) / n_r of the work. A ``sliding_window`` the method takes is its own band
        (its ``validate`` refuses any other), so the band is all there is to compute."""
        dt = compute_dtype(q.dtype)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        band = attn.band(causal)
        left, right = band.left, band.right
        n, d = q.shape[2], k.shape[-1]
        kv = torch.cat([k, v], -1)
        mask = key_padding_mask
        before = after = kv[:, :, :0]
        mask_before = mask_after = None if mask is None else mask[:, :0]
        if left + right:
            before, after = halos(kv, group, left, right)
            if mask is not None:
                mask_before, mask_after = halos(mask[:, None, :, None], group, left, right)
                mask_before, mask_after = mask_before[:, 0, :, 0], mask_after[:, 0, :, 0]
        k_ext = torch.cat([before, kv, after], 2)
        q_ext = F.pad(q, (0, 0, before.shape[2], after.shape[2]))
        mask_ext = None if mask is None else torch.cat([mask_before, mask, mask_after], 1)
        out, _ = banded_attention(
            q_ext, k_ext[..., :d], k_ext[..., d:], left=left, right=right,
            dilation=band.dilation, key_mask=mask_ext, scale=attn.scale,
        )
        return out[:, :, before.shape[2] : before.shape[2] + n]


def halos(x: Tensor, group: SequenceGroup, left: int, right: int) -> tuple[Tensor, Tensor]:
    """The ``left`` tokens before this rank's slice and the ``right`` after it (fewer at the
    ends of the sequence), from one all-gather of every slice's last ``left`` and first
    ``right`` tokens. x: (B, H, n_r, X); returns (B, H, <= left, X), (B, H, <= right, X)."""
    n = x.shape[2]
    tail = F.pad(x[:, :, n - min(left, n):], (0, 0, left - min(left, n), 0))
    head = F.pad(x[:, :, : min(right, n)], (0, 0, 0, right - min(right, n)))
    gathered = group.all_gather(torch.cat([tail, head], 2))
    r, lengths = group.rank, group.lengths
    # Slices shorter than the halo contribute all their tokens; the context is the end of the
    # concatenated tails before r and the start of the heads after r.
    tails = [g[:, :, left - min(left, m) : left]
             for g, m in zip(gathered[:r], lengths[:r], strict=True)]
    heads = [g[:, :, left : left + min(right, m)]
             for g, m in zip(gathered[r + 1 :], lengths[r + 1 :], strict=True)]
    before = torch.cat([x[:, :, :0], *tails], 2)
    after = torch.cat([x[:, :, :0], *heads], 2)
    return before[:, :, before.shape[2] - min(left, before.shape[2]):], after[:, :, :right]
