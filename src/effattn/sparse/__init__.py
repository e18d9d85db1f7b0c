"""The shared blockwise engine of the structured sparse patterns.

See :mod:`effattn.sparse.blockwise`; :mod:`effattn.sparse.parallel` is the sequence-parallel
strategy of banded methods (halos).
"""

from effattn.sparse.blockwise import (
    Band,
    Blocks,
    Columns,
    Globals,
    Summary,
    band_block_size,
    banded_attention,
    block_gather_attention,
    engine_dtype,
    sparse_attention,
)

__all__ = [
    "Band",
    "Blocks",
    "Columns",
    "Globals",
    "Summary",
    "band_block_size",
    "banded_attention",
    "block_gather_attention",
    "engine_dtype",
    "sparse_attention",
]
