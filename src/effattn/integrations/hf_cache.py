"""A transformers ``Cache`` that keeps effattn's decoding state instead of the keys and values.

HF attention modules call ``past_key_values.update(k, v, layer_idx)`` and pass what it returns to
the attention function; the function never sees the cache. :class:`RecurrentLayer.update` returns
the new tokens' k and v unchanged and remembers them as pending; the ``effattn-<method>``
attention function recognises that very key tensor (by identity, see :func:`claim`), runs
``prefill`` or ``step`` of its effattn module on the layer's state and stores the new state there.
The cache also reports the mask sizes of "the new tokens only" (``kv_offset`` = tokens already
folded into the state), so the mask the attention function receives covers exactly those tokens.

What the state holds is the method's: a fixed ``(B, H, F, Dv + 1)`` for kernelized methods
(performer, favor, rfa, linear), a ``window``-sized ring buffer for ``local``, the growing keys
and values for ``softmax`` (those of its sliding window only, in a layer that has one).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

# id(pending key tensor) -> the layer that returned it from update(); the layer holds the tensor
# until the attention function claims it, so the id cannot be reused in between.
_PENDING: weakref.WeakValueDictionary[int, RecurrentLayer] = weakref.WeakValueDictionary()


class RowStates(list):
    """Per-row decoding states of a batch whose prompts had different amounts of left padding."""

    def nbytes(self) -> int:
        return sum(state.nbytes() for state in self if state is not None)


class RecurrentLayer(CacheLayerMixin):
    """One layer's effattn decoding state; ``seen`` tokens have been folded into it.

    ``max_length``: the length the generation will reach, when the cache was told (see
    :class:`RecurrentCache`).
    """

    is_sliding = False

    def __init__(self, max_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: Any = None
        self.seen = 0
        self.max_length = max_length
        self._pending: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if self._pending is not None:
            raise RuntimeError(
                "RecurrentCache: the previous keys of this layer never reached an effattn "
                "attention function (is the model's attn_implementation an effattn-<method>?)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = key_states
        _PENDING[id(key_states)] = self
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen, self._pending = None, 0, None

    def nbytes(self) -> int:
        """Bytes held by the state (0 before the first token)."""
        return 0 if self.state is None else self.state.nbytes()

    def _unsupported(self, *args: Any) -> None:
        raise NotImplementedError(
            "RecurrentCache cannot reorder, crop or repeat its state (beam search, assisted "
            "decoding); use greedy or sampling generation"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


def claim(key: Tensor) -> RecurrentLayer | None:
    """The layer whose ``update`` returned ``key`` and that still waits for it, else None."""
    layer = _PENDING.pop(id(key), None)
    if layer is None or layer._pending is not key:
        return None
    layer._pending = None
    return layer


class RecurrentCache(Cache):
    """Fixed-size decoding cache for ``model.generate(..., past_key_values=RecurrentCache())``.

    Works with a model whose ``attn_implementation`` is ``effattn-<method>`` for a method that
    decodes (``effattn.spec(method).decoding``). Batches may be left-padded (each row then keeps
    its own state and steps alone); beam search and assisted decoding, which reorder or crop
    the cache, are refused.

    ``max_length`` (optional): the length the sequences will reach (prompt + new tokens). A
    state cannot drop old tokens, so a method that cannot honour a model's sliding window is
    refused at the token where the window starts to hide keys; told the length, the cache
    refuses at the prompt instead, before any token is generated.
    """

    def __init__(self, max_length: int | None = None) -> None:
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        super().__init__(
            layer_class_to_replicate=functools.partial(RecurrentLayer, max_length=max_length)
        )

    def nbytes(self) -> int:
        """Bytes held by the states of all layers."""
        return sum(layer.nbytes() for layer in self.layers)
