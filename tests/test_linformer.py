"""Linformer: fast path vs dense reference, projections, padding, sharing, refusals."""

import math

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.mechanisms.linformer import linformer_attention

SHARES = ("none", "kv", "headwise")


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    return torch.autograd.grad((out * weight).sum(), inputs)


def _module(h=3, d=21, max_len=300, **options):
    return effattn.build("linformer", head_dim=d, heads=h, max_len=max_len, seed=0, **options)


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("n, m", [(1, 1), (63, 63), (257, 257), (17, 40), (40, 17)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference_outputs_and_grads(share, n, m, masked, device):
    q, k, v = qkv(n=n, m=m, dv=5)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    mask = padding(2, m).to(device) if masked else None
    attn = _module(proj_len=24, share=share).double().to(device)
    e = attn.e
    f = attn.e if share == "kv" else attn.f
    out = attn(q, k, v, key_padding_mask=mask)
    ref = R.linformer_attention(q, k, v, e, f, key_padding_mask=mask, scale=attn.scale)
    torch.testing.assert_close(out, ref)
    params = [q, k, v, e] + ([] if share == "kv" else [f])
    for got, want in zip(_grads(out, params), _grads(ref, params), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n, m", [(63, 63), (17, 40)])
def test_identity_projection_equals_softmax(n, m, device):
    """With P = M and E = F = I on the first M columns, Linformer is exact attention."""
    q, k, v = (t.to(device) for t in qkv(n=n, m=m, dv=6))
    e = torch.randn(3, m, 100, dtype=torch.float64)
    e[:, :, :m] = torch.eye(m, dtype=torch.float64)
    e = e.to(device)
    out = linformer_attention(q, k, v, e, e.clone(), scale=0.3)
    torch.testing.assert_close(out, R.softmax_attention(q, k, v, scale=0.3))


def test_uses_only_the_first_length_columns():
    q, k, v = qkv(n=63)
    attn = _module(proj_len=16, max_len=100).double()
    out = attn(q, k, v)
    with torch.no_grad():
        attn.e[..., 63:] = torch.randn_like(attn.e[..., 63:])
        attn.f[..., 63:] = torch.randn_like(attn.f[..., 63:])
    torch.testing.assert_close(attn(q, k, v), out)
    with torch.no_grad():
        attn.f[..., 62] += 1.0
    assert not torch.allclose(attn(q, k, v), out)


@pytest.mark.parametrize("share", ["none", "headwise"])
def test_padded_keys_and_values_do_not_change_outputs(share):
    q, k, v = qkv(n=40, m=57, dv=5)
    mask = padding(2, 57)
    attn = _module(proj_len=16, share=share).double()
    out = attn(q, k, v, key_padding_mask=mask)
    k2 = torch.where(mask[:, None, :, None], 100 * torch.randn_like(k), k)
    v2 = torch.where(mask[:, None, :, None], 100 * torch.randn_like(v), v)
    torch.testing.assert_close(attn(q, k2, v2, key_padding_mask=mask), out)
    # without the mask the padded keys would leak into the projections
    assert not torch.allclose(attn(q, k2, v2), out)


def test_fully_padded_row_outputs_zeros():
    q, k, v = qkv(n=10)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[1] = True
    out = _module(proj_len=8).double()(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0 and out[0].abs().max() > 0


def test_sharing_modes_and_parameter_shapes():
    none, kv, headwise = (_module(proj_len=8, max_len=50, share=s) for s in SHARES)
    assert none.e.shape == none.f.shape == (3, 8, 50) and not torch.equal(none.e, none.f)
    assert kv.e.shape == (3, 8, 50) and kv.f is None and len(list(kv.parameters())) == 1
    assert headwise.e.shape == headwise.f.shape == (8, 50)
    q, k, v = qkv(n=30)
    kv = kv.double()
    torch.testing.assert_close(kv(q, k, v), linformer_attention(q, k, v, kv.e, kv.e))



def test_seed_fixes_init_and_init_scale():
    a, b, c = _module(proj_len=64), _module(proj_len=64), effattn.build(
        "linformer", head_dim=21, heads=3, max_len=300, seed=1, proj_len=64
    )
    assert torch.equal(a.e, b.e) and torch.equal(a.f, b.f) and not torch.equal(a.e, c.e)
    std = a.e.std().item()
    assert abs(std - 1 / math.sqrt(64)) < 0.01


def test_refusals_and_option_validation():
    q, k, v = qkv(n=20)
    attn = _module(proj_len=8)
    with pytest.raises(ValueError, match="linformer cannot do causal.*future"):
        attn(q, k, v, causal=True)
    with pytest.raises(ValueError, match="linformer cannot do recurrent decoding"):
        attn.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="max_len"):
        effattn.build("linformer", head_dim=21, heads=3)
    with pytest.raises(ValueError, match="max_len=16"):
        _module(proj_len=8, max_len=16)(q, k, v)
    with pytest.raises(ValueError, match="share"):
        _module(share="layerwise")
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="proj_len"):
            _module(proj_len=bad)
    with pytest.raises(ValueError, match="e must be"):
        linformer_attention(q, k, v, torch.randn(3, 4, 10), torch.randn(3, 4, 10))


def test_functional_attention_builds_with_max_len_from_shapes():
    q, k, v = qkv(n=33, m=45)
    out = effattn.attention(q, k, v, method="linformer", seed=3, proj_len=16)
    again = effattn.attention(q, k, v, method="linformer", seed=3, proj_len=16)
    assert out.shape == (2, 3, 33, 21)
    torch.testing.assert_close(out, again)
