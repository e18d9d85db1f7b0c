"""Sliding-window (local) attention, optionally dilated.

Query i attends to key j when
- non-causal: ``|i - j| <= window // 2`` and ``(i - j) % dilation == 0``;
- causal: ``0 <= i - j <= window - 1`` and ``(i - j) % dilation == 0`` (the last ``window``
  positions, the query's own included; a decoder keeps exactly ``window`` keys).

So the causal form equals causal softmax once ``window >= N``, the non-causal form equals softmax
once ``window // 2 >= N - 1`` (dilation 1). With dilation 1 the causal form is exactly the
sliding window of Mistral-style models; the call input ``sliding_window=w`` asks for that
pattern, and the module accepts it only when it is its own (``window == w``, ``dilation == 1``).
Dilated windows as in Beltagy et al. 2020 (Longformer, section 3.1); sliding windows go back to
Parmar et al. 2018 (Image Transformer).

Computed banded (:func:`effattn.sparse.banded_attention`): blocks of queries against the few key
blocks their window touches, dilation as independent bands over the residue classes mod d.
O(N window / dilation D) time; O(N D) memory kept for the backward (q, k, v, out and one
log-sum-exp per row; the backward recomputes the scores); no N x N mask.
q, k: (B, H, N, D), v: (B, H, N, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from effattn.base import AttentionMethod, check_positive_int, compute_dtype
from effattn.registry import Budget, CallInput, MethodSpec, register
from effattn.sparse import Band, banded_attention, engine_dtype
from effattn.sparse.parallel import Halo


@dataclass
class WindowCache:
    """Ring buffer of the last ``window`` keys and values.

    k: (B, H, window, D), v: (B, H, window, Dv); position p lives in slot p % window;
    ``length`` tokens have been seen.
    """

    k: Tensor
    v: Tensor
    length: int

    def nbytes(self) -> int:
        """Bytes held by the buffer: fixed by the window, whatever the position."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def nbytes_in_use(self) -> int:
        """Bytes of the slots written so far (all of them once ``window`` tokens were seen)."""
        window = self.k.shape[2]
        return self.nbytes() // window * min(self.length, window)


class LocalAttention(AttentionMethod):
    """Sliding-window attention with optional dilation; decodes with a window-sized ring buffer."""

    engine_reads_values = True  # stateless: the banded engine reads it before its kernel

    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, window, dilation):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.window = check_positive_int("window", window)
        self.dilation = check_positive_int("dilation", dilation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, dilation={self.dilation}"

    def band(self, causal: bool) -> Band:
        """The window as a band: the last ``window`` positions causal, ``window // 2`` each way
        otherwise (the engine's and the sequence-parallel halo's pattern)."""
        left, right = (self.window - 1, 0) if causal else (self.window // 2, self.window // 2)
        return Band(left, right, self.dilation)

    def _check_call(self, call, q, k, v, causal):
        """Besides the declarations: a caller's required causal ``sliding_window`` must be this
        module's own pattern, which the computation then is (forward, step, prefill and the
        sequence-parallel halo all check it here)."""
        super()._check_call(call, q, k, v, causal)
        window = call.get("sliding_window")
        if window is not None and (window != self.window or self.dilation != 1):
            raise ValueError(
                f"local computes the causal window {self.window} with dilation {self.dilation}, "
                f"not the required sliding_window={window}: build it with window={window}, "
                "dilation=1"
            )

    def _attend(self, q, k, v, *, causal, key_padding_mask, sliding_window=None):
        dtype = engine_dtype(q.dtype, q.device)
        band = self.band(causal)
        out, _ = banded_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), left=band.left, right=band.right,
            dilation=band.dilation, key_mask=key_padding_mask, scale=self.scale,
        )
        return out

    def _step(self, q, k, v, state, sliding_window=None):
        dtype = compute_dtype(q.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        w = self.window
        if state is None:
            state = WindowCache(
                k.new_zeros(*k.shape[:2], w, k.shape[3]),
                v.new_zeros(*v.shape[:2], w, v.shape[3]),
                0,
            )
        elif not isinstance(state, WindowCache) or state.k.shape[2] != w:
            raise ValueError(
                f"local state must be a WindowCache of window {w}, got {type(state).__name__}"
            )
        t = state.length
        state.k[:, :, t % w] = k[:, :, 0]
        state.v[:, :, t % w] = v[:, :, 0]
        state.length = t + 1
        # Slot s holds position t - ((t - s) mod w); it counts if already written and on the
        # dilation grid.
        back = (t - torch.arange(w, device=q.device)) % w
        visible = (back <= t) & (back % self.dilation == 0)
        scores = (q @ state.k.transpose(-2, -1)) * self.scale
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return weights @ state.v, state


def _reference(
    module: LocalAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Masked softmax over the explicit N x N window pattern of the module (a required
    ``sliding_window`` is that pattern: the module refuses any other)."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.local_attention(
        q, k, v, window=module.window, dilation=module.dilation, causal=causal,
        key_padding_mask=key_padding_mask, scale=module.scale,
    )


register(
    MethodSpec(
        name="local",
        summary="sliding-window attention, optionally dilated; banded blockwise computation",
        paper="Parmar et al. 2018, Image Transformer; dilation: Beltagy et al. 2020, Longformer",
        complexity="O(N window / dilation D) time, O(N D) memory",
        causal=True,
        padding_mask=True,
        cross=False,
        decoding=True,
        options={"window": 128, "dilation": 1},
        budget=Budget("window", (16, 32, 64, 128, 256)),
        call_inputs=(
            CallInput("sliding_window", "a required causal sliding window (0 <= i - j < "
                      "sliding_window); taken only when it is the module's own window, dilation 1",
                      (), causal_only=True, bounds=(1, math.inf), kind="int"),
        ),
        bench_default=True,
        published={"lra_listops": 15.82},
        refusals={
            "cross": "a window over positions needs aligned query and key positions (N == M)",
        },
        reference=_reference,
        sequence_parallel=Halo(),
    ),
    LocalAttention,
)
