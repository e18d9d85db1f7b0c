"""The kernelized engine's GPU strategy (effattn.kernelized.gpu), forced on the CPU.

Every kernelized method against its float64 reference, with gradients, on awkward shapes (N = 63
and 257, not multiples of the chunk; D = 21); the strategy is checked to be the one that ran;
its chunk-parallel prefix against the CPU strategy's recurrence; its training memory; the
redraw guard; decoding; torch.compile. The whole kernelized test suite also runs with
``EFFATTN_STRATEGY=kernelized=gpu`` (.ci/run).
"""

import pytest
import torch
from conftest import (
    SIGNED_MAPS,
    STRATEGY_VARIANTS,
    assert_prefill_continues,
    count_calls,
    make_kernelized,
    padding,
    qkv,
    variant_id,
)
from torch._dynamo.testing import CompileCounterWithBackend

import effattn
from effattn import strategy
from effattn.kernelized import chunkwise, core, cpu, exponents_gpu, gpu


def _tol(name, opts):
    return 1e-7 if (name, opts.get("feature_map")) in SIGNED_MAPS else 1e-9


@pytest.fixture
def calls(monkeypatch):
    """Counts of the GPU strategy's entry points run during the test."""
    return count_calls(monkeypatch, {entry: (gpu, entry)
                                     for entry in ("causal", "key_state", "read_queries")})


@pytest.fixture(autouse=True)
def _gpu_strategy():
    with strategy.force(kernelized="gpu"):
        yield


@pytest.mark.parametrize("variant", STRATEGY_VARIANTS, ids=variant_id)
# Non-causal is one slice whatever N: one awkward length; causal crosses 4 and 17 chunks.
@pytest.mark.parametrize("causal, n", [(False, 63), (True, 63), (True, 257)])
def test_method_matches_reference_outputs_and_gradients(variant, causal, n, calls):
    name, opts = variant
    module = make_kernelized(name, opts)
    q, k, v = qkv(n=n, d=21, dv=5, scale=0.5)
    mask = padding(2, n)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    assert calls["causal" if causal else "read_queries"] == 1
    ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask)
    tol = _tol(name, opts)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    params = [q, k, v, *module.parameters()]
    probe = torch.randn_like(out)
    g_out = torch.autograd.grad((out * probe).sum(), params)
    g_ref = torch.autograd.grad((ref * probe).sum(), params)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=100 * tol, atol=100 * tol)


@pytest.mark.parametrize("variant, causal", [
    (("performer", {}), True), (("rfa", {"gated": True}), True), (("linear", {}), True),
    (("hedgehog", {"window": 5, "feature_map": "softmax_dim"}), True), (("performer", {}), False),
    (("linear", {}), False),
], ids=lambda x: variant_id(x) if isinstance(x, tuple) else ("causal" if x else "full"))
def test_slices_match_the_reference(variant, causal, calls):
    """Small slice budgets (causal: one chunk per slice; non-causal: 17 tokens): the state and
    its gradient cross slice borders, in the forward, the recomputing backward and the hybrid's
    normaliser."""
    name, opts = variant
    module = make_kernelized(name, opts)
    module.slice_elements = 40
    assert gpu.slice_tokens(6, module.feature_dim, 5, 16, module.slice_elements) == 16
    q, k, v = (t.requires_grad_(True) for t in qkv(n=63, d=21, dv=5, scale=0.5))
    mask = padding(2, 63)
    kw = {}
    if opts.get("gated"):
        kw["gate"] = torch.sigmoid(torch.randn(2, 3, 63, dtype=torch.float64)).requires_grad_()
    out = module(q, k, v, causal=causal, key_padding_mask=mask, **kw)
    assert calls["causal" if causal else "read_queries"] == 1
    ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [q, k, v, *kw.values(), *module.parameters()]
    probe = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * probe).sum(), params),
                    torch.autograd.grad((ref * probe).sum(), params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


def test_prefill_from_a_state_that_carries_gradients():
    """The entering state's gradient (a state from an earlier prefill) flows back through
    every slice of the next."""
    module = make_kernelized("performer", {})
    module.slice_elements = 40
    assert_prefill_continues(module, n=50, cut=20)


@pytest.mark.parametrize("variant", STRATEGY_VARIANTS, ids=variant_id)
def test_cross_attention_matches_reference(variant, calls):
    name, opts = variant
    module = make_kernelized(name, opts)
    q = qkv(n=17, d=21, scale=0.5)[0].requires_grad_(True)
    k, v = (t.requires_grad_(True) for t in qkv(n=40, d=21, dv=5, scale=0.5, seed=1)[1:])
    mask = padding(2, 40)
    out = module(q, k, v, key_padding_mask=mask)
    assert calls["key_state"] == calls["read_queries"] == 1
    ref = module.spec.reference(module, q, k, v, key_padding_mask=mask)
    tol = _tol(name, opts)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g_out = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=100 * tol, atol=100 * tol)


def test_gated_rfa_matches_reference_and_decoding(calls):
    module = make_kernelized("rfa", {"gated": True})
    q, k, v = qkv(n=63, d=21, dv=5)
    gate = torch.sigmoid(torch.randn(2, 3, 63, dtype=torch.float64))
    mask = padding(2, 63)
    for t in (q, k, v, gate):
        t.requires_grad_(True)
    out = module(q, k, v, causal=True, key_padding_mask=mask, gate=gate)
    ref = module.spec.reference(module, q, k, v, causal=True, key_padding_mask=mask, gate=gate)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v, gate)),
                    torch.autograd.grad(ref.sum(), (q, k, v, gate)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
    with torch.no_grad():
        half, state = module.prefill(q[:, :, :40], k[:, :, :40], v[:, :, :40],
                                     gate=gate[:, :, :40])
        outs = [half]
        for t in range(40, 63):
            o, state = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state,
                                   gate=gate[:, :, t:t + 1])
            outs.append(o)
        full = module(q, k, v, causal=True, gate=gate)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("empty", [False, True], ids=["state", "empty"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("n", [100, 9])
def test_decayed_prefix_equals_the_cpu_strategys_recurrence(n, scaled, gated, empty):
    """States before every chunk and after the last: GPU strategy (GEMMs over the chunk axis,
    in blocks: 13 chunks are 4 blocks of 4, the last padded; 2 chunks are 2 blocks of 1)
    against the CPU strategy (a loop over the chunks), from a non-empty or an empty entering
    state (at LOG_FLOOR), with log-scales that jump by tens and gates that nearly reset the
    state."""
    g = torch.Generator().manual_seed(0)
    b, h, f, dv, chunk = 2, 3, 7, 4, 8
    phi_q, phi_k = (torch.rand(b, h, n, f, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    ls = 20 * torch.randn(b, h, n, 1, generator=g, dtype=torch.float64) if scaled else None
    gate = torch.rand(b, h, n, generator=g, dtype=torch.float64) ** 4 if gated else None
    mask = padding(b, n)
    state = core.RecurrentState(torch.rand(b, h, f, dv + 1, generator=g, dtype=torch.float64),
                                torch.full((b, h, 1, 1), 3.0, dtype=torch.float64), 5)
    if empty:
        state = core.RecurrentState.empty(b, h, f, dv, v)
        state.position = 5
    q_c, k_c = chunkwise._chunk_major(phi_q, chunk), chunkwise._chunk_major(phi_k, chunk)
    ls_c = None if ls is None else chunkwise._chunk_major(ls, chunk)
    args = (q_c, k_c, ls_c, v, state, mask, gate, chunk)
    out, scale, after, _ = gpu.chunk_parallel(*args)
    out_cpu, scale_cpu, after_cpu = cpu._causal_group(*args)
    torch.testing.assert_close(scale, scale_cpu, rtol=0, atol=0)
    torch.testing.assert_close(out, out_cpu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after.kv, after_cpu.kv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after.log_scale, after_cpu.log_scale, rtol=0, atol=0)
    assert after.position == after_cpu.position == n + 5


@pytest.mark.parametrize("variant", [("performer", {}), ("rfa", {"gated": True}),
                                     ("hedgehog", {"window": 3})], ids=variant_id)
def test_decoding_reads_nothing_back_to_the_host(variant, monkeypatch):
    """The GPU strategy's step is branch-free: no tensor's truth value or item is read (on a
    GPU each would wait for the device), yet keys far beyond the state's scale (the rescale)
    and gates still give the causal forward's result. The engine's step (``_step``), after
    the call's input checks: those read one flag per call (the contract's NaN check)."""
    name, opts = variant
    module = make_kernelized(name, opts)
    q, k, v = qkv(n=12, d=21, dv=5)
    k = k * torch.linspace(0.5, 4.0, 12, dtype=torch.float64)[:, None]  # growing log-scales
    kw = {}
    if opts.get("gated"):
        kw["gate"] = torch.sigmoid(torch.randn(2, 3, 12, dtype=torch.float64))
    with torch.no_grad():
        full = module(q, k, v, causal=True, **kw)
        state, outs = None, []

        def refuse(*_):
            raise AssertionError("a host sync in the step")

        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "__bool__", refuse)
            patch.setattr(torch.Tensor, "item", refuse)
            for t in range(12):
                o, state = module._step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                        state, *(g[:, :, t:t + 1] for g in kw.values()))
                outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-10)


def test_strategy_follows_the_override(calls):
    module = make_kernelized("performer", {})
    q, k, v = qkv(n=33, d=21)
    with strategy.force(kernelized="cpu"):
        cpu = module(q, k, v, causal=True)
    assert calls["causal"] == 0
    torch.testing.assert_close(module(q, k, v, causal=True), cpu, rtol=1e-12, atol=1e-12)
    assert calls["causal"] == 1


def test_hybrid_normaliser_and_gradients_match_the_cpu_strategy():
    """The window hybrid's linear part (kernelized_causal_normalised): output, state and the
    differentiable normaliser on both strategies."""
    module = make_kernelized("hedgehog", {"window": 8, "window_factor": True})
    q, k, v = (t.requires_grad_(True) for t in qkv(n=63, d=21, dv=5, scale=0.5))
    mask = padding(2, 63)
    params = [q, k, v, *module.parameters()]
    out = module(q, k, v, causal=True, key_padding_mask=mask)
    grads = torch.autograd.grad(out.square().sum(), params)
    with strategy.force(kernelized="cpu"):
        ref = module(q, k, v, causal=True, key_padding_mask=mask)
        ref_grads = torch.autograd.grad(ref.square().sum(), params)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_training_keeps_inputs_not_features_or_states():
    """Between forward and backward the causal form keeps q, k, v, the mask, the output and the
    feature tensors: nothing of size N x F or (N / C) x F x (Dv + 1)."""
    n, f, d, dv = 512, 256, 8, 8
    module = effattn.build("performer", head_dim=d, heads=1, seed=0, num_features=f,
                           chunk_size=16)
    q, k, v = (t.float().requires_grad_(True) for t in qkv(b=1, h=1, n=n, d=d, dv=dv))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(q, k, v, causal=True)
    features = n * f
    assert sum(saved) < features / 2, saved
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_redraw_between_forward_and_backward_raises():
    module = make_kernelized("performer", {"redraw_interval": 1}).train()
    q, k, v = (t.requires_grad_(True) for t in qkv(n=40, d=21))
    out = module(q, k, v, causal=True)
    module.redraw()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_lost_rows_raise_on_the_gpu_strategy():
    """Products ~e^-100 (a query's and the keys' softmax peaks on different features)."""
    module = effattn.build("hedgehog", head_dim=4, heads=1, seed=0, chunk_size=4,
                           feature_map="softmax_dim")
    q = torch.tensor([100.0, -100.0, 0.0, 0.0]).expand(1, 1, 12, 4)
    k = torch.tensor([0.0, 0.0, 100.0, -100.0]).expand(1, 1, 12, 4)
    with pytest.raises(ValueError, match="denominator"):
        module(q, k, torch.ones(1, 1, 12, 2), causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_hedgehog_exp_runs_the_per_feature_core_in_its_gpu_form(causal, calls, monkeypatch):
    """The exp form runs the per-feature core, whose causal form on this strategy is the
    chunk-parallel one (kernelized.exponents_gpu, float64 in-chunk products, no host sync), not
    the row core's entry points; checked against the reference, with gradients."""
    module = make_kernelized("hedgehog", {})
    q, k, v = (t.requires_grad_(True) for t in qkv(n=63, d=21, dv=5, scale=0.5))
    mask = padding(2, 63)
    ran, original = [], exponents_gpu.causal

    def spy(*args, **kwargs):
        ran.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(exponents_gpu, "causal", spy)
    out = module(q, k, v, causal=causal, key_padding_mask=mask)
    assert sum(calls.values()) == 0 and len(ran) == causal
    ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v, *module.parameters())),
                    torch.autograd.grad(ref.sum(), (q, k, v, *module.parameters())),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


def test_compile_fullgraph_with_the_gpu_strategy():
    """No graph break, no host sync to trace through: outputs equal eager's to the last bit
    (the same operations), gradients to rounding (eager recomputes in its backward)."""
    torch._dynamo.reset()
    module = make_kernelized("performer", {})
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    q, k, v = (t.requires_grad_(True) for t in qkv(n=40, d=21))
    mask = padding(2, 40)
    out = compiled(q, k, v, causal=True, key_padding_mask=mask)
    ref = module(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert backend.frame_count == 1
    torch._dynamo.reset()
