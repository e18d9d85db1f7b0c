"""longformer: sliding window + global tokens."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.sparse import blockwise


def _out_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                           dtype=out.dtype).to(out.device)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "n, window, global_tokens",
    [(1, 10, (0,)), (63, 10, (0,)), (63, 37, (62, 5, 0, 5)), (257, 21, ()),
     (257, 64, (3, 100, 101, 256)), (300, 128, (0, 299))],
)
def test_matches_reference_outputs_and_grads(masked, n, window, global_tokens, device):
    q, k, v = (t.to(device) for t in qkv(n=n, dv=7))
    mask = padding(2, n).to(device) if masked else None
    opts = {"window": window, "global_tokens": global_tokens}
    m = effattn.build("longformer", head_dim=21, heads=3, **opts)
    fast = _out_and_grads(lambda q, k, v: m(q, k, v, key_padding_mask=mask), q, k, v)
    ref = _out_and_grads(
        lambda q, k, v: R.longformer_attention(q, k, v, key_padding_mask=mask, **opts), q, k, v
    )
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_global_rows_and_columns_reach_everything():
    q, k, v = qkv(n=80)
    m = effattn.build("longformer", head_dim=21, heads=3, window=4, global_tokens=(40,))
    out = m(q, k, v)
    v2 = v.clone()
    v2[:, :, 0] += 1.0  # far outside every window: only the global query 40 sees it
    changed = (m(q, k, v2) - out).abs().amax((0, 1, 3)) > 0
    assert changed.nonzero().flatten().tolist() == [0, 1, 2, 40]
    v2 = v.clone()
    v2[:, :, 40] += 1.0  # the global key: every query sees it
    assert ((m(q, k, v2) - out).abs().amax((0, 1, 3)) > 0).all()


@pytest.mark.parametrize("n", [1, 63, 257])
def test_exact_limits(n, device):
    q, k, v = (t.to(device) for t in qkv(n=n))
    mask = padding(2, n).to(device)
    full = effattn.attention(q, k, v, key_padding_mask=mask)
    everyone = effattn.attention(q, k, v, "longformer", key_padding_mask=mask, window=2,
                                 global_tokens=tuple(range(n)))
    torch.testing.assert_close(everyone, full, rtol=1e-12, atol=1e-12)
    wide = effattn.attention(q, k, v, "longformer", key_padding_mask=mask, window=2 * n,
                             global_tokens=())
    torch.testing.assert_close(wide, full, rtol=1e-12, atol=1e-12)


def test_padded_keys_never_change_outputs():
    q, k, v = qkv(n=90)
    mask = padding(2, 90)
    mask[1, 5] = True  # a padded global token
    m = effattn.build("longformer", head_dim=21, heads=3, window=20, global_tokens=(5, 30, 89))
    out = m(q, k, v, key_padding_mask=mask)
    k2 = k.masked_fill(mask[:, None, :, None], 7.0)
    v2 = v.masked_fill(mask[:, None, :, None], -9.0)
    torch.testing.assert_close(m(q, k2, v2, key_padding_mask=mask), out)
    assert not torch.allclose(m(q, k2, v2), out)


def test_global_tokens_validated_at_build_and_call():
    q, k, v = qkv(n=10)
    m = effattn.build("longformer", head_dim=21, heads=3, global_tokens=(0, 10))
    with pytest.raises(ValueError, match=r"global_tokens \(0, 10\).*length 10"):
        m(q, k, v)
    for bad in (3, (1.5,), (-1,), (True,), "0"):
        with pytest.raises(ValueError, match="global_tokens"):
            effattn.build("longformer", global_tokens=bad)
    with pytest.raises(ValueError, match="window"):
        effattn.build("longformer", window=0)


def test_refusals_name_the_reason():
    q, k, v = qkv(n=10)
    m = effattn.build("longformer", head_dim=21, heads=3)
    with pytest.raises(ValueError, match="longformer cannot do causal.*bidirectional"):
        m(q, k, v, causal=True)
    with pytest.raises(ValueError, match="cannot do cross-attention.*aligned"):
        m(q, k[:, :, :7], v[:, :, :7])
    with pytest.raises(ValueError, match="cannot do recurrent decoding.*future"):
        m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])


def test_scores_never_n_by_n(monkeypatch):
    seen = []

    def spy(out, q, k, scale, biases, softcap=None):
        seen.append(q.shape[-2] * k.shape[-2] * q.shape[:-2].numel())
        return scores(out, q, k, scale, biases, softcap)

    scores = blockwise._scores
    monkeypatch.setattr(blockwise, "_scores", spy)
    q, k, v = qkv(b=1, h=1, n=2048, d=8)
    effattn.attention(q, k, v, "longformer", window=64, global_tokens=(0, 1000))
    # band (65 keys, at most 2.5x in blocks) + 2 global columns + 2 global rows
    assert 0 < sum(seen) <= 2048 * (65 * 2.5 + 2 + 2)
