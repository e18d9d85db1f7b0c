"""Sparse Transformer patterns, strided and fixed (Child et al. 2019, "Generating Long Sequences
with Sparse Transformers").

With stride s (default ``round(sqrt(N))`` at call time), query i attends to key j when
- ``sparse-strided``: ``|i - j| < s`` or ``(i - j) % s == 0``;
- ``sparse-fixed``: ``j // s == i // s`` (same block) or ``j % s >= s - c`` (the last c
  "summary" positions of every block);
and, with ``causal=True`` (the paper's setting), ``j <= i``. Without ``causal`` the same rules
hold in both directions (the bidirectional form; the paper only uses the causal one).
``stride >= N`` gives exact softmax (causal or not).

Computed as two disjoint pieces of :func:`effattn.sparse.sparse_attention` (one softmax over
their union, FlashAttention-style: the backward recomputes the scores), never by masking an
N x N matrix:
- strided: the band ``|i - j| < s`` (:class:`effattn.sparse.Band`), plus the columns
  (:class:`effattn.sparse.Columns`): each residue class mod s attends within itself to its other
  positions (earlier ones when causal);
- fixed: the block-diagonal part (:class:`effattn.sparse.Blocks` of s), plus every query against
  the summary positions of the other blocks (:class:`effattn.sparse.Summary`; earlier blocks when
  causal).
O(N (s + N / s) D) for strided and O(N (s + c N / s) D) for fixed: O(N^1.5 D) at s = sqrt(N).
q, k: (B, H, N, D), v: (B, H, N, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from effattn.base import AttentionMethod, check_positive_int
from effattn.registry import MethodSpec, register
from effattn.sparse import Band, Blocks, Columns, Summary, engine_dtype, sparse_attention


def default_stride(n: int) -> int:
    """round(sqrt(N)), at least 1."""
    return max(1, round(math.sqrt(n)))


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
    n = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = min(default_stride(n) if stride is None else stride, n)
    pieces = [Band(s - 1, 0 if causal else s - 1), Columns(s, causal)]
    return sparse_attention(q, k, v, pieces, scale=scale, key_mask=key_padding_mask)[0]


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
    n = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = min(default_stride(n) if stride is None else stride, n)
    # Causal within the own block: key j <= query a, the same in every block.
    earlier = torch.ones(s, s, dtype=torch.bool).tril() if causal else None
    pieces = [Blocks(None, s, earlier), Summary(s, c, causal)]
    return sparse_attention(q, k, v, pieces, scale=scale, key_mask=key_padding_mask)[0]


class _SparseTransformerAttention(AttentionMethod):
    engine_reads_values = True  # stateless: the banded engine reads it before its kernel

    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, stride):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.stride = None if stride is None else check_positive_int("stride", stride)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stride={self.stride}"


class StridedAttention(_SparseTransformerAttention):
    """Strided pattern: a band of s plus every s-th earlier position."""

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dtype = engine_dtype(q.dtype, q.device)
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
        dtype = engine_dtype(q.dtype, q.device)
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
        complexity="O(N (s + N/s) D) time, O(N D) memory; O(N^1.5 D) at s = sqrt(N)",
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
        complexity="O(N (s + c N/s) D) time, O(N D) memory; O(c N^1.5 D) at s = sqrt(N)",
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
