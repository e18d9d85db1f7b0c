"""The shared blockwise engine of the structured sparse patterns.

See :mod:`effattn.sparse.blockwise`.
"""

from effattn.sparse.blockwise import (
    band_block_size,
    banded_attention,
    block_gather_attention,
    dense_partial,
    masked_partial,
    masked_scores,
    merge_partials,
)

__all__ = [
    "band_block_size",
    "banded_attention",
    "block_gather_attention",
    "dense_partial",
    "masked_partial",
    "masked_scores",
    "merge_partials",
]
