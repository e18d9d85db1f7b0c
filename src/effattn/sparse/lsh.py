"""The layout of reformer's LSH rounds: what hashing and sorting hand to the chunks, whichever
strategy computes them (the mechanism's batched form, :mod:`effattn.sparse.lsh_flex`).

Plain data, importing nothing beyond torch, so that the mechanism can build it at import time
while FlexAttention's module loads only where that strategy runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class Layout:
    """Every round's chunks of queries and windows of keys (n chunks per round).

    rows (B, H, R, n, C): query held by each chunk slot, -1 if none; q_slot (B, H, R, N): slot
    (chunk·C + row) of each query. cols (B, H, R, n, W): key in each window column, col_ok
    whether that column holds a real (in range, unpadded) key. q_code (B, H, R, N) and
    k_code (B, H, R, M), int64: key j is a candidate of query i in round r by the hash part of
    the rule iff 0 <= k_code - q_code < span (positions and padding aside).
    """

    rows: Tensor
    q_slot: Tensor
    cols: Tensor
    col_ok: Tensor
    q_code: Tensor
    k_code: Tensor
    span: int
