"""The kernelized core's recomputing backward (kernelized.core, "Recompute instead of store").

Recording gradients in eager mode, the forward keeps q, k, v, the output, its divisors and
fixed-size states, and the backward recomputes the features slice by slice. Here: its
gradients equal autograd through the same forward (the path torch.compile records) in float64,
with several slices and a partial chunk, for every kernelized method and variant, padding,
cross-attention, an incoming state, and feature maps with trainable tensors (rfa's learned σ,
hedgehog's and taylor's learned per-head maps, such a map handed to the core as a closure with
its tensors, a closure whose tensors are found in its graph); and what
the forward saves for backward stays O(N·(D + Dv) + F·Dv): no N x F tensor.
"""

import math

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive as R
from effattn.kernelized import core
from effattn.kernelized.core import causal_slice_tokens, kernelized_attention

B, H, N, D, DV = 2, 3, 63, 21, 10
VARIANTS = [
    ("performer", {"feature_map": "positive"}),
    ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "trig"}),
    ("performer", {"feature_map": "relu"}),
    ("favor", {}),
    ("rfa", {"feature_map": "sincos"}),
    ("rfa", {"feature_map": "arccos"}),
    ("rfa", {"learn_sigma": True}),
    ("rfa", {"gated": True, "learn_sigma": True}),
    ("linear", {}),
    ("hedgehog", {"feature_map": "exp"}),
    ("hedgehog", {"feature_map": "softmax_dim"}),
    ("taylor", {"learn_projection": True}),
    ("taylor", {"learn_projection": False}),
]
# Options that keep each method small: F = 24 projections (hedgehog: 48 features), taylor's
# P = 5 (21 features).
SMALL = {"linear": {}, "taylor": {"proj_dim": 5}}


def _id(variant):
    name, opts = variant
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def _module(name, opts):
    small = SMALL.get(name, {"num_features": 24})
    module = effattn.build(name, head_dim=D, heads=H, seed=0, chunk_size=10, **small,
                           **opts).double().eval()
    # Slices of 25 tokens forward (causal: 2 chunks), 6 backward: 3 to 11 slices, the last
    # partial, and a partial chunk at the end.
    module.slice_elements = 25 * B * H * module.feature_dim
    return module


def _stored(monkeypatch):
    """Autograd through the forward, as under torch.compile: the path the tests compare with."""
    monkeypatch.setattr(core, "_recording", lambda: False)


def _grads(fn, inputs, probe):
    out = fn()
    wrt = [t for t in inputs if t.requires_grad]
    return out, torch.autograd.grad((out * probe).sum(), wrt, allow_unused=True)


def _assert_same(a, b, what, tol=1e-10):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x is None) == (y is None), f"{what}: gradient {i} reached only one path"
        if x is not None:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol,
                                       msg=lambda text, i=i: f"{what}, gradient {i}: {text}")


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
@pytest.mark.parametrize("mode", ["full", "padded", "causal", "causal-padded", "cross-padded"])
def test_recomputing_backward_equals_autograd_through_the_forward(variant, mode, monkeypatch,
                                                               device):
    name, opts = variant
    causal, padded, cross = "causal" in mode, "padded" in mode, "cross" in mode
    if opts.get("gated") and not causal:
        pytest.skip("the gate is causal only")
    module = _module(name, opts).to(device)
    q, k, v = (t.to(device) for t in qkv(b=B, h=H, n=N, m=50 if cross else N, d=D, dv=DV))
    call = {"causal": causal,
            "key_padding_mask": padding(B, k.shape[2]).to(device) if padded else None}
    inputs = [q, k, v]
    if opts.get("gated"):
        call["gate"] = (torch.rand(B, H, N, dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(1)) * 0.6 + 0.2
                        ).to(device)
        inputs.append(call["gate"])
    for t in inputs:
        t.requires_grad_()
    inputs += [p for p in module.parameters() if p.requires_grad]
    probe = torch.randn(B, H, N, DV, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(2)).to(device)

    out, grads = _grads(lambda: module(q, k, v, **call), inputs, probe)
    _stored(monkeypatch)
    out_s, grads_s = _grads(lambda: module(q, k, v, **call), inputs, probe)
    torch.testing.assert_close(out, out_s, rtol=1e-12, atol=1e-12)
    # favor's and trig's signed features cancel in the normaliser: rounding is amplified
    # (tests/test_kernelized_methods.py), in both paths alike.
    tol = 1e-7 if name == "favor" or opts.get("feature_map") == "trig" else 1e-10
    _assert_same(grads, grads_s, f"{name} {mode}", tol)


def _hedgehog(weight, bias):
    """Hedgehog's map (Zhang et al. 2024) per head: φ(x) = [exp(u), exp(-u)], u = x W_h + b_h,
    in the core's convention: keys at their row max, which becomes their log-scale."""
    def features(x, *, is_query):
        u = torch.einsum("bhnd,hdf->bhnf", x, weight) + bias[:, None, :]
        u = torch.cat([u, -u], -1)
        m = u.detach().amax(-1, keepdim=True)
        return torch.exp(u - m), None if is_query else m
    return features


@pytest.mark.parametrize("causal", [False, True])
def test_trainable_per_head_feature_map_gets_its_gradients(causal, monkeypatch):
    """A map whose tensors are parameters (a per-head linear layer): outputs and gradients of
    q, k, v and of the map's weight and bias equal the dense reference and the stored path."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(H, D, 7, generator=g, dtype=torch.float64) / D).requires_grad_()
    bias = (0.1 * torch.randn(H, 7, generator=g, dtype=torch.float64)).requires_grad_()
    features = _hedgehog(weight, bias)
    q, k, v = (t.requires_grad_() for t in qkv(b=B, h=H, n=N, d=D, dv=DV))
    mask = padding(B, N)
    kw = dict(feature_dim=14, causal=causal, key_padding_mask=mask, chunk_size=10, eps=0.0,
              slice_elements=25 * B * H * 14, feature_tensors=(weight, bias))
    inputs = [q, k, v, weight, bias]
    probe = torch.randn(B, H, N, DV, dtype=torch.float64, generator=g)

    def true_features(x):
        u = torch.einsum("bhnd,hdf->bhnf", x, weight) + bias[:, None, :]
        return torch.cat([u.exp(), (-u).exp()], -1)

    out, grads = _grads(lambda: kernelized_attention(q, k, v, features, **kw), inputs, probe)
    def dense():
        a = true_features(q) @ true_features(k).transpose(-2, -1) * R.kernel_weights(
            N, N, causal=causal, key_padding_mask=mask, dtype=q.dtype, device=q.device)
        den = a.sum(-1, keepdim=True)  # 0 where a query sees no key: its output is 0
        return torch.where(den > 0, (a @ v) / torch.where(den > 0, den, 1.0), 0.0)

    ref, grads_r = _grads(dense, inputs, probe)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    _assert_same(grads, grads_r, "against the dense reference")
    _stored(monkeypatch)
    _, grads_s = _grads(lambda: kernelized_attention(q, k, v, features, **kw), inputs, probe)
    _assert_same(grads, grads_s, "against the stored path")


@pytest.mark.parametrize("causal", [False, True])
def test_trainable_tensors_of_a_closure_are_found_without_being_listed(causal, monkeypatch):
    """Without ``feature_tensors`` the core finds the tensors that require grad in the graph of
    one token's features, here behind a non-leaf (w = 2 w0) and a learned temperature."""
    g = torch.Generator().manual_seed(4)
    w0 = torch.randn(16, D, generator=g, dtype=torch.float64).requires_grad_()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    w = 2 * w0

    def features(x, *, is_query):
        u = (x @ w.T) * (0.1 * log_t.exp())
        m = u.detach().amax(-1, keepdim=True)
        return torch.exp(u - m), None if is_query else m

    q, k, v = qkv(b=B, h=H, n=N, d=D, dv=DV)
    inputs = [q, k, v, w0, log_t]  # q, k, v without gradients: only the map's tensors train
    probe = torch.randn(B, H, N, DV, dtype=torch.float64, generator=g)
    kw = dict(feature_dim=16, causal=causal, chunk_size=10, eps=0.0,
              slice_elements=25 * B * H * 16)
    _, grads = _grads(lambda: kernelized_attention(q, k, v, features, **kw), inputs, probe)
    _stored(monkeypatch)
    _, grads_s = _grads(lambda: kernelized_attention(q, k, v, features, **kw), inputs, probe)
    assert all(t is not None for t in grads)
    _assert_same(grads, grads_s, "closure")


@pytest.mark.parametrize("gated", [False, True])
def test_gradient_reaches_an_incoming_state(gated, monkeypatch):
    """Prefill that continues a state requiring grad (as sequence parallel's incoming state
    does): the state's gradient, and those of both prefills' inputs, equal the stored path's."""
    module = _module("rfa", {"gated": gated})
    q, k, v = (t.requires_grad_() for t in qkv(b=B, h=H, n=N, d=D, dv=DV))
    gate = (torch.rand(B, H, N, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
            * 0.6 + 0.2).requires_grad_()
    inputs = [q, k, v, gate] if gated else [q, k, v]
    probe = torch.randn(B, H, N - 20, DV, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(6))

    def run():
        kw = (lambda a, b: {"gate": gate[:, :, a:b]}) if gated else (lambda a, b: {})
        _, state = module.prefill(q[:, :, :20], k[:, :, :20], v[:, :, :20], **kw(0, 20))
        out, after = module.prefill(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], state, **kw(20, N))
        return out + 1e-3 * after.kv.sum((-2, -1))[..., None, None]

    _, grads = _grads(run, inputs, probe)
    _stored(monkeypatch)
    _, grads_s = _grads(run, inputs, probe)
    _assert_same(grads, grads_s, "incoming state")


def test_memory_and_attend_memory_recompute_too(monkeypatch):
    module = _module("performer", {})
    q, k, v = (t.requires_grad_() for t in qkv(b=B, h=H, n=N, m=40, d=D, dv=DV))
    mask = padding(B, 40)
    probe = torch.randn(B, H, N, DV, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(7))

    def run():
        return module.attend_memory(q, module.memory(k, v, mask))

    _, grads = _grads(run, [q, k, v], probe)
    _stored(monkeypatch)
    _, grads_s = _grads(run, [q, k, v], probe)
    _assert_same(grads, grads_s, "memory")


@pytest.mark.parametrize("causal", [False, True])
def test_redraw_between_forward_and_backward_raises(causal):
    """The backward recomputes the features from the module's projection: one redrawn in
    place after the forward must raise (as autograd does for any saved tensor), not give the
    gradient of other features."""
    module = _module("performer", {})
    q, k, v = (t.requires_grad_() for t in qkv(b=1, h=H, n=N, d=D, dv=DV))
    out = module(q, k, v, causal=causal)
    module.redraw()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# What the forward may keep for backward: q, k, v, the output, the gate, two scalars per query
# (the divisor and the denominator's gradient factor), the feature map's tensors and the state
# (F, Dv + 1): non-causal the keys', causal the one entering each slice. Autograd through the
# forward kept every slice's φ(Q), φ(K) (N x F each; F = 256 is 4 D) and, causal, the chunk
# states (N/C of F x (Dv + 1)): 1.5-7x that (at fc0ffa8 every case here fails).
MEMORY_CASES = [("performer", {}), ("favor", {}), ("rfa", {}), ("rfa", {"gated": True}),
                ("linear", {}), ("hedgehog", {}), ("taylor", {})]


@pytest.mark.parametrize("variant", MEMORY_CASES, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_saves_no_n_by_f_tensor_for_backward(variant, causal, one_thread):
    name, opts = variant
    if opts.get("gated") and not causal:
        pytest.skip("the gate is causal only")
    b, h, n, d = 1, 2, 4096, 64
    options = {"performer": {"num_features": 256}, "favor": {"num_features": 256},
               "rfa": {"num_features": 128}}.get(name, {})
    module = effattn.build(name, head_dim=d, heads=h, seed=0, **options, **opts)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).requires_grad_() for _ in range(3))
    call = {"gate": torch.rand(b, h, n, generator=g) * 0.5 + 0.5} if opts.get("gated") else {}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(q, k, v, causal=causal, **call)
    f, size = module.feature_dim, q.element_size()
    step = causal_slice_tokens(b * h, f, d, module.chunk_size, module.slice_elements)
    states = (math.ceil(n / step) if causal else 1) * b * h * (f * (d + 1) + 1) * size
    budget = (4 * q.nbytes + sum(t.nbytes for t in call.values()) + 2 * b * h * n * size
              + sum(t.nbytes for t in module.feature_tensors()) + states + 1024)
    n_by_f = b * h * n * f * size
    assert states < n_by_f / 8 and budget < 4.6 * q.nbytes  # an N x F tensor is 2-4 q's
    assert sum(saved.values()) <= budget, (
        f"{name}: the forward saved {sum(saved.values()) / 2**20:.1f} MiB for backward, "
        f"budget {budget / 2**20:.1f} MiB (an N x F tensor is {n_by_f / 2**20:.1f} MiB)"
    )
