"""Kernelized methods stay trustworthy at extreme inputs: no future leakage through the
stabiliser in fp32, no silent all-zero rows, decoding equal to the forward within the rounding
that the normaliser's conditioning allows."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import qkv

import effattn
from effattn import naive as R
from effattn.mechanisms.rfa import unit

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


def _build(name, opts, d, dtype, chunk=16, device="cpu"):
    if name != "linear":
        opts = {"num_features": 24, **opts}
    module = effattn.build(name, head_dim=d, heads=3, seed=0, chunk_size=chunk, **opts)
    module = module.to(dtype).eval().to(device)
    module.slice_elements = 3000  # slices of a few chunks: the leak test crosses slice borders
    return module


def _assert_rel_close(out, ref, rtol):
    err = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < rtol, f"relative error {err:.2e}"


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
@pytest.mark.parametrize("t", [37, 47], ids=["mid-chunk", "chunk-end"])
def test_large_future_keys_leave_earlier_fp32_outputs_alone(variant, t, device):
    """Keys after t scaled to norm 30 (log-scales ~100 for trigonometric maps): fp32 outputs at
    positions <= t still equal the float64 ones computed without those keys, in the forward and
    through prefill (a split at 23, mid-chunk, carries a state)."""
    name, opts = variant
    n, d = 100, 21
    q, k, v = qkv(b=2, h=3, n=n, d=d, dv=5, scale=0.7)
    gate = torch.sigmoid(torch.randn(2, 3, n, dtype=torch.float64))
    q, k, v, gate = (x.to(device) for x in (q, k, v, gate))
    kw = (lambda a, b: {"gate": gate[:, :, a:b]}) if opts.get("gated") else (lambda a, b: {})
    reference = _build(name, opts, d, torch.float64, device=device)
    ref = reference(q, k, v, causal=True, **kw(0, n))[:, :, : t + 1]
    k_big = k.clone()
    k_big[:, :, t + 1 :] = 30 * F.normalize(k[:, :, t + 1 :], dim=-1)
    q, k_big, v, gate = q.float(), k_big.float(), v.float(), gate.float()
    module = _build(name, opts, d, torch.float32, device=device)
    out = module(q, k_big, v, causal=True, **kw(0, n))
    _assert_rel_close(out[:, :, : t + 1], ref, 1e-4)
    first, state = module.prefill(q[:, :, :23], k_big[:, :, :23], v[:, :, :23], **kw(0, 23))
    rest, _ = module.prefill(q[:, :, 23:], k_big[:, :, 23:], v[:, :, 23:], state, **kw(23, n))
    _assert_rel_close(torch.cat([first, rest], 2)[:, :, : t + 1], ref, 1e-4)


def _huge_qkv(amp, dtype=torch.float64, n=143, d=16, device="cpu"):
    """q, k with entries ~amp: |x̃|²/2 ~ 5000 at amp 50, so true positive features are
    exp(-5000) (0 even in float64) while softmax of q̃·k̃ is well defined."""
    q, k, v = (x.to(device) for x in qkv(b=2, h=3, n=n, d=d))
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
        future = torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, -1) @ v.double()


POSITIVE = KERNELIZED[:2]


@pytest.mark.parametrize("variant", POSITIVE, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("amp, dtype, rtol", [(50.0, torch.float64, 1e-9),
                                              (12.0, torch.float32, 1e-4)],
                         ids=["entries50-fp64", "entries12-fp32"])
def test_positive_features_at_huge_norms_give_the_estimator(variant, causal, amp, dtype, rtol,
                                                            device):
    """True features exp(u - |x̃|²/2) far below eps (or 0 in the dtype): the denominator is tiny
    but a sum of positive terms, so eps must not floor it and no real key may be clamped away."""
    name, opts = variant
    q, k, v = _huge_qkv(amp, dtype, device=device)
    module = _build(name, opts, 16, dtype, device=device)
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
def test_step_equals_forward_at_huge_norms(variant, device):
    name, opts = variant
    q, k, v = _huge_qkv(50.0, n=40, device=device)
    module = _build(name, opts, 16, torch.float64, device=device)
    full = module(q, k, v, causal=True)
    state, outs = None, []
    for t in range(40):
        out, state = module.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(out)
    _assert_rel_close(torch.cat(outs, 2), full.double(), 1e-9)


def _argument_size(module, x):
    """The largest feature argument |w·x̃ (+ b)| (sin, cos, exp or relu of it; x itself for
    linear's elu) plus the largest key log-scale |x̃|²/2 (none for rfa and linear) of the rows of
    x: their absolute rounding is relative error of the features."""
    x = x.double()
    if module.spec.name == "linear":
        return x.abs().max().item()
    w = module.projection.double()
    if module.spec.name == "rfa":
        return (unit(x) / module.sigma.double()[:, None, None] @ w.T).abs().max().item()
    x = x * module.scale**0.5
    u = x @ w.T + (module.phase.double() if module.spec.name == "favor" else 0.0)
    return u.abs().max().item() + 0.5 * x.square().sum(-1).max().item()


def _condition(module, q, k, gate):
    """κ_i = Σ_j w_ij Σ_f |φ_f(q_i) φ_f(k_j)| / |Σ_j w_ij φ(q_i)·φ(k_j)| (B, H, N), float64."""
    m = copy.deepcopy(module).double()
    phi_q, _ = m.features(q.double(), is_query=True)
    phi_k, log_scale = m.features(k.double(), is_query=False)
    if log_scale is not None:  # a factor shared by all keys cancels in κ
        phi_k = phi_k * torch.exp(log_scale - log_scale.amax(2, keepdim=True))
    n = q.shape[2]
    w = R.kernel_weights(n, n, causal=True, gate=None if gate is None else gate.double(),
                         device=q.device)
    den = ((phi_q @ phi_k.transpose(-2, -1)) * w).sum(-1)
    return ((phi_q.abs() @ phi_k.abs().transpose(-2, -1)) * w).sum(-1) / den.abs()


def _decoding_bound(module, q, k, v, gate, exact, eps):
    """The documented bound (kernelized.core): 4 ε κ_i (μ + √i + √F) (|o_i| + max_{j<=i} |v_j|)
    elementwise, with μ = 1 + _argument_size over q and k and F the width of φ; and κ, μ."""
    kappa = _condition(module, q, k, gate)
    mu = 1.0 + max(_argument_size(module, q), _argument_size(module, k))
    i = torch.arange(1, q.shape[2] + 1, dtype=torch.float64, device=q.device)
    growth = mu + i.sqrt() + module.feature_dim**0.5
    size = exact.abs() + v.double().abs().cummax(2).values
    return 4 * eps * (kappa * growth)[..., None] * size, kappa, mu


def _decode(module, q, k, v, gate, prefill=0):
    """Outputs of ``prefill`` over the first tokens, then one ``step`` per token."""
    def kw(a, b):
        return {} if gate is None else {"gate": gate[:, :, a:b]}

    outs, state = [], None
    if prefill:
        out, state = module.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill],
                                    **kw(0, prefill))
        outs.append(out)
    for t in range(prefill, q.shape[2]):
        out, state = module.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                 state, **kw(t, t + 1))
        outs.append(out)
    return torch.cat(outs, 2)


# (B, H, N, D, Dv, norm of each q and k row, or None for N(0, 1) entries): large logits,
# favor over 33 steps (2112 values) and keys of norm 30 over 200, and small inputs, where even
# the signed maps' κ is ~1.
DECODING_CASES = {
    "33-steps": (2, 4, 33, 64, 8, None),
    "norm-30": (1, 2, 200, 64, 16, 30.0),
    "norm-1": (1, 2, 200, 64, 16, 1.0),
}


def _decoding_inputs(case, gated, dtype, device="cpu"):
    b, h, n, d, dv, norm = DECODING_CASES[case]
    q, k, v = qkv(b=b, h=h, n=n, d=d, dv=dv)
    if norm is not None:
        q, k = norm * F.normalize(q, dim=-1), norm * F.normalize(k, dim=-1)
    g = torch.Generator().manual_seed(1)
    gate = torch.sigmoid(torch.randn(b, h, n, generator=g, dtype=torch.float64)) if gated else None
    return [None if t is None else t.to(device, dtype) for t in (q, k, v, gate)]


def _gate(gate):
    return {} if gate is None else {"gate": gate}


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
@pytest.mark.parametrize("case", DECODING_CASES)
def test_fp32_decoding_equals_forward_within_the_conditioning_bound(variant, case, device):
    """``step`` (from the start and after a prefill) and the causal forward sum the same terms in
    different orders. In fp32 each is within the documented bound of the float64 result, and so
    of each other; where neither the normaliser cancels nor the feature arguments are large
    (κ_i <= 2, μ <= 30) they agree to 1e-5. The signed maps' reported disagreements (favor over
    33 steps, trig with keys of norm 30) are where κ_i is large."""
    name, opts = variant
    q, k, v, gate = _decoding_inputs(case, opts.get("gated"), torch.float32, device)
    module = effattn.build(name, head_dim=q.shape[-1], heads=q.shape[1], seed=0, **opts)
    module = module.eval().to(device)
    exact = copy.deepcopy(module).double()(
        q.double(), k.double(), v.double(), causal=True,
        **_gate(None if gate is None else gate.double()),
    )
    bound, kappa, mu = _decoding_bound(module, q, k, v, gate, exact, 2.0**-24)
    forward = module(q, k, v, causal=True, **_gate(gate))
    stepped = _decode(module, q, k, v, gate)
    prefilled = _decode(module, q, k, v, gate, prefill=q.shape[2] - 9)
    for out, ref in [(forward, exact), (stepped, exact), (prefilled, exact),
                     (stepped, forward), (prefilled, forward)]:
        excess = ((out.double() - ref.double()).abs() / bound).max().item()
        assert excess <= 1.0, f"{excess:.3g} times the bound"
    if mu <= 30:
        small = (kappa <= 2)[..., None].expand_as(forward)
        torch.testing.assert_close(stepped[small], forward[small], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prefilled[small], forward[small], rtol=1e-5, atol=1e-5)
    signed = name == "favor" or opts.get("feature_map") == "trig"
    if signed and case != "norm-1":
        assert kappa.max() > 1e3


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
@pytest.mark.parametrize("case", ["33-steps", "norm-30"])
def test_float64_decoding_equals_forward_within_the_conditioning_bound(variant, case, device):
    """The same bound with ε = 2^-53: float64 step and prefill equal the forward to ~1e-15
    relative, ~1e-12 on the rows of large κ_i."""
    name, opts = variant
    q, k, v, gate = _decoding_inputs(case, opts.get("gated"), torch.float64, device)
    module = effattn.build(name, head_dim=q.shape[-1], heads=q.shape[1], seed=0, **opts)
    module = module.double().eval().to(device)
    forward = module(q, k, v, causal=True, **_gate(gate))
    bound, _, _ = _decoding_bound(module, q, k, v, gate, forward, 2.0**-53)
    for out in (_decode(module, q, k, v, gate), _decode(module, q, k, v, gate, prefill=20)):
        assert ((out - forward).abs() / bound).max() <= 1.0
        rows = (out - forward).norm(dim=-1) / forward.norm(dim=-1)
        assert rows.median() < 1e-13 and rows.max() < 1e-10
