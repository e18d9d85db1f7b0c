"""The GPU strategy's form of the per-feature core (effattn.kernelized.exponents_gpu), forced on
the CPU: against the log-space float64 reference (outputs, normalisers and gradients, the
exponents function's parameters included) on awkward shapes, several slices, padding, lag and an
incoming state; exponents of ~100 in fp32; growth of the running max by hundreds inside a chunk
and by thousands across chunks; equal to the CPU strategy to rounding; training memory; no host
sync; hedgehog training, decoding and compile under the forced strategy."""

import pytest
import torch
from conftest import qkv
from test_exponents import key_mask, map_of, weights
from torch._dynamo.testing import CompileCounterWithBackend

import effattn
from effattn import naive, strategy
from effattn.kernelized import exponents as ex
from effattn.kernelized import exponents_gpu as exg
from effattn.kernelized.core import RecurrentState


@pytest.fixture(autouse=True)
def _gpu_strategy():
    with strategy.force(kernelized="gpu"):
        yield


@pytest.fixture
def slices(monkeypatch):
    """The number of causal slices the chunk-parallel form ran."""
    count = [0]
    original = exg._slice

    def spy(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(exg, "_slice", spy)
    return count


def log_kernel(u_q, u_k, mask=None, lag=0):
    """log Σ_f exp(u_qf(i) + u_kf(j)) over the keys query i sees (j <= i - lag, not padded),
    -inf elsewhere: (B, H, N, N)."""
    logs = torch.logsumexp(u_q[..., :, None, :] + u_k[..., None, :, :], -1)
    i = torch.arange(u_q.shape[2])
    seen = (i[None, :] <= i[:, None] - lag)[None, None]
    if mask is not None:
        seen = seen & ~mask[:, None, None, :]
    return logs.masked_fill(~seen, float("-inf"))


def grads(out, inputs, probe):
    return torch.autograd.grad((out * probe).sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("slice_elements", [1 << 20, 400, 10])
def test_float64_outputs_and_gradients_equal_the_reference(causal, padded, slice_elements,
                                                           slices):
    """N = 63, D = 21, chunks of 16 (63 is no multiple); causal in one slice, in slices of two
    chunks and of one (each recomputed in the backward, the state's gradient crossing them):
    outputs and the gradients of q, k, v, W and b equal the log-space reference's."""
    q, k, v = (t.requires_grad_() for t in qkv(b=3, h=3, n=63, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights())
    mask = key_mask(3, 63) if padded else None
    exponents = map_of(w, b)
    out = ex.attention(q, k, v, exponents, 10, is_causal=causal, key_padding_mask=mask,
                       chunk_size=16, slice_elements=slice_elements)
    if causal:
        assert slices[0] == {1 << 20: 1, 400: 2, 10: 4}[slice_elements]
    ref = naive.exponent_attention(exponents(q), exponents(k), v, causal=causal,
                                   key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    probe = torch.randn_like(out)
    for a, c in zip(grads(out, (q, k, v, w, b), probe), grads(ref, (q, k, v, w, b), probe),
                    strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)


def check_lag_and_normaliser(lag):
    """The window hybrid's linear part through hedgehog's core configuration, in the strategy
    forced: query i sees keys j <= i - lag; N = 63, chunks of 16, padding, slices of one chunk;
    outputs, normalisers (log |Σ_j φ(q_i)·φ(k_j)|, sign 1 where a key is seen) and gradients
    against the log-space reference. (Also run by tests/test_fused_exponents.py.)"""
    module = effattn.build("hedgehog", head_dim=21, heads=3, num_features=5, seed=0,
                           chunk_size=16).double()
    module.slice_elements = 10
    q, k, v = (t.requires_grad_() for t in qkv(b=3, h=3, n=63, d=21, dv=7))
    mask = key_mask(3, 63)
    out, _, norm = module.core().causal_normalised(q, k, v, key_padding_mask=mask, lag=lag)
    logs = log_kernel(module.exponents(q), module.exponents(k), mask, lag)
    ref = torch.softmax(logs, -1).nan_to_num(0.0) @ v
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norm.log_abs, torch.logsumexp(logs, -1))
    torch.testing.assert_close(norm.sign, (logs.amax(-1) > float("-inf")).double())
    if lag >= 63:  # no query sees a key
        assert (out == 0).all()
        return
    params = (q, k, v, *module.parameters())
    probe = torch.randn_like(out)
    weight = torch.randn_like(norm.log_abs)
    seen = norm.sign > 0
    loss = (out * probe).sum() + (norm.log_abs.where(seen, 0.0) * weight).sum()
    ref_log = torch.logsumexp(logs, -1)
    ref_loss = (ref * probe).sum() + (ref_log.where(seen, 0.0) * weight).sum()
    for a, c in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref_loss, params),
                    strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("lag", [0, 1, 5, 17, 63, 70])
def test_lag_and_normaliser_equal_the_reference(lag):
    check_lag_and_normaliser(lag)


def check_incoming_state(exponents_of):
    """A prefix's state (split mid-chunk, so its scale is a partial chunk's) handed to the rest,
    in the strategy forced, for the exponents ``exponents_of(w, b)`` (Hedgehog's map): outputs
    and the gradients through the state (into q, k, v and W of both parts) equal the reference
    over the whole sequence; the final state equals the one-pass state. (Also run by
    tests/test_fused_exponents.py.)"""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=3, n=63, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights(size=5.0))
    exponents = exponents_of(w, b)
    mask = key_mask(2, 63)
    first, mid, _ = ex.causal(q[:, :, :23], k[:, :, :23], v[:, :, :23], exponents, 10,
                              key_padding_mask=mask[:, :23], chunk_size=16, slice_elements=10)
    rest, end, _ = ex.causal(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], exponents, 10, mid,
                             key_padding_mask=mask[:, 23:], chunk_size=16, slice_elements=10)
    out = torch.cat([first, rest], 2)
    ref = naive.exponent_attention(exponents(q), exponents(k), v, causal=True,
                                   key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    probe = torch.randn_like(out)
    for a, c in zip(grads(out, (q, k, v, w, b), probe), grads(ref, (q, k, v, w, b), probe),
                    strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)
    _, whole, _ = ex.causal(q, k, v, exponents, 10, key_padding_mask=mask, chunk_size=16)
    torch.testing.assert_close(end.log_scale, whole.log_scale, rtol=0, atol=0)
    torch.testing.assert_close(end.kv, whole.kv, rtol=1e-12, atol=1e-12)
    assert end.position == whole.position == 63


def test_an_incoming_state_gives_the_whole_sequence():
    check_incoming_state(map_of)


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_exponents_of_100_are_finite_and_exact(causal):
    """Weights scaled so that the exponents reach 100 (exp(u) alone overflows fp32): the fp32
    outputs are finite and equal the float64 log-space result to fp32's precision of the
    exponents (relative 1e-7 of |u|), and so are the gradients."""
    q, k, v = qkv(b=2, h=3, n=100, d=21, dv=7)
    w, b = weights()
    w = w * (100 / map_of(w, b)(torch.cat([q, k], 2)).abs().max())
    mask = key_mask(2, 100)
    exact = naive.exponent_attention(map_of(w, b)(q), map_of(w, b)(k), v, causal=causal,
                                     key_padding_mask=mask)
    qf, kf = (t.float().requires_grad_() for t in (q, k))
    exponents = map_of(w.float(), b.float())
    out = ex.attention(qf, kf, v.float(), exponents, 10, is_causal=causal,
                       key_padding_mask=mask, chunk_size=16)
    assert torch.isfinite(out).all()
    tol = 4e-5
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)
    probe = torch.randn_like(out)
    q64, k64 = (t.clone().requires_grad_() for t in (q, k))
    want = grads(naive.exponent_attention(map_of(w, b)(q64), map_of(w, b)(k64), v,
                                          causal=causal, key_padding_mask=mask),
                 (q64, k64), probe.double())
    for got, ref in zip(grads(out, (qf, kf), probe), want, strict=True):
        assert torch.isfinite(got).all()
        scale = ref.abs().max()
        torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=30 * tol)


def jumping(w, b):
    """Hedgehog's exponents plus one feature that is x's last coordinate itself: a key whose
    last coordinate is raised makes that feature's running max jump."""
    base = map_of(w, b)

    def exponents(x):
        return torch.cat([base(x), x[..., -1:]], -1)

    return exponents


# fp32 only up to 200: beyond, u itself holds the jump and fp32 rounds exponents of 3000 by 2e-4.
@pytest.mark.parametrize("dtype, at, jump", [
    (torch.float64, 40, 200.0), (torch.float64, 32, 200.0), (torch.float64, 32, 3000.0),
    (torch.float64, 47, 600.0), (torch.float32, 40, 200.0), (torch.float32, 32, 200.0),
], ids=["in-chunk-200", "at-border-200", "at-border-3000", "in-chunk-600", "fp32-in-chunk-200",
        "fp32-at-border-200"])
def test_growth_of_the_running_max_stays_exact(dtype, at, jump):
    """One feature's keys jump by ``jump`` at key ``at`` (chunks of 16): inside a chunk (up to
    GROWTH_LIMIT, the float64 in-chunk products) or at a chunk border (any size: the prefix's
    weights are exp of differences, no reference scale), the outputs equal the log-space
    reference."""
    q, k, v = qkv(b=2, h=2, n=64, d=21, dv=7)
    w, b = weights(h=2)
    k = k.clone()
    k[:, :, at:, -1] += jump
    q = q.clone()
    q[:, 0, :, -1] += jump / 2  # head 0: queries that weigh the jumping feature
    exponents = jumping(w.to(dtype), b.to(dtype))
    out = ex.attention(q.to(dtype), k.to(dtype), v.to(dtype), exponents, 11, is_causal=True,
                       chunk_size=16, key_padding_mask=key_mask(2, 64))
    ref = naive.exponent_attention(jumping(w, b)(q), jumping(w, b)(k), v, causal=True,
                                   key_padding_mask=key_mask(2, 64))
    tol = 1e-10 if dtype == torch.float64 else 4e-7 * jump
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_in_chunk_growth_beyond_the_limit_loses_only_what_the_docstring_says():
    """GROWTH_LIMIT's honesty: a feature rising by 2000 inside a chunk drops the in-chunk
    products of the queries before the rise in that chunk (their query factor is clamped at
    e^700), so those outputs differ from the reference; every other output is exact."""
    q, k, v = qkv(b=1, h=2, n=64, d=21, dv=7)
    w, b = weights(h=2)
    k = k.clone()
    k[:, :, 40:, -1] += 2000.0
    q = q.clone()
    q[:, :, :, -1] += 1000.0  # every query weighs the jumping feature
    out = ex.attention(q, k, v, jumping(w, b), 11, is_causal=True, chunk_size=16)
    ref = naive.exponent_attention(jumping(w, b)(q), jumping(w, b)(k), v, causal=True)
    torch.testing.assert_close(out[:, :, 40:], ref[:, :, 40:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out[:, :, :32], ref[:, :, :32], rtol=1e-10, atol=1e-12)
    assert (out[:, :, 32:40] - ref[:, :, 32:40]).abs().amax() > 1e-3


def check_equals_strategy(other, dtype, exponents_of, scale_tol=0.0):
    """The strategy forced against ``other``, for the exponents ``exponents_of(w, b)``: from
    an incoming state, with padding, the normaliser and slices of one chunk, outputs,
    normalisers, the state after and the gradients (the incoming state's included) equal to
    rounding, the state's log-scales within ``scale_tol``. (Also run by
    tests/test_fused_exponents.py.)"""
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(b=2, h=3, n=63, d=21, dv=7))
    w, b = weights(size=20.0)
    w, b = (t.to(dtype).requires_grad_() for t in (w, b))
    exponents = exponents_of(w, b)
    g = torch.Generator().manual_seed(1)
    kv = torch.rand(2, 3, 10, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    scale = (torch.randn(2, 3, 10, 1, generator=g, dtype=torch.float64) * 5).to(dtype)
    mask = key_mask(2, 63)

    def run():
        out, state, norm = ex.causal(q, k, v, exponents, 10, RecurrentState(kv, scale, 4),
                                     key_padding_mask=mask, chunk_size=16, slice_elements=10,
                                     normaliser=True)
        loss = (out * probe).sum() + (norm.log_abs * weight).sum() + (state.kv * end).sum()
        return out, state, norm, torch.autograd.grad(loss, (q, k, v, w, b, kv))

    probe = torch.randn(2, 3, 63, 7, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(2, 3, 63, generator=g, dtype=torch.float64).to(dtype)
    end = torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64).to(dtype)
    got = run()
    with strategy.force(kernelized=other):
        want = run()
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1].log_scale, want[1].log_scale, rtol=scale_tol,
                               atol=scale_tol)
    torch.testing.assert_close(got[1].kv, want[1].kv, rtol=tol, atol=tol)
    assert got[1].position == want[1].position == 67
    torch.testing.assert_close(got[2].log_abs, want[2].log_abs, rtol=tol, atol=tol)
    torch.testing.assert_close(got[2].sign, want[2].sign, rtol=0, atol=0)
    for a, c in zip(got[3], want[3], strict=True):
        scale_ = c.abs().max()
        torch.testing.assert_close(a / scale_, c / scale_, rtol=tol, atol=10 * tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equals_the_cpu_strategy(dtype):
    check_equals_strategy("cpu", dtype, map_of)


def test_training_keeps_inputs_not_exponents_or_states():
    """Between forward and backward the causal form keeps q, k, v, the states entering its
    slices and the projection: nothing of size N x F or (N / C) x F x (Dv + 1)."""
    n = 512
    module = effattn.build("hedgehog", head_dim=8, heads=1, seed=0, num_features=64,
                           chunk_size=16)
    q, k, v = (t.float().requires_grad_() for t in qkv(b=1, h=1, n=n, d=8, dv=8))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(q, k, v, causal=True)
    assert sum(saved) < n * module.feature_dim / 2, saved
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("grad", [False, True])
def test_the_forward_reads_nothing_back_to_the_host(grad, monkeypatch):
    """No tensor's truth value or item is read in the causal or non-causal forward (on a GPU
    each would wait for the device)."""
    q, k, v = (t.requires_grad_(grad) for t in qkv(b=2, h=3, n=63, d=21, dv=7))
    exponents = map_of(*weights())
    mask = key_mask(2, 63)

    def refuse(*_):
        raise AssertionError("a host sync in the forward")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "__bool__", refuse)
        patch.setattr(torch.Tensor, "item", refuse)
        for causal in (False, True):
            ex.attention(q, k, v, exponents, 10, is_causal=causal, key_padding_mask=mask,
                         chunk_size=16, slice_elements=10)


def check_hedgehog_trains_and_decodes():
    """Hedgehog's exp form in fp32 under the strategy forced: a few optimiser steps lower a
    regression loss with finite gradients on the projection, and then decoding token by token
    and a prefill split mid-chunk give the causal forward's outputs. (Also run by
    tests/test_fused_exponents.py.)"""
    torch.manual_seed(0)
    module = effattn.build("hedgehog", head_dim=16, heads=2, seed=0, chunk_size=16)
    q, k, v = qkv(b=2, h=2, n=50, d=16, dtype=torch.float32)
    target = torch.randn(2, 2, 50, 16)
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        loss = (module(q, k, v, causal=True) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in module.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        full = module(q, k, v, causal=True)
        state, outs = None, []
        for t in range(50):
            out, state = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                     state)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-5, atol=1e-5)
        first, state = module.prefill(q[:, :, :23], k[:, :, :23], v[:, :, :23])
        rest, _ = module.prefill(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], state)
        torch.testing.assert_close(torch.cat([first, rest], 2), full, rtol=1e-5, atol=1e-5)


def test_hedgehog_trains_and_decodes_as_its_forward(slices):
    check_hedgehog_trains_and_decodes()
    assert slices[0] > 0


def test_compile_fullgraph_of_hedgehog():
    """No graph break, no host sync to trace through: outputs equal eager's to rounding and so
    do the gradients (eager recomputes its slices in the backward)."""
    torch._dynamo.reset()
    module = effattn.build("hedgehog", head_dim=21, heads=3, seed=0, chunk_size=16).double()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    q, k, v = (t.requires_grad_(True) for t in qkv(n=40, d=21))
    mask = key_mask(2, 40)
    out = compiled(q, k, v, causal=True, key_padding_mask=mask)
    ref = module(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, c in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                    torch.autograd.grad(ref.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)
    assert backend.frame_count == 1
    torch._dynamo.reset()


def test_non_causal_slices_are_device_sized():
    """On the GPU strategy the non-causal key state and read-out run in SLICE_SCALE times the
    CPU strategy's slice budget."""
    x = torch.zeros(1)
    assert exg.slice_budget(1000, x) == 1000 * exg.gpu.SLICE_SCALE
    with strategy.force(kernelized="cpu"):
        assert exg.slice_budget(1000, x) == 1000
