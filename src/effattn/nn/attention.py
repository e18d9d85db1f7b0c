"""Multi-head attention with a pluggable mechanism, shaped like ``torch.nn.MultiheadAttention``.

out = W_o · concat_h attn_h(x_q W_q^h, x_k W_k^h, x_v W_v^h) + b_o, where attn is any registered
method (``effattn.methods()``). Inputs are (B, N, E) with ``batch_first=True`` (the default here)
or (N, B, E) otherwise; the call returns ``(out, None)`` like torch's, since efficient methods never
form the N x M attention weights.

Two kinds of mechanism change the layer itself, as their spec's ``layer`` hints say:

- a gated one (gated RFA, ``gated=True``): a per-head gate g = sigmoid(x W_g + b_g), (B, H, N),
  computed from the query input and handed to the mechanism as ``gate=`` (Peng et al. 2021, eq. 7).
- a parameter-free mixer (FNet's 2-D Fourier transform), which has no queries, keys or values. The
  layer has no projections at all and mixes the full embedding (one "head" of size E), as in
  Lee-Thorp et al. 2021; ``num_heads`` is only checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from effattn.registry import DEFAULT_METHOD, build, spec


@dataclass
class CrossState:
    """A decoder's cross-attention memory, prepared once per source.

    ``memory`` is the mechanism's own (:meth:`effattn.base.AttentionMethod.memory`): the
    projected keys and values (B, H, M, D) for most methods, the fixed-size [S, z] of the
    projected source for kernelized ones.
    """

    memory: Any


def gate_bias_init(num_heads: int) -> Tensor:
    """Initial gate biases: per-head forgetting timescales spread from 2 to 64 tokens.

    With b = 0 every gate starts at 0.5, i.e. the memory halves at each token and the layer begins
    as a purely local mixer that must learn to remember. Spreading the initial g_h = 1 - 1/tau_h
    over tau_h in [2, 64] (geometrically) starts some heads local and some long-range, the same
    idea as RetNet's per-head decay rates; training moves them freely from there.
    """
    tau = torch.logspace(1.0, 6.0, num_heads, base=2.0) if num_heads > 1 else torch.tensor([8.0])
    g = 1.0 - 1.0 / tau
    return torch.log(g / (1.0 - g))


class MultiheadAttention(nn.Module):
    """Drop-in multi-head attention whose core is ``effattn.build(method, ...)``.

    Args:
        embed_dim: E, model width; must be divisible by ``num_heads``.
        num_heads: H; each head has D = E / H.
        method: a registered mechanism name.
        batch_first: inputs (B, N, E) if True (default), (N, B, E) if False.
        bias: biases on the projections.
        kdim, vdim: feature sizes of key and value inputs (default E).
        max_len: longest sequence (needed by methods with length-dependent parameters).
        seed: fixes the mechanism's random draws.
        **options: the mechanism's own options (``effattn.spec(method).options``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        method: str = DEFAULT_METHOD,
        *,
        batch_first: bool = True,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        max_len: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        for arg, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}"
            )
        method_spec = spec(method)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.method = method
        self.batch_first = batch_first
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.gated = method_spec.layer.gated({**method_spec.options, **options})
        if method_spec.layer.parameter_free:
            if (self.kdim, self.vdim) != (embed_dim, embed_dim):
                raise ValueError(f"{method} mixes one sequence: kdim/vdim must equal embed_dim")
            self.attn = build(method, head_dim=embed_dim, heads=1, max_len=max_len, seed=seed,
                              **options)
            self.q_proj = self.k_proj = self.v_proj = self.out_proj = None
        else:
            self.attn = build(method, head_dim=self.head_dim, heads=num_heads, max_len=max_len,
                              seed=seed, **options)
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
            self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
            self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.xavier_uniform_(proj.weight)
            for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
        self.gate_proj = None
        if self.gated:
            self.gate_proj = nn.Linear(embed_dim, num_heads)
            with torch.no_grad():
                # Small input weights so the initial gates sit at their biases' timescales.
                self.gate_proj.weight.mul_(0.1)
                self.gate_proj.bias.copy_(gate_bias_init(num_heads))

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, method: str = DEFAULT_METHOD, **kwargs: Any
    ) -> MultiheadAttention:
        """A layer with ``module``'s projection weights and layout, using ``method`` inside."""
        if module.bias_k is not None or module.add_zero_attn or module.dropout:
            raise ValueError(
                "cannot convert a torch MultiheadAttention with add_bias_kv, add_zero_attn or "
                "attention dropout: efficient methods do not form attention weights"
            )
        has_bias = module.in_proj_bias is not None
        new = cls(module.embed_dim, module.num_heads, method, batch_first=module.batch_first,
                  bias=has_bias, kdim=module.kdim, vdim=module.vdim, **kwargs)
        if new.q_proj is None:
            raise ValueError(f"{method} has no projections to copy weights into")
        e = module.embed_dim
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                weights = module.in_proj_weight.split(e)
            else:
                weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
            for proj, w in zip((new.q_proj, new.k_proj, new.v_proj), weights, strict=True):
                proj.weight.copy_(w)
            if has_bias:
                for proj, b in zip((new.q_proj, new.k_proj, new.v_proj),
                                   module.in_proj_bias.split(e), strict=True):
                    proj.bias.copy_(b)
                new.out_proj.bias.copy_(module.out_proj.bias)
            new.out_proj.weight.copy_(module.out_proj.weight)
        return new.to(module.out_proj.weight.device)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, method={self.method!r}, "
                f"batch_first={self.batch_first}, gated={self.gated}")

    def _check_input(self, arg: str, x: Tensor, dim: int) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
            raise ValueError(f"{arg} must be 3-D {layout} with E={dim}, got {shape}")

    def _heads(self, x: Tensor, proj: nn.Linear) -> Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge(self, o: Tensor) -> Tensor:
        b, _, n, _ = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.embed_dim))

    def _gate(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.gate_proj(x)).transpose(1, 2)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        """Attention of ``query`` over ``key``/``value`` (both default to ``query``).

        key_padding_mask: bool (B, M), True marks padding. Returns ``(out, None)``; out has the
        layout of ``query``.
        """
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: efficient attention methods never form the "
                "attention weights; call with need_weights=False"
            )
        if attn_mask is not None:
            raise ValueError(
                "attn_mask is not supported (arbitrary masks break sub-quadratic methods); use "
                "is_causal=True for causal masking and key_padding_mask for padding"
            )
        self_attention = key is None and value is None
        key = query if key is None else key
        value = key if value is None else value
        self._check_input("query", query, self.embed_dim)
        self._check_input("key", key, self.kdim)
        self._check_input("value", value, self.vdim)
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if query.shape[0] != key.shape[0] or key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"query, key, value disagree in batch or length: query {tuple(query.shape)}, "
                f"key {tuple(key.shape)}, value {tuple(value.shape)} (batch_first=True layout)"
            )
        kwargs = {}
        if self.gated:
            if not (self_attention or (key is query and value is query)):
                raise ValueError("a gated method is defined for causal self-attention only")
            kwargs["gate"] = self._gate(query)
        if self.q_proj is None:
            if not (key is query and value is query):
                raise ValueError(f"{self.method} mixes one sequence: key/value must be the query")
            x = query[:, None]
            out = self.attn(x, x, x, causal=is_causal, key_padding_mask=key_padding_mask)[:, 0]
        else:
            o = self.attn(self._heads(query, self.q_proj), self._heads(key, self.k_proj),
                          self._heads(value, self.v_proj), causal=is_causal,
                          key_padding_mask=key_padding_mask, **kwargs)
            out = self._merge(o)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def step(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        """One step of causal self-attention for decoding: x (B, 1, E) (or (1, B, E)).

        ``state`` is the mechanism's own decoding state (``None`` to start): a KV cache for
        softmax, a fixed-size (S, z) for kernelized methods. Feeding a sequence one token at a time
        equals ``forward(x, is_causal=True)``. Returns ``(out, state)``.
        """
        return self._decode(x, state, "step")

    def prefill(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        """Causal self-attention over a block x (B, L, E) that continues ``state``, in the
        mechanism's parallel form; equals L calls to :meth:`step`. Returns ``(out, state)``."""
        return self._decode(x, state, "prefill")

    def _decode(self, x: Tensor, state: Any, how: str) -> tuple[Tensor, Any]:
        self._check_input("x", x, self.embed_dim)
        if not self.batch_first:
            x = x.transpose(0, 1)
        if how == "step" and x.shape[1] != 1:
            raise ValueError(f"step takes one token per sequence, got x of shape {tuple(x.shape)}")
        if self.q_proj is None:
            reason = spec(self.method).refusals.get("decoding", "not supported")
            raise ValueError(f"{self.method} cannot do recurrent decoding ({how}): {reason}")
        kwargs = {"gate": self._gate(x)} if self.gated else {}
        o, state = getattr(self.attn, how)(self._heads(x, self.q_proj),
                                           self._heads(x, self.k_proj),
                                           self._heads(x, self.v_proj), state, **kwargs)
        out = self._merge(o)
        return (out if self.batch_first else out.transpose(0, 1)), state

    def cross_state(
        self, key: Tensor, value: Tensor | None = None, key_padding_mask: Tensor | None = None
    ) -> CrossState:
        """Project the memory key (B, M, kdim) and value (default: key) once for
        :meth:`cross_step` during decoding."""
        if self.q_proj is None:
            raise ValueError(f"{self.method} has no cross-attention form")
        value = key if value is None else value
        self._check_input("key", key, self.kdim)
        self._check_input("value", value, self.vdim)
        if not self.batch_first:
            key, value = key.transpose(0, 1), value.transpose(0, 1)
        return CrossState(self.attn.memory(self._heads(key, self.k_proj),
                                           self._heads(value, self.v_proj), key_padding_mask))

    def cross_step(self, x: Tensor, state: CrossState) -> Tensor:
        """Cross-attention of decoder queries x (B, L, E) (one step: L = 1) over a projected
        memory."""
        self._check_input("x", x, self.embed_dim)
        if not self.batch_first:
            x = x.transpose(0, 1)
        o = self.attn.attend_memory(self._heads(x, self.q_proj), state.memory)
        out = self._merge(o)
        return out if self.batch_first else out.transpose(0, 1)
