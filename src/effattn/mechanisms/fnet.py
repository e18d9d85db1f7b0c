"""FNet: parameter-free Fourier mixing in place of attention.

y = Re(FFT_seq(FFT_hidden(v)))   (Lee-Thorp et al. 2022, "FNet: Mixing Tokens with Fourier
Transforms"), the 2-D DFT over (sequence, head features) of each head, unnormalised as in the
paper. Only v (B, H, N, Dv) is used: q and k are accepted for the common contract and ignored,
and the output (B, H, N, Dv) has one row per position of v. Cost O(N Dv log(N Dv)) per head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from effattn.base import AttentionMethod, compute_dtype
from effattn.registry import LayerHints, MethodSpec, register


def fnet_mixing(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Re(DFT_N v DFT_Dv) for v (B, H, N, Dv); q and k are ignored.

    v is real, so Y = DFT_N v DFT_Dv has Y[i, j] = conj(Y[-i, -j]) (indices mod N, Dv): the real
    FFT gives columns j <= Dv // 2 and the others are Re Y[-i, Dv - j], without a full complex
    (B, H, N, Dv) buffer.
    """
    dv = v.shape[-1]
    half = torch.fft.rfft2(v, dim=(-2, -1)).real
    mirrored = half[..., 1 : (dv + 1) // 2].flip(-2, -1).roll(1, dims=-2)
    return torch.cat([half, mirrored], dim=-1)


class FNet(AttentionMethod):
    """Fourier mixing of v over (sequence, features); no parameters, q and k unused."""

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        return fnet_mixing(q, k, v.to(compute_dtype(v.dtype)))


def _reference(
    module: FNet,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Re(W_N v W_Dv) with the explicit DFT matrices; the module has no parameters."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.fnet_mixing(q, k, v)


register(
    MethodSpec(
        name="fnet",
        summary="parameter-free 2-D Fourier mixing of v over (sequence, features); q, k unused",
        paper="Lee-Thorp et al. 2022, FNet: Mixing Tokens with Fourier Transforms",
        complexity="O(N Dv log(N Dv)) time, O(N Dv) memory",
        causal=False,
        padding_mask=False,
        cross=False,
        decoding=False,
        refusals={
            "causal": "the DFT along the sequence mixes every position into every output, "
            "future ones included",
            "padding_mask": "there are no keys to mask: padded positions enter every output "
            "through the DFT, and the DFT itself depends on the padded length",
            "cross": "there are no queries: the output has one row per position of v, so it "
            "needs N == M",
            "decoding": "the DFT over the sequence has no recurrent form",
            "sequence_parallel": "the DFT along the sequence mixes every position into every "
            "output",
        },
        reference=_reference,
        layer=LayerHints(parameter_free=True),
    ),
    FNet,
)
