"""The GPU strategy's written-out causal backward (effattn.kernelized.gpu._span_backward), forced
on the CPU.

Its adjoint recurrence (``decayed_suffix``) against autograd through the forward's
(``decayed_prefix``), in float64; the backward in spans shorter than the forward's slices (the
states entering them read off the forward's chunk states) against the float64 references, for a
map with log-scales, one without, the gate and the window hybrid's normaliser, from an entering
state that carries a gradient; and what it holds: a training call's peak of live tensor bytes
against an inference forward's, accounted on the CPU (``effattn.tools.bench.accounting``), which
allocates what a GPU would.
"""

import pytest
import torch
from conftest import assert_prefill_continues, padding, qkv

import effattn
from effattn import strategy
from effattn.kernelized import gpu
from effattn.tools.bench.accounting import count_ops, live_peak_bytes


@pytest.fixture(autouse=True)
def _gpu_strategy():
    with strategy.force(kernelized="gpu"):
        yield


@pytest.mark.parametrize("after", [True, False], ids=["after", "no-after"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("nc", [1, 2, 5, 13, 16, 30])
def test_suffix_is_the_prefix_adjoint(nc, gated, after):
    """U_c = ∂L/∂S_c: the entering state's gradient is U_0 and each delta's enter_c U_{c+1},
    for chunk counts that fill their blocks (16) and that do not (5, 13, 30), from an entering
    scale below the chunks' and gates that nearly reset the state."""
    g = torch.Generator().manual_seed(nc)
    b, h, f, e = 2, 3, 4, 5
    deltas = torch.randn(nc, b, h, f, e, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(b, h, f, e, generator=g, dtype=torch.float64, requires_grad=True)
    chunk_max = 10 * torch.randn(nc, b, h, generator=g, dtype=torch.float64)
    running = torch.cummax(torch.cat([chunk_max.new_full((1, b, h), -3.0), chunk_max]), 0).values
    decay = (-5 * torch.rand(nc, b, h, generator=g, dtype=torch.float64)) if gated else None
    before, state_after = gpu.decayed_prefix(kv, deltas, running, chunk_max, decay)
    reads = torch.randn(before.shape, generator=g, dtype=torch.float64)
    d_after = torch.randn(state_after.shape, generator=g, dtype=torch.float64) if after else None
    loss = (before * reads).sum()
    if d_after is not None:
        loss = loss + (state_after * d_after).sum()
    loss.backward()
    adjoint = gpu.decayed_suffix(reads, d_after, running, chunk_max, decay)
    last = torch.zeros_like(kv) if d_after is None else d_after
    enter = torch.exp(chunk_max - running[1:])[..., None, None]
    torch.testing.assert_close(adjoint[0], kv.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([adjoint[1:], last[None]]) * enter, deltas.grad,
                               rtol=1e-12, atol=1e-12)


def _module(name, opts):
    options = {"chunk_size": 16, **opts}
    if name in ("performer", "rfa"):
        options.setdefault("num_features", 24)
    module = effattn.build(name, head_dim=21, heads=3, seed=0, **options).double().eval()
    # Forward slices of 64 tokens (4 chunks) at B H = 6, Dv = 5: slice_elements * SLICE_SCALE / 2
    # values of φ and [V, 1]; backward spans of 16 (the fixture's BACKWARD_SLICE_SCALE).
    module.slice_elements = 64 * 6 * (module.feature_dim + 6) * 2 // gpu.SLICE_SCALE
    return module


@pytest.fixture
def spans(monkeypatch):
    """Backward spans of one chunk inside the GPU strategy's forward slices of four; records
    the spans run (both GPU forms list them)."""
    monkeypatch.setattr(gpu, "BACKWARD_SLICE_SCALE", 16)
    seen = []
    original = gpu.backward_spans

    def spy(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(gpu, "backward_spans", spy)
    return seen


@pytest.mark.parametrize("name, opts, extra", [
    ("performer", {}, None),
    ("linear", {}, None),
    ("rfa", {"gated": True}, "gate"),
    ("performer", {"window": 5}, None),
], ids=["performer", "linear", "gated-rfa", "window-hybrid"])
def test_backward_in_spans_matches_the_reference(name, opts, extra, spans):
    module = _module(name, opts)
    n = 150
    q, k, v = (t.requires_grad_(True) for t in qkv(n=n, d=21, dv=5, scale=0.5))
    mask = padding(2, n)
    kw = {}
    if extra == "gate":
        g = torch.Generator().manual_seed(1)
        kw["gate"] = torch.sigmoid(torch.randn(2, 3, n, generator=g, dtype=torch.float64))
        kw["gate"].requires_grad_(True)
    assert gpu.slice_tokens(6, module.feature_dim, 5, 16, module.slice_elements) == 64
    out = module(q, k, v, causal=True, key_padding_mask=mask, **kw)
    ref = module.spec.reference(module, q, k, v, causal=True, key_padding_mask=mask, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [q, k, v, *kw.values(), *module.parameters()]
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), params)
    want = torch.autograd.grad((ref * probe).sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
    # The linear part of the hybrid runs the causal core too (its normaliser's gradient).
    assert spans and len(spans[-1]) == 10, spans  # 3 slices (64, 64, 22) in 16-token spans


def test_spans_carry_an_entering_state_with_gradients(spans):
    """A second prefill from the first's state: the gradient reaches the first through every
    span of the second."""
    assert_prefill_continues(_module("performer", {}), n=120, cut=37)
    assert [len(s) for s in spans] == [3, 6]


def test_training_peak_stays_at_the_forwards():
    """With the default spans (half a forward slice), forward + backward holds no more than an
    inference forward of the same slices (the chunk states of one span, recomputed, and their
    adjoints); backward spans as long as the slices hold more. Bytes, not time: the same on a
    busy machine."""
    module = effattn.build("performer", head_dim=16, heads=2, seed=0, num_features=64,
                           chunk_size=16)
    # Forward slices of 512 tokens (default SLICE_SCALE): N = 1024 is two of them.
    module.slice_elements = 512 * 2 * 2 * (64 + 17) // gpu.SLICE_SCALE
    q, k, v = (t.float().requires_grad_(True) for t in qkv(b=1, h=2, n=1024, d=16, dv=16))

    def forward():
        with torch.no_grad():
            module(q, k, v, causal=True)

    def train():
        module(q, k, v, causal=True).sum().backward()

    train()
    inference = live_peak_bytes(forward)
    assert live_peak_bytes(train) <= 1.1 * inference
    scale = gpu.BACKWARD_SLICE_SCALE
    try:
        gpu.BACKWARD_SLICE_SCALE = gpu.SLICE_SCALE
        assert live_peak_bytes(train) > 1.2 * inference
    finally:
        gpu.BACKWARD_SLICE_SCALE = scale


def test_accounting_counts_storages_and_operations():
    x = torch.randn(64, 64)

    def work():
        a = x @ x  # 16 KiB
        b = a @ a  # 16 KiB, a still alive
        del a
        c = b + 1  # 16 KiB, b still alive
        return c.view(-1)

    assert 2 * x.nbytes <= live_peak_bytes(work) < 2 * x.nbytes + 1024
    assert count_ops(work) == 3  # two mm and an add; the view launches nothing


def test_hedgehog_exp_backward_in_spans_matches_the_reference(spans):
    """hedgehog's exp form (the per-feature core's GPU form, kernelized.exponents_gpu): its
    backward in spans of half a slice (its own share, not BACKWARD_SLICE_SCALE), from states
    read off the forward's, with padding."""
    from effattn.kernelized import exponents_gpu

    module = effattn.build("hedgehog", head_dim=21, heads=3, seed=0, chunk_size=16).double()
    module.eval()
    f = module.feature_dim
    # Slices of 64 tokens (4 chunks) at B H = 6, Dv = 5; spans of 32.
    module.slice_elements = 64 * 6 * (f + 6) * 2 * exponents_gpu.SLICE_SHARE // gpu.SLICE_SCALE
    assert exponents_gpu.slice_tokens(6, f, 5, 16, module.slice_elements) == 64
    n = 150
    q, k, v = (t.requires_grad_(True) for t in qkv(n=n, d=21, dv=5, scale=0.5))
    mask = padding(2, n)
    out = module(q, k, v, causal=True, key_padding_mask=mask)
    ref = module.spec.reference(module, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [q, k, v, *module.parameters()]
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), params)
    want = torch.autograd.grad((ref * probe).sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
    assert [len(s) for s in spans] == [5]  # 3 slices (64, 64, 22) in 32-token spans


@pytest.mark.parametrize("name, opts", [("performer", {}), ("linear", {}), ("rfa", {"gated": True}),
                                        ("hedgehog", {})], ids=["performer", "linear",
                                                                 "gated-rfa", "hedgehog"])
def test_launches_do_not_grow_with_the_chunks(name, opts):
    """Within one slice the operations a causal call dispatches (each at least one kernel
    launch on a GPU) do not grow with the chunks it holds: 64 chunks or 256, forward and
    backward, the same count but for a few of autograd's own accumulations (which depend on
    the shapes). A loop over the chunks, as the CPU strategy's, would add hundreds."""
    # eval: a training-mode redraw of the random features would add its own operations.
    module = effattn.build(name, head_dim=16, heads=2, seed=0, chunk_size=16, **opts).eval()
    counts = []
    for n in (1024, 4096):
        q, k, v = (t.float().requires_grad_(True) for t in qkv(b=1, h=2, n=n, d=16, dv=16))
        kw = {"gate": torch.full((1, 2, n), 0.9)} if opts.get("gated") else {}
        outs = []
        forward_ops = count_ops(lambda q=q, k=k, v=v, kw=kw, outs=outs: outs.append(
            module(q, k, v, causal=True, **kw)))
        counts.append((forward_ops, count_ops(lambda outs=outs: outs[0].sum().backward())))
    (fwd_few, bwd_few), (fwd_many, bwd_many) = counts
    assert abs(fwd_many - fwd_few) <= 4 and abs(bwd_many - bwd_few) <= 4, counts
