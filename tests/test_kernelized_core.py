"""The shared linear-attention core against its dense reference (float64).

The core is driven through its entry point, :func:`kernelized_attention`, on precomputed
features: the feature map of :func:`on_features` hands them through (the keys carry their
log-scale as a last column), so that the stabiliser, the gate and the chunking meet inputs no
real feature map makes (log-scales that jump by 45, gates that reset the state).
"""

import pytest
import torch

from effattn import naive as R
from effattn.kernelized.core import (
    RecurrentState,
    kernelized_attention,
    linear_attention_step,
    slice_tokens,
)


def on_features(phi_q, phi_k, v, *, key_log_scale=None, key_padding_mask=None, causal=False,
                gate=None, chunk_size=64, eps=1e-6):
    """:func:`kernelized_attention` of precomputed φ(Q) (B, H, N, F), φ(K) (B, H, M, F) and
    key log-scales (B, H, M, 1): the keys travel as [φ(K), log-scale]."""
    scaled = key_log_scale is not None
    k = torch.cat([phi_k, key_log_scale], -1) if scaled else phi_k

    def features(x, *, is_query):
        return (x[..., :-1], x[..., -1:]) if scaled and not is_query else (x, None)

    return kernelized_attention(phi_q, k, v, features, feature_dim=phi_q.shape[-1],
                                causal=causal, key_padding_mask=key_padding_mask, gate=gate,
                                chunk_size=chunk_size, eps=eps)


def features(b=2, h=3, n=63, m=None, f=10, dv=5, seed=0, signed=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    phi_q = torch.rand(b, h, n, f, generator=g, dtype=torch.float64)
    phi_k = torch.rand(b, h, m, f, generator=g, dtype=torch.float64)
    if signed:  # trigonometric maps give signed features
        phi_q, phi_k = phi_q - 0.3, phi_k - 0.3
    v = torch.randn(b, h, m, dv, generator=g, dtype=torch.float64)
    log_scale = 3 * torch.randn(b, h, m, 1, generator=g, dtype=torch.float64)
    gate = 0.3 + 0.7 * torch.rand(b, h, n, generator=g, dtype=torch.float64)
    # Drawn on the CPU and moved, so every device sees the same numbers.
    return tuple(t.to(device) for t in (phi_q, phi_k, v, log_scale, gate))


def pad_mask(b, m, device="cpu"):
    mask = torch.zeros(b, m, dtype=torch.bool, device=device)
    mask[0, : max(1, m // 6)] = m > 1
    mask[-1, m - max(1, m // 4) :] = m > 1
    return mask


CASES = [
    dict(causal=False, scaled=False, gated=False),
    dict(causal=False, scaled=True, gated=False),
    dict(causal=True, scaled=False, gated=False),
    dict(causal=True, scaled=True, gated=False),
    dict(causal=True, scaled=False, gated=True),
    dict(causal=True, scaled=True, gated=True),
]


def _case_id(case):
    return "-".join(k for k, on in case.items() if on) or "plain"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("n, chunk", [(1, 64), (63, 16), (257, 64), (100, 7), (257, 8)])
@pytest.mark.parametrize("padded", [False, True])
def test_core_matches_reference_outputs_and_gradients(case, n, chunk, padded, device):
    phi_q, phi_k, v, ls, gate = features(n=n, device=device)
    inputs = [phi_q, phi_k, v, ls, gate]
    for t in inputs:
        t.requires_grad_(True)
    kwargs = dict(
        key_log_scale=ls if case["scaled"] else None,
        key_padding_mask=pad_mask(2, n, device) if padded else None,
        causal=case["causal"],
        gate=gate if case["gated"] else None,
        chunk_size=chunk,
    )
    out = on_features(phi_q, phi_k, v, **kwargs)
    ref = R.kernel_attention(phi_q, phi_k, v, **{k: x for k, x in kwargs.items()
                                                 if k != "chunk_size"})
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    probe = torch.randn_like(out)
    used = [t for t, on in zip(inputs, [1, 1, 1, case["scaled"], case["gated"]], strict=True) if on]
    g_out = torch.autograd.grad((out * probe).sum(), used)
    g_ref = torch.autograd.grad((ref * probe).sum(), used)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n, m", [(17, 40), (40, 3)])
def test_cross_attention_with_padding(n, m, device):
    phi_q, _, _, _, _ = features(n=n, device=device)
    _, phi_k, v, ls, _ = features(n=m, seed=1, device=device)
    mask = pad_mask(2, m, device)
    out = on_features(phi_q, phi_k, v, key_log_scale=ls, key_padding_mask=mask)
    ref = R.kernel_attention(phi_q, phi_k, v, key_log_scale=ls, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_signed_features_keep_the_sign_of_the_denominator(device):
    phi_q, phi_k, v, _, _ = features(n=40, signed=True, device=device)
    out = on_features(phi_q, phi_k, v, causal=True, chunk_size=8)
    ref = R.kernel_attention(phi_q, phi_k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("gated", [False, True])
def test_step_equals_causal_forward_and_state_is_fixed_size(gated, device):
    phi_q, phi_k, v, ls, gate = features(n=50, device=device)
    full = on_features(
        phi_q, phi_k, v, key_log_scale=ls, causal=True, gate=gate if gated else None, chunk_size=8
    )
    state, outs, sizes = None, [], set()
    for t in range(50):
        o, state = linear_attention_step(
            phi_q[:, :, t : t + 1], phi_k[:, :, t : t + 1], v[:, :, t : t + 1], state,
            key_log_scale=ls[:, :, t : t + 1], gate=gate[:, :, t : t + 1] if gated else None,
        )
        outs.append(o)
        sizes.add(state.nbytes())
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-10)
    assert isinstance(state, RecurrentState) and state.position == 50 and len(sizes) == 1
    assert state.s.shape == (2, 3, 10, 5) and state.z.shape == (2, 3, 10)


def _steps(phi_q, phi_k, v, ls, gate, state=None):
    outs = []
    for t in range(phi_q.shape[2]):
        o, state = linear_attention_step(
            phi_q[:, :, t : t + 1], phi_k[:, :, t : t + 1], v[:, :, t : t + 1], state,
            key_log_scale=None if ls is None else ls[:, :, t : t + 1],
            gate=None if gate is None else gate[:, :, t : t + 1],
        )
        outs.append(o)
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("gated", [False, True])
def test_step_rescales_lazily_but_exactly(gated, device):
    """The step keeps its state at a scale that lags the keys' by up to RESCALE_MARGIN: key
    scales that jump far past it, and gates that drive it far below the keys', must still give
    the causal forward."""
    phi_q, phi_k, v, ls, gate = features(n=60, device=device)
    ls = ls.clone()
    ls[:, :, 20:] += 45.0  # past the margin at once
    creep = torch.linspace(0, 30, 20, dtype=ls.dtype, device=device)
    ls[:, :, 40:] += creep[:, None]  # creeping up
    if gated:
        gate = gate.clone()
        gate[:, :, 5:35] = 0.02  # log g ~ -3.9 per step: the scale falls ~120 below the keys'
        gate[0, 0, 50] = 0.0  # a full reset
    full = on_features(
        phi_q, phi_k, v, key_log_scale=ls, causal=True, gate=gate if gated else None, chunk_size=8
    )
    stepped, _ = _steps(phi_q, phi_k, v, ls, gate if gated else None)
    torch.testing.assert_close(stepped, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shift", [0.0, 56.0, 1024.0])
def test_fp32_causal_forward_and_step_do_not_depend_on_the_size_of_the_log_scales(shift,
                                                                                  device):
    """A log-scale shared by every key cancels, whatever its size: trigonometric keys of norm 30
    have |x̃|²/2 ~ 56 at D = 64, positive ones far more. With non-negative features (nothing
    cancels) and log-scales on a 1/256 grid (shifted exactly in fp32) the fp32 forward and step
    stay at fp32 rounding of the float64 result. The forward's in-chunk weights, once formed from
    log-scales scaled by log2(e) before they were subtracted, each carried ~ε·|log-scale| of
    error: 5e-6 at 56, 1e-4 at 1024 (this test failed at both)."""
    phi_q, phi_k, v, ls, _ = features(n=100, f=16, device=device)
    ls = (ls * 256).round() / 256
    ref = on_features(phi_q, phi_k, v, key_log_scale=ls, causal=True, chunk_size=16)
    f32 = [t.float() for t in (phi_q, phi_k, v, ls + shift)]
    out = on_features(*f32[:3], key_log_scale=f32[3], causal=True, chunk_size=16)
    stepped, _ = _steps(*f32, None)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(stepped.double(), ref, rtol=2e-6, atol=2e-6)


def test_step_updates_in_place_without_autograd_and_not_with_it(device):
    phi_q, phi_k, v, ls, gate = features(n=6, device=device)
    with torch.no_grad():
        _, state = _steps(phi_q[:, :, :3], phi_k[:, :, :3], v[:, :, :3], ls[:, :, :3], None)
        before = state.kv.clone()
        _, after = linear_attention_step(phi_q[:, :, 3:4], phi_k[:, :, 3:4], v[:, :, 3:4], state,
                                         key_log_scale=ls[:, :, 3:4])
        assert after.kv.data_ptr() == state.kv.data_ptr()  # consumed: no new state tensor
        assert not torch.equal(state.kv, before)
    # With autograd recording the old state stays intact, and gradients through the steps
    # equal those of the chunkwise forward.
    inputs = [t.clone().requires_grad_(True) for t in (phi_q, phi_k, v, ls, gate)]
    stepped, _ = _steps(*inputs)
    g_step = torch.autograd.grad(stepped.square().sum(), inputs)
    full = on_features(*inputs[:3], key_log_scale=inputs[3], causal=True, gate=inputs[4],
                            chunk_size=4)
    g_full = torch.autograd.grad(full.square().sum(), inputs)
    for a, b in zip(g_step, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("jump", [48, 44], ids=["chunk-boundary", "mid-chunk"])
def test_causal_has_no_future_leakage_even_through_the_stabiliser(jump):
    phi_q, phi_k, v, ls, gate = features(n=64)
    out = on_features(phi_q, phi_k, v, key_log_scale=ls, causal=True, gate=gate, chunk_size=16)
    phi_k2, v2, ls2 = phi_k.clone(), v.clone(), ls.clone()
    phi_k2[:, :, 40:] = 5.0
    v2[:, :, 40:] = -7.0
    # A huge future key scale must not swamp earlier keys, in its chunk or before it.
    ls2[:, :, jump:] += 60.0
    out2 = on_features(
        phi_q, phi_k2, v2, key_log_scale=ls2, causal=True, gate=gate, chunk_size=16
    )
    torch.testing.assert_close(out2[:, :, :40], out[:, :, :40], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out2[:, :, 40:], out[:, :, 40:])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_never_change_the_output(causal):
    phi_q, phi_k, v, ls, _ = features(n=45)
    mask = pad_mask(2, 45)
    out = on_features(phi_q, phi_k, v, key_log_scale=ls, key_padding_mask=mask, causal=causal)
    keep = ~mask[:, None, :, None]
    phi_k2 = torch.where(keep, phi_k, 100.0)
    v2 = torch.where(keep, v, 1e3)
    ls2 = torch.where(keep, ls, 50.0)
    out2 = on_features(
        phi_q, phi_k2, v2, key_log_scale=ls2, key_padding_mask=mask, causal=causal
    )
    torch.testing.assert_close(out, out2, rtol=1e-12, atol=1e-12)


def test_fully_padded_query_rows_are_zero():
    phi_q, phi_k, v, ls, _ = features(n=12)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0] = True
    out = on_features(phi_q, phi_k, v, key_log_scale=ls, key_padding_mask=mask)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0


def test_core_error_paths():
    phi_q, phi_k, v, ls, gate = features(n=8)
    with pytest.raises(ValueError, match="gate needs causal"):
        on_features(phi_q, phi_k, v, gate=gate)
    with pytest.raises(ValueError, match="feature dim"):
        on_features(phi_q[..., :3], phi_k, v, causal=True)
    with pytest.raises(ValueError, match="key_log_scale"):
        kernelized_attention(phi_q, phi_k, v, lambda x, is_query: (x, x[..., :2]),
                             feature_dim=10)
    with pytest.raises(ValueError, match="chunk_size"):
        on_features(phi_q, phi_k, v, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match="gate must be"):
        on_features(phi_q, phi_k, v, causal=True, gate=gate[..., :3])
    with pytest.raises(ValueError, match="RecurrentState"):
        linear_attention_step(phi_q[:, :, :1], phi_k[:, :, :1], v[:, :, :1], state=(1, 2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_sliced_driver_equals_one_slice(causal, scaled, device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 70, 6, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 70 if causal else 33, 6, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, k.shape[2], 4, generator=g, dtype=torch.float64)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64)
    gate = 0.5 + 0.5 * torch.rand(2, 3, 70, generator=g, dtype=torch.float64) if causal else None
    q, k, v, w = (t.to(device) for t in (q, k, v, w))
    gate = gate.to(device) if causal else None

    def feats(x, *, is_query):
        u = x @ w.T
        if not scaled:
            return torch.exp(u / 4), None
        m = u.amax(-1, keepdim=True)
        return torch.exp(u - m), (None if is_query else m + 5 * x[..., :1])

    mask = pad_mask(2, k.shape[2], device)
    phi_q, _ = feats(q, is_query=True)
    phi_k, ls = feats(k, is_query=False)
    whole = on_features(phi_q, phi_k, v, key_log_scale=ls, key_padding_mask=mask,
                             causal=causal, gate=gate, chunk_size=8)
    assert slice_tokens(6, 9, 8, 200) == 8
    sliced = kernelized_attention(q, k, v, feats, feature_dim=9, key_padding_mask=mask,
                                  causal=causal, gate=gate, chunk_size=8, slice_elements=200)
    torch.testing.assert_close(sliced, whole, rtol=1e-10, atol=1e-10)


def test_gaussian_projection_blocks_are_orthogonal_with_gaussian_row_norms():
    from effattn.kernelized.projections import gaussian_projection, make_generator

    w = gaussian_projection(1000, 16, orthogonal=True, generator=make_generator(0),
                            dtype=torch.float64)
    assert w.shape == (1000, 16)
    for start in range(0, 992, 16):
        block = w[start : start + 16]
        unit = block / block.norm(dim=1, keepdim=True)
        torch.testing.assert_close(unit @ unit.T, torch.eye(16, dtype=torch.float64))
    # Row norms are chi(16): E|w|^2 = 16 with sd sqrt(32) per row; 1000 rows -> sd of mean 0.18.
    assert abs((w * w).sum(1).mean().item() - 16) < 1.0
    iid = gaussian_projection(1000, 16, orthogonal=False, generator=make_generator(0))
    unit = iid[:16] / iid[:16].norm(dim=1, keepdim=True)
    assert (unit @ unit.T - torch.eye(16)).abs().max() > 0.1
    again = gaussian_projection(1000, 16, orthogonal=True, generator=make_generator(0),
                                dtype=torch.float64)
    assert torch.equal(w, again)
