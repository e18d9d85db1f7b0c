"""FNet: Fourier mixing vs explicit DFT matrices, q/k unused, refusals."""

import numpy as np
import pytest
import torch
from conftest import qkv

import effattn
from effattn import naive as R
from effattn.mechanisms.fnet import fnet_mixing


@pytest.mark.parametrize("n, d, dv", [(1, 21, 21), (63, 21, 5), (257, 21, 21), (64, 8, 1)])
def test_matches_dft_reference_outputs_and_grads(n, d, dv, device):
    q, k, v = (t.to(device) for t in qkv(n=n, d=d, dv=dv))
    v.requires_grad_()
    attn = effattn.build("fnet", head_dim=d, heads=3).to(device)
    out = attn(q, k, v)
    ref = R.fnet_mixing(q, k, v)
    torch.testing.assert_close(out, ref)
    weight = torch.randn(out.shape, dtype=out.dtype).to(device)
    (got,) = torch.autograd.grad((out * weight).sum(), v)
    (want,) = torch.autograd.grad((ref * weight).sum(), v)
    torch.testing.assert_close(got, want)


def test_equals_numpy_fft2_and_known_values(device):
    q, k, v = qkv(n=12, d=6)
    expected = np.fft.fft2(v.numpy(), axes=(-2, -1)).real
    q, k, v = (t.to(device) for t in (q, k, v))
    torch.testing.assert_close(fnet_mixing(q, k, v), torch.from_numpy(expected).to(device))
    # a constant input puts everything into frequency (0, 0): N * Dv * c there, 0 elsewhere
    const = torch.full((1, 1, 12, 6), 0.5, dtype=torch.float64, device=device)
    out = fnet_mixing(const, const, const)
    assert out[0, 0, 0, 0].item() == pytest.approx(12 * 6 * 0.5)
    out[0, 0, 0, 0] = 0
    assert out.abs().max() < 1e-12


def test_q_and_k_are_ignored():
    q, k, v = qkv(n=40)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn = effattn.build("fnet", head_dim=21, heads=3)
    out = attn(q, k, v)
    torch.testing.assert_close(attn(torch.randn_like(q), torch.randn_like(k), v), out)
    assert torch.autograd.grad(out.sum(), (q, k), allow_unused=True) == (None, None)
    assert list(attn.parameters()) == []


def test_refusals_give_reasons():
    q, k, v = qkv(n=20)
    attn = effattn.build("fnet", head_dim=21, heads=3)
    with pytest.raises(ValueError, match="fnet cannot do causal attention: .*future"):
        attn(q, k, v, causal=True)
    with pytest.raises(ValueError, match="fnet cannot do a key padding mask: .*padded"):
        attn(q, k, v, key_padding_mask=torch.zeros(2, 20, dtype=torch.bool))
    with pytest.raises(ValueError, match="fnet cannot do cross-attention .*N == M"):
        attn(q[:, :, :7], k, v)
    with pytest.raises(ValueError, match="fnet cannot do recurrent decoding"):
        attn.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
