"""Sparse Transformer patterns, strided and fixed (Child et al. 2019, "Generating Long Sequences
with Sparse Transformers").

With stride s (default ``round(sqrt(N))`` at call time), query i attends to key j when
- ``sparse-strided``: ``|i - j| < s`` or ``(i - j) % s == 0``;
- ``sparse-fixed``: ``j // s == i // s`` (same block) or ``j % s >= s - c`` (the last c
  "summary" positions of every block);
and, with ``causal=True`` (the paper's setting), ``j <= i``. Without ``causal`` the same rules
hold in both directions (the bidirectional form; the paper only uses the causal one).
``stride >= N`` gives exact softmax (causal or not).

Computed as two disjoint pieces merged by log-sum-exp, never by masking an N x N matrix:
- strided: the band ``|i - j| < s`` (:func:`effattn.sparse.banded_attention`), plus the column
  part: positions laid out as an (N / s, s) grid, each residue column attends within itself to
  the other rows (earlier rows when causal);
- fixed: the block-diagonal part (blocks of s), plus every query against the summary positions of
  the other blocks (earlier blocks when causal).
O(N (s + N / s) D) for strided and O(N (s + c N / s) D) for fixed: O(N^1.5 D) at s = sqrt(N).
q, k: (B, H, N, D), v: (B, H, N, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.base import AttentionMethod, check_positive_int, compute_dtype
from effattn.registry import MethodSpec, register
from effattn.sparse import banded_attention, block_gather_attention, dense_partial, merge_partials


def default_stride(n: int) -> int:
    """round(sqrt(N)), at least 1."""
    return max(1, round(math.sqrt(n)))


def _grid(x: Tensor, rows: int, s: int) -> Tensor:
    """(B, H, N, D) -> (B, H, rows, s, D), zero-padded to rows * s positions."""
    return F.pad(x, (0, 0, 0, rows * s - x.shape[2])).reshape(*x.shape[:2], rows, s, -1)


def _padding_grid(key_padding_mask: Tensor | None, b: int, n: int, rows: int, s: int,
                  device: torch.device) -> Tensor:
    """(B, rows, s) bool, True for padded keys and for the positions added to fill the grid."""
    ignore = torch.ones(b, rows * s, dtype=torch.bool, device=device)
    ignore[:, :n] = False if key_padding_mask is None else key_padding_mask
    return ignore.reshape(b, rows, s)


def strided_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    stride: int | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Strided Sparse Transformer attention (see the module docstring)."""
    b, h, n, _ = q.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = min(default_stride(n) if stride is None else stride, n)
    band = banded_attention(
        q, k, v, left=s - 1, right=0 if causal else s - 1, key_mask=key_padding_mask, scale=scale
    )
    rows = -(-n // s)
    if rows == 1:
        return band[0]
    # Column part: in the (rows, s) grid, i - j is a nonzero multiple of s exactly when i and j
    # share a column and sit in different rows.
    ignore = _padding_grid(key_padding_mask, b, n, rows, s, q.device).transpose(1, 2)
    row = torch.arange(rows, device=q.device)
    other_rows = row[None, :] < row[:, None] if causal else row[None, :] != row[:, None]
    key_ok = ~ignore[:, None, :, None, :]

    def allowed(r0: int, r1: int) -> Tensor:
        return key_ok & other_rows[r0:r1]

    def columns(x: Tensor) -> Tensor:
        return _grid(x, rows, s).transpose(2, 3)

    out, lse = dense_partial(
        columns(q), columns(k), columns(v), allowed, scale=scale,
        key_prefix=(lambda r0, r1: r1 - 1) if causal else None,
    )
    out = out.transpose(2, 3).reshape(b, h, rows * s, -1)[:, :, :n]
    lse = lse.transpose(2, 3).reshape(b, h, rows * s)[:, :, :n]
    return merge_partials([band, (out, lse)])[0]


def fixed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    stride: int | None = None,
    c: int = 8,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Fixed Sparse Transformer attention (see the module docstring)."""
    b, h, n, _ = q.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = min(default_stride(n) if stride is None else stride, n)
    c = min(c, s)
    rows = -(-n // s)
    # Causal within the own block: key j <= query a, the same in every block.
    earlier = torch.ones(s, s, dtype=torch.bool, device=q.device).tril() if causal else None
    own = block_gather_attention(
        q, k, v, torch.arange(rows, device=q.device)[:, None], block_size=s, scale=scale,
        key_mask=key_padding_mask, pattern=earlier,
    )
    if rows == 1:
        return own[0]
    # Summary keys: the last c positions of every block, (B, H, rows * c, D).
    ignore = _padding_grid(key_padding_mask, b, n, rows, s, q.device)[:, :, s - c :]
    key_ok = ~ignore.reshape(b, 1, 1, rows * c)
    key_block = torch.arange(rows, device=q.device).repeat_interleave(c)
    query_block = torch.arange(n, device=q.device)[:, None] // s

    def allowed(r0: int, r1: int) -> Tensor:
        qb = query_block[r0:r1]
        return key_ok & ((key_block < qb) if causal else (key_block != qb))

    def summary(x: Tensor) -> Tensor:
        return _grid(x, rows, s)[:, :, :, s - c :].reshape(b, h, rows * c, -1)

    summaries = dense_partial(
        q, summary(k), summary(v), allowed, scale=scale,
        key_prefix=(lambda r0, r1: (r1 - 1) // s * c) if causal else None,
    )
    return merge_partials([own, summaries])[0]


class _SparseTransformerAttention(AttentionMethod):
    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, stride):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.stride = None if stride is None else check_positive_int("stride", stride)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stride={self.stride}"


class StridedAttention(_SparseTransformerAttention):
    """Strided pattern: a band of s plus every s-th earlier position."""

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dtype = compute_dtype(q.dtype)
        return strided_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), stride=self.stride, causal=causal,
            key_padding_mask=key_padding_mask, scale=self.scale,
        )


class FixedAttention(_SparseTransformerAttention):
    """Fixed pattern: own block of s plus the last c positions of every block."""

    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, stride, c):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale, stride=stride)
        self.c = check_positive_int("c", c)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, c={self.c}"

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dtype = compute_dtype(q.dtype)
        return fixed_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), stride=self.stride, c=self.c, causal=causal,
            key_padding_mask=key_padding_mask, scale=self.scale,
        )


def _strided_reference(
    module: StridedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Masked softmax over the explicit N x N strided pattern."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.sparse_strided_attention(
        q, k, v, stride=module.stride, causal=causal, key_padding_mask=key_padding_mask,
        scale=module.scale,
    )


def _fixed_reference(
    module: FixedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Masked softmax over the explicit N x N fixed pattern."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.sparse_fixed_attention(
        q, k, v, stride=module.stride, c=module.c, causal=causal,
        key_padding_mask=key_padding_mask, scale=module.scale,
    )


_REFUSALS = {
    "cross": "the pattern is defined over aligned query and key positions (N == M)",
    "decoding": "the strided/summary keys reach back over the whole prefix, so a step needs "
    "the full KV cache (use softmax's step); no fixed-size state",
    "sequence_parallel": "the strided and summary keys of a query lie on every earlier rank: "
    "each rank would need all of K and V, and no strategy computes the pattern over them",
}

register(
    MethodSpec(
        name="sparse-strided",
        summary="Sparse Transformer strided pattern: band of s plus every s-th position",
        paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers",
        complexity="O(N (s + N/s) D) time and memory; O(N^1.5 D) at s = sqrt(N)",
        causal=True,
        padding_mask=True,
        cross=False,
        decoding=False,
        options={"stride": None},
        published={"lra_listops": 17.07},
        refusals=_REFUSALS,
        reference=_strided_reference,
    ),
    StridedAttention,
)

register(
    MethodSpec(
        name="sparse-fixed",
        summary="Sparse Transformer fixed pattern: own block of s plus c summary positions "
        "per block",
        paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers",
        complexity="O(N (s + c N/s) D) time and memory; O(c N^1.5 D) at s = sqrt(N)",
        causal=True,
        padding_mask=True,
        cross=False,
        decoding=False,
        options={"stride": None, "c": 8},
        published={"lra_listops": 17.07},
        refusals=_REFUSALS,
        reference=_fixed_reference,
    ),
    FixedAttention,
)
