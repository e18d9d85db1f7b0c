"""effattn methods as Hugging Face transformers attention implementations (extra ``hf``).

>>> from transformers import AutoModelForCausalLM, LlamaConfig
>>> from effattn.integrations import transformers as hf
>>> hf.register()                      # effattn-<method> for every method
>>> cfg = LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
...                   num_attention_heads=4, intermediate_size=128)
>>> cfg.effattn_options = {"num_features": 64}   # options of the method, per model
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="effattn-performer")
>>> out = model.generate(ids, max_new_tokens=16, past_key_values=hf.RecurrentCache())

Contracts of transformers 5.x this relies on (checked against 5.23.0):

- ``AttentionInterface.register(name, fn)``: the model's attention modules call
  ``fn(module, query, key, value, attention_mask, scaling=, dropout=, **kwargs)`` with
  query (B, H, N, D), key/value (B, H_kv, M, D) (H_kv divides H: grouped-query attention), and
  expect ``(out (B, N, H, Dv), weights or None)``.
- ``AttentionMaskInterface.register(name, fn)``: ``create_causal_mask`` /
  ``create_bidirectional_mask`` call ``fn(batch_size=, q_length=, kv_length=, q_offset=,
  kv_offset=, mask_function=, attention_mask=, ...)`` and hand its result to the attention
  function; see :mod:`effattn.integrations.hf_masks`.
- A model's ``Cache.update(k, v, layer_idx)`` runs right before its attention function and its
  result is what the function receives; see :mod:`effattn.integrations.hf_cache`.

One effattn module per HF attention module is built at its first call and attached to it as the
submodule ``effattn`` (so random features are in the model's ``state_dict`` and follow
``.to()``); it is rebuilt when the method, options, head shape or scaling change. Layer ``i``
gets ``seed = config.effattn_seed + i`` (``effattn_seed`` defaults to 0), so layers differ and a
model rebuilt from the same config draws the same features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import effattn
from effattn.base import AttentionMethod
from effattn.integrations.hf_cache import RecurrentCache, RecurrentLayer, RowStates, claim
from effattn.integrations.hf_masks import MaskSpec, decode_mask, effattn_mask

__all__ = ["MaskSpec", "RecurrentCache", "decode_mask", "effattn_mask", "name", "register"]

PREFIX = "effattn-"

# Keywords some models pass to their attention function that change what it computes; effattn
# cannot honour them, so they are refused rather than ignored.
_REFUSED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


def name(method: str) -> str:
    """The ``attn_implementation`` name of an effattn method: ``effattn-<method>``."""
    return PREFIX + method


def register(method: str | None = None, **options: Any) -> list[str]:
    """Register ``effattn-<method>`` in transformers' attention and mask interfaces.

    ``method=None`` registers every method of :func:`effattn.methods` with its default options;
    a name registers that method with ``options`` (e.g. ``register("performer",
    num_features=64)``), replacing an earlier registration. A model's
    ``config.effattn_options`` (a dict) overrides these per model. Returns the names
    registered. Unknown methods raise ``KeyError`` listing the valid names, unknown options
    ``TypeError`` (both from :func:`effattn.build`).
    """
    if method is None:
        if options:
            raise ValueError(f"options {sorted(options)} need a method: register(method, **opts)")
        names = effattn.methods()
    else:
        effattn.spec(method)
        names = [method]
        if "scale" in options:
            raise ValueError("scale is no option here: transformers passes each layer's scaling")
        # Options are checked now, not at the model's first forward.
        effattn.build(method, head_dim=8, heads=1, **options)
    for m in names:
        AttentionInterface.register(name(m), _attention_function(m, dict(options)))
        AttentionMaskInterface.register(name(m), effattn_mask)
    return [name(m) for m in names]


def _attention_function(method: str, options: Mapping[str, Any]) -> Callable[..., Any]:
    def effattn_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: MaskSpec | Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        return attention_forward(
            method, options, module, query, key, value, attention_mask,
            scaling=scaling, dropout=dropout, **kwargs,
        )

    effattn_attention_forward.__qualname__ = f"effattn_attention_forward[{method}]"
    return effattn_attention_forward


def attention_forward(
    method: str,
    options: Mapping[str, Any],
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: MaskSpec | Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention with effattn ``method``: q (B, H, N, D), k, v (B, H_kv, M, D) -> (B, N, H, Dv).

    The mask is a :class:`MaskSpec` from :func:`effattn_mask`, a 4-D tensor (decoded by
    :func:`decode_mask`) or None (no padding; causal iff ``kwargs["is_causal"]``, else
    ``module.is_causal``, as HF's sdpa does). Attention weights are never returned.
    """
    for kw in _REFUSED_KWARGS:
        if kwargs.get(kw) is not None:
            raise ValueError(f"{name(method)} cannot honour {kw}={kwargs[kw]!r}")
    if dropout:
        raise ValueError(
            f"{name(method)} has no attention dropout, got dropout={dropout}: set the model's "
            "attention dropout probability to 0"
        )
    layer = claim(key)
    if attention_mask is None:
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        spec = MaskSpec(causal, None, key.shape[2] - query.shape[2])
    elif isinstance(attention_mask, MaskSpec):
        spec = attention_mask
    else:
        spec = decode_mask(attention_mask)
    if spec.kv_offset and layer is None:
        raise ValueError(
            f"{name(method)}: the mask starts at key {spec.kv_offset} but no effattn state holds "
            "the earlier keys (a cache other than RecurrentCache dropped them)"
        )
    if query.shape[1] != key.shape[1]:
        if query.shape[1] % key.shape[1]:
            raise ValueError(
                f"query has {query.shape[1]} heads, key {key.shape[1]}: not a multiple"
            )
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    kpm = spec.key_padding_mask
    if kpm is not None and kpm.shape[0] != query.shape[0]:
        kpm = kpm.expand(query.shape[0], -1)
    attn = _module_attention(module, method, options, query, scaling)
    if layer is not None:
        out = _decode(attn, layer, spec, kpm, query, key, value, method)
    else:
        out = _attend(attn, spec.causal, spec.diagonal, kpm, query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _module_attention(
    module: torch.nn.Module,
    method: str,
    options: Mapping[str, Any],
    query: Tensor,
    scaling: float | None,
) -> AttentionMethod:
    """The effattn module attached to ``module`` for these settings, built on first use."""
    config = getattr(module, "config", None)
    merged = {**options, **(getattr(config, "effattn_options", None) or {})}
    heads, head_dim = query.shape[1], query.shape[-1]
    key = (method, tuple(sorted(merged.items())), head_dim, heads, scaling)
    attn = getattr(module, "effattn", None)
    if attn is None or getattr(module, "_effattn_key", None) != key:
        base_seed = getattr(config, "effattn_seed", 0)
        layer_idx = getattr(module, "layer_idx", None) or 0
        attn = effattn.build(
            method,
            head_dim=head_dim,
            heads=heads,
            max_len=getattr(config, "max_position_embeddings", None),
            seed=None if base_seed is None else base_seed + layer_idx,
            scale=scaling,
            **merged,
        ).to(query.device)
        attn.train(module.training)
        module.effattn = attn
        module._effattn_key = key
    return attn


def _attend(
    attn: AttentionMethod,
    causal: bool,
    diagonal: int,
    kpm: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
) -> Tensor:
    """effattn over the whole key history; causal masks aligned at ``diagonal`` (B, H, N, Dv)."""
    n, m = q.shape[2], k.shape[2]
    if not causal:
        return attn(q, k, v, key_padding_mask=kpm)
    if diagonal > m - n or diagonal + n <= 0:
        raise ValueError(
            f"causal mask with diagonal {diagonal} does not fit N={n} queries and M={m} keys"
        )
    # Keys past the last query's position are hidden from every query (a preallocated cache).
    m = diagonal + n
    k, v = k[:, :, :m], v[:, :, :m]
    kpm = None if kpm is None else kpm[:, :m]
    if m == n:
        return attn(q, k, v, causal=True, key_padding_mask=kpm)
    if n == 1 and attn.spec.cross:
        # One query at the end of the history sees every key.
        return attn(q, k, v, key_padding_mask=kpm)
    # N queries at the end of M keys (a cache holding the keys): effattn's causal form needs
    # N == M, so M - N placeholder queries go in front and their outputs are dropped.
    pad = q.new_zeros(*q.shape[:2], m - n, q.shape[3])
    return attn(torch.cat([pad, q], 2), k, v, causal=True, key_padding_mask=kpm)[:, :, m - n :]


def _decode(
    attn: AttentionMethod,
    layer: RecurrentLayer,
    spec: MaskSpec,
    kpm: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str,
) -> Tensor:
    """Prefill or step through the :class:`RecurrentCache` layer's state; (B, H, N, Dv)."""
    if not attn.spec.decoding:
        raise ValueError(
            f"{name(method)} cannot decode with RecurrentCache: "
            f"{attn.spec.refusals.get('decoding', 'no recurrent form')}"
        )
    if not spec.causal or spec.diagonal != 0 or spec.kv_offset != layer.seen:
        raise ValueError(
            f"RecurrentCache needs a causal mask over the new tokens, got causal={spec.causal}, "
            f"diagonal={spec.diagonal}, kv_offset={spec.kv_offset} after {layer.seen} tokens"
        )
    n = q.shape[2]
    if kpm is not None and layer.state is not None:
        raise ValueError(
            "RecurrentCache: padding after the prompt (only left padding of the prompt is allowed)"
        )
    if kpm is None and not isinstance(layer.state, RowStates):
        out, layer.state = _advance(attn, q, k, v, layer.state)
    else:
        out, layer.state = _advance_rows(attn, q, k, v, kpm, layer.state)
    layer.seen += n
    return out


def _advance(attn: AttentionMethod, q: Tensor, k: Tensor, v: Tensor, state: Any) -> Any:
    if q.shape[2] == 1:
        return attn.step(q, k, v, state)
    return attn.prefill(q, k, v, state)


def _advance_rows(
    attn: AttentionMethod,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kpm: Tensor | None,
    states: RowStates | None,
) -> tuple[Tensor, RowStates]:
    """Row by row: a left-padded prompt starts each row's state at its first real token."""
    b, n = q.shape[0], q.shape[2]
    if kpm is not None:
        pads = kpm.sum(1)
        left = torch.arange(n, device=kpm.device)[None, :] < pads[:, None]
        if not bool((kpm == left).all()):
            raise ValueError(
                "RecurrentCache takes left-padded prompts only (padding before the first token "
                "of each row); pad on the left (tokenizer.padding_side = 'left')"
            )
        starts = pads.tolist()
    else:
        starts = [0] * b
    if states is None:
        states = RowStates([None] * b)
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    for row, start in enumerate(starts):
        if start == n:
            continue
        r, t = slice(row, row + 1), slice(start, n)
        out[r, :, t], states[row] = _advance(
            attn, q[r, :, t], k[r, :, t], v[r, :, t], states[row]
        )
    return out, states
