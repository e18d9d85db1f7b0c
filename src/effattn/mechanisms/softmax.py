"""Exact scaled dot-product attention, through PyTorch's fused ``scaled_dot_product_attention``.

out = softmax(scale * q k^T + mask) v  (Vaswani et al. 2017, "Attention Is All You Need").
q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.base import AttentionMethod
from effattn.parallel import SequenceGroup, SequenceStrategy
from effattn.registry import MethodSpec, Problem, register


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

    @classmethod
    def empty(cls, k: Tensor, v: Tensor, capacity: int = 16) -> KVCache:
        """An empty cache for keys/values shaped like k (B, H, *, D) and v (B, H, *, Dv)."""
        return cls(k.new_empty(*k.shape[:2], capacity, k.shape[3]),
                   v.new_empty(*v.shape[:2], capacity, v.shape[3]), 0)

    def extend(self, k: Tensor, v: Tensor) -> None:
        """Append L positions, k (B, H, L, D) and v (B, H, L, Dv)."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            capacity = max(2 * self.k.shape[2], 1 << (end - 1).bit_length())
            self.k = _grow(self.k, capacity)
            self.v = _grow(self.v, capacity)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end

    def nbytes(self) -> int:
        """Bytes held by the cache (its full capacity, which is what it occupies)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def nbytes_in_use(self) -> int:
        """Bytes of the positions seen; the buffers grow by doubling beyond them."""
        return self.nbytes() // self.k.shape[2] * self.length


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
        return self._prefill(q, k, v, state)

    def _prefill(self, q, k, v, state):
        if state is None:
            state = KVCache.empty(k, v)
        elif not isinstance(state, KVCache):
            raise ValueError(f"softmax state must be a KVCache, got {type(state).__name__}")
        past = state.length
        state.extend(k, v)
        keys, values = state.k[:, :, : state.length], state.v[:, :, : state.length]
        n = q.shape[2]
        if n == 1 or past == 0:
            # One new query sees every cached key; a block from the start is plain causal.
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1, scale=self.scale)
        else:
            i = torch.arange(n, device=q.device)[:, None]
            j = torch.arange(state.length, device=q.device)[None, :]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=j <= past + i, scale=self.scale
            )
        return out, state


class AllGather(SequenceStrategy):
    """Sequence parallelism of exact attention: every rank all-gathers K and V, O(N) per rank,
    and attends with its own queries over the whole sequence."""


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
    ) -> Tensor:
        d = k.shape[-1]
        kv = _gather_slices(torch.cat([k, v], -1), group)
        keys, values = kv[..., :d], kv[..., d:]
        keep = None
        if key_padding_mask is not None:
            mask = _gather_slices(key_padding_mask[:, None, :, None], group)
            keep = ~mask[:, :, None, :, 0]  # (B, 1, 1, N)
        if causal:
            i = torch.arange(group.offset, group.offset + q.shape[2], device=q.device)[:, None]
            seen = torch.arange(group.total, device=q.device)[None, :] <= i
            keep = seen if keep is None else keep & seen
        if keep is None:
            return F.scaled_dot_product_attention(q, keys, values, scale=attn.scale)
        # A query without a visible key outputs 0: its mask row is opened so that the softmax
        # stays finite (no NaN in the gradients), then its output is cleared.
        visible = keep.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep | ~visible,
                                             scale=attn.scale)
        return out.masked_fill(~visible, 0.0)


def _gather_slices(x: Tensor, group: SequenceGroup) -> Tensor:
    """Every rank's x (B, H, n_r, X), padded to the longest slice for the all-gather, joined
    along the sequence: (B, H, N, X). Differentiable when x is floating point."""
    padded = F.pad(x, (0, 0, 0, max(group.lengths) - x.shape[2]))
    gathered = group.all_gather(padded)
    return torch.cat([g[:, :, :n] for g, n in zip(gathered, group.lengths, strict=True)], 2)


def _reference(
    module: SoftmaxAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """softmax(scale q k^T) v with the explicit N x M score matrix."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.softmax_attention(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=module.scale
    )


def _flops(options: Mapping[str, Any], p: Problem) -> float:
    """2·B·H·pairs·(D + Dv): q k^T and the weights times v; causal scores N (N + 1) / 2 pairs."""
    pairs = p.n * (p.n + 1) / 2 if p.causal else p.n * p.m
    return 2.0 * p.batch * p.heads * pairs * (p.head_dim + p.value_dim)


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
        flops=_flops,
        bench_default=True,
        published={"lra_listops": 36.37},
        reference=_reference,
        sequence_parallel=AllGather(),
    ),
    SoftmaxAttention,
)
