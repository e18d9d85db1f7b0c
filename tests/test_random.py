"""Random-subset attention: sampler, fast path vs dense reference, limits, causality, padding."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.mechanisms import random_subset as F


def _grads(fn, q, k, v, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return [out, *torch.autograd.grad((out * weights).sum(), (q, k, v))]


@pytest.mark.parametrize(
    "n, m, causal, ratio, block_elements",
    [
        (1, 1, False, 0.07, 1 << 22),
        (1, 1, True, 0.5, 1 << 22),
        (63, 63, False, 0.07, 1 << 22),
        (63, 63, True, 0.5, 1 << 22),
        (257, 257, True, 0.07, 1 << 22),
        (257, 257, False, 0.5, 1 << 22),
        (40, 17, False, 0.5, 1 << 22),
        (17, 40, False, 0.07, 1 << 22),
        # Blocks of a few queries (7 and 3 per block): the blockwise loops and the recomputing
        # backward across block edges.
        (63, 63, True, 0.3, 7 * 2 * 3 * 19 * 21),
        (40, 17, False, 0.5, 3 * 2 * 3 * 9 * 21),
    ],
)
def test_fast_path_matches_dense_reference(n, m, causal, ratio, block_elements, monkeypatch):
    monkeypatch.setattr(F, "_BLOCK_ELEMENTS", block_elements)
    q, k, v = qkv(n=n, m=m, dv=5)
    idx = F.sample_subsets(
        3, n, m, F.subset_size(m, ratio), causal=causal, generator=torch.Generator().manual_seed(n)
    )
    for mask in (None, padding(2, m)):
        kw = dict(indices=idx, causal=causal, key_padding_mask=mask, scale=0.4)
        fast = _grads(F.random_subset_attention, q, k, v, **kw)
        ref = _grads(R.random_subset_attention, q, k, v, **kw)
        for a, b in zip(fast, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_module_uses_its_pattern():
    q, k, v = qkv(n=63, m=50)
    attn = effattn.build("random", head_dim=21, heads=3, seed=3, ratio=0.2).eval()
    mask = padding(2, 50)
    ref = R.random_subset_attention(q, k, v, attn.subsets(63, 50, False), key_padding_mask=mask)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=mask), ref)


def test_subset_size():
    assert F.subset_size(10, 0.3) == 3  # 0.3 * 10 = 3.0000000000000004
    assert F.subset_size(10, 0.31) == 4
    assert F.subset_size(10, 0.01) == 1
    assert F.subset_size(7, 1.0) == 7


def test_sampler_is_stratified_without_replacement():
    g = torch.Generator().manual_seed(0)
    m, size = 103, 10
    idx = F.sample_subsets(4, 300, m, size, generator=g).long()
    assert idx.shape == (4, 300, size) and idx.dtype == torch.long
    lo = torch.arange(size) * m // size
    hi = (torch.arange(size) + 1) * m // size
    assert ((idx >= lo) & (idx < hi)).all()  # one key per stratum, so all distinct
    # Every key is drawn, with frequency about 1 / |stratum| per query.
    counts = torch.bincount(idx.flatten(), minlength=m).float() / (4 * 300)
    size_of = (hi - lo).repeat_interleave(hi - lo).float()
    assert (counts - 1 / size_of).abs().max() < 0.05
    assert torch.equal(F.sample_subsets(2, 5, 5, 5), torch.arange(5).expand(2, 5, 5).int())


def test_causal_sampler_keeps_self_and_stays_in_the_past():
    idx = F.sample_subsets(3, 200, 200, 13, causal=True, generator=torch.Generator()).long()
    i = torch.arange(200)[:, None]
    count = torch.clamp(torch.arange(200) + 1, max=13)
    used = idx >= 0
    assert torch.equal(used.sum(-1), count.expand(3, 200))
    assert (idx <= i).all()
    assert torch.equal(idx.gather(-1, (count - 1).view(1, 200, 1).expand(3, 200, 1))[..., 0],
                       torch.arange(200).expand(3, 200))
    kept = torch.where(used, idx, -torch.arange(13) - 1)  # distinct fillers for unused slots
    assert (kept.sort(-1).values.diff(dim=-1) > 0).all()  # no key twice
    assert torch.equal(idx[:, :13].sort(-1).values[:, 12], torch.arange(13).expand(3, 13))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, m", [(1, 1), (45, 45), (20, 45), (45, 20)])
def test_ratio_one_is_exact_softmax(causal, n, m):
    if causal and n != m:
        pytest.skip("causal needs N == M")
    q, k, v = qkv(n=n, m=m, dv=4, scale=2.0)
    attn = effattn.build("random", head_dim=21, heads=3, ratio=1.0)
    for mask in (None, padding(2, m)):
        out = attn(q, k, v, causal=causal, key_padding_mask=mask)
        exact = R.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(out, exact, rtol=1e-10, atol=1e-10)


def test_causal_has_no_future_leakage():
    q, k, v = qkv(n=63)
    attn = effattn.build("random", head_dim=21, heads=3, seed=1, ratio=0.2).eval()
    out = attn(q, k, v, causal=True)
    t = 30
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t:] = 5 * torch.randn(x[:, :, t:].shape, dtype=x.dtype)
    out2 = attn(q2, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, :t], out[:, :, :t], rtol=0, atol=0)
    assert not torch.allclose(out2[:, :, t:], out[:, :, t:])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_never_change_outputs(causal):
    q, k, v = qkv(n=63)
    mask = padding(2, 63)
    attn = effattn.build("random", head_dim=21, heads=3, seed=2, ratio=0.3).eval()
    out = attn(q, k, v, causal=causal, key_padding_mask=mask)
    at = mask[:, None, :, None]
    k2 = torch.where(at, 100 * torch.randn_like(k), k)
    v2 = torch.where(at, 100 * torch.randn_like(v), v)
    torch.testing.assert_close(
        attn(q, k2, v2, causal=causal, key_padding_mask=mask), out, rtol=0, atol=1e-12
    )
    assert not torch.allclose(attn(q, k2, v2, causal=causal), attn(q, k, v, causal=causal))


def test_query_whose_sample_is_all_padding_outputs_zero():
    q, k, v = qkv(n=40, m=40)
    attn = effattn.build("random", head_dim=21, heads=3, seed=0, ratio=0.05).eval()  # 2 keys
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[:, :30] = True
    out = attn(q, k, v, key_padding_mask=mask)
    hit = ~mask[:, attn.subsets(40, 40, False).long()]  # (B, H, N, S): unpadded samples
    empty = ~hit.any(-1)
    assert empty.any() and (~empty).any()
    assert torch.isfinite(out).all()
    assert out[empty].abs().max() == 0 and out[~empty].abs().min() > 0


def test_seeds_eval_fixed_training_redraws():
    q, k, v = qkv(n=63)

    def build(seed):
        return effattn.build("random", head_dim=21, heads=3, seed=seed, ratio=0.1)

    a, b, c = build(3).eval(), build(3).eval(), build(4).eval()
    out = a(q, k, v)
    torch.testing.assert_close(b(q, k, v), out, rtol=0, atol=0)
    torch.testing.assert_close(a(q, k, v), out, rtol=0, atol=0)
    assert not torch.allclose(c(q, k, v), out)
    a.train()
    b.train()
    first, second = a(q, k, v), a(q, k, v)
    assert not torch.allclose(first, second)
    torch.testing.assert_close(b(q, k, v), first, rtol=0, atol=0)
    torch.testing.assert_close(a.eval()(q, k, v), out, rtol=0, atol=0)
    unseeded = effattn.build("random", head_dim=21, heads=3).eval()
    torch.testing.assert_close(unseeded(q, k, v), unseeded(q, k, v), rtol=0, atol=0)


def test_refusals_and_validation():
    attn = effattn.build("random", head_dim=21, heads=3)
    q, k, v = qkv(n=1)
    with pytest.raises(ValueError, match="random cannot do recurrent decoding.*the pattern"):
        attn.step(q, k, v)
    for bad in (0, 0.0, -0.1, 1.5, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="ratio"):
            effattn.build("random", ratio=bad)
    q, k, v = qkv(n=10, m=12)
    with pytest.raises(ValueError, match="indices"):
        F.random_subset_attention(q, k, v, torch.zeros(3, 10, 2, dtype=torch.long) + 12)
    with pytest.raises(ValueError, match="indices"):
        F.random_subset_attention(q, k, v, torch.zeros(3, 9, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="causal sampling needs N == M"):
        F.sample_subsets(3, 10, 12, 2, causal=True)
