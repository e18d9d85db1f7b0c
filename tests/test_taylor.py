"""taylor: the Taylor kernel exactly, its projection, decoding, large inputs, the learned
projection (gradients, distillation, state_dict), the FLOP model and bad options.

The reference comparisons over every mode (causal, padding, cross, gradients of the learned
projection) run for every registered method and variant in tests/test_references.py; compile in
tests/test_compile.py; sequence parallel in tests/test_distributed.py."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import padding, qkv

import effattn
from effattn import naive
from effattn.kernelized import features as fm
from effattn.kernelized.core import SLICE_ELEMENTS

PROJECTIONS = [True, False]


def make(learn_projection=True, d=21, h=3, dtype=torch.float64, **opts):
    module = effattn.build("taylor", head_dim=d, heads=h, seed=0, chunk_size=16,
                           learn_projection=learn_projection, **opts).to(dtype).eval()
    module.slice_elements = 3000  # slices of a few chunks: decoding crosses slice borders
    return module


def _full_vec(x):
    """[1, x, vec(x xᵀ)/√2]: Based's map as written, with all P² quadratic features."""
    quad = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2)
    return torch.cat([torch.ones_like(x[..., :1]), x, quad], -1)


@pytest.mark.parametrize("p", [1, 2, 5, 16])
def test_the_kernel_is_exactly_one_plus_t_plus_half_t_squared(p, device):
    """The symmetric map (upper triangle, √2 on off-diagonal pairs) and the full vec(x xᵀ)/√2
    give the same kernel 1 + t + t²/2, t = x·y, in float64 (inputs up to norm ~40)."""
    g = torch.Generator().manual_seed(p)
    norms = torch.logspace(-2, 1, 50, dtype=torch.float64)[:, None]  # rows of norm ~0.01 to 40
    x = torch.randn(3, 2, 50, p, generator=g, dtype=torch.float64) * norms
    y = torch.randn(3, 2, 50, p, generator=g, dtype=torch.float64)
    x, y = x.to(device), y.to(device)
    phi_x, log_scale = fm.taylor(x)
    phi_y, _ = fm.taylor(y)
    assert log_scale is None and phi_x.shape[-1] == 1 + p + p * (p + 1) // 2
    t = (x * y).sum(-1)
    kernel = 1 + t + t * t / 2
    torch.testing.assert_close((phi_x * phi_y).sum(-1), kernel, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close((_full_vec(x) * _full_vec(y)).sum(-1), kernel, rtol=1e-13,
                               atol=1e-13)
    assert fm.denominator_eps(fm.taylor) == 0.0  # the kernel is >= 1/2: no eps floor


@pytest.mark.parametrize("p", [1, 2, 5, 16])
def test_the_map_as_data_is_the_modules_features_and_a_product_of_two_affine_maps(p):
    """What the core calls (feature_fn, a TaylorMap) computes exactly what features does, and
    its factors rebuild each feature as (a_f·x̃ + b_f)(c_f·x̃ + e_f) on the module's x̃ (the
    product the triton strategy's kernels form), exactly in float64."""
    module = effattn.build("taylor", head_dim=7, heads=3, proj_dim=p, seed=0).double()
    fn = module.feature_fn()
    assert isinstance(fn, fm.TaylorMap)
    x = torch.randn(2, 3, 11, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(p))
    for is_query in (True, False):
        phi, log_scale = module.features(x, is_query=is_query)
        got, got_scale = fn(x, is_query=is_query)
        assert torch.equal(got, phi) and got_scale is None and log_scale is None
    inputs = fn.inputs(x)
    a, c, b, e = fm.TaylorMap.factors(p, inputs)
    assert a.shape == c.shape == (module.feature_dim, p) and b.shape == e.shape == a.shape[:1]
    torch.testing.assert_close((inputs @ a.T + b) * (inputs @ c.T + e), phi, rtol=1e-15,
                               atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_at_proj_dim_of_at_least_d_t_is_the_softmax_logit(causal, device):
    """P >= D: the projection has orthonormal rows (W Wᵀ = I, to the fp32 rounding of the
    stored weights), so t = scale q·k and the module is the Taylor expansion of
    softmax(scale q kᵀ) to second order."""
    for p in (21, 30):
        module = make(proj_dim=p, learn_projection=False).to(device)
        w = module.projection
        torch.testing.assert_close(w @ w.transpose(-2, -1),
                                   torch.eye(21, dtype=torch.float64,
                                             device=device).expand(3, 21, 21),
                                   rtol=1e-6, atol=1e-6)
        q, k, v = (t.to(device) for t in qkv(n=40, dv=5))
        t = module.scale * q @ k.transpose(-2, -1)
        kernel = 1 + t + t * t / 2
        if causal:
            kernel = kernel.tril()
        want = kernel @ v / kernel.sum(-1, keepdim=True)
        torch.testing.assert_close(module(q, k, v, causal=causal), want, rtol=1e-5, atol=1e-5)


def test_a_smaller_projection_is_unbiased():
    """P < D: W_h = sqrt(D/P) Q_h with Q_h an orthonormal basis of a random P-dimensional
    subspace: W_h W_hᵀ is D/P times a projector (rank P), E[W Wᵀ] = I. Mean over 3000 heads:
    every entry within 0.06 of I (each entry's mean has a spread of ~0.01)."""
    w = effattn.build("taylor", head_dim=16, heads=3000, seed=0, proj_dim=4).projection.double()
    wwt = w @ w.transpose(-2, -1)
    torch.testing.assert_close(w.transpose(-2, -1) @ w,
                               4.0 * torch.eye(4, dtype=torch.float64).expand(3000, 4, 4),
                               rtol=1e-6, atol=1e-6)  # fp32 weights
    assert (wwt.mean(0) - torch.eye(16, dtype=torch.float64)).abs().max() < 0.06
    assert (wwt.diagonal(dim1=-2, dim2=-1).mean() - 1).abs() < 1e-6  # trace D, every head


@pytest.mark.parametrize("learn_projection", PROJECTIONS, ids=["learned", "fixed"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)],
                         ids=["float64", "fp32"])
@pytest.mark.parametrize("prefill", [0, 37], ids=["step", "prefill-then-step"])
def test_decoding_equals_the_causal_forward(learn_projection, dtype, tol, prefill, device):
    module = make(learn_projection, dtype=dtype, proj_dim=6).to(device)
    q, k, v = (t.to(device, dtype) for t in qkv(n=50, dv=5))
    full = module(q, k, v, causal=True)
    outs, state = [], None
    if prefill:
        out, state = module.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill])
        outs.append(out)
    for t in range(prefill, 50):
        out, state = module.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                 state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=tol, atol=tol)
    assert state.kv.shape == (2, 3, 28, 6) and state.position == 50


@pytest.mark.parametrize("causal", [False, True])
def test_no_overflow_at_norms_of_30_in_fp32(causal, device):
    """Rows of norm 30 (t up to ~110 at D = 64, kernel values ~6000): polynomial features need no
    stabiliser; fp32 equals float64 to its rounding, gradients finite."""
    q, k, v = (x.to(device) for x in qkv(b=1, h=2, n=200, d=64))
    q = 30 * F.normalize(q, dim=-1)
    k = 30 * F.normalize(k, dim=-1)
    k[:, :, 150:] *= 0.1
    module = make(d=64, h=2, dtype=torch.float32).to(device)
    exact = copy.deepcopy(module).double()(q, k, v, causal=causal)
    qf = q.float().requires_grad_()
    out = module(qf, k.float(), v.float(), causal=causal)
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert torch.isfinite(qf.grad).all() and torch.isfinite(module.projection.grad).all()


def test_padding_only_zeroes_the_queries_that_see_no_key():
    """eps = 0: a query that sees no key gets exactly 0 (no underflow error), every other one a
    denominator >= 1/2 per key it sees."""
    q, k, v = (x.float() for x in qkv(n=30, d=16))
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[0] = True
    mask[1, :9] = True
    module = make(d=16, dtype=torch.float32)
    out = module(q, k, v, causal=True, key_padding_mask=mask)
    assert (out[0] == 0).all() and (out[1, :, :9] == 0).all()
    assert (out[1, :, 9:].abs().amax(-1) > 0).all()


@pytest.mark.parametrize("learn_projection", PROJECTIONS, ids=["learned", "fixed"])
def test_the_projection_is_a_parameter_or_a_buffer(learn_projection):
    module = make(learn_projection, proj_dim=6).train()
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    if learn_projection:
        assert module.feature_parameters() == (module.projection,) and "projection" in params
    else:
        assert module.feature_parameters() == () and not params and "projection" in buffers
    assert "projection" in module.state_dict()
    q, k, v = (t.requires_grad_() for t in qkv(n=30))
    module(q, k, v, causal=True, key_padding_mask=padding(2, 30)).square().sum().backward()
    if learn_projection:
        assert module.projection.grad.abs().sum() > 0
    assert q.grad.abs().sum() > 0


def test_attention_distillation_reduces_the_error_to_softmax():
    """Cross-entropy between softmax(scale q kᵀ) and the Taylor kernel's normalised weights,
    on the teacher's own q, k, over the learned projection (P = 4 of D = 16: a poor random
    start, 0.72 of relative output error): 30 Adam steps take it to 0.54, where a rank-4 t and
    the flatter Taylor kernel leave it (more steps or a larger rate gain nothing)."""
    q, k, v = qkv(b=1, h=2, n=64, d=16)
    module = make(d=16, h=2, proj_dim=4).train()
    teacher = torch.softmax(module.scale * q @ k.transpose(-2, -1), -1)
    exact = naive.softmax_attention(q, k, v, scale=module.scale)

    def error():
        with torch.no_grad():
            return ((module(q, k, v) - exact).norm() / exact.norm()).item()

    before = error()
    optimizer = torch.optim.Adam(module.feature_parameters(), lr=0.05)
    for _ in range(30):
        phi_q, _ = module.features(q, is_query=True)
        phi_k, _ = module.features(k, is_query=False)
        a = phi_q @ phi_k.transpose(-2, -1)
        loss = -(teacher * (a / a.sum(-1, keepdim=True)).log()).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert error() < 0.8 * before


@pytest.mark.parametrize("learn_projection", PROJECTIONS, ids=["learned", "fixed"])
def test_state_dict_round_trip(learn_projection):
    a = make(learn_projection, proj_dim=6)
    with torch.no_grad():
        a.projection.mul_(1.5)  # a trained-looking projection, not the seed's draw
    b = effattn.build("taylor", head_dim=21, heads=3, seed=5, chunk_size=16, proj_dim=6,
                      learn_projection=learn_projection).double()
    b.load_state_dict(a.state_dict())
    q, k, v = qkv(n=30)
    torch.testing.assert_close(b.eval()(q, k, v, causal=True), a(q, k, v, causal=True),
                               rtol=0, atol=0)


def test_flop_model_is_the_gemm_work_of_a_forward():
    from torch.utils.flop_counter import FlopCounterMode

    from effattn.registry import Problem

    spec = effattn.spec("taylor")
    for opts in ({}, {"proj_dim": 5, "learn_projection": False}):
        module = effattn.build("taylor", head_dim=16, heads=2, seed=0, **opts).eval()
        q, k, v = qkv(b=2, h=2, n=63, m=40, d=16, dv=12, dtype=torch.float32)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            module(q, k, v)
        expected = spec.flops({**spec.options, **opts}, Problem(2, 2, 63, 40, 16, 12))
        assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)


def test_compiled_training_gives_the_projection_the_eager_gradients():
    eager = make(proj_dim=5).train()
    eager.slice_elements = SLICE_ELEMENTS  # one slice: a smaller graph to trace
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    q, k, v = qkv(n=24)
    mask = padding(2, 24)
    eager(q, k, v, causal=True, key_padding_mask=mask).square().sum().backward()
    compiled(q, k, v, causal=True, key_padding_mask=mask).square().sum().backward()
    torch.testing.assert_close(compiled_module.projection.grad, eager.projection.grad,
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("opts, match", [
    ({"proj_dim": 0}, "proj_dim"),
    ({"proj_dim": 4.0}, "proj_dim"),
    ({"learn_projection": "yes"}, "learn_projection"),
    ({"chunk_size": -1}, "chunk_size"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        effattn.build("taylor", head_dim=8, heads=2, **opts)
