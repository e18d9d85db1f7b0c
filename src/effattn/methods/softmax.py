"""Exact scaled dot-product attention, through PyTorch's fused ``scaled_dot_product_attention``.

out = softmax(scale * q k^T + mask) v  (Vaswani et al. 2017, "Attention Is All You Need").
q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.base import AttentionMethod
from effattn.registry import MethodSpec, register


def visible_rows(key_padding_mask: Tensor, n: int, causal: bool) -> Tensor:
    """(B, 1, N, 1) bool: does query i see at least one unpadded key?

    A query whose visible keys are all padding has an empty softmax; it outputs zeros.
    """
    unpadded = ~key_padding_mask
    if causal:
        seen = unpadded.cumsum(-1)[:, :n] > 0
    else:
        seen = unpadded.any(-1, keepdim=True).expand(-1, n)
    return seen[:, None, :, None]


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Exact attention; rows with no visible key give 0 instead of NaN."""
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    n, m = q.shape[2], k.shape[2]
    keep = ~key_padding_mask[:, None, None, :]
    if causal:
        keep = keep & torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    return out.masked_fill(~visible_rows(key_padding_mask, n, causal), 0.0)


@dataclass
class KVCache:
    """Keys and values seen so far, in buffers that grow by doubling (amortised O(1) appends).

    k: (B, H, capacity, D), v: (B, H, capacity, Dv); the first ``length`` positions are valid.
    """

    k: Tensor
    v: Tensor
    length: int

    def append(self, k: Tensor, v: Tensor) -> None:
        if self.length == self.k.shape[2]:
            capacity = 2 * self.k.shape[2]
            self.k = _grow(self.k, capacity)
            self.v = _grow(self.v, capacity)
        self.k[:, :, self.length] = k[:, :, 0]
        self.v[:, :, self.length] = v[:, :, 0]
        self.length += 1

    def nbytes(self) -> int:
        """Bytes held by the cache (its full capacity, which is what it occupies)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def _grow(buf: Tensor, capacity: int) -> Tensor:
    out = buf.new_empty(*buf.shape[:2], capacity, buf.shape[3])
    out[:, :, : buf.shape[2]] = buf
    return out


class SoftmaxAttention(AttentionMethod):
    """Exact softmax attention (the reference every other method is measured against)."""

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        return softmax_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=self.scale
        )

    def _step(self, q, k, v, state):
        if state is None:
            state = KVCache(q.new_empty(*k.shape[:2], 16, k.shape[3]),
                            q.new_empty(*v.shape[:2], 16, v.shape[3]), 0)
        elif not isinstance(state, KVCache):
            raise ValueError(f"softmax state must be a KVCache, got {type(state).__name__}")
        state.append(k, v)
        n = state.length
        out = F.scaled_dot_product_attention(
            q, state.k[:, :, :n], state.v[:, :, :n], scale=self.scale
        )
        return out, state


register(
    MethodSpec(
        name="softmax",
        summary="exact scaled dot-product attention (fused SDPA)",
        paper="Vaswani et al. 2017, Attention Is All You Need",
        complexity="O(N M D) time, O(N + M) memory with the fused kernel",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
    ),
    SoftmaxAttention,
)
