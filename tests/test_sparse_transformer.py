"""sparse-strided and sparse-fixed: the Sparse Transformer patterns (causal and bidirectional)."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.sparse import blockwise

REFERENCES = {
    "sparse-strided": R.sparse_strided_attention,
    "sparse-fixed": R.sparse_fixed_attention,
}


def _out_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                           dtype=out.dtype).to(out.device)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


CASES = [
    ("sparse-strided", 1, {}),
    ("sparse-strided", 63, {}),
    ("sparse-strided", 257, {"stride": 17}),
    ("sparse-strided", 300, {"stride": 7}),
    ("sparse-strided", 63, {"stride": 1}),
    ("sparse-fixed", 1, {}),
    ("sparse-fixed", 63, {"c": 3}),
    ("sparse-fixed", 257, {"stride": 17}),
    ("sparse-fixed", 300, {"stride": 13, "c": 1}),
    ("sparse-fixed", 63, {"stride": 5, "c": 8}),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, n, opts", CASES)
def test_matches_reference_outputs_and_grads(causal, name, n, opts, device):
    q, k, v = (t.to(device) for t in qkv(n=n, dv=7))
    mask = padding(2, n).to(device)
    m = effattn.build(name, head_dim=21, heads=3, **opts).to(device)
    fast = _out_and_grads(lambda q, k, v: m(q, k, v, causal=causal, key_padding_mask=mask),
                          q, k, v)
    ref = _out_and_grads(
        lambda q, k, v: REFERENCES[name](q, k, v, causal=causal, key_padding_mask=mask, **opts),
        q, k, v,
    )
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_default_stride_is_round_sqrt_n():
    q, k, v = qkv(n=130)  # sqrt(130) = 11.4
    for name in REFERENCES:
        out = effattn.attention(q, k, v, name, causal=True)
        torch.testing.assert_close(out, effattn.attention(q, k, v, name, causal=True, stride=11))
        assert not torch.allclose(out, effattn.attention(q, k, v, name, causal=True, stride=12))


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("n", [1, 63, 257])
def test_stride_at_least_n_is_exact_softmax(name, n, device):
    q, k, v = (t.to(device) for t in qkv(n=n))
    mask = padding(2, n).to(device)
    for causal in (True, False):
        full = effattn.attention(q, k, v, causal=causal, key_padding_mask=mask)
        for stride in (n, n + 5):
            out = effattn.attention(q, k, v, name, causal=causal, key_padding_mask=mask,
                                    stride=stride)
            torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_no_future_leakage(name):
    q, k, v = qkv(n=100)
    m = effattn.build(name, head_dim=21, heads=3, stride=7, c=2) if name == "sparse-fixed" else \
        effattn.build(name, head_dim=21, heads=3, stride=7)
    out = m(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 60:] += 5.0
    v2[:, :, 60:] -= 3.0
    out2 = m(q, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, :60], out[:, :, :60], rtol=0, atol=0)
    assert not torch.allclose(out2[:, :, 60:], out[:, :, 60:])
    assert not torch.allclose(m(q, k2, v2)[:, :, :60], m(q, k, v)[:, :, :60])  # bidirectional


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_never_change_outputs(name, causal):
    q, k, v = qkv(n=90)
    mask = padding(2, 90)
    m = effattn.build(name, head_dim=21, heads=3, stride=8)
    out = m(q, k, v, causal=causal, key_padding_mask=mask)
    k2 = k.masked_fill(mask[:, None, :, None], 7.0)
    v2 = v.masked_fill(mask[:, None, :, None], -9.0)
    torch.testing.assert_close(m(q, k2, v2, causal=causal, key_padding_mask=mask), out)
    assert not torch.allclose(m(q, k2, v2, causal=causal), out)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_refusals_name_the_reason(name):
    q, k, v = qkv(n=10)
    m = effattn.build(name, head_dim=21, heads=3)
    with pytest.raises(ValueError, match=f"{name} cannot do cross-attention.*aligned"):
        m(q, k[:, :, :7], v[:, :, :7])
    with pytest.raises(ValueError, match="cannot do recurrent decoding.*KV cache"):
        m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])


@pytest.mark.parametrize("name, option, value", [
    ("sparse-strided", "stride", 0), ("sparse-strided", "stride", 2.0),
    ("sparse-fixed", "stride", -3), ("sparse-fixed", "c", 0), ("sparse-fixed", "c", True),
])
def test_option_validation(name, option, value):
    with pytest.raises(ValueError, match=option):
        effattn.build(name, **{option: value})


def test_c_is_a_fixed_only_option():
    with pytest.raises(TypeError, match="c"):
        effattn.build("sparse-strided", c=4)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_scores_are_blockwise_never_n_by_n(monkeypatch, name):
    seen = []

    def spy(out, q, k, scale, biases, softcap=None):
        seen.append(q.shape[-2] * k.shape[-2] * q.shape[:-2].numel())
        return scores(out, q, k, scale, biases, softcap)

    scores = blockwise._scores
    monkeypatch.setattr(blockwise, "_scores", spy)
    n = 4096
    q, k, v = qkv(b=1, h=1, n=n, d=4, dv=1)
    effattn.attention(q, k, v, name, causal=True)
    # s = 64, causal: strided = band of 64 (2.5x in blocks) + up to 64 earlier rows of the
    # column; fixed = own block of 64 + up to 8 summaries of each of 64 blocks, and only the
    # earlier blocks' summaries are scored (about half).
    budget = n * (64 * 2.5 + 64) if name == "sparse-strided" else n * (64 + 8 * 64 * 0.6)
    assert 0 < sum(seen) <= budget < n * n / 4
