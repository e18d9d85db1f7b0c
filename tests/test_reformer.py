"""Reformer LSH attention: fast path vs dense reference, exact limits, causality, padding, seeds."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.mechanisms import reformer as F


def _inputs(n, m, shared, seed=0, dv=5, device="cpu"):
    q, k, v = (t.to(device) for t in qkv(b=2, h=3, n=n, m=m, d=21, dv=dv, seed=seed))
    return q, (q if shared else k), v


def _grads(fn, q, k, v, shared, **kw):
    q = q.clone().requires_grad_()
    k = q if shared else k.clone().requires_grad_()
    v = v.clone().requires_grad_()
    out = fn(q, k, v, **kw)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    leaves = [q, v] if shared else [q, k, v]
    return [out, *torch.autograd.grad((out * weights).sum(), leaves)]


CASES = [
    # (n, m, shared_qk, causal)
    (1, 1, False, True),
    (63, 63, False, False),
    (63, 63, False, True),
    (257, 257, False, True),
    (40, 17, False, False),
    (17, 40, False, False),
    (1, 1, True, True),
    (63, 63, True, False),
    (63, 63, True, True),
    (257, 257, True, False),
]


@pytest.mark.parametrize("n, m, shared, causal", CASES)
@pytest.mark.parametrize("group_elements", [None, 2500], ids=["one-group", "grouped"])
def test_fast_path_matches_dense_reference(n, m, shared, causal, group_elements, monkeypatch,
                                           device):
    bucket_size = 8  # lengths are not multiples of it; many buckets and chunks
    if group_elements is not None:
        # Chunks in groups of 1 (C = 16) or 3 (shared, C = 8), the last one short.
        monkeypatch.setattr(F, "GROUP_ELEMENTS", group_elements)
    q, k, v = _inputs(n, m, shared, device=device)
    rotations = F.draw_rotations(
        3, 3, 21, F.num_buckets(n, m, bucket_size), generator=torch.Generator().manual_seed(n)
    ).double().to(device)
    for mask in (None, padding(2, m).to(device)):
        kw = dict(
            rotations=rotations,
            bucket_size=bucket_size,
            causal=causal,
            key_padding_mask=mask,
            shared_qk=shared,
            scale=0.3,
        )
        fast = _grads(F.reformer_attention, q, k, v, shared, **kw)
        ref = _grads(R.reformer_attention, q, k, v, shared, **kw)
        for a, b in zip(fast, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if n > 2 * bucket_size:
        # The test is not vacuous: each query sees only part of the keys.
        seen = R.reformer_candidates(
            q, k, rotations, bucket_size=bucket_size, causal=causal, shared_qk=shared
        )
        assert seen.float().mean() < 0.9


@pytest.mark.parametrize("shared", [False, True])
def test_module_hashes_with_its_rotations(shared, device):
    q, k, v = _inputs(63, 63, shared, device=device)
    attn = effattn.build(
        "reformer", head_dim=21, heads=3, seed=5, n_hashes=2, bucket_size=8, shared_qk=shared
    ).eval().to(device)
    mask = padding(2, 63).to(device)
    out = attn(q, k, v, causal=True, key_padding_mask=mask)
    ref = R.reformer_attention(
        q, k, v, attn.rotations(63, 63).double().to(device), bucket_size=8, causal=True,
        key_padding_mask=mask, shared_qk=shared,
    )
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, m", [(1, 1), (30, 30), (17, 30), (30, 17)])
def test_one_chunk_is_exact_softmax(causal, n, m, device):
    if causal and n != m:
        pytest.skip("causal needs N == M")
    q, k, v = (t.to(device) for t in qkv(n=n, m=m, dv=4, scale=2.0))
    mask = padding(2, m).to(device)
    attn = effattn.build("reformer", head_dim=21, heads=3, seed=0, n_hashes=3,
                         bucket_size=30).to(device)
    for pad in (None, mask):
        out = attn(q, k, v, causal=causal, key_padding_mask=pad)
        exact = R.softmax_attention(q, k, v, causal=causal, key_padding_mask=pad)
        torch.testing.assert_close(out, exact, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_shared_qk_one_chunk_is_softmax_without_the_diagonal(causal, device):
    q, _, v = (t.to(device) for t in qkv(n=20, dv=4))
    attn = effattn.build(
        "reformer", head_dim=21, heads=3, seed=0, n_hashes=2, bucket_size=32, shared_qk=True
    ).to(device)
    out = attn(q, q, v, causal=causal)
    keys = q / q.norm(dim=-1, keepdim=True)
    scores = q @ keys.transpose(-2, -1) / 21**0.5
    blocked = torch.eye(20, dtype=torch.bool, device=device)
    if causal:
        blocked |= torch.ones(20, 20, dtype=torch.bool, device=device).triu(1)
        blocked[0, 0] = False  # token 0 has no other key: it attends to itself
    expected = torch.softmax(scores.masked_fill(blocked, float("-inf")), -1) @ v
    torch.testing.assert_close(out, expected)
    if causal:
        torch.testing.assert_close(out[:, :, 0], v[:, :, 0])


def test_number_of_buckets_rule():
    assert F.num_buckets(64, 64, 64) == 1
    assert F.num_buckets(65, 10, 64) == 2
    assert F.num_buckets(10, 200, 64) == 4
    assert F.num_buckets(1000, 1000, 64) == 16
    with pytest.raises(ValueError, match="n_buckets"):
        F.draw_rotations(1, 1, 4, 3)


def test_block_size_rule():
    assert F.block_sizes(1000, 1000, 64, shared_qk=False) == (64, 128)
    assert F.block_sizes(1000, 1000, 64, shared_qk=True) == (64, 128)
    # Cross-attention: about one bucket of queries per chunk, two buckets of keys per window.
    assert F.block_sizes(250, 1000, 64, shared_qk=False) == (16, 128)
    assert F.block_sizes(1000, 250, 64, shared_qk=False) == (64, 32)
    # Capped at what there is.
    assert F.block_sizes(143, 143, 4096, shared_qk=False) == (143, 143)
    assert F.block_sizes(143, 143, 4096, shared_qk=True) == (143, 286)
    assert F.block_sizes(5, 77, 64, shared_qk=False) == (5, 77)
    assert F.block_sizes(1, 1, 1, shared_qk=False) == (1, 1)


@pytest.mark.parametrize(
    "n, m, shared, bucket_size",
    [(143, 143, False, 4096), (143, 143, True, 4096), (17, 40, False, 4096), (5, 77, False, 64)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_bucket_size_past_the_sequence_is_capped(n, m, shared, bucket_size, causal, device):
    """A bucket_size past the sequence gives one chunk of every query and one window of every
    key (never 2·bucket_size columns for a short sequence), and the reference's result."""
    if causal and n != m:
        pytest.skip("causal needs N == M")
    q, k, v = _inputs(n, m, shared, device=device)
    mask = padding(2, m).to(device)
    rotations = F.draw_rotations(
        3, 2, 21, F.num_buckets(n, m, bucket_size), generator=torch.Generator().manual_seed(0)
    ).double().to(device)
    layout = F._layout(q, k, rotations, mask, bucket_size, causal, shared)
    chunk, width = F.block_sizes(n, m, bucket_size, shared)
    assert layout.rows.shape[-2:] == (1, n) and chunk == n
    assert layout.cols.shape[-1] == width == (2 * n if shared else m)
    kw = dict(bucket_size=bucket_size, causal=causal, key_padding_mask=mask, shared_qk=shared)
    out = F.reformer_attention(q, k, v, rotations, **kw)
    torch.testing.assert_close(out, R.reformer_attention(q, k, v, rotations, **kw),
                               rtol=1e-10, atol=1e-10)
    if bucket_size >= max(n, m) and not shared:
        exact = R.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(out, exact, rtol=1e-10, atol=1e-10)


def test_angular_hash_depends_on_direction_only():
    x = torch.randn(2, 3, 50, 8, dtype=torch.float64)
    rotations = F.draw_rotations(3, 2, 8, 6, generator=torch.Generator().manual_seed(1))
    b = F.lsh_buckets(x, rotations)
    assert b.shape == (2, 3, 2, 50) and b.min() >= 0 and b.max() < 6 and len(b.unique()) == 6
    assert torch.equal(F.lsh_buckets(3.5 * x, rotations), b)
    assert torch.equal(F.lsh_buckets(-x, rotations), (b + 3) % 6)  # antipodes: opposite bucket


@pytest.mark.parametrize("shared", [False, True])
def test_causal_has_no_future_leakage(shared):
    q, k, v = _inputs(63, 63, shared)
    attn = effattn.build(
        "reformer", head_dim=21, heads=3, seed=1, n_hashes=3, bucket_size=4, shared_qk=shared
    ).eval()
    out = attn(q, k, v, causal=True)
    t = 30
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    g = torch.Generator().manual_seed(7)
    q2[:, :, t:] = torch.randn(q2[:, :, t:].shape, generator=g, dtype=q.dtype)
    k2[:, :, t:] = torch.randn(k2[:, :, t:].shape, generator=g, dtype=q.dtype)
    v2[:, :, t:] = torch.randn(v2[:, :, t:].shape, generator=g, dtype=q.dtype)
    if shared:
        k2 = q2
    out2 = attn(q2, k2, v2, causal=True)
    # Same candidate sets; only the summation order inside the chunks moves (rounding).
    torch.testing.assert_close(out2[:, :, :t], out[:, :, :t], rtol=0, atol=1e-12)
    assert not torch.allclose(out2[:, :, t:], out[:, :, t:])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_never_change_unpadded_outputs(shared, causal):
    q, k, v = _inputs(63, 63, shared)
    mask = padding(2, 63)
    attn = effattn.build(
        "reformer", head_dim=21, heads=3, seed=2, n_hashes=2, bucket_size=8, shared_qk=shared
    ).eval()
    out = attn(q, k, v, causal=causal, key_padding_mask=mask)
    noise = 100 * torch.randn(2, 3, 63, 21, dtype=q.dtype)
    at = mask[:, None, :, None]
    q2 = torch.where(at, noise, q) if shared else q
    k2 = q2 if shared else torch.where(at, noise, k)
    v2 = torch.where(at, -noise[..., :5], v)
    out2 = attn(q2, k2, v2, causal=causal, key_padding_mask=mask)
    real = ~mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out2[real], out[real], rtol=0, atol=1e-12)
    if not shared:
        torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True])
def test_fully_padded_rows_are_zero_and_causal_queries_never_empty(shared):
    q, k, v = _inputs(40, 40, shared)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0] = True
    attn = effattn.build("reformer", head_dim=21, heads=3, seed=0, bucket_size=8, shared_qk=shared)
    out = attn(q, k, v, causal=True, key_padding_mask=mask)
    # Row 1 is unpadded: every causal query keeps at least its own key (shared: self fallback;
    # not shared: key i is always a candidate), so no output is 0.
    assert torch.isfinite(out).all() and out[0].abs().max() == 0 and out[1].abs().min() > 0
    out = attn(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0


@pytest.mark.parametrize("bucket_size", [16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_large_logits_give_no_zero_row_and_match_the_reference(bucket_size, dtype, device):
    # Causal, q and k entries ~50 at D = 16 (logits ~1e4), N = 143, two rounds. A query whose
    # round has no new candidate must not report a row max of 0 to the merge of rounds: there
    # it would outrank real maxima of -1e4, their exp would underflow and the row come out 0.
    q, k, v = (t.to(device) for t in qkv(n=143, d=16, dv=5, scale=50.0))
    attn = effattn.build(
        "reformer", head_dim=16, heads=3, seed=0, n_hashes=2, bucket_size=bucket_size
    ).eval().to(device)
    rotations = attn.rotations(143, 143).double().to(device)
    for mask in (None, padding(2, 143).to(device)):
        kw = dict(bucket_size=bucket_size, causal=True, key_padding_mask=mask)
        sees = R.reformer_candidates(q, k, rotations, **kw).any(-1)
        out = attn(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, key_padding_mask=mask)
        zero = (out == 0).all(-1)
        assert not zero[sees].any(), f"{int(zero[sees].sum())} zero rows of queries with keys"
        assert torch.isfinite(out).all() and not out[~sees].any()
        if dtype == torch.float64:
            kw["rotations"] = rotations
            fast = _grads(F.reformer_attention, q, k, v, False, **kw)
            ref = _grads(R.reformer_attention, q, k, v, False, **kw)
            for a, b in zip(fast, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_causal_query_sees_its_own_key_when_its_bucket_has_no_past(device):
    # n_buckets = 16 for N = 63, bucket_size 4: query 0 rarely shares a bucket with key 0.
    q, k, v = (t.to(device) for t in qkv(n=63, dv=4))
    rotations = F.draw_rotations(3, 1, 21, 16, generator=torch.Generator().manual_seed(0))
    out = F.reformer_attention(q, k, v, rotations.double().to(device), bucket_size=4,
                               causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])


def test_refusals_and_option_validation():
    attn = effattn.build("reformer", head_dim=21, heads=3)
    q, k, v = qkv(n=1)
    with pytest.raises(ValueError, match="reformer cannot do recurrent decoding.*n_buckets"):
        attn.step(q, k, v)
    shared = effattn.build("reformer", head_dim=21, heads=3, shared_qk=True)
    q, k, v = qkv(n=10, m=12)
    with pytest.raises(ValueError, match="shared_qk=True cannot do cross-attention"):
        shared(q, k, v)
    q, k, v = qkv(n=10)
    with pytest.raises(ValueError, match="k equal to q"):
        shared(q, k, v)
    shared(q, q.clone(), v)  # equal values are fine
    for bad in ({"n_hashes": 0}, {"bucket_size": 1.5}, {"bucket_size": True}, {"shared_qk": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            effattn.build("reformer", **bad)
    with pytest.raises(ValueError, match="rotations"):
        F.reformer_attention(q, k, v, torch.zeros(3, 1, 20, 1), bucket_size=4)


def test_seeds_eval_fixed_training_redraws():
    q, k, v = qkv(n=63)

    def build(seed):
        return effattn.build("reformer", head_dim=21, heads=3, seed=seed, bucket_size=4)

    a, b, c = build(3).eval(), build(3).eval(), build(4).eval()
    out = a(q, k, v)
    torch.testing.assert_close(b(q, k, v), out, rtol=0, atol=0)
    torch.testing.assert_close(a(q, k, v), out, rtol=0, atol=0)
    assert not torch.allclose(c(q, k, v), out)
    a.train()
    b.train()
    first, second = a(q, k, v), a(q, k, v)
    assert not torch.allclose(first, second)
    torch.testing.assert_close(b(q, k, v), first, rtol=0, atol=0)  # same seed, same draws
    torch.testing.assert_close(a.eval()(q, k, v), out, rtol=0, atol=0)
    unseeded = effattn.build("reformer", head_dim=21, heads=3, bucket_size=4).eval()
    torch.testing.assert_close(unseeded(q, k, v), unseeded(q, k, v), rtol=0, atol=0)


def test_any_length_and_low_precision():
    attn = effattn.build("reformer", head_dim=21, heads=3, seed=0, bucket_size=16)
    for n, m in [(1, 1), (5, 77), (77, 5), (100, 100)]:
        q, k, v = qkv(n=n, m=m, dv=7, dtype=torch.float32)
        out = attn(q, k, v)
        assert out.shape == (2, 3, n, 7) and torch.isfinite(out).all()


@pytest.mark.parametrize("shared, causal", [(False, False), (True, True), (False, True)])
def test_gpu_sized_groups_compute_the_same(shared, causal, monkeypatch):
    """On a GPU a round's chunks run as one batched group (GPU_GROUP_ELEMENTS), on a CPU in
    cache-sized groups: the same result, outputs and gradients, and the reference's."""
    assert F.group_elements(torch.device("cuda")) == F.GPU_GROUP_ELEMENTS
    assert F.group_elements(torch.device("cpu")) == F.GROUP_ELEMENTS
    n, bucket_size = 513, 16
    q, k, v = _inputs(n, n, shared)
    rotations = F.draw_rotations(
        3, 2, 21, F.num_buckets(n, n, bucket_size), generator=torch.Generator().manual_seed(1)
    ).double()
    kw = dict(rotations=rotations, bucket_size=bucket_size, causal=causal,
              key_padding_mask=padding(2, n), shared_qk=shared, scale=0.3)
    monkeypatch.setattr(F, "GROUP_ELEMENTS", 4096)  # several groups per round
    grouped = _grads(F.reformer_attention, q, k, v, shared, **kw)
    monkeypatch.setattr(F, "GROUP_ELEMENTS", F.GPU_GROUP_ELEMENTS)  # one group per round
    batched = _grads(F.reformer_attention, q, k, v, shared, **kw)
    ref = _grads(R.reformer_attention, q, k, v, shared, **kw)
    for a, b, c in zip(grouped, batched, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-10)
