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

What a model's attention function computes besides causal + padding (see ``docs/integrations.md``
for the table per method):

- a sliding window (``sliding_window``) or chunks (``attention_chunk_size``), read from the mask
  (:mod:`effattn.integrations.hf_masks`). One that hides no key in the call at hand is no
  restriction: the call runs as plain causal attention. A window that restricts runs with the
  method's call input ``sliding_window=`` (softmax: exact, banded; local: when it is its own
  window), or, for a single query, on the keys inside it (every method that does
  cross-attention, e.g. kernelized decoding with transformers' cache); otherwise it is refused,
  in the call where it first restricts. Chunks run as causal attention within each chunk
  (every causal method; in a RecurrentCache a state reset at chunk boundaries).
- logit soft-capping (keyword ``softcap``, Gemma 2): the method's ``softcap`` option, else refused;
- attention sinks (keyword ``s_aux``, GPT-OSS): the method's call input ``sinks=``, else refused;
- an additive position bias (``position_bias``, T5): refused.

Refusals name the option and its value (a tensor by its shape) and say what to do instead.

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
# What to do about a window a method cannot honour.
_NO_WINDOW = (
    "set config.sliding_window = None (every layer then attends to its whole causal history, "
    "which the model was not trained with), or use effattn-softmax"
)


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
    ``module.is_causal``, as HF's sdpa does). ``softcap`` and ``s_aux`` (or ``sinks``) in
    ``kwargs`` are honoured or refused (see the module docstring); ``sliding_window`` is read from
    the mask, which carries it (the keyword repeats it for flash-attention kernels, and sdpa
    ignores it too). Attention weights are never returned.
    """
    if dropout:
        raise ValueError(
            f"{name(method)} has no attention dropout, got dropout={dropout}: set the model's "
            "attention dropout probability to 0"
        )
    method_spec = effattn.spec(method)
    built, call = _model_features(method, method_spec, kwargs)
    layer = claim(key)
    if attention_mask is None:
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        spec = MaskSpec(causal, None, key.shape[2] - query.shape[2])
    elif isinstance(attention_mask, MaskSpec):
        spec = attention_mask
    else:
        spec = decode_mask(attention_mask)
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
    attn = _module_attention(module, method, options, query, scaling, built)
    if spec.kv_offset and layer is None and not (
        attn.spec.cross or _takes(attn.spec, "sliding_window")
    ):
        # A cross-capable method computes a function of the keys it gets, and local's window
        # counts back from the query: both are exact on the keys a sliding-window cache kept.
        # Other patterns count positions from the first key, which moved.
        raise ValueError(
            f"{name(method)}: the cache dropped the keys before position {spec.kv_offset} (a "
            f"sliding-window cache), and {method}'s pattern needs every position from the "
            "first on; generate with use_cache=False, or set config.sliding_window = None"
        )
    if layer is not None:
        out = _decode(attn, layer, spec, kpm, query, key, value, method, call)
    else:
        out = _attend(attn, spec, kpm, query, key, value, method, call)
    return out.transpose(1, 2).contiguous(), None


def _takes(method_spec: effattn.registry.MethodSpec, name: str) -> bool:
    """Whether the method declares the call input ``name`` (``MethodSpec.call_inputs``)."""
    return any(c.name == name for c in method_spec.call_inputs)


def _describe(value: Any) -> str:
    """A keyword's value for an error message: a tensor by its shape, never its entries."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def _model_features(
    method: str, method_spec: effattn.registry.MethodSpec, kwargs: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's soft cap as build options and its sinks as call inputs of ``method``, or a
    ValueError (at the layer's first call, before any output) naming what cannot be honoured."""
    built: dict[str, Any] = {}
    call: dict[str, Any] = {}
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{name(method)} cannot honour position_bias={_describe(kwargs['position_bias'])} "
            "(an additive bias on the scores, as T5's relative positions): effattn methods "
            "add no bias; use attn_implementation='sdpa' or 'eager' for this model"
        )
    softcap = kwargs.get("softcap")
    if softcap is not None:
        if "softcap" not in method_spec.options:
            raise ValueError(
                f"{name(method)} cannot honour logit soft-capping softcap={_describe(softcap)} "
                "(config.attn_logit_softcapping): the scores are never formed; use "
                "effattn-softmax, or set config.attn_logit_softcapping = None (the model then "
                "computes without the cap it was trained with)"
            )
        built["softcap"] = softcap
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        if not _takes(method_spec, "sinks"):
            raise ValueError(
                f"{name(method)} cannot honour attention sinks s_aux={_describe(sinks)} (one "
                "logit per head in the softmax normaliser): the normaliser is never formed; "
                "use effattn-softmax"
            )
        call["sinks"] = sinks
    return built, call


def _module_attention(
    module: torch.nn.Module,
    method: str,
    options: Mapping[str, Any],
    query: Tensor,
    scaling: float | None,
    built: Mapping[str, Any],
) -> AttentionMethod:
    """The effattn module attached to ``module`` for these settings, built on first use.

    ``built``: options the model's layer sets (its soft cap); they must agree with the user's.
    """
    config = getattr(module, "config", None)
    merged = {**options, **(getattr(config, "effattn_options", None) or {})}
    for option, value in built.items():
        if merged.get(option) not in (None, value):
            raise ValueError(
                f"{name(method)}: the model's layer has {option}={value!r}, the effattn options "
                f"say {option}={merged[option]!r}"
            )
        merged[option] = value
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


def _window_hides(spec: MaskSpec, kpm: Tensor | None, n: int) -> bool:
    """Whether the window hides an unpadded key among the call's keys from some query (the last
    query hides the most: keys j <= diagonal + n - 1 - window)."""
    if spec.window is None:
        return False
    end = spec.diagonal + n - spec.window
    return end > 0 and (kpm is None or bool((~kpm[:, :end]).any()))


def _chunk_starts(spec: MaskSpec, n: int, device: torch.device) -> Tensor | None:
    """(B,) index among the call's keys where the last query's chunk starts, None when no
    chunk hides an unpadded key (a row's keys before its chunk start are padding or absent)."""
    if spec.chunk is None:
        return None
    last = spec.kv_offset + spec.diagonal + n - 1
    rows = spec.chunk_start.to(device)
    first = rows + torch.div(last - rows, spec.chunk, rounding_mode="floor") * spec.chunk
    first = first - spec.kv_offset
    # Keys before a row's start are its left padding, keys before the call's first key are not
    # there: hiding them restricts nothing.
    return first if bool((first > (rows - spec.kv_offset).clamp(min=0)).any()) else None


def _attend(
    attn: AttentionMethod,
    spec: MaskSpec,
    kpm: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str,
    call: Mapping[str, Any],
) -> Tensor:
    """effattn over the call's keys, as ``spec`` says (B, H, N, Dv)."""
    n, m = q.shape[2], k.shape[2]
    if not spec.causal:
        return attn(q, k, v, key_padding_mask=kpm, **call)
    diagonal = spec.diagonal
    if diagonal > m - n or diagonal + n <= 0:
        raise ValueError(
            f"causal mask with diagonal {diagonal} does not fit N={n} queries and M={m} keys"
        )
    # Keys past the last query's position are hidden from every query (a preallocated cache).
    m = diagonal + n
    k, v = k[:, :, :m], v[:, :, :m]
    kpm = None if kpm is None else kpm[:, :m]
    window = spec.window if _window_hides(spec, kpm, n) else None
    first = _chunk_starts(spec, n, q.device)
    if n == 1 and (m == 1 or attn.spec.cross):
        # One query sees a set of keys: the window's or chunk's first key on, minus padding.
        start = None if first is None else first.clamp(min=0)
        if window is not None:
            start = torch.full((q.shape[0],), m - window, device=q.device)
        if start is not None:
            lo = int(start.min())
            k, v = k[:, :, lo:], v[:, :, lo:]
            before = torch.arange(lo, m, device=q.device)[None, :] < start[:, None]
            kpm = before if kpm is None else kpm[:, lo:] | before
            kpm = kpm if bool(kpm.any()) else None
        return attn(q, k, v, key_padding_mask=kpm, **call)
    if window is not None:
        if not _takes(attn.spec, "sliding_window"):
            raise ValueError(
                f"{name(method)} cannot honour sliding_window={spec.window}: the window hides "
                f"the keys more than {spec.window - 1} positions back, and {method} attends to "
                f"every causal key; {_NO_WINDOW}"
            )
        call = {**call, "sliding_window": window}
    if m != n:
        # N queries at the end of M keys (a cache holding the keys): effattn's causal form needs
        # N == M, so M - N placeholder queries go in front and their outputs are dropped.
        q = torch.cat([q.new_zeros(*q.shape[:2], m - n, q.shape[3]), q], 2)
    try:
        if first is not None:
            out = _chunked(attn, q, k, v, kpm, first, spec.chunk, call)
        else:
            out = attn(q, k, v, causal=True, key_padding_mask=kpm, **call)
    except ValueError as err:
        if window is None:
            raise
        raise ValueError(f"{name(method)} cannot honour sliding_window={window}: {err}") from None
    return out[:, :, m - n :]


def _chunked(
    attn: AttentionMethod,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kpm: Tensor | None,
    first: Tensor,
    chunk: int,
    call: Mapping[str, Any],
) -> Tensor:
    """Causal attention within chunks of ``chunk`` positions, row b's chunks starting at every
    position congruent to first[b] modulo ``chunk``: q, k, v (B, H, N, ·) -> (B, H, N, Dv).

    Each row is shifted right by r_b = -first[b] mod C (slots filled with padding) so that its
    chunks start at multiples of C, then the (B, H, L) sequences become B L / C independent
    sequences of C tokens: one causal call of the method, for any method (a kernelized state
    restarts at every chunk; Llama 4's ``attention_chunk_size``).
    """
    b, n = q.shape[0], q.shape[2]
    shift = torch.remainder(-first, chunk)
    length = -(-(n + int(shift.max())) // chunk) * chunk
    src = torch.arange(length, device=q.device)[None, :] - shift[:, None]  # (B, L)
    inside = (src >= 0) & (src < n)
    pad = ~inside if kpm is None else ~inside | kpm.gather(1, src.clamp(0, n - 1))
    index = src.clamp(0, n - 1)[:, None, :, None]

    def chunks(x: Tensor) -> Tensor:
        x = x.gather(2, index.expand(-1, x.shape[1], -1, x.shape[3]))
        x = x * inside[:, None, :, None]
        x = x.view(b, x.shape[1], length // chunk, chunk, x.shape[3]).transpose(1, 2)
        return x.reshape(-1, x.shape[2], chunk, x.shape[4])

    pad_chunks = pad.view(-1, chunk)
    out = attn(chunks(q), chunks(k), chunks(v), causal=True,
               key_padding_mask=pad_chunks if bool(pad_chunks.any()) else None, **call)
    out = out.view(b, length // chunk, out.shape[1], chunk, out.shape[3]).transpose(1, 2)
    out = out.reshape(b, out.shape[1], length, out.shape[4])
    back = (torch.arange(n, device=q.device)[None, :] + shift[:, None])[:, None, :, None]
    return out.gather(2, back.expand(-1, out.shape[1], -1, out.shape[3]))


def _decode(
    attn: AttentionMethod,
    layer: RecurrentLayer,
    spec: MaskSpec,
    kpm: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str,
    call: Mapping[str, Any],
) -> Tensor:
    """Prefill or step through the :class:`RecurrentCache` layer's state; (B, H, N, Dv).

    A chunk boundary resets a row's state (:func:`_cuts`); a window that hides a token the
    state holds is passed on as the call input ``sliding_window=`` or refused.
    """
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
    window = spec.window
    # Token t sees t - window + 1 .. t, and the state holds the tokens from 0 on: refused as soon
    # as that can happen (at the prompt when the cache knows the length the generation reaches).
    reach = max(layer.seen + n, layer.max_length or 0)
    if window is not None and reach > window and not _takes(attn.spec, "sliding_window"):
        raise ValueError(
            f"{name(method)} cannot honour sliding_window={window} with RecurrentCache "
            f"(max_length={layer.max_length}): token {window + 1} on sees only the last "
            f"{window} tokens, and the state keeps all of them; {_NO_WINDOW}. transformers' own "
            "cache decodes the window exactly, one query at a time; RecurrentCache(max_length=) "
            "refuses this at the prompt, before any token is generated"
        )
    if window is not None and reach > window:
        call = {**call, "sliding_window": window}
    if kpm is not None and layer.state is not None:
        raise ValueError(
            "RecurrentCache: padding after the prompt (only left padding of the prompt is allowed)"
        )
    starts = None if spec.chunk is None else spec.chunk_start.tolist()
    try:
        if kpm is None and not isinstance(layer.state, RowStates) and len(set(starts or [0])) == 1:
            cuts = _cuts(layer.seen, n, starts[0], spec.chunk) if starts else []
            out, layer.state = _advance(attn, q, k, v, layer.state, cuts, call)
        else:
            out, layer.state = _advance_rows(attn, q, k, v, kpm, layer, starts, spec.chunk, call)
    except ValueError as err:
        if "sliding_window" not in call:
            raise
        raise ValueError(f"{name(method)} cannot honour sliding_window={window}: {err}") from None
    layer.seen += n
    return out


def _cuts(seen: int, n: int, start: int, chunk: int | None) -> list[int]:
    """Indices t in [0, n) of the new tokens (positions seen + t) that begin a chunk: chunks of
    ``chunk`` positions counted from the row's first token at position ``start``."""
    if chunk is None:
        return []
    first = max(seen, start)
    offset = (-(first - start)) % chunk  # tokens until the next chunk boundary
    return list(range(first - seen + offset, n, chunk))


def _advance(
    attn: AttentionMethod,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Any,
    cuts: list[int],
    call: Mapping[str, Any],
) -> tuple[Tensor, Any]:
    """Prefill (or step) q, k, v (B, H, L, D) from ``state``, restarting it at each cut."""
    outs = []
    for a, b in zip([0, *cuts], [*cuts, q.shape[2]], strict=True):
        if a == b:
            continue
        if a in cuts:
            state = None
        piece = slice(a, b)
        advance = attn.step if b - a == 1 else attn.prefill
        out, state = advance(q[:, :, piece], k[:, :, piece], v[:, :, piece], state, **call)
        outs.append(out)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), state


def _advance_rows(
    attn: AttentionMethod,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kpm: Tensor | None,
    layer: RecurrentLayer,
    chunk_starts: list[int] | None,
    chunk: int | None,
    call: Mapping[str, Any],
) -> tuple[Tensor, RowStates]:
    """Row by row: a left-padded prompt starts each row's state at its first real token, and
    each row's chunks count from there."""
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
    states = layer.state
    if states is None:
        states = RowStates([None] * b)
    elif not isinstance(states, RowStates):
        # Rows share one state only when the prompt had no padding, and then every row's chunks
        # start at 0; this would need the shared state cut into rows.
        raise ValueError("RecurrentCache: the rows' chunks start at different positions only "
                         "when the prompt was left-padded")
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    for row, start in enumerate(starts):
        if start == n:
            continue
        cuts = [] if chunk_starts is None else [
            t - start for t in _cuts(layer.seen, n, chunk_starts[row], chunk) if t >= start
        ]
        r, t = slice(row, row + 1), slice(start, n)
        out[r, :, t], states[row] = _advance(
            attn, q[r, :, t], k[r, :, t], v[r, :, t], states[row], cuts, call
        )
    return out, states
