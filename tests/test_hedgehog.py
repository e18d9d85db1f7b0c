"""hedgehog: the learned exp / softmax-over-features map at its initialisation, decoding, large
inputs, its parameters (gradients, distillation, state_dict), the FLOP model and bad options.

The reference comparisons over every mode (causal, padding, cross, gradients of W and b) run
for every registered method in tests/test_references.py; compile in tests/test_compile.py;
sequence parallel in tests/test_distributed.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import padding, qkv

import effattn
from effattn import naive
from effattn.kernelized.core import SLICE_ELEMENTS

MAPS = ["exp", "softmax_dim"]


def make(feature_map="exp", d=21, h=3, dtype=torch.float64, **opts):
    module = effattn.build("hedgehog", head_dim=d, heads=h, seed=0, chunk_size=16,
                           feature_map=feature_map, **opts).to(dtype).eval()
    module.slice_elements = 3000  # slices of a few chunks: decoding crosses slice borders
    return module


def trained(module, seed=1):
    """``module`` with a trained-looking map: W off the identity, b non-zero (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.add_(0.3 * torch.randn(module.weight.shape, generator=g).to(module.weight))
        module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=g).to(module.bias))
    return module


def _decode(module, q, k, v, prefill):
    outs, state = [], None
    if prefill:
        out, state = module.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill])
        outs.append(out)
    for t in range(prefill, q.shape[2]):
        out, state = module.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                 state)
        outs.append(out)
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)],
                         ids=["float64", "fp32"])
@pytest.mark.parametrize("prefill", [0, 37], ids=["step", "prefill-then-step"])
def test_decoding_equals_the_causal_forward(feature_map, dtype, tol, prefill, device):
    module = trained(make(feature_map, dtype=dtype, num_features=30)).to(device)
    q, k, v = (t.to(device, dtype) for t in qkv(n=50, dv=5))
    full = module(q, k, v, causal=True)
    out, state = _decode(module, q, k, v, prefill)
    torch.testing.assert_close(out, full, rtol=tol, atol=tol)
    assert state.kv.shape == (2, 3, 60, 6) and state.position == 50


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("mode", ["full", "causal-padded", "cross-padded"])
def test_a_trained_map_equals_its_reference_with_gradients(feature_map, mode, device):
    """tests/test_references.py checks the map at its initialisation (W = I, b = 0); here W and b
    are off it, and F = 30 > D = 21: outputs and gradients of q, k, v, W and b equal the
    explicit kernel matrix in float64 (N = 63, M = 50 for cross, Dv = 10, chunks of 16 and
    slices of a few chunks, both ending in a partial one)."""
    causal, cross = mode.startswith("causal"), mode.startswith("cross")
    module = trained(make(feature_map, num_features=30)).to(device)
    q, k, v = (t.to(device) for t in qkv(n=63, m=50 if cross else 63, dv=10))
    mask = padding(2, k.shape[2]).to(device) if mode.endswith("padded") else None
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    ref = effattn.spec("hedgehog").reference(module, q, k, v, causal=causal,
                                             key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    probe = torch.randn(out.shape, dtype=out.dtype,
                        generator=torch.Generator().manual_seed(3)).to(device)
    wrt = [*inputs, module.weight, module.bias]
    got = torch.autograd.grad((out * probe).sum(), wrt)
    want = torch.autograd.grad((ref * probe).sum(), wrt)
    for name, a, b in zip(["q", "k", "v", "weight", "bias"], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10,
                                   msg=lambda text, name=name: f"grad {name}: {text}")


def test_the_reference_rejects_an_unknown_map():
    q, k, v = qkv(n=5, d=4, h=1)
    with pytest.raises(ValueError, match="feature_map 'relu'"):
        naive.hedgehog_attention(q, k, v, torch.eye(4)[None], torch.zeros(1, 4),
                                 feature_map="relu")


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("t", [37, 47], ids=["mid-chunk", "chunk-end"])
def test_large_future_keys_leave_earlier_fp32_outputs_alone(feature_map, t, device):
    """The causal stabiliser (the prefix max of the keys' log-scales) takes no future key: keys
    after t moved to norm 100 (log-scales ~130 above the earlier keys': a stabiliser that took
    them would scale those keys by exp(-130), below fp32's range) leave the fp32 outputs at
    positions <= t equal to the float64 ones without them, in the forward and through a
    prefill split at 23 (mid-chunk), with a trained-looking map. The softmax form has no
    log-scale; it must pass as well."""
    q, k, v = (x.to(device) for x in qkv(n=100, dv=5, scale=0.7))
    module = trained(make(feature_map, num_features=30)).to(device)
    ref = module(q, k, v, causal=True)[:, :, : t + 1]
    k_big = k.clone()
    k_big[:, :, t + 1 :] = 100 * F.normalize(k[:, :, t + 1 :], dim=-1)
    q, k_big, v = q.float(), k_big.float(), v.float()
    module = module.float()
    torch.testing.assert_close(module(q, k_big, v, causal=True)[:, :, : t + 1].double(), ref,
                               rtol=1e-4, atol=1e-4)
    first, state = module.prefill(q[:, :, :23], k_big[:, :, :23], v[:, :, :23])
    rest, _ = module.prefill(q[:, :, 23:], k_big[:, :, 23:], v[:, :, 23:], state)
    torch.testing.assert_close(torch.cat([first, rest], 2)[:, :, : t + 1].double(), ref,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_no_overflow_at_norms_of_30_in_fp32(feature_map, causal, device):
    """Rows of norm 30 (|u| up to ~20 at the identity, exp(±u) alone overflows nothing but their
    products across 2F features and keys of very different norms test the stabiliser): finite
    outputs and gradients, equal to the float64 result."""
    q, k, v = (x.to(device) for x in qkv(b=1, h=2, n=200, d=64))
    q = 30 * F.normalize(q, dim=-1)
    k = 30 * F.normalize(k, dim=-1)
    k[:, :, 150:] *= 0.1
    module = make(feature_map, d=64, h=2, dtype=torch.float32).to(device)
    exact = copy.deepcopy(module).double()(q, k, v, causal=causal)
    qf = q.float().requires_grad_()
    out = module(qf, k.float(), v.float(), causal=causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert torch.isfinite(qf.grad).all() and torch.isfinite(module.weight.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_identity_init_is_the_cosh_kernel(causal, device):
    """At init W = I and b = 0: φ(q)·φ(k) = Σ_f exp(q_f + k_f) + exp(-q_f - k_f)
    = 2 Σ_f cosh(q_f + k_f), on q and k as they are (scale has no effect)."""
    module = make(scale=0.01).to(device)
    identity = torch.eye(21, dtype=torch.float64, device=device).expand(3, 21, 21)
    assert torch.equal(module.weight, identity)
    assert not module.bias.any()
    q, k, v = (t.to(device) for t in qkv(n=40, dv=5, scale=0.7))
    kernel = 2 * torch.cosh(q[..., :, None, :] + k[..., None, :, :]).sum(-1)  # (B, H, N, M)
    if causal:
        kernel = kernel.tril()
    want = kernel @ v / kernel.sum(-1, keepdim=True)
    torch.testing.assert_close(module(q, k, v, causal=causal), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(make().to(device)(q, k, v, causal=causal), want, rtol=1e-12,
                               atol=1e-12)


def test_init_beyond_and_below_the_head_dim():
    """F > D: the identity in the first D columns, small distinct columns after it (equal zero
    columns would get equal gradients forever); F < D: the first F columns of the identity."""
    wide = make(d=8, num_features=20).weight
    assert torch.equal(wide[..., :8], torch.eye(8, dtype=torch.float64).expand(3, 8, 8))
    extra = wide[..., 8:]
    assert 0 < extra.abs().max() < 0.1
    assert len({tuple(c.tolist()) for c in extra[0].T}) == 12
    assert torch.equal(make(d=8, num_features=20).weight, wide)  # drawn from the seed
    narrow = make(d=8, num_features=5).weight
    assert torch.equal(narrow, torch.eye(8, 5, dtype=torch.float64).expand(3, 8, 5))
    assert make(d=8, num_features=5).feature_dim == 10 and make(d=8).feature_dim == 16


def test_parameters_get_gradients_and_are_the_feature_parameters():
    module = make(num_features=24).train()
    assert module.feature_parameters() == (module.weight, module.bias)
    assert {n for n, _ in module.named_parameters()} == {"weight", "bias"}
    q, k, v = qkv(n=30)
    module(q, k, v, causal=True, key_padding_mask=padding(2, 30)).square().sum().backward()
    assert module.weight.grad.abs().sum() > 0 and module.bias.grad.abs().sum() > 0


def _attention_weights(module, q, k):
    """The normalised weights φ(q_i)·φ(k_j) / Σ_j φ(q_i)·φ(k_j) of the module's map (B, H, N, M)."""
    phi_q, _ = module.features(q, is_query=True)
    phi_k, log_scale = module.features(k, is_query=False)
    if log_scale is not None:
        phi_k = phi_k * torch.exp(log_scale - log_scale.amax(-2, keepdim=True))
    a = phi_q @ phi_k.transpose(-2, -1)
    return a / a.sum(-1, keepdim=True)


@pytest.mark.parametrize("feature_map, lr, factor", [("exp", 0.05, 0.5),
                                                     ("softmax_dim", 0.2, 0.85)])
def test_attention_distillation_reduces_the_error_to_softmax(feature_map, lr, factor):
    """Hedgehog's training signal: cross-entropy between softmax(scale q kᵀ) and the map's
    normalised weights, on the teacher's own q, k. 30 Adam steps on W and b move the output
    toward exact softmax attention (peaked logits, where the identity map is near uniform): the
    exp map from 0.81 to 0.38 of relative error, the bounded softmax one, slower, 0.89 to 0.69."""
    torch.manual_seed(0)
    q, k, v = qkv(b=1, h=2, n=64, d=16, scale=0.5)
    q[..., :4] *= 6.0  # a few large logits per query: a peaked teacher
    k[..., :4] *= 6.0
    module = make(feature_map, d=16, h=2).train()
    teacher = torch.softmax(module.scale * q @ k.transpose(-2, -1), -1)
    exact = naive.softmax_attention(q, k, v, scale=module.scale)

    def error():
        with torch.no_grad():
            return ((module(q, k, v) - exact).norm() / exact.norm()).item()

    before = error()
    optimizer = torch.optim.Adam(module.feature_parameters(), lr=lr)
    for _ in range(30):
        loss = -(teacher * _attention_weights(module, q, k).log()).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert error() < factor * before


def test_state_dict_round_trip():
    a = make(num_features=24).train()
    q, k, v = qkv(n=30)
    optimizer = torch.optim.SGD(a.parameters(), lr=0.1)
    a(q, k, v, causal=True).square().sum().backward()
    optimizer.step()
    b = effattn.build("hedgehog", head_dim=21, heads=3, seed=5, chunk_size=16, num_features=24)
    b = b.double()
    b.load_state_dict(a.state_dict())
    assert {"weight", "bias"} <= set(a.state_dict())
    torch.testing.assert_close(b.eval()(q, k, v, causal=True), a.eval()(q, k, v, causal=True),
                               rtol=0, atol=0)


@pytest.mark.parametrize("feature_map", MAPS)
def test_flop_model_is_the_gemm_work_of_a_forward(feature_map):
    from torch.utils.flop_counter import FlopCounterMode

    from effattn.registry import Problem

    spec = effattn.spec("hedgehog")
    for opts in ({}, {"num_features": 24}):
        opts = {**opts, "feature_map": feature_map}
        module = effattn.build("hedgehog", head_dim=16, heads=2, seed=0, **opts).eval()
        q, k, v = qkv(b=2, h=2, n=63, m=40, d=16, dv=12, dtype=torch.float32)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            module(q, k, v)
        expected = spec.flops({**spec.options, **opts}, Problem(2, 2, 63, 40, 16, 12))
        assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)


def test_compiled_training_gives_the_map_the_eager_gradients():
    eager = make(num_features=24).train()
    eager.slice_elements = SLICE_ELEMENTS  # one slice: a smaller graph to trace
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    q, k, v = qkv(n=24)
    mask = padding(2, 24)
    eager(q, k, v, causal=True, key_padding_mask=mask).square().sum().backward()
    compiled(q, k, v, causal=True, key_padding_mask=mask).square().sum().backward()
    for p_e, p_c in zip(eager.parameters(), compiled_module.parameters(), strict=True):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("opts, match", [
    ({"num_features": 0}, "num_features"),
    ({"num_features": 2.5}, "num_features"),
    ({"feature_map": "relu"}, "feature_map"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        effattn.build("hedgehog", head_dim=8, heads=2, **opts)
