"""local (sliding window, dilation) and the shared blockwise engine of effattn.sparse."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.sparse import banded_attention, blockwise


def _out_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                           dtype=out.dtype).to(out.device)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n, window, dilation",
    [(1, 10, 1), (63, 10, 1), (63, 37, 3), (257, 1, 1), (257, 64, 5), (300, 37, 3),
     (300, 128, 1)],
)
def test_matches_reference_outputs_and_grads(n, causal, window, dilation, device):
    q, k, v = (t.to(device) for t in qkv(n=n, dv=7))
    mask = padding(2, n).to(device)
    opts = {"window": window, "dilation": dilation}
    m = effattn.build("local", head_dim=21, heads=3, **opts)
    fast = _out_and_grads(lambda q, k, v: m(q, k, v, causal=causal, key_padding_mask=mask),
                          q, k, v)
    ref = _out_and_grads(
        lambda q, k, v: R.local_attention(q, k, v, causal=causal, key_padding_mask=mask, **opts),
        q, k, v,
    )
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
@pytest.mark.parametrize("left, right, dilation", [(0, 0, 1), (7, 0, 1), (9, 4, 2), (30, 30, 4)])
def test_banded_engine_any_block_size_matches_dense(block_size, left, right, dilation, device):
    q, k, v = (t.to(device) for t in qkv(n=61, dv=5))
    mask = padding(2, 61).to(device)
    out, lse = banded_attention(q, k, v, left=left, right=right, dilation=dilation, scale=0.3,
                                key_mask=mask, block_size=block_size)
    i, j = torch.arange(61, device=device)[:, None], torch.arange(61, device=device)[None, :]
    allowed = (i - j <= left) & (j - i <= right) & ((i - j) % dilation == 0) & ~mask[:, None, None]
    scores = (0.3 * q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, -1).nan_to_num(0.0) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("n", [1, 63, 257])
def test_exact_limits(n):
    q, k, v = qkv(n=n)
    mask = padding(2, n)
    full = effattn.attention(q, k, v, key_padding_mask=mask)
    causal = effattn.attention(q, k, v, causal=True, key_padding_mask=mask)
    # causal: the last `window` positions, so window >= N is causal softmax.
    for window in (n, n + 7):
        out = effattn.attention(q, k, v, "local", causal=True, key_padding_mask=mask,
                                window=window)
        torch.testing.assert_close(out, causal, rtol=1e-12, atol=1e-12)
    # non-causal: window // 2 to each side, so window // 2 >= N - 1 is softmax.
    for window in (2 * n - 2, 2 * n - 1, 10**6):
        out = effattn.attention(q, k, v, "local", key_padding_mask=mask, window=max(1, window))
        torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    if n > 2:
        narrower = effattn.attention(q, k, v, "local", key_padding_mask=mask, window=2 * n - 4)
        assert not torch.allclose(narrower, full)


def test_no_future_leakage():
    q, k, v = qkv(n=100)
    m = effattn.build("local", head_dim=21, heads=3, window=17, dilation=2)
    out = m(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 60:] += 5.0
    v2[:, :, 60:] -= 3.0
    out2 = m(q, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, :60], out[:, :, :60], rtol=0, atol=0)
    assert not torch.allclose(out2[:, :, 60:], out[:, :, 60:])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_never_change_outputs(causal):
    q, k, v = qkv(n=90)
    mask = padding(2, 90)
    m = effattn.build("local", head_dim=21, heads=3, window=30, dilation=3)
    out = m(q, k, v, causal=causal, key_padding_mask=mask)
    k2 = k.masked_fill(mask[:, None, :, None], 7.0)
    v2 = v.masked_fill(mask[:, None, :, None], -9.0)
    torch.testing.assert_close(m(q, k2, v2, causal=causal, key_padding_mask=mask), out)
    assert not torch.allclose(m(q, k2, v2, causal=causal), out)


def test_rows_whose_window_is_all_padding_give_zero_and_finite_grads():
    q, k, v = qkv(n=40)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, :20] = True
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = effattn.attention(q, k, v, "local", key_padding_mask=mask, window=10)
    assert out[0, :, :15].abs().max() == 0 and out[0, :, 16:].abs().min() > 0
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("window, dilation", [(1, 1), (6, 1), (7, 3), (64, 2)])
def test_step_equals_causal_forward_with_window_sized_state(window, dilation):
    q, k, v = qkv(n=41, dv=6)
    m = effattn.build("local", head_dim=21, heads=3, window=window, dilation=dilation)
    state, outs = None, []
    for t in range(41):
        o, state = m.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(o)
    assert state.k.shape[2] == window and state.v.shape == (2, 3, window, 6)
    torch.testing.assert_close(torch.cat(outs, 2), m(q, k, v, causal=True))


def test_step_rejects_foreign_state():
    q, k, v = qkv(n=1)
    m = effattn.build("local", head_dim=21, heads=3, window=4)
    _, state = effattn.build("local", head_dim=21, heads=3, window=5).step(q, k, v)
    with pytest.raises(ValueError, match="window 4"):
        m.step(q, k, v, state)


def test_cross_attention_refused_with_reason():
    q, _, _ = qkv(n=10)
    _, k, v = qkv(n=12)
    with pytest.raises(ValueError, match="local cannot do cross-attention.*aligned"):
        effattn.attention(q, k, v, "local")


@pytest.mark.parametrize("option, value", [("window", 0), ("window", 2.5), ("window", True),
                                           ("dilation", 0), ("dilation", None)])
def test_option_validation(option, value):
    with pytest.raises(ValueError, match=option):
        effattn.build("local", **{option: value})


def test_scores_are_banded_never_n_by_n(monkeypatch):
    seen = []

    def spy(out, q, k, scale, biases, softcap=None):
        seen.append(q.shape[-2] * k.shape[-2] * q.shape[:-2].numel())
        return scores(out, q, k, scale, biases, softcap)

    scores = blockwise._scores
    monkeypatch.setattr(blockwise, "_scores", spy)
    q, k, v = qkv(b=1, h=1, n=2048, d=8)
    effattn.attention(q, k, v, "local", window=64)
    undilated = sum(seen)
    seen.clear()
    effattn.attention(q, k, v, "local", window=64, dilation=4)
    # 65 keys in the window: the blocks compute at most 2.5x that, and dilation computes less.
    assert 0 < sum(seen) < undilated <= 2048 * 65 * 2.5


def _dense_softmax(q, k, v, allowed, scale):
    scores = (scale * q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v, torch.logsumexp(scores, -1)


def _engine_vs_dense(engine, allowed, q, k, v):
    """Outputs and q, k, v gradients of (out, lse) with random upstream weights on both."""
    results = []
    for fn in (engine, lambda q, k, v: _dense_softmax(q, k, v, allowed, 0.3)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(*leaves)
        g = torch.Generator().manual_seed(1)
        weight_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
        weight_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
        loss = (out * weight_out).sum() + (lse.nan_to_num(0.0, neginf=0.0) * weight_lse).sum()
        results.append((out, lse, *torch.autograd.grad(loss, leaves)))
    return results


@pytest.mark.parametrize("slice_elements", [1, 1000, 1 << 21])
@pytest.mark.parametrize("left, right, block_size", [(7, 0, 4), (9, 4, 5), (30, 30, 16)])
def test_banded_gradients_of_out_and_lse_match_dense_in_any_slicing(
    monkeypatch, slice_elements, left, right, block_size
):
    # Slices of one query block up to all of them: windows cross the ends of the flat blocks
    # and the boundaries between sequences.
    monkeypatch.setattr(blockwise, "SLICE_ELEMENTS", slice_elements)
    q, k, v = qkv(n=61, dv=5)
    mask = padding(2, 61)
    mask[1] = True  # a sequence without keys: out 0, lse -inf, zero gradients
    i, j = torch.arange(61)[:, None], torch.arange(61)[None, :]
    allowed = (i - j <= left) & (j - i <= right) & ~mask[:, None, None]
    fast, dense = _engine_vs_dense(
        lambda q, k, v: banded_attention(q, k, v, left=left, right=right, scale=0.3,
                                         key_mask=mask, block_size=block_size),
        allowed, q, k, v,
    )
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("slice_elements", [1, 1000, 1 << 21])
@pytest.mark.parametrize("left, right, tokens", [(3, 3, (0,)), (9, 4, (60, 2, 30)), (5, 0, (7,))])
def test_banded_with_global_tokens_matches_dense_in_any_slicing(
    monkeypatch, slice_elements, left, right, tokens
):
    monkeypatch.setattr(blockwise, "SLICE_ELEMENTS", slice_elements)
    q, k, v = qkv(b=3, n=61, dv=5)
    mask = padding(3, 61)
    mask[0, tokens[0]] = True  # a padded global token is no key, but still a global row
    mask[1] = True  # a sequence without keys: out 0, lse -inf, zero gradients
    i, j = torch.arange(61)[:, None], torch.arange(61)[None, :]
    is_global = torch.zeros(61, dtype=torch.bool)
    is_global[list(tokens)] = True
    allowed = (i - j <= left) & (j - i <= right) | is_global[:, None] | is_global[None, :]
    allowed = allowed & ~mask[:, None, None]
    fast, dense = _engine_vs_dense(
        lambda q, k, v: banded_attention(q, k, v, left=left, right=right, scale=0.3,
                                         key_mask=mask, global_tokens=torch.tensor(tokens)),
        allowed, q, k, v,
    )
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("slice_elements", [1, 1 << 21])
def test_dilated_band_with_global_tokens_matches_dense(monkeypatch, slice_elements):
    # Residue classes of unequal length (61 = 4 * 15 + 1) and a global key inside the band.
    monkeypatch.setattr(blockwise, "SLICE_ELEMENTS", slice_elements)
    q, k, v = qkv(n=61, dv=5)
    mask = padding(2, 61)
    tokens = (3, 40)
    i, j = torch.arange(61)[:, None], torch.arange(61)[None, :]
    is_global = torch.zeros(61, dtype=torch.bool)
    is_global[list(tokens)] = True
    band = (i - j <= 9) & (j - i <= 5) & ((i - j) % 4 == 0)
    allowed = (band | is_global[:, None] | is_global[None, :]) & ~mask[:, None, None]
    fast, dense = _engine_vs_dense(
        lambda q, k, v: banded_attention(q, k, v, left=9, right=5, dilation=4, scale=0.3,
                                         key_mask=mask, global_tokens=torch.tensor(tokens)),
        allowed, q, k, v,
    )
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("slice_elements", [1, 1 << 21])
def test_gathered_blocks_with_per_head_blocks_and_pattern_match_dense(monkeypatch, slice_elements):
    monkeypatch.setattr(blockwise, "SLICE_ELEMENTS", slice_elements)
    c, n, h = 4, 21, 3
    q, k, v = qkv(b=2, h=h, n=n, dv=5)
    mask = padding(2, n)
    # Per head, every query block sees its own block and one other (or -1, unused).
    g = torch.Generator().manual_seed(3)
    nb = -(-n // c)
    own = torch.arange(nb).expand(h, nb)
    other = (own + torch.randint(1, nb, (h, nb), generator=g)) % nb
    other = other.masked_fill(torch.rand(h, nb, generator=g) < 0.3, -1)
    key_blocks = torch.stack([own, other], -1)
    # Causal within the own block only (pattern (C, 2C)).
    pattern = torch.cat([torch.ones(c, c, dtype=torch.bool).tril(), torch.ones(c, c, dtype=bool)],
                        1)
    qblock, kblock = torch.arange(n)[:, None] // c, torch.arange(n)[None, :] // c
    inside = torch.arange(n)[:, None] % c >= torch.arange(n)[None, :] % c
    allowed = torch.zeros(h, n, n, dtype=torch.bool)
    for head in range(h):
        mine = kblock == qblock
        extra = kblock == other[head][qblock]
        allowed[head] = (mine & inside) | (extra & (other[head][qblock] >= 0))
    allowed = allowed[None] & ~mask[:, None, None, :]
    fast, dense = _engine_vs_dense(
        lambda q, k, v: blockwise.block_gather_attention(
            q, k, v, key_blocks, block_size=c, scale=0.3, key_mask=mask, pattern=pattern),
        allowed, q, k, v,
    )
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("slice_elements", [1, 1000, 1 << 21])
def test_gathered_blocks_with_global_tokens_match_dense(monkeypatch, slice_elements):
    # Global tokens inside listed key blocks are counted once; a padded global token is no key
    # but still a global row; a sequence without keys gives 0, -inf and zero gradients.
    monkeypatch.setattr(blockwise, "SLICE_ELEMENTS", slice_elements)
    c, n, h, tokens = 4, 21, 3, [0, 1, 9, 20]
    q, k, v = qkv(b=3, h=h, n=n, dv=5)
    mask = padding(3, n)
    mask[0, 9] = True
    mask[2] = True
    g = torch.Generator().manual_seed(5)
    nb = -(-n // c)
    own = torch.arange(nb).expand(h, nb)
    other = (own + torch.randint(1, nb, (h, nb), generator=g)) % nb
    other = other.masked_fill(torch.rand(h, nb, generator=g) < 0.3, -1)
    key_blocks = torch.stack([own, other], -1)
    qblock, kblock = torch.arange(n)[:, None] // c, torch.arange(n)[None, :] // c
    is_global = torch.zeros(n, dtype=torch.bool)
    is_global[tokens] = True
    allowed = torch.zeros(h, n, n, dtype=torch.bool)
    for head in range(h):
        listed = (kblock == qblock) | (kblock == other[head][qblock])
        allowed[head] = listed | is_global[:, None] | is_global[None, :]
    allowed = allowed[None] & ~mask[:, None, None, :]
    fast, dense = _engine_vs_dense(
        lambda q, k, v: blockwise.block_gather_attention(
            q, k, v, key_blocks, block_size=c, scale=0.3, key_mask=mask,
            global_tokens=torch.tensor(tokens)),
        allowed, q, k, v,
    )
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b)


def test_gathered_global_tokens_need_aligned_positions():
    q, k, v = qkv(n=8)
    with pytest.raises(ValueError, match="global_tokens need aligned positions"):
        blockwise.block_gather_attention(q, k[:, :, :4], v[:, :, :4], torch.zeros(2, 1).long(),
                                         block_size=4, scale=0.3, global_tokens=torch.tensor([0]))


@pytest.mark.parametrize(
    "name, options, causal, n",
    [
        ("local", {"window": 64}, False, 1024),
        ("local", {"window": 64}, False, 1000),
        ("local", {"window": 64}, True, 1000),
        ("local", {"window": 64, "dilation": 3}, True, 1000),
        ("longformer", {"window": 64, "global_tokens": (0, 500)}, False, 1000),
        ("bigbird", {"block_size": 32}, False, 1000),
        ("sparse-strided", {}, True, 1000),
        ("sparse-strided", {}, False, 1024),
        ("sparse-fixed", {}, True, 1000),
        ("sparse-fixed", {}, False, 1024),
    ],
)
def test_forward_keeps_only_q_k_v_out_and_lse_for_backward(name, options, causal, n):
    # What the banded engine saves for its backward: the inputs themselves (no padded, folded
    # or gathered copy), out and one log-sum-exp per row; no scores, probabilities or gathered
    # keys of any piece. Was: padded or folded copies of q, k, v wherever N is not a multiple
    # of the block size or dilation > 1, and the scores of sparse-*'s second piece (10-15x q).
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    q, k, v = (t.requires_grad_(True)
               for t in qkv(b=2, h=2, n=n, d=16, dv=8, dtype=torch.float32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = effattn.attention(q, k, v, name, causal=causal, key_padding_mask=padding(2, n),
                                seed=0, **options)
    assert {t.untyped_storage().data_ptr() for t in (q, k, v, out)} <= saved.keys()
    rows = out.shape[:-1].numel()
    # At most one block (<= 128 rows) of spare rows beyond out and lse.
    spare = 128 * (out.shape[-1] + 1) * out.element_size()
    kept = q.nbytes + k.nbytes + v.nbytes + out.nbytes + rows * out.element_size()
    assert sum(saved.values()) <= kept + spare
