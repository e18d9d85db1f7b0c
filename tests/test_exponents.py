"""The per-feature stabilised core (effattn.kernelized.exponents) of maps given by exponents
(hedgehog's exp form): against the log-space float64 reference (outputs and gradients,
awkward shapes, padding, slices), at exponents far beyond fp32's range of exp, both of its
in-chunk precisions, decoding == forward, no future key setting a scale, and its errors."""

import copy
import math

import pytest
import torch
from conftest import qkv

import effattn
from effattn import naive
from effattn.kernelized import core
from effattn.kernelized import exponents as ex
from effattn.kernelized.core import RecurrentState


def map_of(w, b):
    """Hedgehog's exponents [x W_h + b_h, -(x W_h + b_h)] for w (H, D, F), b (H, F)."""

    def exponents(x):
        u = x @ w.to(x.dtype) + b.to(x.dtype)[:, None, :]
        return torch.cat([u, -u], -1)

    return exponents


def weights(h=3, d=21, f=5, size=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(h, d, f, generator=g, dtype=torch.float64) * size / d**0.5
    b = torch.randn(h, f, generator=g, dtype=torch.float64)
    return w, b


def reference(q, k, v, exponents, causal, key_padding_mask=None):
    return naive.exponent_attention(exponents(q), exponents(k), v, causal=causal,
                                    key_padding_mask=key_padding_mask)


def key_mask(b, n):
    """Padding in front (b = 0), at the end (b = 1) and none (b >= 2)."""
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, :5] = True
    if b > 1:
        mask[1, n - 20:] = True
    return mask


def attend(q, k, v, exponents, causal, mask=None, chunk=16, slice_elements=1 << 20):
    f = exponents(q[:, :, :1]).shape[-1]
    return ex.attention(q, k, v, exponents, f, is_causal=causal, key_padding_mask=mask,
                        chunk_size=chunk, slice_elements=slice_elements)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("slice_elements", [1 << 20, 700])
def test_float64_outputs_and_gradients_equal_the_reference(causal, padded, slice_elements):
    """N = 63, D = 21, chunks of 16 (63 is no multiple), slices of 1-2 chunks (each recomputed
    in the backward) or one: outputs and the gradients of q, k, v, W and b equal the log-space
    reference's in float64."""
    q, k, v = qkv(b=3, h=3, n=63, d=21, dv=7)
    w, b = (t.requires_grad_() for t in weights())
    mask = key_mask(3, 63) if padded else None
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*inputs, map_of(w, b), causal, mask, slice_elements=slice_elements)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    w_ref, b_ref = (t.detach().clone().requires_grad_() for t in (w, b))
    ref = reference(*ref_inputs, map_of(w_ref, b_ref), causal, mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for got, want in zip([*inputs, w, b], [*ref_inputs, w_ref, b_ref], strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [100.0, 300.0])
def test_fp32_exponents_far_beyond_exp_range_are_exact(causal, size):
    """Weights scaled so that the exponents reach 100 (and 300): exp(u) alone over- and
    underflows fp32 (e^±88) and the row convention loses whole normalisers, while here the fp32
    outputs are finite and equal the float64 log-space result to fp32's precision of the
    exponents themselves (relative 1e-7 of |u|), and so are their gradients."""
    q, k, v = qkv(b=2, h=3, n=100, d=21, dv=7)
    w, b = weights(size=1.0)
    top = map_of(w, b)(torch.cat([q, k], 2)).abs().max()
    w = w * (size / top)
    mask = key_mask(2, 100)
    exact = reference(q, k, v, map_of(w, b), causal, mask)
    qf, kf = (t.float().requires_grad_() for t in (q, k))
    out = attend(qf, kf, v.float(), map_of(w.float(), b.float()), causal, mask)
    assert torch.isfinite(out).all()
    tol = 4e-7 * size
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)
    grad = torch.randn_like(out)
    out.backward(grad)
    q64, k64 = (t.clone().requires_grad_() for t in (q, k))
    reference(q64, k64, v, map_of(w, b), causal, mask).backward(grad.double())
    for got, want in ((qf, q64), (kf, k64)):
        assert torch.isfinite(got.grad).all()
        scale = want.grad.abs().max()
        torch.testing.assert_close(got.grad.double() / scale, want.grad / scale,
                                   rtol=0, atol=30 * tol)


@pytest.mark.parametrize("growth", [-1.0, 1e9])
def test_both_in_chunk_precisions_agree(monkeypatch, growth):
    """The in-chunk products run in the input's dtype below FP32_GROWTH and in float64 above
    it (with the exact shift): forcing either on the same inputs gives the reference."""
    monkeypatch.setattr(ex, "FP32_GROWTH", growth)
    q, k, v = qkv(b=2, h=3, n=63, d=21, dv=7)
    w, b = weights(size=3.0)
    out = attend(q, k, v, map_of(w, b), True, key_mask(2, 63))
    torch.testing.assert_close(out, reference(q, k, v, map_of(w, b), True, key_mask(2, 63)),
                               rtol=1e-10, atol=1e-12)


def test_prefix_max_is_the_running_max():
    x = torch.randn(2, 3, 4, 13, 5, dtype=torch.float64)
    torch.testing.assert_close(ex._prefix_max(x), torch.cummax(x, -2).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoding_and_split_prefill_equal_the_forward(dtype):
    """At exponents up to 200: token-by-token steps and a prefill split mid-chunk give the
    forward's outputs, and the states agree."""
    q, k, v = (t.to(dtype) for t in qkv(b=2, h=3, n=50, d=21, dv=7))
    w, b = weights()
    w = w * 200 / map_of(w, b)(torch.cat([q, k], 2).double()).abs().max()
    exponents = map_of(w, b)
    out, state, _ = ex.causal(q, k, v, exponents, 10, chunk_size=16)
    steps, s = [], None
    for t in range(50):
        o, s = ex.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], s, exponents)
        steps.append(o)
    tol = 4e-7 * 200 if dtype == torch.float32 else 1e-11  # the exponents' own rounding
    torch.testing.assert_close(torch.cat(steps, 2), out, rtol=tol, atol=tol)
    first, mid, _ = ex.causal(q[:, :, :23], k[:, :, :23], v[:, :, :23], exponents, 10,
                              chunk_size=16)
    rest, end, _ = ex.causal(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], exponents, 10, mid,
                             chunk_size=16)
    torch.testing.assert_close(torch.cat([first, rest], 2), out, rtol=tol, atol=tol)
    for got in (s, end):  # the same state, at scales up to e^RESCALE_MARGIN apart
        gap = state.log_scale - got.log_scale  # the exponents' rounding differs by shape
        assert (gap >= -1e-4).all() and (gap <= core.RESCALE_MARGIN + 1e-4).all()
        torch.testing.assert_close(got.kv * torch.exp(got.log_scale - state.log_scale),
                                   state.kv, rtol=tol, atol=tol)
        assert got.position == state.position == 50


def test_no_future_key_sets_a_scale():
    """Keys after t moved to exponents 400 above the others: the fp32 outputs at positions <= t
    change only by rounding (the later chunks switch the slice to float64 products); a shift
    set by those keys would scale the earlier keys by e^-400, to zero."""
    q, k, v = qkv(b=1, h=3, n=64, d=21, dv=7, dtype=torch.float32)
    w, b = weights()
    exponents = map_of(w.float(), b.float())
    before = attend(q, k, v, exponents, True)
    k_big = k.clone()
    k_big[:, :, 40:] *= 400 / exponents(k[:, :, 40:]).abs().max()
    after = attend(q, k_big, v, exponents, True)
    torch.testing.assert_close(after[:, :, :40], before[:, :, :40], rtol=1e-5, atol=1e-6)


def test_non_causal_state_in_slices_equals_one_pass():
    """key_state over two slices of keys (the state rescaled per feature between them) reads
    out as over all keys at once."""
    q, k, v = qkv(b=2, h=3, n=40, d=21, dv=7)
    w, b = weights(size=50.0)
    exponents = map_of(w, b)
    whole = ex.key_state(k, v, exponents, 10)
    part = ex.key_state(k[:, :, 25:], v[:, :, 25:], exponents, 10,
                        state=ex.key_state(k[:, :, :25], v[:, :, :25], exponents, 10))
    torch.testing.assert_close(ex.read_queries(q, part, exponents),
                               ex.read_queries(q, whole, exponents))
    torch.testing.assert_close(ex.read_queries(q, whole, exponents),
                               reference(q, k, v, exponents, False))


def test_a_query_that_sees_no_key_gets_zero():
    q, k, v = qkv(b=1, h=3, n=20, d=21, dv=7)
    mask = torch.zeros(1, 20, dtype=torch.bool)
    mask[0, :7] = True
    out = attend(q, k, v, map_of(*weights()), True, mask)
    assert (out[:, :, :7] == 0).all() and (out[:, :, 7:].abs().amax(-1) > 0).all()
    state = ex.key_state(k, v, map_of(*weights()), 10,
                         key_padding_mask=torch.ones(1, 20, dtype=torch.bool))
    assert (ex.read_queries(q, state, map_of(*weights())) == 0).all()


def test_bad_lags_are_refused():
    module = effattn.build("hedgehog", head_dim=21, heads=3, num_features=5).double()
    q, k, v = qkv(b=1, h=3, n=8, d=21, dv=7)
    for lag in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lag must be an int >= 0"):
            module.core().causal(q, k, v, lag=lag)
    _, state = module.core().causal(q, k, v)
    with pytest.raises(ValueError, match="lag > 0 needs state=None"):
        module.core().causal(q, k, v, state, lag=2)


def test_bad_states_and_gates_are_refused():
    q, k, v = qkv(b=1, h=3, n=8, d=21, dv=7)
    row_state = RecurrentState(torch.zeros(1, 3, 10, 8, dtype=torch.float64),
                               torch.zeros(1, 3, 1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="per-feature state"):
        ex.causal(q, k, v, map_of(*weights()), 10, row_state)
    with pytest.raises(ValueError, match="state must be a RecurrentState"):
        ex.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], "state", map_of(*weights()))
    module = effattn.build("hedgehog", head_dim=21, heads=3, num_features=5).double()
    with pytest.raises(ValueError, match="gate"):
        module.core().causal(q, k, v, gate=torch.full((1, 3, 8), 0.5, dtype=torch.float64))


def test_hedgehog_exp_runs_it_and_trains_where_the_row_convention_underflowed():
    """Inputs of entries ~50 (exponents |x W + b| up to ~200) in fp32: the exp form, which
    underflowed to a refused normaliser with one scale per row, now equals the float64
    log-space result, forward and prefill."""
    q, k, v = qkv(b=2, h=2, n=143, d=16, dtype=torch.float32)
    q, k = 50 * q, 50 * k
    module = effattn.build("hedgehog", head_dim=16, heads=2, seed=0, chunk_size=16)
    exponents = module.exponents
    exact = naive.exponent_attention(exponents(q.double()).detach(),
                                     exponents(k.double()).detach(), v.double(), causal=True)
    torch.testing.assert_close(module(q, k, v, causal=True).double(), exact,
                               rtol=1e-4, atol=1e-4)
    out, _ = module.prefill(q, k, v)
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)


def test_the_softmax_form_still_names_its_underflow():
    """The softmax form keeps the row convention: a query and keys whose peaks sit on other
    features (products ~e^-100) underflow in fp32, and the module names the method and its
    exponents instead of returning a zero row."""
    module = effattn.build("hedgehog", head_dim=4, heads=1, feature_map="softmax_dim")
    q = torch.tensor([100.0, -100.0, 0.0, 0.0]).expand(1, 1, 3, 4)
    k = torch.tensor([0.0, 0.0, 100.0, -100.0]).expand(1, 1, 3, 4)
    v = torch.ones(1, 1, 3, 2)
    match = r"^hedgehog: .* 0 in torch\.float32 .*\(the map's exponents \|x W \+ b\| reach \d+"
    with pytest.raises(ValueError, match=match):
        module(q, k, v, causal=True)
    out = copy.deepcopy(module).double()(q.double(), k.double(), v.double(), causal=True)
    assert torch.isfinite(out).all()


def test_features_against_a_state_give_the_kernel():
    """``against``: keys exp(u - o), queries exp(u + o - c) and c reproduce the kernel
    Σ_f exp(u_qf + u_kf) at exponents of 100, and reading the state with them gives the
    non-causal read-out."""
    q, k, v = qkv(b=2, h=3, n=30, d=21, dv=7)
    w, b = weights(size=1.0)
    exponents = map_of(w * 100 / map_of(w, b)(torch.cat([q, k], 2)).abs().max(), b)
    state = ex.key_state(k, v, exponents, 10)
    phi_q, top = ex.against(exponents(q), state.log_scale, is_query=True)
    phi_k, none = ex.against(exponents(k), state.log_scale, is_query=False)
    assert none is None and phi_q.amax() <= 1 and phi_k.amax() <= 1
    log_kernel = torch.logsumexp(exponents(q)[..., :, None, :] + exponents(k)[..., None, :, :], -1)
    torch.testing.assert_close((phi_q @ phi_k.transpose(-2, -1)).log() + top, log_kernel)
    raw = phi_q @ state.kv
    torch.testing.assert_close(raw[..., :-1] / raw[..., -1:], ex.read_queries(q, state, exponents))


def test_keys_a_rounding_above_the_scale_keep_their_gradient():
    """``against`` clamps a key above the state's scale at exp(0) = 1 (padding rows) but passes
    the gradient: the key that set a feature's scale, recomputed with other rounding, lands a
    rounding above it and must keep d exp(u - o) / du = 1 (a clamp would give 0, as a window
    hybrid's band over several slices did)."""
    scale = torch.zeros(1, 1, 3, 1, dtype=torch.float64)
    u = torch.tensor([[[[1e-15, -1.0, 5.0]]]], dtype=torch.float64, requires_grad=True)
    phi, _ = ex.against(u, scale, is_query=False)
    assert torch.equal(phi.detach(), torch.tensor([[[[1.0, math.exp(-1.0), 1.0]]]],
                                                  dtype=torch.float64))
    (grad,) = torch.autograd.grad(phi.sum(), u)
    torch.testing.assert_close(grad, torch.tensor([[[[1.0, math.exp(-1.0), 1.0]]]],
                                                  dtype=torch.float64))


@pytest.mark.parametrize("lag", [0, 1, 5, 62, 63, 70])
def test_lag_equals_the_reference_with_gradients(lag):
    """``lag`` (the window hybrid's linear part): query i sees keys j <= i - lag; N = 63, chunks
    of 16, padding; outputs, normalisers and gradients against the log-space reference, through
    the module's core configuration."""
    module = effattn.build("hedgehog", head_dim=21, heads=3, num_features=5, seed=0,
                           chunk_size=16).double()
    q, k, v = (t.requires_grad_() for t in qkv(b=3, h=3, n=63, d=21, dv=7))
    mask = key_mask(3, 63)
    out, _, norm = module.core().causal_normalised(q, k, v, key_padding_mask=mask, lag=lag)
    u_q, u_k = module.exponents(q), module.exponents(k)
    log_kernel = torch.logsumexp(u_q[..., :, None, :] + u_k[..., None, :, :], -1)
    i = torch.arange(63)
    seen = (i[None, :] <= i[:, None] - lag)[None, None] & ~mask[:, None, None, :]
    log_kernel = log_kernel.masked_fill(~seen, float("-inf"))
    ref = torch.softmax(log_kernel, -1).nan_to_num(0.0) @ v
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norm.log_abs, torch.logsumexp(log_kernel, -1))
    if lag >= 63:  # no query sees a key: zeros, which depend on nothing
        assert (out == 0).all() and not out.requires_grad
        return
    probe = torch.randn_like(out)
    params = (q, k, v, *module.parameters())
    for a, b in zip(torch.autograd.grad((out * probe).sum(), params),
                    torch.autograd.grad((ref * probe).sum(), params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


# The hand-written backward (kernelized.exponents, "Gradients are written by hand") against
# autograd through the same forward (the path torch.compile records), in float64.

def _stored(monkeypatch):
    # The per-feature core asks the row core's _recording whether to take its own backward.
    monkeypatch.setattr(core, "_recording", lambda: False)


def _grads(run, inputs, probes):
    outs = run()
    loss = sum((o.masked_fill(~torch.isfinite(o), 0.0) * p).sum()
               for o, p in zip(outs, probes[:len(outs)], strict=True))
    return outs, torch.autograd.grad(loss, inputs, allow_unused=True)


def _same(got, want, tol=1e-10):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), f"gradient {i} reached only one path"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol,
                                       msg=lambda text, i=i: f"gradient {i}: {text}")


CASES = {
    # N = 63, chunks of 16: the last chunk is partial; slices of one chunk (several slices).
    "one-slice": {},
    "slices": {"slice_elements": 700},
    "padded-slices": {"slice_elements": 700, "padded": True},
    # The in-chunk products in float64 (a GPU's and a compiled graph's path), exponents ~30.
    "float64-in-chunk": {"slice_elements": 700, "padded": True, "fp32_growth": -1.0,
                         "size": 30.0},
    # Exponents whose growth inside a chunk passes the clamp: no gradient past it, as autograd.
    "clamped": {"fp32_growth": -1.0, "growth_limit": 0.5, "size": 3.0},
    "lag": {"slice_elements": 700, "padded": True, "lag": 5},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_backward_equals_autograd_through_the_forward(case, causal, monkeypatch):
    """Outputs, the causal normaliser's log and the gradients of q, k, v, W and b (through the
    normaliser's log too) equal autograd through the same forward."""
    opts = CASES[case]
    if not causal and ("lag" in opts or "growth_limit" in opts):
        pytest.skip("a causal setting")
    monkeypatch.setattr(ex, "FP32_GROWTH", opts.get("fp32_growth", ex.FP32_GROWTH))
    monkeypatch.setattr(ex, "GROWTH_LIMIT", opts.get("growth_limit", ex.GROWTH_LIMIT))
    q, k, v = (t.requires_grad_() for t in qkv(b=3, h=3, n=63, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights(size=opts.get("size", 1.0)))
    mask = key_mask(3, 63) if opts.get("padded") else None
    slices = opts.get("slice_elements", 1 << 20)

    def run():
        exponents = map_of(w, b)
        if not causal:
            return (attend(q, k, v, exponents, False, mask, slice_elements=slices),)
        out, state, norm = ex.causal(q, k, v, exponents, 10, key_padding_mask=mask,
                                     chunk_size=16, slice_elements=slices, normaliser=True,
                                     lag=opts.get("lag", 0))
        return out, norm.log_abs, state.kv

    g = torch.Generator().manual_seed(1)
    probes = [torch.randn(s, generator=g, dtype=torch.float64)
              for s in ((3, 3, 63, 7), (3, 3, 63), (3, 3, 10, 8))]
    inputs = (q, k, v, w, b)
    outs, grads = _grads(run, inputs, probes)
    _stored(monkeypatch)
    outs_s, grads_s = _grads(run, inputs, probes)
    for a, b_ in zip(outs, outs_s, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)
    _same(grads, grads_s)


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_reaches_an_incoming_state(causal, monkeypatch):
    """A split prefill (causal) or a key state continued (non-causal), the first part's state
    requiring grad as sequence parallelism's incoming state does: every gradient, the state's
    included, equals autograd through the forward."""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=3, n=63, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights(size=10.0))
    mask = key_mask(2, 63)

    def run():
        exponents = map_of(w, b)
        if causal:
            first, mid, _ = ex.causal(q[:, :, :23], k[:, :, :23], v[:, :, :23], exponents, 10,
                                      key_padding_mask=mask[:, :23], chunk_size=16)
            rest, end, norm = ex.causal(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], exponents, 10,
                                        mid, key_padding_mask=mask[:, 23:], chunk_size=16,
                                        slice_elements=700, normaliser=True)
            return torch.cat([first, rest], 2), end.kv, norm.log_abs
        state = ex.key_state(k[:, :, :25], v[:, :, :25], exponents, 10,
                             key_padding_mask=mask[:, :25])
        state = ex.key_state(k[:, :, 25:], v[:, :, 25:], exponents, 10, state=state,
                             key_padding_mask=mask[:, 25:], slice_elements=700)
        return ex.read_queries(q, state, exponents, slice_elements=700), state.kv

    g = torch.Generator().manual_seed(2)
    probes = [torch.randn(s, generator=g, dtype=torch.float64)
              for s in ((2, 3, 63, 7), (2, 3, 10, 8), (2, 3, 40))]
    inputs = (q, k, v, w, b)
    _, grads = _grads(run, inputs, probes)
    _stored(monkeypatch)
    _, grads_s = _grads(run, inputs, probes)
    _same(grads, grads_s)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    """torch.autograd.gradcheck of the hand-written backward: a tiny case (N = 11, chunks of
    4, slices of one chunk) from an incoming state that requires grad, with the causal
    normaliser's log as an output."""
    q, k, v = qkv(b=1, h=2, n=11, d=3, dv=2, seed=3)
    w, b = weights(h=2, d=3, f=2, size=3.0, seed=3)
    exponents = map_of(w, b)
    before = ex.causal(q, k, v, exponents, 4, chunk_size=4)[1] if causal else ex.key_state(
        k, v, exponents, 4)
    scale = before.log_scale
    slices = 1 * 2 * 4 * 4 * ex.SLICE_SHARE

    def true_scale(state):  # the state's kv at its scale moves with the largest key; this not
        return state.kv * state.log_scale.exp()

    def run(q, k, v, kv, w, b):
        state = RecurrentState(kv, scale)
        if causal:
            out, after, norm = ex.causal(q, k, v, map_of(w, b), 4, state, chunk_size=4,
                                         slice_elements=slices, normaliser=True)
            return out, norm.log_abs, true_scale(after)
        after = ex.key_state(k, v, map_of(w, b), 4, state=state, slice_elements=slices)
        return ex.read_queries(q, after, map_of(w, b), slice_elements=slices), true_scale(after)

    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, before.kv, w, b)]
    assert torch.autograd.gradcheck(run, inputs, fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_a_map_changed_before_the_backward_raises(causal):
    """The module's W and b are inputs of the recomputing backward (saved, as any saved
    tensor): changed in place between forward and backward, the backward raises rather than
    recomputing other exponents."""
    module = effattn.build("hedgehog", head_dim=21, heads=3, num_features=5, seed=0).double()
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=3, n=40, d=21, dv=7))
    out = module(q, k, v, causal=causal)
    with torch.no_grad():
        module.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
