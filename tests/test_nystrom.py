"""Nyströmformer: fast path vs dense reference, landmarks, pinv, padding, exact limit, refusals."""

import pytest
import torch
import torch.nn.functional as F
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.mechanisms.nystrom import iterative_pinv, nystrom_attention, segment_averaging


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    return torch.autograd.grad((out * weight).sum(), inputs)


def _heavy_padding(b, m, kept):
    mask = torch.ones(b, m, dtype=torch.bool)
    mask[0, m - kept :] = False
    mask[1:, :kept] = False
    return mask


@pytest.mark.parametrize(
    "n, m, landmarks, mask_kind",
    [
        (1, 1, 4, None),
        (63, 63, 8, None),
        (63, 63, 8, "padding"),
        (63, 63, 40, "heavy"),  # fewer unpadded keys (25) than landmarks: empty ones drop out
        (63, 63, 64, "padding"),  # exact limit (S V)
        (257, 257, 64, "padding"),
        (17, 40, 8, "padding"),
        (40, 17, 8, None),
        (40, 17, 30, "padding"),  # more landmarks than keys, fewer than queries
        (17, 40, 64, None),  # exact limit (S V), cross
    ],
)
def test_matches_reference_outputs_and_grads(n, m, landmarks, mask_kind, device):
    q, k, v = qkv(n=n, m=m, dv=5)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    mask = {None: None, "padding": padding(2, m), "heavy": _heavy_padding(2, m, 25)}[mask_kind]
    mask = None if mask is None else mask.to(device)
    kwargs = dict(key_padding_mask=mask, scale=0.4, num_landmarks=landmarks)
    out = nystrom_attention(q, k, v, **kwargs)
    ref = R.nystrom_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n, masked", [(63, False), (63, True), (257, True)])
def test_module_with_conv_matches_reference(n, masked, device):
    q, k, v = qkv(n=n, dv=4)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    mask = padding(2, n).to(device) if masked else None
    attn = effattn.build("nystrom", head_dim=21, heads=3, seed=0, num_landmarks=16,
                         pinv_iterations=4, conv_kernel=5).double().to(device)
    out = attn(q, k, v, key_padding_mask=mask)
    ref = R.nystrom_attention(q, k, v, key_padding_mask=mask, num_landmarks=16,
                              pinv_iterations=4, conv_weight=attn.conv_weight)
    torch.testing.assert_close(out, ref)
    inputs = (q, k, v, attn.conv_weight)
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(got, want)
    without = nystrom_attention(q, k, v, key_padding_mask=mask, num_landmarks=16,
                                pinv_iterations=4)
    assert (out - without).abs().max() > 0.1


@pytest.mark.parametrize("n, m", [(1, 1), (63, 63), (17, 40), (40, 17)])
@pytest.mark.parametrize("masked", [False, True])
def test_landmarks_at_least_length_is_exact_softmax(n, m, masked, device):
    q, k, v = (t.to(device) for t in qkv(n=n, m=m, dv=6))
    mask = padding(2, m).to(device) if masked else None
    attn = effattn.build("nystrom", head_dim=21, heads=3, num_landmarks=max(n, m)).to(device)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=mask),
                               R.softmax_attention(q, k, v, key_padding_mask=mask))
    more = effattn.build("nystrom", head_dim=21, heads=3, num_landmarks=max(n, m) + 9).to(device)
    torch.testing.assert_close(more(q, k, v, key_padding_mask=mask),
                               R.softmax_attention(q, k, v, key_padding_mask=mask))


def test_uneven_segments():
    keep = torch.ones(1, 10, dtype=torch.bool)
    avg, valid = segment_averaging(keep, 4, torch.float64)
    # boundaries floor(i * 10 / 4) = 0, 2, 5, 7, 10
    sizes = [(row > 0).sum().item() for row in avg[0]]
    assert sizes == [2, 3, 2, 3] and valid.all()
    torch.testing.assert_close(avg[0].sum(-1), torch.ones(4, dtype=torch.float64))
    keep = torch.tensor([[True, False, True, True, False, False, True]])
    avg, valid = segment_averaging(keep, 6, torch.float64)
    # four kept tokens over six segments: each kept token alone, two segments empty
    assert valid.sum() == 4 and (avg[0, :, [1, 4, 5]] == 0).all()
    assert sorted(avg[0].argmax(-1)[valid[0]].tolist()) == [0, 2, 3, 6]


def test_iterative_pinv_converges_and_keeps_zero_rows_and_columns(device):
    g = torch.Generator().manual_seed(0)
    s = torch.softmax(torch.randn(2, 12, 9, generator=g, dtype=torch.float64).to(device), -1)
    exact = torch.linalg.pinv(s)
    # smallest singular values near 0.04: 6 steps are not converged yet, 12 are
    err = [(iterative_pinv(s, t) - exact).abs().max().item() for t in (3, 6, 12)]
    assert err[0] > err[1] > err[2] and err[2] < 1e-8
    padded = torch.zeros(2, 15, 11, dtype=torch.float64, device=device)
    padded[:, :12, 2:] = s
    z = iterative_pinv(padded, 6)
    assert z[:, :2].abs().max() == 0 and z[:, :, 12:].abs().max() == 0
    torch.testing.assert_close(z[:, 2:, :12], iterative_pinv(s, 6))


@pytest.mark.parametrize("conv_kernel", [None, 3])
def test_padded_positions_do_not_change_outputs(conv_kernel):
    q, k, v = qkv(n=63, dv=5)
    mask = padding(2, 63)
    attn = effattn.build("nystrom", head_dim=21, heads=3, seed=0, num_landmarks=8,
                         conv_kernel=conv_kernel).double()
    out = attn(q, k, v, key_padding_mask=mask)
    pad = mask[:, None, :, None]
    q2, k2, v2 = (torch.where(pad, 50 * torch.randn_like(t), t) for t in (q, k, v))
    out2 = attn(q2, k2, v2, key_padding_mask=mask)
    keep = ~pad.expand_as(out)
    torch.testing.assert_close(out2[keep], out[keep])
    # Unmasked, the padded tokens count (milder ones: 50x tokens are past Nyström's breakdown).
    q3, k3, v3 = (torch.where(pad, 2 * torch.randn_like(t), t) for t in (q, k, v))
    assert not torch.allclose(attn(q3, k3, v3)[keep], out[keep])


@pytest.mark.parametrize("conv_kernel", [None, 5])
def test_padded_sequence_equals_unpadded_sequence(conv_kernel):
    """Segments are cut over the unpadded tokens, so padding (left or right) changes nothing."""
    q, k, v = qkv(b=1, n=50, dv=5)
    attn = effattn.build("nystrom", head_dim=21, heads=3, seed=0, num_landmarks=12,
                         conv_kernel=conv_kernel).double()
    alone = attn(q, k, v)
    for left in (True, False):
        q2, k2, v2 = (_pad(t, 23, left) for t in (q, k, v))
        mask = torch.zeros(1, 73, dtype=torch.bool)
        mask[:, :23] = left
        mask[:, 50:] = not left
        kept = slice(23, None) if left else slice(None, 50)
        torch.testing.assert_close(attn(q2, k2, v2, key_padding_mask=mask)[:, :, kept], alone)


def _pad(t, extra, left):
    filler = 10 * torch.randn(*t.shape[:2], extra, t.shape[3], dtype=t.dtype)
    return torch.cat([filler, t] if left else [t, filler], 2)


def test_sequences_in_a_batch_are_independent():
    q, k, v = qkv(n=63, scale=2.0)
    k[1] *= 2.5  # a very different second sequence: a batch-wide pinv norm would change row 0
    out = nystrom_attention(q, k, v, num_landmarks=8)
    torch.testing.assert_close(out[:1], nystrom_attention(q[:1], k[:1], v[:1], num_landmarks=8))


def test_error_shrinks_with_more_landmarks():
    q, k, v = qkv(b=1, n=257, scale=0.7)
    exact = R.softmax_attention(q, k, v)
    err = [(nystrom_attention(q, k, v, num_landmarks=m) - exact).norm().item()
           for m in (4, 32, 128)]
    assert err[0] > err[1] > err[2]


def test_fully_padded_row_outputs_zeros_with_finite_gradients():
    q, k, v = qkv(n=30)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[0] = True
    for landmarks in (8, 64):
        out = nystrom_attention(q, k, v, key_padding_mask=mask, num_landmarks=landmarks)
        assert torch.isfinite(out).all() and out[0].abs().max() == 0 and out[1].abs().max() > 0
        grads = _grads(out, (q, k, v))
        assert all(torch.isfinite(g).all() and g[0].abs().max() == 0 for g in grads)


def test_refusals_and_option_validation():
    q, k, v = qkv(n=20)
    attn = effattn.build("nystrom", head_dim=21, heads=3)
    with pytest.raises(ValueError, match="nystrom cannot do causal.*future"):
        attn(q, k, v, causal=True)
    with pytest.raises(ValueError, match="nystrom cannot do recurrent decoding"):
        attn.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    for name, bad in [("num_landmarks", 0), ("num_landmarks", 2.0), ("pinv_iterations", 0),
                      ("pinv_iterations", True), ("conv_kernel", 4), ("conv_kernel", -1),
                      ("conv_kernel", "3")]:
        with pytest.raises(ValueError, match=name):
            effattn.build("nystrom", head_dim=21, heads=3, **{name: bad})
    conv = effattn.build("nystrom", head_dim=21, heads=3, conv_kernel=3)
    with pytest.raises(ValueError, match="N == M"):
        conv(q, k[:, :, :10], v[:, :, :10])


def test_seed_fixes_conv_weights():
    a, b, c = (effattn.build("nystrom", head_dim=8, heads=2, seed=s, conv_kernel=33)
               for s in (0, 0, 1))
    assert a.conv_weight.shape == (2, 33)
    assert torch.equal(a.conv_weight, b.conv_weight) and not torch.equal(a.conv_weight,
                                                                         c.conv_weight)
    assert a.conv_weight.abs().max() <= 1 / 33**0.5



def _peaked(n, dtype, device="cpu"):
    """q, k ~ N(0, 50^2), D = 16: logits of std 2500, where every softmax is one-hot."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64).to(device)
               for _ in range(3))
    return (50 * q).to(dtype), (50 * k).to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [143, 286])
@pytest.mark.parametrize("masked", [False, True])
def test_peaked_logits_are_refused_not_zeroed(dtype, n, masked):
    # Landmark keys far below every landmark query's maximum: the landmark kernel is singular,
    # and the 6-step estimate used to output all-zero rows for the queries on those landmarks.
    q, k, v = _peaked(n, dtype)
    mask = padding(2, n) if masked else None
    attn = effattn.build("nystrom", head_dim=16, heads=2)
    with pytest.raises(ValueError, match=r"weights of query \d+ .* sum to .*num_landmarks=64"):
        attn(q, k, v, key_padding_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [57, 143])
def test_exact_limit_holds_on_peaked_logits(dtype, n, device):
    """Single-token landmarks give S V directly: no pseudo-inverse of the singular S."""
    q, k, v = _peaked(n, dtype, device)
    out = effattn.build("nystrom", head_dim=16, heads=2, num_landmarks=n).to(device)(q, k, v)
    assert (out.abs().amax(-1) > 0).all()
    # The limit is SDPA itself on the same device; against the float64 dense reference, a logit
    # of size L rounds by eps * L, and a fused kernel (CUDA's fp32 SDPA) moves a weight by that
    # relative amount: the tolerance is that bound.
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    logits = q.double() @ k.double().transpose(-2, -1) / 4
    bound = 4 * torch.finfo(dtype).eps * logits.abs().max().item() * v.abs().max().item()
    exact = R.softmax_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), exact, atol=bound, rtol=0)
    if n <= 64:
        # These tokens padded to 143 are exact too, by their own length.
        q2, k2, v2 = (torch.cat([t, torch.zeros_like(t[:, :, :1]).expand(-1, -1, 143 - n, -1)],
                                2) for t in (q, k, v))
        mask = (torch.arange(143, device=device) >= n).expand(2, -1)
        out = effattn.build("nystrom", head_dim=16, heads=2).to(device)(q2, k2, v2,
                                                                        key_padding_mask=mask)
        torch.testing.assert_close(out[:, :, :n].double(), exact, atol=bound, rtol=0)


@pytest.mark.parametrize("cross", [False, True])
def test_padded_rows_equal_unpadded_rows_whatever_their_length(cross, device):
    """Exact or iterative is chosen per sequence by its unpadded length, never the padded one:
    in one batch, rows of 5, 16 (<= 16 landmarks: exact), 17, 60 and 97 (iterative) tokens."""
    lengths, total, landmarks = [5, 16, 17, 60, 97], 97, 16
    q, k, v = (t.to(device) for t in qkv(b=5, n=12 if cross else total, m=total, dv=5, scale=1.5))
    mask = (torch.arange(total, device=device)[None, :]
            >= torch.tensor(lengths, device=device)[:, None])
    mask[2] = mask[2].flip(0)  # one row padded on the left
    out = nystrom_attention(q, k, v, key_padding_mask=mask, num_landmarks=landmarks, scale=0.3)
    for row, length in enumerate(lengths):
        kept = ~mask[row]
        assert kept.sum() == length
        q1 = q[row : row + 1] if cross else q[row : row + 1, :, kept]
        alone = nystrom_attention(q1, k[row : row + 1, :, kept], v[row : row + 1, :, kept],
                                  num_landmarks=landmarks, scale=0.3)
        got = out[row : row + 1] if cross else out[row : row + 1, :, kept]
        torch.testing.assert_close(got, alone, rtol=1e-12, atol=1e-12)
    ref = R.nystrom_attention(q, k, v, key_padding_mask=mask, num_landmarks=landmarks, scale=0.3)
    torch.testing.assert_close(out, ref)
