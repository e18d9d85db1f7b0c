"""performer, favor, rfa, linear: modules against their dense references, decoding, redraw
policy, statistical convergence to softmax, numerical safety and error paths."""

import pytest
import torch
import torch.nn.functional as F
from conftest import padding, qkv

import effattn
from effattn import naive as R

# (method, options, reference call taking (module, q, k, v, **kw))
VARIANTS = [
    ("performer", {"feature_map": "positive"}),
    ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "trig"}),
    ("performer", {"feature_map": "relu"}),
    ("performer", {"orthogonal": False}),
    ("favor", {}),
    ("rfa", {"feature_map": "sincos"}),
    ("rfa", {"feature_map": "arccos", "sigma": 0.7}),
    ("rfa", {"learn_sigma": True}),
    ("linear", {}),
]


def _id(variant):
    name, opts = variant
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def make(name, opts, d=21, h=3, chunk=16, device="cpu"):
    options = {"chunk_size": chunk, **opts}
    if name != "linear":
        options.setdefault("num_features", 24)
    module = effattn.build(name, head_dim=d, heads=h, seed=0, **options).double().eval()
    module = module.to(device)
    module.slice_elements = 3000  # slices of a few chunks: every test crosses slice borders
    return module


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 63, 257])
def test_module_matches_reference_outputs_and_gradients(variant, causal, n, device):
    name, opts = variant
    module = make(name, opts, device=device)
    q, k, v = (t.to(device) for t in qkv(n=n, dv=5, scale=0.5))
    mask = padding(2, n).to(device) if n > 1 else None
    for t in (q, k, v):
        t.requires_grad_(True)
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask)
    tol = 1e-7 if opts.get("feature_map") == "trig" or name == "favor" else 1e-9
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    params = [q, k, v] + [p for p in module.parameters()]
    probe = torch.randn_like(out)
    g_out = torch.autograd.grad((out * probe).sum(), params)
    g_ref = torch.autograd.grad((ref * probe).sum(), params)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=100 * tol, atol=100 * tol)


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_cross_attention_matches_reference(variant, device):
    name, opts = variant
    module = make(name, opts, device=device)
    q = qkv(n=17, scale=0.5)[0].to(device)
    k, v = (t.to(device) for t in qkv(n=40, dv=5, scale=0.5, seed=1)[1:])
    mask = padding(2, 40).to(device)
    out = module(q, k, v, key_padding_mask=mask)
    ref = module.spec.reference(module, q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)


def test_gated_rfa_matches_recurrence_and_step(device):
    module = make("rfa", {"gated": True}, device=device)
    q, k, v = (t.to(device) for t in qkv(n=70, dv=5))
    gate = torch.sigmoid(torch.randn(2, 3, 70, dtype=torch.float64)).to(device)
    mask = padding(2, 70).to(device)
    for t in (q, k, v, gate):
        t.requires_grad_(True)
    out = module(q, k, v, causal=True, key_padding_mask=mask, gate=gate)
    ref = module.spec.reference(module, q, k, v, causal=True, key_padding_mask=mask, gate=gate)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    g_out = torch.autograd.grad(out.sum(), (q, k, v, gate))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v, gate))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize(
    "variant", VARIANTS + [("rfa", {"gated": True})], ids=_id
)
def test_step_equals_causal_forward_with_fixed_size_state(variant, device):
    name, opts = variant
    module = make(name, opts, device=device)
    q, k, v = (t.to(device) for t in qkv(n=45, dv=5, scale=0.5))
    gate = torch.sigmoid(torch.randn(2, 3, 45, dtype=torch.float64)).to(device)
    kw = {"gate": gate} if opts.get("gated") else {}
    full = module(q, k, v, causal=True, **kw)
    state, outs, sizes = None, [], set()
    for t in range(45):
        step_kw = {"gate": gate[:, :, t : t + 1]} if kw else {}
        o, state = module.step(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, **step_kw
        )
        outs.append(o)
        sizes.add(state.nbytes())
    tol = 1e-7 if opts.get("feature_map") == "trig" or name == "favor" else 1e-10
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=tol, atol=tol)
    assert len(sizes) == 1


@pytest.mark.parametrize("name", ["performer", "favor", "rfa", "linear"])
def test_no_future_leakage_and_padding_invariance(name):
    module = make(name, {})
    q, k, v = qkv(n=50, scale=0.5)
    out = module(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] *= 4.0
    v2[:, :, 30:] = 9.0
    torch.testing.assert_close(module(q, k2, v2, causal=True)[:, :, :30], out[:, :, :30])
    mask = padding(2, 50)
    keep = ~mask[:, None, :, None]
    for causal in (False, True):
        out = module(q, k, v, causal=causal, key_padding_mask=mask)
        out2 = module(
            q, torch.where(keep, k, 3.0), torch.where(keep, v, -50.0),
            causal=causal, key_padding_mask=mask,
        )
        torch.testing.assert_close(out, out2)


def _rel_err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.slow
def test_performer_error_falls_with_features_and_orthogonal_beats_iid():
    q, k, v = qkv(b=1, h=4, n=256, d=32, scale=0.5, dtype=torch.float32)
    exact = F.scaled_dot_product_attention(q, k, v)
    errors = {}
    for orthogonal in (True, False):
        for f in (64, 256, 1024):
            errs = [
                _rel_err(effattn.attention(q, k, v, method="performer", num_features=f,
                                           orthogonal=orthogonal, seed=s), exact)
                for s in range(6)
            ]
            errors[orthogonal, f] = sum(errs) / len(errs)
    for orthogonal in (True, False):
        assert errors[orthogonal, 64] > errors[orthogonal, 256] > errors[orthogonal, 1024]
        assert errors[orthogonal, 1024] < 0.5 * errors[orthogonal, 64]
    assert sum(errors[True, f] for f in (64, 256, 1024)) < sum(
        errors[False, f] for f in (64, 256, 1024)
    )


@pytest.mark.slow
@pytest.mark.parametrize("sigma", [1.0, 0.6])
def test_rfa_converges_to_softmax_of_unit_vectors_over_sigma_squared(sigma):
    q, k, v = qkv(b=1, h=2, n=128, d=16, dtype=torch.float32)
    exact = R.softmax_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v,
                                scale=1 / sigma**2)
    errs = [
        sum(_rel_err(effattn.attention(q, k, v, method="rfa", num_features=f, sigma=sigma,
                                       seed=s), exact) for s in range(4)) / 4
        for f in (32, 256, 2048)
    ]
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < errs[0] / 4  # 64x the features: Monte Carlo error ~ 1/sqrt(F) drops ~8x
    if sigma == 1.0:
        assert errs[2] < 0.1


@pytest.mark.parametrize("name, opts", [
    ("performer", {}), ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "trig"}), ("favor", {}), ("rfa", {}), ("linear", {}),
])
@pytest.mark.parametrize("causal", [False, True])
def test_no_nan_or_inf_for_large_norms_in_fp32(name, opts, causal):
    q, k, v = qkv(b=1, h=2, n=200, d=64, dtype=torch.float32)
    q = 30 * F.normalize(q, dim=-1)
    k = 30 * F.normalize(k, dim=-1)
    k[:, :, 150:] *= 0.1  # keys of very different norms: stabilisers must cope
    module = effattn.build(name, head_dim=64, heads=2, seed=0, **opts)
    out = module(q, k, v, causal=causal)
    assert torch.isfinite(out).all()
    q.requires_grad_(True)
    module(q, k, v, causal=causal).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_seed_fixes_features_and_redraw_follows_the_policy():
    a = effattn.build("performer", head_dim=16, heads=2, seed=3, redraw_interval=2)
    b = effattn.build("performer", head_dim=16, heads=2, seed=3, redraw_interval=2)
    assert torch.equal(a.projection, b.projection)
    q, k, v = qkv(b=1, h=2, n=8, d=16, dtype=torch.float32)
    first = a.projection.clone()
    a.eval()
    for _ in range(5):
        a(q, k, v)
    assert torch.equal(a.projection, first), "eval mode never redraws"
    a.train()
    a(q, k, v)
    a(q, k, v)
    assert torch.equal(a.projection, first), "the first interval keeps the initial draw"
    a(q, k, v)
    assert not torch.equal(a.projection, first), "call 3 starts interval 2 with a redraw"
    b.train()
    for _ in range(3):
        b(q, k, v)
    assert torch.equal(a.projection, b.projection), "the redraw sequence is seeded"
    never = effattn.build("favor", head_dim=16, heads=2, seed=1, redraw_interval=None).train()
    phase = never.phase.clone()
    for _ in range(4):
        never(q, k, v)
    assert torch.equal(never.phase, phase)


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_the_map_as_data_is_the_modules_features(variant):
    """What the core calls (feature_fn) computes exactly what features does; a map given as data
    rebuilds the true features from its parts, as the triton strategy's kernels form them:
    exp(x̃ r^T - m) e^{log-scale} for PositiveMap (m the row maxima), sin(x̃ r^T + c)
    e^{log-scale} for SineMap (r its rows, c its phases), (relu(x̃ w^T) + b) e^{log-scale} for
    ReluMap (b its floor), x + 1 above 0 and e^x below for EluMap, float64."""
    from effattn.kernelized import features as fm

    module = make(*variant)
    fn = module.feature_fn()
    x = torch.randn(2, 3, 11, 21, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for is_query in (True, False):
        phi, log_scale = module.features(x, is_query=is_query)
        got, got_scale = fn(x, is_query=is_query)
        assert torch.equal(got, phi)
        assert (got_scale is None) == (log_scale is None)
        if log_scale is not None:
            assert torch.equal(got_scale, log_scale)
        true = phi * (1.0 if log_scale is None else log_scale.exp())
        if isinstance(fn, fm.PositiveMap):
            u = fn.inputs(x) @ fn.rows().T
            m = u.amax(-1, keepdim=True)
            scale = fm.positive_log_scale(fn.inputs(x), m, u.shape[-1], is_query=is_query)
            rebuilt = torch.exp(u - m) * scale.exp()
        elif isinstance(fn, fm.SineMap):
            scale = fn.log_scale(fn.inputs(x), is_query=is_query)
            rebuilt = torch.sin(fn.inputs(x) @ fn.rows().T + fn.phases())
            rebuilt = rebuilt * (1.0 if scale is None else scale.exp())
        elif isinstance(fn, fm.ReluMap):
            scale = fn.log_scale(fn.inputs(x), is_query=is_query)
            rebuilt = (fn.inputs(x) @ fn.w.T).clamp_min(0) + fn.floor()
            rebuilt = rebuilt * (1.0 if scale is None else scale.exp())
        elif isinstance(fn, fm.EluMap):
            rebuilt = torch.where(x > 0, x + 1, x.exp())
        else:
            assert fn == module.features
            continue
        torch.testing.assert_close(rebuilt, true, rtol=1e-12, atol=1e-12)


def test_rfa_learned_sigma_gets_gradients_and_feature_dims():
    m = effattn.build("rfa", head_dim=8, heads=2, learn_sigma=True, num_features=10, seed=0)
    q, k, v = qkv(b=1, h=2, n=12, d=8, dtype=torch.float32)
    m(q, k, v, causal=True).sum().backward()
    assert m.log_sigma.grad is not None and m.log_sigma.grad.abs().sum() > 0
    assert m.feature_dim == 20
    assert effattn.build("rfa", head_dim=8, heads=2, feature_map="arccos",
                         num_features=10).feature_dim == 10
    assert effattn.build("performer", head_dim=8, heads=2, feature_map="hyperbolic",
                         num_features=10).feature_dim == 20
    assert effattn.build("linear", head_dim=8, heads=2).feature_dim == 8


def test_rfa_map_inputs_and_their_gradients_equal_autograds_of_unit_over_sigma():
    """RFA's x ↦ unit(x)/σ keeps only x̃ and |x| for backward (rfa._ScaledUnit): its value and
    gradients (x and σ, learned) equal autograd's through F.normalize, in float64, also on a
    zero row and one below the norm's floor (where unit(x) = x / ε)."""
    from effattn.mechanisms.rfa import UNIT_EPS, _ScaledUnit, unit

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, 21, generator=g, dtype=torch.float64).requires_grad_()
    s = (0.5 + torch.rand(3, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(_ScaledUnit.apply, (x, s))
    x = x.detach().clone()
    x[0, 1, 2] = 0.0
    x[1, 0, 3] *= 0.1 * UNIT_EPS / x[1, 0, 3].norm()
    x.requires_grad_()
    y = _ScaledUnit.apply(x, s)
    expected = unit(x) * s[:, None, None]
    torch.testing.assert_close(y, expected, rtol=1e-14, atol=0)
    d_y = torch.randn(y.shape, generator=g, dtype=torch.float64)
    got, want = torch.autograd.grad(y, (x, s), d_y), torch.autograd.grad(expected, (x, s), d_y)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    assert got[0][1, 0, 3].abs().min() > 1.0 / UNIT_EPS * 1e-3  # the floor's 1/ε branch
    module = effattn.build("rfa", head_dim=21, heads=3, learn_sigma=True, seed=0).double()
    with torch.no_grad():
        module.log_sigma.copy_(s.detach().reciprocal().log())
    torch.testing.assert_close(module._inputs(x), expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("name, opts, match", [
    ("performer", {"num_features": 0}, "num_features"),
    ("performer", {"feature_map": "cosine"}, "feature_map"),
    ("performer", {"redraw_interval": 0}, "redraw_interval"),
    ("performer", {"chunk_size": 0}, "chunk_size"),
    ("favor", {"num_features": -3}, "num_features"),
    ("rfa", {"sigma": 0.0}, "sigma"),
    ("rfa", {"feature_map": "positive"}, "feature_map"),
    ("linear", {"chunk_size": 2.5}, "chunk_size"),
])
def test_bad_options(name, opts, match):
    with pytest.raises(ValueError, match=match):
        effattn.build(name, head_dim=8, heads=2, **opts)


def test_gate_errors():
    q, k, v = qkv(b=1, h=2, n=6, d=8, dtype=torch.float32)
    gate = torch.full((1, 2, 6), 0.5)
    gated = effattn.build("rfa", head_dim=8, heads=2, gated=True)
    with pytest.raises(ValueError, match="needs gate"):
        gated(q, k, v, causal=True)
    with pytest.raises(ValueError, match="causal=True"):
        gated(q, k, v, gate=gate)
    with pytest.raises(ValueError, match=r"\(B, H, N\)"):
        gated(q, k, v, causal=True, gate=gate[..., :4])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gated(q, k, v, causal=True, gate=gate + 1)
    with pytest.raises(ValueError, match="gate is only taken with gated=True"):
        effattn.build("rfa", head_dim=8, heads=2)(q, k, v, causal=True, gate=gate)
    with pytest.raises(TypeError, match="unexpected call argument.* gate; .* are: none"):
        effattn.build("performer", head_dim=8, heads=2)(q, k, v, causal=True, gate=gate)
    with pytest.raises(ValueError, match="needs gate"):
        gated.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    out = effattn.attention(q, k, v, method="rfa", gated=True, causal=True, gate=gate, seed=0)
    assert out.shape == (1, 2, 6, 8)


@pytest.mark.parametrize("variant", [("softmax", {})] + VARIANTS + [("rfa", {"gated": True})],
                         ids=_id)
def test_prefill_then_step_equals_causal_forward(variant, device):
    name, opts = variant
    module = (make(name, opts, device=device) if name != "softmax"
              else effattn.build("softmax", head_dim=21, heads=3).double().to(device))
    q, k, v = (t.to(device) for t in qkv(n=60, dv=5, scale=0.5))
    gate = torch.sigmoid(torch.randn(2, 3, 60, dtype=torch.float64)).to(device)

    def kw(a, b):
        return {"gate": gate[:, :, a:b]} if opts.get("gated") else {}

    full = module(q, k, v, causal=True, **kw(0, 60))
    out1, state = module.prefill(q[:, :, :23], k[:, :, :23], v[:, :, :23], **kw(0, 23))
    out2, state = module.prefill(q[:, :, 23:50], k[:, :, 23:50], v[:, :, 23:50], state,
                                 **kw(23, 50))
    outs = [out1, out2]
    for t in range(50, 60):
        out, state = module.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                 state, **kw(t, t + 1))
        outs.append(out)
    tol = 1e-7 if opts.get("feature_map") == "trig" or name == "favor" else 1e-10
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=tol, atol=tol)


def test_prefill_refusals():
    m = effattn.build("softmax", head_dim=4, heads=3)
    q, k, v = qkv(n=5, m=7, d=4)
    with pytest.raises(ValueError, match="causal=True needs N == M"):
        m.prefill(q, k, v)
    with pytest.raises(ValueError, match="KVCache"):
        m.prefill(q, q, q, state="cache")


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_flop_model_is_the_gemm_work_of_a_forward(variant):
    """The spec's FLOP model, which benchmarks divide by, counts the GEMMs a non-causal forward
    runs (paired sin/cos and antithetic features once projected 2F wide, twice the model)."""
    from torch.utils.flop_counter import FlopCounterMode

    from effattn.registry import Problem

    name, opts = variant
    spec = effattn.spec(name)
    module = effattn.build(name, head_dim=16, heads=2, seed=0, **opts).eval()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 63, 16, generator=gen)
    k = torch.randn(2, 2, 40, 16, generator=gen)
    v = torch.randn(2, 2, 40, 12, generator=gen)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(q, k, v)
    expected = spec.flops({**spec.options, **opts}, Problem(2, 2, 63, 40, 16, 12))
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_backward_graph_has_no_view_copies(variant):
    """No in-place op on a view of an N x F tensor: autograd would record a CopySlices node,
    which copies and zero-fills whole buffers in backward."""
    name, opts = variant
    module = effattn.build(name, head_dim=16, heads=2, seed=0, **opts)
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    seen, stack, kinds = set(), [module(q, k, v, causal=True).grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kinds.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    assert "CopySlices" not in kinds
