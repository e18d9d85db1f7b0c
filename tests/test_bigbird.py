"""bigbird: window, global and seeded random blocks."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.mechanisms.bigbird import draw_random_blocks
from effattn.sparse import blockwise


def _out_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                           dtype=out.dtype).to(out.device)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


def _reference(m, q, k, v, mask=None):
    blocks = m.random_blocks(-(-q.shape[2] // m.block_size))
    return R.bigbird_attention(
        q, k, v, block_size=m.block_size, random_blocks=blocks,
        num_global_blocks=m.num_global_blocks, key_padding_mask=mask, scale=m.scale,
    )


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "n, block_size, num_random_blocks, num_global_blocks",
    [(1, 64, 3, 1), (63, 8, 2, 1), (63, 5, 3, 0), (257, 16, 3, 2), (300, 7, 4, 1),
     (300, 64, 1, 1)],
)
def test_matches_reference_outputs_and_grads(
    masked, n, block_size, num_random_blocks, num_global_blocks, device
):
    q, k, v = (t.to(device) for t in qkv(n=n, dv=7))
    mask = padding(2, n).to(device) if masked else None
    m = effattn.build("bigbird", head_dim=21, heads=3, seed=5, block_size=block_size,
                      num_random_blocks=num_random_blocks,
                      num_global_blocks=num_global_blocks).eval().to(device)
    fast = _out_and_grads(lambda q, k, v: m(q, k, v, key_padding_mask=mask), q, k, v)
    ref = _out_and_grads(lambda q, k, v: _reference(m, q, k, v, mask), q, k, v)
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n, opts", [(150, {}), (192, {}), (40, {"block_size": 16}),
                                     (200, {"block_size": 10, "num_random_blocks": 20}),
                                     (90, {"block_size": 30, "num_global_blocks": 0})])
def test_every_block_covered_is_exact_softmax(n, opts, device):
    q, k, v = (t.to(device) for t in qkv(n=n))
    mask = padding(2, n).to(device)
    out = effattn.attention(q, k, v, "bigbird", key_padding_mask=mask, seed=0, **opts)
    full = effattn.attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)


def test_pattern_is_sparse_when_blocks_are_not_all_covered():
    q, k, v = qkv(n=120)
    out = effattn.attention(q, k, v, "bigbird", seed=0, block_size=10, num_random_blocks=2)
    assert not torch.allclose(out, effattn.attention(q, k, v))


@pytest.mark.parametrize("nb, r, g", [(1, 3, 1), (2, 3, 0), (6, 3, 1), (6, 10, 2), (40, 3, 2)])
def test_random_blocks_are_distinct_and_outside_window_and_globals(nb, r, g):
    blocks = draw_random_blocks(nb, 4, r, g, torch.Generator().manual_seed(0))
    assert blocks.shape == (4, nb, r)
    for a in range(nb):
        covered = {a - 1, a, a + 1} | set(range(g))
        available = [x for x in range(nb) if x not in covered]
        for h in range(4):
            row = [x for x in blocks[h, a].tolist() if x >= 0]
            assert len(row) == len(set(row)) == min(r, len(available))
            assert set(row) <= set(available)


def test_random_blocks_are_uniform_among_available():
    blocks = draw_random_blocks(12, 3000, 3, 1, torch.Generator().manual_seed(0))
    counts = torch.bincount(blocks[:, 6].flatten(), minlength=12).double()
    available = [1, 2, 3, 4, 8, 9, 10, 11]
    assert counts[[0, 5, 6, 7]].sum() == 0
    expected = 3000 * 3 / len(available)
    assert (counts[available] - expected).abs().max() < 5 * expected**0.5


def test_seed_fixes_blocks_eval_is_fixed_training_redraws():
    q, k, v = qkv(n=200)
    kw = {"head_dim": 21, "heads": 3, "block_size": 10, "num_random_blocks": 2}
    a = effattn.build("bigbird", seed=1, **kw).eval()
    b = effattn.build("bigbird", seed=1, **kw).eval()
    c = effattn.build("bigbird", seed=2, **kw).eval()
    torch.testing.assert_close(a(q, k, v), b(q, k, v), rtol=0, atol=0)
    torch.testing.assert_close(a(q, k, v), a(q, k, v), rtol=0, atol=0)
    assert not torch.allclose(a(q, k, v), c(q, k, v))
    unseeded = effattn.build("bigbird", **kw).eval()
    torch.testing.assert_close(unseeded(q, k, v), unseeded(q, k, v), rtol=0, atol=0)
    eval_out = a(q, k, v)
    a.train()
    b.train()
    train_a = [a(q, k, v) for _ in range(3)]
    train_b = [b(q, k, v) for _ in range(3)]
    assert not torch.allclose(train_a[1], train_a[2])
    for x, y in zip(train_a, train_b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    a.eval()
    torch.testing.assert_close(a(q, k, v), eval_out, rtol=0, atol=0)


def test_padded_keys_never_change_outputs():
    q, k, v = qkv(n=130)
    mask = padding(2, 130)
    m = effattn.build("bigbird", head_dim=21, heads=3, seed=0, block_size=9).eval()
    out = m(q, k, v, key_padding_mask=mask)
    k2 = k.masked_fill(mask[:, None, :, None], 7.0)
    v2 = v.masked_fill(mask[:, None, :, None], -9.0)
    torch.testing.assert_close(m(q, k2, v2, key_padding_mask=mask), out)
    assert not torch.allclose(m(q, k2, v2), out)


def test_refusals_name_the_reason():
    q, k, v = qkv(n=10)
    m = effattn.build("bigbird", head_dim=21, heads=3)
    with pytest.raises(ValueError, match="bigbird cannot do causal.*bidirectional"):
        m(q, k, v, causal=True)
    with pytest.raises(ValueError, match="cannot do cross-attention.*aligned"):
        m(q, k[:, :, :7], v[:, :, :7])
    with pytest.raises(ValueError, match="cannot do recurrent decoding.*future"):
        m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])


@pytest.mark.parametrize("option, value", [("block_size", 0), ("block_size", 1.0),
                                           ("num_random_blocks", -1), ("num_global_blocks", -2),
                                           ("num_global_blocks", True)])
def test_option_validation(option, value):
    with pytest.raises(ValueError, match=option):
        effattn.build("bigbird", **{option: value})


def test_scores_never_n_by_n(monkeypatch):
    seen = []

    def spy(out, q, k, scale, biases, softcap=None):
        seen.append(q.shape[-2] * k.shape[-2] * q.shape[:-2].numel())
        return scores(out, q, k, scale, biases, softcap)

    scores = blockwise._scores
    monkeypatch.setattr(blockwise, "_scores", spy)
    q, k, v = qkv(b=1, h=1, n=2048, d=8)
    effattn.attention(q, k, v, "bigbird", block_size=32, seed=0)
    # 3 window + 1 global + 3 random blocks per query block, the global block's dense rows
    assert 0 < sum(seen) <= 2048 * 7 * 32 + 32 * 2048
