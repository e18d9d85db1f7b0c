"""Longformer attention: a sliding window plus global tokens (Beltagy et al. 2020).

Query i attends to key j when ``|i - j| <= window // 2``, or i is a global token (it attends to
every key), or j is a global token (every query attends to it). ``global_tokens`` are positions.

Computed by the band engine with global tokens (:func:`effattn.sparse.banded_attention`): each
row's softmax over its band (global keys excluded) and the G global keys is merged by log-sum-exp
in place, and the G global rows are replaced by their dense row over all keys; the backward
recomputes the probabilities (FlashAttention-style) and adds the global pieces' gradients in
place. O(N (window + G) D) time, O(N D) memory kept for the backward; no N x N mask.
q, k: (B, H, N, D), v: (B, H, N, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from effattn.base import AttentionMethod, check_positive_int
from effattn.registry import Budget, MethodSpec, register
from effattn.sparse import banded_attention, engine_dtype


def check_global_tokens(global_tokens: object, n: int | None = None) -> tuple[int, ...]:
    """Sorted distinct positions; a ValueError naming global_tokens if not ints in [0, n)."""
    if isinstance(global_tokens, int) or not isinstance(global_tokens, Sequence) or any(
        isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in global_tokens
    ):
        raise ValueError(
            f"global_tokens must be a sequence of non-negative int positions, got {global_tokens!r}"
        )
    if n is not None and any(t >= n for t in global_tokens):
        raise ValueError(
            f"global_tokens {tuple(global_tokens)} has positions outside a sequence of length {n}"
        )
    return tuple(sorted(set(global_tokens)))


def longformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    global_tokens: Sequence[int],
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Window + global attention (see the module docstring); non-causal only."""
    if causal:
        raise ValueError("longformer_attention is bidirectional: causal=True is not supported")
    n = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tokens = check_global_tokens(global_tokens, n)
    out, _ = banded_attention(
        q, k, v, left=window // 2, right=window // 2, key_mask=key_padding_mask, scale=scale,
        global_tokens=torch.tensor(tokens) if tokens else None,
    )
    return out


class LongformerAttention(AttentionMethod):
    """Sliding window plus global tokens; bidirectional."""

    engine_reads_values = True  # stateless: the banded engine reads it before its kernel

    def __init__(
        self, head_dim, heads, max_len=None, seed=None, scale=None, *, window, global_tokens
    ):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.window = check_positive_int("window", window)
        self.global_tokens = check_global_tokens(global_tokens)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, global_tokens={self.global_tokens}"

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dtype = engine_dtype(q.dtype, q.device)
        return longformer_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), window=self.window,
            global_tokens=self.global_tokens, key_padding_mask=key_padding_mask, scale=self.scale,
        )


def _reference(
    module: LongformerAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Masked softmax over the explicit N x N window-plus-global pattern of the module."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.longformer_attention(
        q, k, v, window=module.window, global_tokens=module.global_tokens,
        key_padding_mask=key_padding_mask, scale=module.scale,
    )


register(
    MethodSpec(
        name="longformer",
        summary="sliding window plus global tokens that attend to and are attended by all",
        paper="Beltagy et al. 2020, Longformer: The Long-Document Transformer",
        complexity="O(N (window + G) D) time, O(N D) memory, G global tokens",
        causal=False,
        padding_mask=True,
        cross=False,
        decoding=False,
        options={"window": 128, "global_tokens": (0,)},
        budget=Budget("window", (16, 32, 64, 128, 256)),
        published={"lra_listops": 35.63},
        refusals={
            "causal": "global tokens attend to and are attended by every position "
            "(bidirectional by design); use local for a causal window",
            "cross": "a window over positions needs aligned query and key positions (N == M)",
            "decoding": "global tokens attend to the whole sequence, future included, so there "
            "is no causal recurrence",
            "sequence_parallel": "global tokens attend to and are attended by every position, "
            "on every rank",
        },
        reference=_reference,
    ),
    LongformerAttention,
)
