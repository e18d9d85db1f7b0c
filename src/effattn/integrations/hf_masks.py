"""Hugging Face attention masks -> effattn's ``causal`` + ``key_padding_mask``, or a ValueError.

transformers builds every mask through the mask function registered for the model's
``attn_implementation`` (``AttentionMaskInterface``); :func:`effattn_mask` is ours. It never
returns ``None``: without a mask function transformers hands a custom attention function
``attention_mask=None`` and padding is silently lost, and even with one, ``sdpa``'s mask function
returns ``None`` for "causal, no padding", which an attention function cannot tell apart from
"no mask".

The two patterns effattn can express come back as a :class:`MaskSpec` without building the
(B, 1, N, M) tensor: HF's own ``causal_mask_function`` and ``bidirectional_mask_function``, each
with the 2-D padding mask. Any other pattern (sliding window, chunked, packed sequences, image
blocks, ...) is materialised and decoded by :func:`decode_mask`, which accepts it only if it is
one of those two in disguise. A ready-made 4-D mask passed by the user skips the mask function
(transformers returns it as is) and is decoded the same way by the attention function.
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


@dataclass(frozen=True)
class MaskSpec:
    """A mask effattn can honour: key j is visible to query i iff

    ``not key_padding_mask[b, j]`` and, when ``causal``, ``j <= i + diagonal``.

    key_padding_mask: bool (B, M), True marks padding, None for none. ``diagonal`` is HF's
    ``q_offset - kv_offset`` (``M - N`` when the keys are the whole history). ``kv_offset`` counts
    the keys before the first one passed to attention: 0 unless a cache keeps a state instead
    of the keys (:class:`effattn.integrations.hf_cache.RecurrentCache`).
    """

    causal: bool
    key_padding_mask: Tensor | None
    diagonal: int
    kv_offset: int = 0


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
    **kwargs: Any,
) -> MaskSpec:
    """The ``AttentionMaskInterface`` entry of every ``effattn-<method>``: same signature as
    ``transformers.masking_utils.sdpa_mask``, returns a :class:`MaskSpec` or raises ValueError."""
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    if mask_function is causal_mask_function or mask_function is bidirectional_mask_function:
        return MaskSpec(
            causal=mask_function is causal_mask_function,
            key_padding_mask=_padding(attention_mask, kv_length, kv_offset),
            diagonal=q_offset - kv_offset,
            kv_offset=kv_offset,
        )
    dense = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    spec = decode_mask(dense)
    return MaskSpec(spec.causal, spec.key_padding_mask, spec.diagonal, kv_offset)


def decode_mask(mask: Tensor) -> MaskSpec:
    """Decode a 4-D HF mask (B or 1, H or 1, N, M) into causal + key padding, or raise ValueError.

    Bool masks mark visible pairs with True; float masks are additive (0 visible, a large negative
    number or -inf hidden); any other value is a bias effattn cannot add. Key padding is the set
    of key columns no query of the row sees; the rest must be all visible (bidirectional) or the
    causal pattern aligned to the last query (``j <= i + M - N``). In left-padded causal rows the
    padded queries see nothing, which the causal pattern restricted to unpadded keys reproduces.
    """
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        raise ValueError(
            "attention_mask must be a 4-D (B, 1, N, M) tensor or an effattn MaskSpec, got "
            f"{getattr(mask, 'shape', type(mask).__name__)}"
        )
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        hidden = (mask <= torch.finfo(mask.dtype).min / 2) | (mask == float("-inf"))
        if not bool((visible | hidden).all()):
            raise ValueError(
                "attention_mask carries an additive bias (values other than 0 and -inf): effattn "
                "methods take only causal + key padding"
            )
    else:
        raise ValueError(f"attention_mask must be bool or float, got dtype {mask.dtype}")
    if not bool((visible == visible[:, :1]).all()):
        raise ValueError("attention_mask differs between heads: effattn takes one for all heads")
    visible = visible[:, 0]
    n, m = visible.shape[-2:]
    kpm = ~visible.any(dim=1)
    keep = ~kpm[:, None, :]
    padding = kpm if bool(kpm.any()) else None
    if bool((visible == keep).all()):
        return MaskSpec(causal=False, key_padding_mask=padding, diagonal=m - n)
    i = torch.arange(n, device=mask.device)[:, None]
    j = torch.arange(m, device=mask.device)[None, :]
    if bool((visible == (keep & (j <= i + m - n))).all()):
        return MaskSpec(causal=True, key_padding_mask=padding, diagonal=m - n)
    raise ValueError(
        f"attention_mask of shape {tuple(mask.shape)} is neither causal nor bidirectional once "
        "padded keys are removed (e.g. sliding-window, chunked, packed-sequence or custom "
        "pattern): effattn methods take only causal + key padding"
    )
