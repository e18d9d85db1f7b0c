"""The window hybrid of the kernelized methods (``window=W``, effattn.kernelized.hybrid): exact
softmax over each query's window plus the feature-map estimate over every other key.

Against the dense reference (effattn.naive.kernelized, ``hybrid=``) in float64 with gradients of
q, k, v, the gate and the per-head factor, on N = 63, D = 21, Dv = 10 with windows smaller,
equal and larger than a chunk (C = 8) and padding; exact limits (a window over every key is
softmax; ``window=None`` is the pure method); decoding (ring buffer + state) and prefill equal
the causal forward; torch.compile; the errors.
"""

import copy
import math

import pytest
import torch
from conftest import padding, qkv
from torch._dynamo.testing import CompileCounterWithBackend

import effattn
from effattn import naive
from effattn.kernelized.hybrid import Partial, WindowState, calibrate_factor, cancels

B, H, N, D, DV = 2, 3, 63, 21, 10
CHUNK = 8
# Every kernelized method (and RFA's gate), with small budgets.
METHODS = [
    ("performer", {"num_features": 24}),
    ("performer-trig", {"num_features": 24, "feature_map": "trig"}),
    ("favor", {"num_features": 24}),
    ("rfa", {"num_features": 24}),
    ("rfa-gated", {"num_features": 24, "gated": True}),
    ("linear", {}),
    ("hedgehog", {}),
    ("taylor", {"proj_dim": 5}),
]
# Signed features cancel in the normaliser: rounding is amplified (see kernelized.core).
TOLERANCE = {"favor": 1e-7, "performer-trig": 1e-8}


def _method(label):
    return label.split("-")[0]


def _build(label, options, window, *, factor=True, device="cpu"):
    module = effattn.build(_method(label), head_dim=D, heads=H, seed=0, chunk_size=CHUNK,
                           window=window, window_factor=factor and window is not None,
                           **options)
    module.slice_elements = 500  # a few chunks per slice of the sequence
    module = module.double().eval().to(device)
    if module.window_log_factor is not None:
        with torch.no_grad():
            module.window_log_factor.copy_(torch.linspace(-0.7, 0.9, H))
    return module


def _inputs(device, gated, seed=0, n=N):
    q, k, v = (t.to(device) for t in qkv(b=B, h=H, n=n, d=D, dv=DV, seed=seed))
    call = {}
    if gated:
        g = torch.Generator().manual_seed(seed + 7)
        call["gate"] = (0.2 + 0.7 * torch.rand(B, H, n, dtype=torch.float64, generator=g)).to(
            device)
    return q, k, v, call


# Windows smaller than, equal to and larger than a chunk, each causal and not, with and without
# padding (tests/test_references.py runs every mode at window 9 as well).
SETTINGS = [(3, True, True), (CHUNK, True, False), (13, True, True), (3, False, False),
            (CHUNK, False, True), (13, False, True)]


@pytest.mark.parametrize("window, causal, padded", SETTINGS,
                         ids=[f"window={w}-{'causal' if c else 'full'}-{'padded' if p else 'dense'}"
                              for w, c, p in SETTINGS])
@pytest.mark.parametrize("label, options", METHODS, ids=[m for m, _ in METHODS])
def test_matches_the_reference_with_gradients(label, options, window, causal, padded, device):
    gated = options.get("gated", False)
    if gated and not causal:
        pytest.skip("the gate is a causal recurrence")
    module = _build(label, options, window, device=device)
    q, k, v, call = _inputs(device, gated)
    mask = padding(B, N, seed=3).to(device) if padded else None
    leaves = [q, k, v, *call.values(), module.window_log_factor]
    for t in leaves:
        t.requires_grad_(True)
    out = module(q, k, v, causal=causal, key_padding_mask=mask, **call)
    ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask, **call)
    tol = TOLERANCE.get(label, 1e-10)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1)).to(
        device)
    got = torch.autograd.grad((out * g).sum(), leaves)
    want = torch.autograd.grad((ref * g).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=100 * tol, atol=100 * tol)


def _softmax(label, module, q, k, v, causal, mask):
    """Exact softmax of the logits the features estimate the exponential of."""
    if _method(label) == "rfa":
        unit = [x / x.norm(dim=-1, keepdim=True) for x in (q, k)]
        return naive.softmax_attention(*unit, v, causal=causal, key_padding_mask=mask,
                                       scale=float(module.sigma[0]) ** -2)
    return naive.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask,
                                   scale=module.scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("label, options", METHODS, ids=[m for m, _ in METHODS])
def test_a_window_over_every_key_is_exact_softmax(label, options, causal):
    if options.get("gated") and not causal:
        pytest.skip("the gate is a causal recurrence")
    # Causal: the last N keys; non-causal: N - 1 to each side.
    module = _build(label, options, N if causal else 2 * (N - 1))
    q, k, v, call = _inputs("cpu", options.get("gated", False))
    mask = padding(B, N, seed=3)
    out = module(q, k, v, causal=causal, key_padding_mask=mask, **call)
    want = _softmax(label, module, q, k, v, causal, mask)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("label, options", METHODS, ids=[m for m, _ in METHODS])
def test_window_none_is_the_pure_method(label, options):
    q, k, v, call = _inputs("cpu", options.get("gated", False))
    pure = effattn.build(_method(label), head_dim=D, heads=H, seed=0, chunk_size=CHUNK,
                         **options).double().eval()
    default = _build(label, options, None)
    # The same slices, so that the same sums are formed in the same order (the GPU strategy's
    # chunk-parallel prefix is grouped by slice: other slices agree only to rounding).
    pure.slice_elements = default.slice_elements
    assert default.window is None and default.window_log_factor is None
    assert "window_log_factor" not in default.state_dict()
    causal = True
    out = default(q, k, v, causal=causal, **call)
    torch.testing.assert_close(out, pure(q, k, v, causal=causal, **call), rtol=0, atol=0)
    ref = pure.spec.reference(pure, q, k, v, causal=causal, **call)
    torch.testing.assert_close(out, ref, rtol=TOLERANCE.get(label, 1e-10),
                               atol=TOLERANCE.get(label, 1e-10))


def test_the_window_is_exact_where_attention_is_local():
    """Peaked, local attention (each query's logits large on its own recent keys): the hybrid's
    error against softmax is far below the pure random-feature estimate's."""
    n = 200
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2, n, 16, dtype=torch.float64, generator=g)
    # Keys drift slowly: neighbours are similar, so a query's largest logits are near it.
    k = torch.cumsum(base, 2) / 4
    q, v = k.clone(), torch.randn(1, 2, n, 16, dtype=torch.float64, generator=g)
    exact = naive.softmax_attention(q, k, v, causal=True)
    errors = {}
    for window in (None, 64):
        module = effattn.build("performer", head_dim=16, heads=2, seed=0, num_features=64,
                               window=window).double().eval()
        out = module(q, k, v, causal=True)
        errors[window] = ((out - exact).norm() / exact.norm()).item()
    assert errors[64] < errors[None] / 10, errors  # measured: 1.02 -> 0.015


@pytest.mark.parametrize("window", [1, 5, CHUNK, 13, 80], ids=lambda w: f"window={w}")
@pytest.mark.parametrize("label, options", METHODS, ids=[m for m, _ in METHODS])
def test_step_and_prefill_equal_the_causal_forward(label, options, window):
    """Token by token from nothing, and a prompt prefilled in two blocks (the second continues
    the ring buffer and the state), then steps: each equals the causal forward."""
    module = _build(label, options, window)
    q, k, v, call = _inputs("cpu", options.get("gated", False), n=40)
    tol = TOLERANCE.get(label, 1e-10)
    with torch.no_grad():
        full = module(q, k, v, causal=True, **call)

        def at(a, b):
            return [x[:, :, a:b] for x in (q, k, v)], {n: x[:, :, a:b] for n, x in call.items()}

        state, outs = None, []
        for t in range(40):
            (qt, kt, vt), ct = at(t, t + 1)
            out, state = module.step(qt, kt, vt, state, **ct)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, 2), full, rtol=tol, atol=tol)
        outs, state = [], None
        for a, b in ((0, 11), (11, 23)):
            (qs, ks, vs), cs = at(a, b)
            out, state = module.prefill(qs, ks, vs, state, **cs)
            outs.append(out)
        for t in range(23, 40):
            (qt, kt, vt), ct = at(t, t + 1)
            out, state = module.step(qt, kt, vt, state, **ct)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=tol, atol=tol)
    assert isinstance(state, WindowState) and state.length == 40
    assert state.k.shape[2] == window  # the ring holds W keys whatever the length


@pytest.mark.parametrize("label, options", [METHODS[0], METHODS[4], METHODS[6]],
                         ids=[METHODS[i][0] for i in (0, 4, 6)])
def test_step_under_autograd_leaves_earlier_states_alone_and_gives_the_forwards_gradients(
        label, options):
    """Stepped with q, k, v (and the gate) that require grad, as a training loop or a script
    may: each step returns a new state and leaves the caller's earlier one as it was, and the
    gradients through the steps equal those through the causal forward."""
    window, n = 5, 14  # keys leave the ring and enter the state
    module = _build(label, options, window)
    q, k, v, call = _inputs("cpu", options.get("gated", False), n=n)
    leaves = [q, k, v, *call.values()]
    for t in leaves:
        t.requires_grad_(True)
    state, outs, kept = None, [], []
    for t in range(n):
        out, new = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state,
                               **{name: x[:, :, t:t + 1] for name, x in call.items()})
        if state is not None:
            for ring, saved in zip((state.k, state.v), kept[-1], strict=True):
                assert torch.equal(ring, saved), f"step {t} changed the state it was given"
        kept.append((new.k.detach().clone(), new.v.detach().clone()))
        state = new
        outs.append(out)
    stepped = torch.cat(outs, 2)
    full = module(q, k, v, causal=True, **call)
    tol = TOLERANCE.get(label, 1e-10)
    torch.testing.assert_close(stepped, full, rtol=tol, atol=tol)
    g = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((stepped * g).sum(), leaves)
    want = torch.autograd.grad((full * g).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=100 * tol, atol=100 * tol)


def test_decoding_state_does_not_grow():
    module = effattn.build("performer", head_dim=8, heads=2, seed=0, num_features=16,
                           window=4).eval()
    q, k, v = qkv(b=1, h=2, n=30, d=8, dtype=torch.float32)
    state, sizes = None, []
    with torch.no_grad():
        for t in range(30):
            _, state = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
            sizes.append(state.nbytes())
    assert len(set(sizes[4:])) == 1  # the kernelized state exists once a key left the window


def test_fp32_step_matches_the_forward():
    module = effattn.build("hedgehog", head_dim=16, heads=2, seed=0, window=6).eval()
    q, k, v = qkv(b=2, h=2, n=50, d=16, dtype=torch.float32)
    with torch.no_grad():
        full = module(q, k, v, causal=True)
        state, outs = None, []
        for t in range(50):
            out, state = module.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("label, options, training",
                         [(*METHODS[0], False), (*METHODS[0], True), (*METHODS[4], True)],
                         ids=["performer-eval", "performer-train", "rfa-gated-train"])
def test_compiles_fullgraph_and_matches_eager(label, options, training, one_thread):
    torch._dynamo.reset()
    eager = _build(label, options, 5).train(training)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(copy.deepcopy(eager), backend=counter, fullgraph=True)
    gated = options.get("gated", False)
    modes = [True] if gated else [False, True]
    for causal in modes:
        q, k, v, call = _inputs("cpu", gated, n=30)
        mask = padding(B, 30, seed=1)
        want = eager(q, k, v, causal=causal, key_padding_mask=mask, **call)
        got = compiled(q, k, v, causal=causal, key_padding_mask=mask, **call)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # One whole graph per mode (causal is a Python bool the graph specialises on), no break.
    assert counter.frame_count == len(modes), counter.frame_count
    torch._dynamo.reset()


def test_the_factor_is_a_trained_parameter_in_the_state_dict():
    module = _build("hedgehog", {}, 5)
    assert "window_log_factor" in module.state_dict()
    assert any(p is module.window_log_factor for p in module.parameters())
    copy_ = _build("hedgehog", {}, 5, factor=True)
    with torch.no_grad():
        copy_.window_log_factor.zero_()
    copy_.load_state_dict(module.state_dict())
    torch.testing.assert_close(copy_.window_log_factor, module.window_log_factor)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="window must be a positive int"):
        effattn.build("performer", window=0)
    with pytest.raises(ValueError, match="window_factor=True needs a window"):
        effattn.build("performer", window_factor=True)
    with pytest.raises(ValueError, match="window_factor must be a bool"):
        effattn.build("performer", window=4, window_factor=1)
    module = effattn.build("performer", head_dim=8, heads=2, window=4)
    q, _, _ = qkv(b=1, h=2, n=6, d=8, dtype=torch.float32)
    k, v, _ = qkv(b=1, h=2, n=9, d=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"window=4 cannot do cross-attention \(N=6 != M=9\)"):
        module(q, k, v)
    with pytest.raises(ValueError, match="window=4 cannot do cross-attention over a memory"):
        module.memory(k, v)
    one = q[:, :, :1]
    with pytest.raises(ValueError, match="state must be the WindowState"):
        module.step(one, one, one, state=torch.zeros(1))
    _, state = module.step(one, one, one)
    other = effattn.build("performer", head_dim=8, heads=2, window=5)
    with pytest.raises(ValueError, match="W=5"):
        other.step(one, one, one, state)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["performer", "favor", "rfa"])
def test_calibrated_factor_of_an_unbiased_estimator_is_one(name, causal):
    """Random features estimate e^{s} at the true scale (the query's log-scale carries every
    constant): at small logits, where the estimate's spread is small, the factor that matches
    softmax's mass outside the window is 1 (measured |log α| <= 0.02 with 1024 features)."""
    g = torch.Generator().manual_seed(0)
    q, k = (0.5 * torch.randn(2, 4, 128, 16, dtype=torch.float64, generator=g)
            for _ in range(2))
    module = effattn.build(name, head_dim=16, heads=4, seed=0, num_features=1024, window=16,
                           window_factor=True).double().eval()
    with torch.no_grad():
        module.window_log_factor.fill_(3.0)  # calibration does not depend on the factor held
    calibrate_factor(module, q, k, causal=causal, key_padding_mask=padding(2, 128, seed=2))
    assert module.window_log_factor.abs().max() < 0.05, module.window_log_factor


@pytest.mark.parametrize(("name", "options", "unbiased"), [
    ("performer", {}, True), ("performer", {"feature_map": "hyperbolic"}, True),
    ("performer", {"feature_map": "trig"}, True), ("performer", {"feature_map": "relu"}, False),
    ("favor", {}, True), ("rfa", {}, True), ("rfa", {"feature_map": "arccos"}, False),
    ("rfa", {"gated": True}, True), ("linear", {}, False), ("hedgehog", {}, False),
    ("taylor", {}, False)])
def test_which_maps_estimate_the_exponential(name, options, unbiased):
    # relu and arccos estimate other kernels (measured log α -6.4 and 0.15 at 4096 features, at
    # logits of std 0.5); Taylor's is deterministic and only near e^s for small s.
    assert effattn.build(name, head_dim=16, heads=2, **options).estimates_exp is unbiased


def test_calibration_brings_an_arbitrary_map_to_softmax():
    """hedgehog's identity map has a kernel of its own scale: uncalibrated (α = 1) its estimate
    outweighs the window; calibrated, the hybrid is closer to softmax."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (1.5 * torch.randn(2, 4, 128, 16, dtype=torch.float64, generator=g)
               for _ in range(3))
    exact = naive.softmax_attention(q, k, v, causal=True)
    module = effattn.build("hedgehog", head_dim=16, heads=4, seed=0, window=16,
                           window_factor=True).double().eval()
    with torch.no_grad():
        before = (module(q, k, v, causal=True) - exact).norm() / exact.norm()
        calibrate_factor(module, q, k, causal=True, key_padding_mask=None)
        after = (module(q, k, v, causal=True) - exact).norm() / exact.norm()
    assert (module.window_log_factor < -1).all()  # measured about -3.6
    assert after < 0.85 * before, (before, after)  # measured 0.78 -> 0.61


def test_calibration_needs_the_factor():
    module = effattn.build("hedgehog", head_dim=8, heads=2, window=4)
    q, k, _ = qkv(b=1, h=2, n=10, d=8)
    with pytest.raises(ValueError, match="window_factor=True"):
        calibrate_factor(module.double(), q, k, causal=True, key_padding_mask=None)


def _count_passes(monkeypatch):
    """Counts of the core's non-causal key passes and causal passes the hybrid makes."""
    from effattn.kernelized.core import CoreConfig

    calls = {"key_state": 0, "causal_normalised": 0}

    def counting(name):
        original = getattr(CoreConfig, name)

        def counted(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(CoreConfig, name, counting(name))
    return calls


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("label, options", [METHODS[0], METHODS[2], METHODS[6]],
                         ids=["performer", "favor", "hedgehog"])
def test_non_causal_is_one_pass_over_the_keys_minus_the_window(label, options, padded,
                                                                  monkeypatch):
    """Non-causal: every key's estimate (one key state) minus the window's band, merged with
    the window; no causal pass (hedgehog: its per-feature state, and the band at its scale)."""
    module = _build(label, options, 8)
    q, k, v, _ = _inputs("cpu", False)
    mask = padding(B, N, seed=3) if padded else None
    calls = _count_passes(monkeypatch)
    out = module(q, k, v, causal=False, key_padding_mask=mask)
    assert calls == {"key_state": 1, "causal_normalised": 0}
    ref = module.spec.reference(module, q, k, v, causal=False, key_padding_mask=mask)
    tol = TOLERANCE.get(label, 1e-10)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def _part(log_abs, sign=None):
    log_abs = torch.tensor([log_abs], dtype=torch.float32)
    return Partial(torch.zeros(1, 1), log_abs, None if sign is None else torch.tensor([sign]))


def test_the_subtraction_is_refused_where_it_would_cancel():
    """`cancels`: a row whose estimate over every key is mostly the window's band, with the
    window's exact part too small to outweigh it, loses its digits in the subtraction; a row
    where either the window dominates or the band is a small part of the total does not; a lost
    read-out is refused whatever the sizes."""
    no = torch.tensor(False)
    # Every key's estimate 1, the band's 1 - 1e-6 (a part of sign -1, as
    # outside_window_parts gives it): the difference is fp32's rounding.
    assert cancels(_part(-30.0), _part(0.0), _part(math.log1p(-1e-6), -1.0), no)
    # The same, but the window's exact part is e^2 times larger: the rounding is small in it.
    assert not cancels(_part(2.0), _part(0.0), _part(math.log1p(-1e-6), -1.0), no)
    # The band is a tenth of the total: one digit lost.
    assert not cancels(_part(-30.0), _part(0.0), _part(math.log(0.1), -1.0), no)
    # Signed (trig) estimates: a negative band estimate adds to the total.
    assert not cancels(_part(-30.0), _part(0.0, 1.0), _part(0.0, 1.0), no)
    assert cancels(_part(0.0), _part(-1.0), _part(-2.0, -1.0), torch.tensor(True))


def test_where_the_subtraction_cancels_the_two_lagged_passes_answer(monkeypatch):
    """Peaked fp32 logits where every key's estimate is the window's: the hybrid finds the
    subtraction unsafe, takes one lagged causal pass each way instead, and equals the float64
    reference to fp32's accuracy."""
    module = _build("performer", {"num_features": 24}, 8)
    q, k, v = qkv(b=1, h=H, n=40, d=D, dv=DV, seed=2)
    # Keys equal to their queries and far apart: each query's estimate is its own key's, in
    # the window, and (by the factor) outweighs the window's softmax.
    k = q = q * 6.0
    with torch.no_grad():
        module.window_log_factor.fill_(400.0)
        want = module(q, k, v, causal=False)
        calls = _count_passes(monkeypatch)
        got = module.float()(q.float(), k.float(), v.float(), causal=False)
    assert calls == {"key_state": 1, "causal_normalised": 2}
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("label, options", [METHODS[2], METHODS[6]], ids=["favor", "hedgehog"])
def test_the_two_lagged_passes_match_the_reference_with_gradients(label, options, monkeypatch):
    """The non-causal form without the subtraction (taken where it would cancel, and while
    compiling) against the float64 reference, gradients included."""
    from effattn.kernelized import hybrid

    monkeypatch.setattr(hybrid, "cancels", lambda *parts: True)
    module = _build(label, options, 8)
    q, k, v, _ = _inputs("cpu", False)
    mask = padding(B, N, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, causal=False, key_padding_mask=mask)
    ref = module.spec.reference(module, *leaves, causal=False, key_padding_mask=mask)
    tol = TOLERANCE.get(label, 1e-10)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), leaves)
    want = torch.autograd.grad((ref * probe).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("label, options", [METHODS[0], METHODS[6]],
                         ids=["performer", "hedgehog"])
def test_fp32_non_causal_subtraction_keeps_fp32_accuracy(label, options):
    """Every key minus the window's keys in fp32, where the window holds most of the estimate
    (peaked logits), against the same module in float64: non-negative maps to fp32's rounding
    (measured: 1.4e-6 and 2.5e-7 at most, as the two lagged passes this form replaced gave;
    signed maps differ by their normaliser's condition number, as in kernelized.core)."""
    module = _build(label, options, 32)
    q, k, v = qkv(b=1, h=H, n=300, d=D, dv=DV, seed=5, scale=1.5)
    with torch.no_grad():
        want = module(q, k, v, causal=False)
        got = module.float()(q.float(), k.float(), v.float(), causal=False)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
