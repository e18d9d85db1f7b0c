"""Kernelized methods stay trustworthy at extreme inputs: no future leakage through the
stabiliser in fp32, no silent all-zero rows."""

import pytest
import torch
import torch.nn.functional as F
from conftest import qkv

import effattn

KERNELIZED = [
    ("performer", {"feature_map": "positive"}),
    ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "trig"}),
    ("performer", {"feature_map": "relu"}),
    ("favor", {}),
    ("rfa", {}),
    ("rfa", {"gated": True}),
    ("linear", {}),
]


def _id(variant):
    name, opts = variant
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def _build(name, opts, d, dtype, chunk=16):
    if name != "linear":
        opts = {"num_features": 24, **opts}
    module = effattn.build(name, head_dim=d, heads=3, seed=0, chunk_size=chunk, **opts)
    module = module.to(dtype).eval()
    module.slice_elements = 3000  # slices of a few chunks: the leak test crosses slice borders
    return module


def _assert_rel_close(out, ref, rtol):
    err = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < rtol, f"relative error {err:.2e}"


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
@pytest.mark.parametrize("t", [37, 47], ids=["mid-chunk", "chunk-end"])
def test_large_future_keys_leave_earlier_fp32_outputs_alone(variant, t):
    """Keys after t scaled to norm 30 (log-scales ~100 for trigonometric maps): fp32 outputs at
    positions <= t still equal the float64 ones computed without those keys, in the forward and
    through prefill (a split at 23, mid-chunk, carries a state)."""
    name, opts = variant
    n, d = 100, 21
    q, k, v = qkv(b=2, h=3, n=n, d=d, dv=5, scale=0.7)
    gate = torch.sigmoid(torch.randn(2, 3, n, dtype=torch.float64))
    kw = (lambda a, b: {"gate": gate[:, :, a:b]}) if opts.get("gated") else (lambda a, b: {})
    ref = _build(name, opts, d, torch.float64)(q, k, v, causal=True, **kw(0, n))[:, :, : t + 1]
    k_big = k.clone()
    k_big[:, :, t + 1 :] = 30 * F.normalize(k[:, :, t + 1 :], dim=-1)
    q, k_big, v, gate = q.float(), k_big.float(), v.float(), gate.float()
    module = _build(name, opts, d, torch.float32)
    out = module(q, k_big, v, causal=True, **kw(0, n))
    _assert_rel_close(out[:, :, : t + 1], ref, 1e-4)
    first, state = module.prefill(q[:, :, :23], k_big[:, :, :23], v[:, :, :23], **kw(0, 23))
    rest, _ = module.prefill(q[:, :, 23:], k_big[:, :, 23:], v[:, :, 23:], state, **kw(23, n))
    _assert_rel_close(torch.cat([first, rest], 2)[:, :, : t + 1], ref, 1e-4)


def _huge_qkv(amp, dtype=torch.float64, n=143, d=16):
    """q, k with entries ~amp: |x̃|²/2 ~ 5000 at amp 50, so true positive features are
    exp(-5000) (0 even in float64) while softmax of q̃·k̃ is well defined."""
    q, k, v = qkv(b=2, h=3, n=n, d=d)
    return (q * amp).to(dtype), (k * amp).to(dtype), v.to(dtype)


def _log_space_estimator(module, q, k, v, causal):
    """FAVOR+ with positive or hyperbolic features, from log-features t (φ = exp(t)) in float64:
    Σ_j φ(q)·φ(k_j) v_j / Σ_j φ(q)·φ(k_j) = softmax_j(logsumexp_f(t_q + t_kj)) v (the query's
    and the 1/sqrt(F) factors cancel), finite where the explicit reference underflows to 0 / 0."""
    root = module.scale**0.5
    w = module.projection.double()

    def log_features(x):
        x = x.double() * root
        u = x @ w.T
        if module.feature_map == "hyperbolic":
            u = torch.cat([u, -u], -1)
        return u - 0.5 * (x * x).sum(-1, keepdim=True)

    pairs = log_features(q)[..., :, None, :] + log_features(k)[..., None, :, :]  # (B, H, N, M, F)
    logits = torch.logsumexp(pairs, -1)
    if causal:
        n = q.shape[2]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, -1) @ v.double()


POSITIVE = KERNELIZED[:2]


@pytest.mark.parametrize("variant", POSITIVE, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("amp, dtype, rtol", [(50.0, torch.float64, 1e-9),
                                              (12.0, torch.float32, 1e-4)],
                         ids=["entries50-fp64", "entries12-fp32"])
def test_positive_features_at_huge_norms_give_the_estimator(variant, causal, amp, dtype, rtol):
    """True features exp(u - |x̃|²/2) far below eps (or 0 in the dtype): the denominator is tiny
    but a sum of positive terms, so eps must not floor it and no real key may be clamped away."""
    name, opts = variant
    q, k, v = _huge_qkv(amp, dtype)
    module = _build(name, opts, 16, dtype)
    ref = _log_space_estimator(module, q, k, v, causal)
    _assert_rel_close(module(q, k, v, causal=causal), ref, rtol)


@pytest.mark.parametrize("variant, dtype", [
    (variant, dtype) for variant in KERNELIZED for dtype in (torch.float64, torch.float32)
    if not (variant in POSITIVE and dtype == torch.float32)
], ids=lambda x: _id(x) if isinstance(x, tuple) else str(x)[6:])
@pytest.mark.parametrize("causal", [False, True])
def test_no_all_zero_rows_for_huge_inputs(variant, causal, dtype):
    name, opts = variant
    if opts.get("gated") and not causal:
        pytest.skip("the gate is causal only")
    q, k, v = _huge_qkv(50.0, dtype)
    gate = torch.sigmoid(torch.randn(2, 3, 143, dtype=dtype))
    kw = {"gate": gate} if opts.get("gated") else {}
    out = _build(name, opts, 16, dtype)(q, k, v, causal=causal, **kw)
    assert torch.isfinite(out).all()
    assert (out.abs().amax(-1) > 0).all()


@pytest.mark.parametrize("variant", POSITIVE, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_underflow_at_huge_norms_raises(variant, causal):
    """Entries ~50 in fp32: Σ_f exp(u_qf - max u_q + u_kf - max u_k), the product of the
    row-normalised query and key features, is exp(-100..-300) (their peaks sit on different
    features) and underflows to 0; GEMMs with per-row scales cannot avoid it. The rows would be
    silent zeros: the forward, prefill and a memory read refuse instead (fp64 computes them,
    test_positive_features_at_huge_norms_give_the_estimator)."""
    name, opts = variant
    q, k, v = _huge_qkv(50.0, torch.float32)
    module = _build(name, opts, 16, torch.float32)
    match = r"performer: .* 0 in torch\.float32 .* underflows .*\|scale q·k\| <= .* up to"
    with pytest.raises(ValueError, match=match):
        module(q, k, v, causal=causal)
    if causal:
        with pytest.raises(ValueError, match=match):
            module.prefill(q, k, v)
    else:
        with pytest.raises(ValueError, match="performer: .* underflows"):
            module.attend_memory(q, module.memory(k, v))


NONNEGATIVE = [
    ("performer", {"feature_map": "positive"}),
    ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "relu"}),
    ("rfa", {"feature_map": "arccos"}),
    ("linear", {}),
]


@pytest.mark.parametrize("variant", NONNEGATIVE, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_zeros_do_not_raise(variant, causal):
    """Rows that see no key are a legitimate 0 (eps = 0 maps, fp32, normal inputs): batch 0
    is all padding, batch 1 pads its first 9 keys (causal queries 0..8 see none)."""
    name, opts = variant
    q, k, v = (x.float() for x in qkv(b=2, h=3, n=30, d=16))
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[0] = True
    mask[1, :9] = True
    module = _build(name, opts, 16, torch.float32)
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    seeing = torch.ones(2, 30, dtype=torch.bool)
    seeing[0] = False
    if causal:
        seeing[1, :9] = False
    assert (out[~seeing[:, None, :].expand(-1, 3, -1)] == 0).all()
    assert (out.abs().amax(-1) > 0)[seeing[:, None, :].expand(-1, 3, -1)].all()
    if not causal:
        module.attend_memory(q, module.memory(k, v, mask))


@pytest.mark.parametrize("variant", POSITIVE + [("favor", {})], ids=_id)
def test_step_equals_forward_at_huge_norms(variant):
    name, opts = variant
    q, k, v = _huge_qkv(50.0, n=40)
    module = _build(name, opts, 16, torch.float64)
    full = module(q, k, v, causal=True)
    state, outs = None, []
    for t in range(40):
        out, state = module.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(out)
    _assert_rel_close(torch.cat(outs, 2), full.double(), 1e-9)
