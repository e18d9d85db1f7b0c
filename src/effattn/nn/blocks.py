"""Pre-norm Transformer blocks with a pluggable attention method.

x = x + Attn(LN(x)); [x = x + CrossAttn(LN(x), memory)]; x = x + FFN(LN(x))  (pre-norm, as in
Xiong et al. 2020, which trains stably without warm-up tricks at any depth used here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from effattn.nn.attention import CrossState, MultiheadAttention, layer_seed
from effattn.registry import DEFAULT_METHOD, spec


class FeedForward(nn.Sequential):
    """Linear(d, ff_mult d) -> GELU -> Linear(ff_mult d, d) -> Dropout."""

    def __init__(self, d_model: int, ff_mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__(nn.Linear(d_model, ff_mult * d_model), nn.GELU(),
                         nn.Linear(ff_mult * d_model, d_model), nn.Dropout(dropout))


@dataclass
class BlockState:
    """Decoding state of one block: the self-attention method's state, the projected memory."""

    self_state: Any = None
    cross: CrossState | None = None


class TransformerBlock(nn.Module):
    """One pre-norm block: self-attention (causal or not), optional cross-attention, FFN.

    Args:
        d_model, num_heads: width and heads.
        method: mechanism of the self-attention.
        causal: causal self-attention (decoder).
        cross: add a cross-attention sub-layer over a memory (encoder-decoder).
        cross_method: mechanism of the cross-attention (default ``method``); it gets ``options``
            without those that turn on causal-only call inputs when it is ``method``, none
            otherwise.
        ff_mult, dropout: FFN width multiple, dropout on every residual branch.
        max_len, seed: passed to the mechanisms.
        **options: the self-attention mechanism's options.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        method: str = DEFAULT_METHOD,
        *,
        causal: bool = False,
        cross: bool = False,
        cross_method: str | None = None,
        ff_mult: int = 4,
        dropout: float = 0.0,
        max_len: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.causal = causal
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiheadAttention(d_model, num_heads, batch_first=True, method=method,
                                            max_len=max_len, seed=layer_seed(seed, 0), **options)
        self.cross_attn = None
        if cross:
            cross_method = method if cross_method is None else cross_method
            # Causal-only call inputs (a gate) do not exist in cross-attention: it goes without.
            cross_options = (spec(method).non_causal_options(options) if cross_method == method
                             else {})
            self.norm_cross = nn.LayerNorm(d_model)
            self.cross_attn = MultiheadAttention(d_model, num_heads, batch_first=True,
                                                 method=cross_method, max_len=max_len,
                                                 seed=layer_seed(seed, 1), **cross_options)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, ff_mult, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        memory: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """x (B, N, d) -> (B, N, d); ``memory`` (B, M, d) is required iff the block has cross."""
        if (memory is None) != (self.cross_attn is None):
            raise ValueError("memory must be given exactly when the block has cross-attention")
        h = self.norm1(x)
        x = x + self.drop(self.self_attn(h, key_padding_mask=key_padding_mask,
                                         need_weights=False, is_causal=self.causal)[0])
        if self.cross_attn is not None:
            h = self.norm_cross(x)
            x = x + self.drop(self.cross_attn(h, memory, memory, need_weights=False,
                                              key_padding_mask=memory_key_padding_mask)[0])
        return x + self.ff(self.norm2(x))

    def start(
        self, memory: Tensor | None = None, memory_key_padding_mask: Tensor | None = None
    ) -> BlockState:
        """A fresh decoding state (projecting ``memory`` once if the block has cross)."""
        if (memory is None) != (self.cross_attn is None):
            raise ValueError("memory must be given exactly when the block has cross-attention")
        if self.cross_attn is None:
            return BlockState()
        return BlockState(cross=self.cross_attn.cross_state(
            memory, key_padding_mask=memory_key_padding_mask))

    def step(self, x: Tensor, state: BlockState) -> tuple[Tensor, BlockState]:
        """One decoding step x (B, 1, d); equals :meth:`forward` (causal) at that position."""
        return self._decode(x, state, "step")

    def prefill(self, x: Tensor, state: BlockState) -> tuple[Tensor, BlockState]:
        """A block of L tokens x (B, L, d) continuing ``state``; equals L calls to :meth:`step`."""
        return self._decode(x, state, "prefill")

    def _decode(self, x: Tensor, state: BlockState, how: str) -> tuple[Tensor, BlockState]:
        if not self.causal:
            raise ValueError(f"{how} needs a causal block")
        o, state.self_state = getattr(self.self_attn, how)(self.norm1(x), state.self_state)
        x = x + self.drop(o)
        if self.cross_attn is not None:
            x = x + self.drop(self.cross_attn.cross_step(self.norm_cross(x), state.cross))
        return x + self.ff(self.norm2(x)), state


def check_capability(method: str, capability: str, what: str) -> None:
    """``ValueError`` with the spec's reason when ``method`` cannot do ``capability``."""
    method_spec = spec(method)
    if not getattr(method_spec, capability):
        raise ValueError(
            f"{what} needs {capability.replace('_', ' ')} attention, which {method} cannot do: "
            f"{method_spec.refusals[capability]}"
        )
