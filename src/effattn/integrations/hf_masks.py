"""Hugging Face attention masks -> effattn's ``causal`` + ``key_padding_mask`` (+ a sliding window
or chunks), or a ValueError.

transformers builds every mask through the mask function registered for the model's
``attn_implementation`` (``AttentionMaskInterface``); :func:`effattn_mask` is ours. It never
returns ``None``: without a mask function transformers hands a custom attention function
``attention_mask=None`` and padding is silently lost, and even with one, ``sdpa``'s mask function
returns ``None`` for "causal, no padding", which an attention function cannot tell apart from
"no mask".

HF's own ``causal_mask_function`` and ``bidirectional_mask_function``, each with the 2-D padding
mask, come back as a :class:`MaskSpec` without building the (B, 1, N, M) tensor. Any other
pattern is evaluated (in slices of query rows, by ``sdpa_mask``) and matched against the
patterns effattn can compute, with the 2-D padding:

- the sliding window of ``create_sliding_window_causal_mask`` (Mistral, Qwen2, Gemma 2/3, Phi-3,
  GPT-OSS, Cohere2, ...): causal and ``q_pos - k_pos < sliding_window``;
- the chunks of ``create_chunked_causal_mask`` (Llama 4 ``attention_chunk_size``): causal within
  chunks of C positions counted from each row's first token (after its left padding);
- plain causal (a window or chunk that restricts nothing in this call), bidirectional.

The window or chunk size is the ``local_size`` transformers passes along with these two mask
functions (chunked when it equals ``config.attention_chunk_size``); a pattern that matches none
of the above (packed sequences, image-token blocks, a custom function) is refused. A ready-made
4-D mask passed by the user skips the mask function (transformers returns it as is) and is
decoded by :func:`decode_mask`, which recognises causal, bidirectional and sliding-window
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

# Mask entries (B x rows x M) compared per slice of query rows: the comparisons' temporaries stay
# a few MiB however long the sequence.
_SLICE = 1 << 22


@dataclass(frozen=True)
class MaskSpec:
    """A mask effattn can honour. Key j of the call is at position ``kv_offset + j``, query i at
    ``q_pos = kv_offset + i + diagonal``; key j is visible to query i iff

    ``not key_padding_mask[b, j]`` and, when ``causal``, ``k_pos <= q_pos``, and with a
    ``window`` ``q_pos - k_pos < window``, and with a ``chunk`` C both positions lie in the same
    chunk: ``(q_pos - s_b) // C == (k_pos - s_b) // C`` with ``s_b = chunk_start[b]``.

    key_padding_mask: bool (B, M), True marks padding, None for none. ``diagonal`` is HF's
    ``q_offset - kv_offset`` (``M - N`` when the keys are the whole history). ``kv_offset`` counts
    the keys before the first one passed to attention: those a cache dropped (transformers'
    sliding-window caches) or folded into a state (:class:`effattn.integrations.hf_cache.
    RecurrentCache`). ``window`` and ``chunk`` are the layer's own sizes, also in a call they
    restrict nothing (the attention function decides that, and a RecurrentCache needs them for
    the tokens still to come); ``chunk_start`` (B,) long, each row's first unpadded position.
    """

    causal: bool
    key_padding_mask: Tensor | None
    diagonal: int
    kv_offset: int = 0
    window: int | None = None
    chunk: int | None = None
    chunk_start: Tensor | None = None


def _pattern(
    keep: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    causal: bool,
    window: int | None = None,
    chunk: int | None = None,
    chunk_start: Tensor | None = None,
) -> Tensor:
    """The (B, R, M) bool pattern of :class:`MaskSpec` for queries at positions q_pos (R,) and
    keys at k_pos (M,), keep (B, M) the unpadded keys."""
    ok = keep[:, None, :]
    if causal:
        lag = q_pos[:, None] - k_pos[None, :]
        ok = ok & (lag >= 0)
        if window is not None:
            ok = ok & (lag < window)
        if chunk is not None:
            start = chunk_start[:, None, None]
            same = torch.div(q_pos[None, :, None] - start, chunk, rounding_mode="floor") == (
                torch.div(k_pos[None, None, :] - start, chunk, rounding_mode="floor")
            )
            ok = ok & same
    return ok.expand(keep.shape[0], q_pos.shape[0], k_pos.shape[0])


def _matches(visible: Tensor, keep: Tensor, q_pos: Tensor, k_pos: Tensor, **how: Any) -> bool:
    """Whether the (B, R, M) ``visible`` rows are exactly :func:`_pattern` (keep, q_pos, k_pos)."""
    return bool(torch.equal(visible, _pattern(keep, q_pos, k_pos, **how)))


def _row_slices(b: int, n: int, m: int) -> list[tuple[int, int]]:
    rows = max(1, _SLICE // max(1, b * m))
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


def _left_padding(attention_mask: Tensor | None, b: int, device: torch.device | str) -> Tensor:
    """(B,) long: padded positions before each row's first token, as transformers counts them
    for chunked attention (``create_chunked_causal_mask``)."""
    if attention_mask is None:
        return torch.zeros(b, dtype=torch.long, device=device)
    return (attention_mask.long().cumsum(-1) == 0).sum(-1)


def _padding(attention_mask: Tensor | None, kv_length: int, kv_offset: int) -> Tensor | None:
    """(B, kv_length) True-is-padding from HF's 2-D keep-mask, None when nothing is padded."""
    keep = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if keep is None:
        return None
    kpm = ~keep[:, kv_offset : kv_offset + kv_length].bool()
    return kpm if bool(kpm.any()) else None


def effattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    local_size: int | None = None,
    config: Any = None,
    **kwargs: Any,
) -> MaskSpec:
    """The ``AttentionMaskInterface`` entry of every ``effattn-<method>``: same signature as
    ``transformers.masking_utils.sdpa_mask``, returns a :class:`MaskSpec` or raises ValueError."""
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    kpm = _padding(attention_mask, kv_length, kv_offset)
    if mask_function is causal_mask_function or mask_function is bidirectional_mask_function:
        return MaskSpec(
            causal=mask_function is causal_mask_function,
            key_padding_mask=kpm,
            diagonal=q_offset - kv_offset,
            kv_offset=kv_offset,
        )
    chunked = local_size is not None and getattr(config, "attention_chunk_size", None) == local_size
    window = None if chunked else local_size
    chunk = local_size if chunked else None
    starts = _left_padding(attention_mask, batch_size, device) if chunked else None
    keep = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    if kpm is not None:
        keep = ~kpm
    k_pos = kv_offset + torch.arange(kv_length, device=device)
    local, causal, bidirectional = local_size is not None, True, True
    for r0, r1 in _row_slices(batch_size, q_length, kv_length):
        if not (local or causal or bidirectional):
            break
        visible = sdpa_mask(
            batch_size=batch_size,
            q_length=r1 - r0,
            kv_length=kv_length,
            q_offset=q_offset + r0,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=use_vmap,
            device=device,
        )[:, 0]
        q_pos = q_offset + torch.arange(r0, r1, device=device)
        local = local and _matches(visible, keep, q_pos, k_pos, causal=True, window=window,
                                   chunk=chunk, chunk_start=starts)
        causal = causal and _matches(visible, keep, q_pos, k_pos, causal=True)
        bidirectional = bidirectional and _matches(visible, keep, q_pos, k_pos, causal=False)
    if local or causal or bidirectional:
        return MaskSpec(
            causal=local or causal,
            key_padding_mask=kpm,
            diagonal=q_offset - kv_offset,
            kv_offset=kv_offset,
            window=window if local else None,
            chunk=chunk if local else None,
            chunk_start=starts if local else None,
        )
    raise ValueError(
        f"the attention mask ({q_length} queries at position {q_offset}, {kv_length} keys from "
        f"{kv_offset}) is not causal with an optional sliding window or chunks, nor "
        "bidirectional, once padded keys are removed (e.g. packed sequences, image-token "
        "blocks or a custom mask function): effattn methods cannot honour it"
    )


def decode_mask(mask: Tensor) -> MaskSpec:
    """Decode a 4-D HF mask (B or 1, H or 1, N, M) into causal + key padding (+ a sliding window),
    or raise ValueError.

    Bool masks mark visible pairs with True; float masks are additive (0 visible, a large negative
    number or -inf hidden); any other value is a bias effattn cannot add. Key padding is the set
    of key columns no query of the row sees; the rest must be all visible (bidirectional), the
    causal pattern aligned to the last query (``j <= i + M - N``), or that pattern within a
    sliding window (``i + M - N - j < w``, w the widest visible span). In left-padded causal rows
    the padded queries see nothing, which the causal pattern restricted to unpadded keys
    reproduces.
    """
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        raise ValueError(
            "attention_mask must be a 4-D (B, 1, N, M) tensor or an effattn MaskSpec, got "
            f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}"
        )
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        hidden = (mask <= torch.finfo(mask.dtype).min / 2) | (mask == float("-inf"))
        if not bool((visible | hidden).all()):
            raise ValueError(
                "attention_mask carries an additive bias (values other than 0 and -inf): effattn "
                "methods take only causal + key padding (+ a sliding window)"
            )
    else:
        raise ValueError(f"attention_mask must be bool or float, got dtype {mask.dtype}")
    if not bool((visible == visible[:, :1]).all()):
        raise ValueError("attention_mask differs between heads: effattn takes one for all heads")
    visible = visible[:, 0]
    b, n, m = visible.shape
    kpm = ~visible.any(dim=1)
    keep = ~kpm
    padding = kpm if bool(kpm.any()) else None
    # Positions relative to the keys: query i sits at i + M - N.
    q_all, k_pos = torch.arange(n, device=mask.device) + m - n, torch.arange(m, device=mask.device)
    slices = _row_slices(b, n, m)
    for causal in (False, True):
        if all(_matches(visible[:, r0:r1], keep, q_all[r0:r1], k_pos, causal=causal)
               for r0, r1 in slices):
            return MaskSpec(causal=causal, key_padding_mask=padding, diagonal=m - n)
    # The widest span a query sees is the window, if this is one.
    widest = max(
        int(((q_all[r0:r1, None] - k_pos[None, :]) * visible[:, r0:r1]).max()) for r0, r1 in slices
    )
    if all(_matches(visible[:, r0:r1], keep, q_all[r0:r1], k_pos, causal=True, window=widest + 1)
           for r0, r1 in slices):
        return MaskSpec(causal=True, key_padding_mask=padding, diagonal=m - n, window=widest + 1)
    raise ValueError(
        f"attention_mask of shape {tuple(mask.shape)} is neither causal (with an optional "
        "sliding window) nor bidirectional once padded keys are removed (e.g. chunked, "
        "packed-sequence or custom pattern): effattn methods cannot honour it"
    )
