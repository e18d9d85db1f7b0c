"""The shared blockwise engine of the structured sparse patterns.

See :mod:`effattn.sparse.blockwise`; :mod:`effattn.sparse.parallel` is the sequence-parallel
strategy of banded methods (halos).
"""

from effattn.sparse.blockwise import (
    Band,
    band_block_size,
    banded_attention,
    block_gather_attention,
    dense_partial,
    masked_partial,
    masked_scores,
    merge_partials,
)

__all__ = [
    "Band",
    "band_block_size",
    "banded_attention",
    "block_gather_attention",
    "dense_partial",
    "masked_partial",
    "masked_scores",
    "merge_partials",
]
