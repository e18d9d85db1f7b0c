"""The per-feature core's triton strategy (effattn.kernelized.fused_exponents), its kernels run on
the CPU by Triton's interpreter: against the log-space float64 reference (outputs, normalisers
and the gradients of q, k, v, W and b) on awkward shapes, with padding, several slices and
backward spans, several feature blocks (atomic and deterministic), every chunk's products term
by term; lag and the normaliser; an entering state; growth of the running max by thousands
inside a chunk, exact (where the GPU strategy clamps); fp32 against the GPU strategy; bf16 read
as it is; hedgehog training and decoding; what it hands elsewhere; what a training call holds
against the GPU strategy's."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from conftest import count_calls, qkv  # noqa: E402
from test_exponents import key_mask, map_of, weights  # noqa: E402

import effattn  # noqa: E402
from effattn import naive, strategy  # noqa: E402
from effattn.kernelized import exponents as ex  # noqa: E402
from effattn.kernelized import exponents_gpu, fused, fused_exponents  # noqa: E402
from effattn.kernelized import fused_exponents_kernels as kernels  # noqa: E402
from effattn.kernelized.core import RecurrentState  # noqa: E402
from effattn.kernelized.features import AffineExponents  # noqa: E402
from effattn.tools.bench.accounting import live_peak_bytes  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_strategy():
    if not fused.runs(torch.zeros(1)):
        pytest.skip("CPU case: Triton's interpreter is off on a machine with a GPU")
    with strategy.force(kernelized="triton"):
        yield


@pytest.fixture
def launches(monkeypatch):
    """Counts of the kernels' forward and backward launches and of the GPU strategy's calls."""
    return count_calls(monkeypatch, {"forward": (kernels, "forward"),
                                     "backward": (kernels, "backward"),
                                     "gpu": (exponents_gpu, "causal")})


@pytest.fixture
def term_by_term(monkeypatch):
    """Every chunk's in-chunk products formed term by term (a growth limit below any exponent),
    the path a chunk takes when a feature's running max grows by more than GROWTH in it."""
    monkeypatch.setattr(kernels, "GROWTH", dict.fromkeys(kernels.GROWTH, -1e30))


def grads(out, inputs, probe):
    return torch.autograd.grad((out * probe).sum(), inputs, allow_unused=True)


def _equal_reference(q, k, v, w, b, mask, slice_elements, **kw):
    out = ex.attention(q, k, v, AffineExponents(w, b), 2 * w.shape[-1], is_causal=True,
                       key_padding_mask=mask, chunk_size=16, slice_elements=slice_elements)
    ref = naive.exponent_attention(map_of(w, b)(q), map_of(w, b)(k), v, causal=True,
                                   key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    probe = torch.randn_like(out)
    for a, c in zip(grads(out, (q, k, v, w, b), probe), grads(ref, (q, k, v, w, b), probe),
                    strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("products", ["gemm", "term-by-term"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("slice_elements", [1 << 20, 200], ids=["one-slice", "slices"])
def test_float64_outputs_and_gradients_equal_the_reference(products, padded, slice_elements,
                                                           launches, request):
    """N = 63, D = 21, 10 features, chunks of 16: in one slice, and in slices of 32 tokens with
    backward spans of 16 (the state's gradient crossing them); the chunks' products as GEMMs
    and term by term."""
    if products == "term-by-term":
        request.getfixturevalue("term_by_term")
    q, k, v = (t.requires_grad_() for t in qkv(b=3, h=3, n=63, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights())
    _equal_reference(q, k, v, w, b, key_mask(3, 63) if padded else None, slice_elements)
    assert launches["gpu"] == 0
    assert (launches["forward"], launches["backward"]) == {1 << 20: (1, 1),
                                                           200: (2, 4)}[slice_elements]


@pytest.mark.parametrize("deterministic", [False, True])
def test_feature_blocks_combine_their_sums(deterministic):
    """40 features: two blocks of 32 in float64, whose shifts combine by an atomic max (or one
    row each, reduced after) and whose sums add atomically (or one buffer each)."""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=3, n=40, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights(f=20))
    assert fused._kernels().meta(torch.float64, 16, 40, 7, 21, True)["BK"] == 32
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        _equal_reference(q, k, v, w, b, key_mask(2, 40), 1 << 20)
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("lag", [0, 5, 63])
def test_lag_and_normaliser_equal_the_reference(lag, launches):
    """The window hybrid's linear part through hedgehog's core configuration: query i sees
    keys j <= i - lag; padding, slices of 16 tokens; outputs, normalisers and gradients."""
    module = effattn.build("hedgehog", head_dim=21, heads=3, num_features=5, seed=0,
                           chunk_size=16).double()
    module.slice_elements = 10
    q, k, v = (t.requires_grad_() for t in qkv(b=3, h=3, n=63, d=21, dv=7))
    mask = key_mask(3, 63)
    out, _, norm = module.core().causal_normalised(q, k, v, key_padding_mask=mask, lag=lag)
    logs = torch.logsumexp(module.exponents(q)[..., :, None, :]
                           + module.exponents(k)[..., None, :, :], -1)
    i = torch.arange(63)
    seen = (i[None, :] <= i[:, None] - lag)[None, None] & ~mask[:, None, None, :]
    logs = logs.masked_fill(~seen, float("-inf"))
    ref = torch.softmax(logs, -1).nan_to_num(0.0) @ v
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norm.log_abs, torch.logsumexp(logs, -1))
    torch.testing.assert_close(norm.sign, (logs.amax(-1) > float("-inf")).double())
    if lag >= 63:  # no query sees a key: nothing to launch
        assert (out == 0).all()
        return
    assert launches["forward"] > 0 and launches["gpu"] == 0
    params = (q, k, v, *module.parameters())
    probe, weight = torch.randn_like(out), torch.randn_like(norm.log_abs)
    found = norm.sign > 0
    loss = (out * probe).sum() + (norm.log_abs.where(found, 0.0) * weight).sum()
    ref_loss = (ref * probe).sum() + (torch.logsumexp(logs, -1).where(found, 0.0) * weight).sum()
    for a, c in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref_loss, params),
                    strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)


def test_an_incoming_state_gives_the_whole_sequence():
    """A prefix's state (split mid-chunk) handed to the rest: outputs and the gradients through
    the state equal the reference over the whole sequence; the final state equals the one-pass
    state (its per-feature scales exactly)."""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=3, n=63, d=21, dv=7))
    w, b = (t.requires_grad_() for t in weights(size=5.0))
    exponents = AffineExponents(w, b)
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


@pytest.mark.parametrize("dtype, at, jump", [
    (torch.float64, 40, 2000.0), (torch.float64, 32, 3000.0), (torch.float32, 40, 200.0),
], ids=["in-chunk-2000", "at-border-3000", "fp32-in-chunk-200"])
def test_growth_of_the_running_max_stays_exact(dtype, at, jump):
    """One projection reads only x's last coordinate, and the keys' last coordinate jumps by
    ``jump`` at key ``at``: inside a chunk (beyond the GPU strategy's GROWTH_LIMIT of 700,
    where its float64 products clamp: here term by term) or at a chunk border, the outputs
    equal the log-space reference, and in float64 so do the gradients."""
    q, k, v = qkv(b=2, h=2, n=64, d=21, dv=7)
    w, b = weights(h=2)
    w[:, :, 0] = 0.0
    w[:, -1, 0] = 1.0
    k, q = k.clone(), q.clone()
    k[:, :, at:, -1] += jump
    q[:, 0, :, -1] += jump / 2  # head 0: queries that weigh the jumping feature
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = ex.attention(q, k, v, AffineExponents(w.to(dtype), b.to(dtype)), 10, is_causal=True,
                       chunk_size=16, key_padding_mask=key_mask(2, 64))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive.exponent_attention(map_of(w, b)(q64), map_of(w, b)(k64), v64, causal=True,
                                   key_padding_mask=key_mask(2, 64))
    assert torch.isfinite(out).all()
    tol = 1e-10 if dtype == torch.float64 else 4e-7 * jump
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if dtype == torch.float64:
        probe = torch.randn_like(out)
        for a, c in zip(grads(out, (q, k, v), probe), grads(ref, (q64, k64, v64), probe),
                        strict=True):
            torch.testing.assert_close(a, c, rtol=1e-8, atol=1e-9)


def test_fp32_equals_the_gpu_strategy():
    """From an incoming state, with padding, the normaliser and slices of one chunk: fp32
    outputs, normalisers, the state after and the gradients (the incoming state's included)
    equal the GPU strategy's to rounding."""
    dtype = torch.float32
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(b=2, h=3, n=63, d=21, dv=7))
    w, b = weights(size=20.0)
    w, b = (t.to(dtype).requires_grad_() for t in (w, b))
    g = torch.Generator().manual_seed(1)
    kv = torch.rand(2, 3, 10, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    scale = (torch.randn(2, 3, 10, 1, generator=g, dtype=torch.float64) * 5).to(dtype)
    probe = torch.randn(2, 3, 63, 7, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(2, 3, 63, generator=g, dtype=torch.float64).to(dtype)
    end = torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64).to(dtype)

    def run():
        out, state, norm = ex.causal(q, k, v, AffineExponents(w, b), 10,
                                     RecurrentState(kv, scale, 4),
                                     key_padding_mask=key_mask(2, 63), chunk_size=16,
                                     slice_elements=10, normaliser=True)
        loss = (out * probe).sum() + (norm.log_abs * weight).sum() + (state.kv * end).sum()
        return out, state, norm, torch.autograd.grad(loss, (q, k, v, w, b, kv))

    got = run()
    with strategy.force(kernelized="gpu"):
        want = run()
    tol = 2e-5
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    # The running maxima of exponents that the kernels' GEMM and torch's round differently.
    torch.testing.assert_close(got[1].log_scale, want[1].log_scale, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1].kv, want[1].kv, rtol=tol, atol=tol)
    assert got[1].position == want[1].position == 67
    torch.testing.assert_close(got[2].log_abs, want[2].log_abs, rtol=tol, atol=tol)
    torch.testing.assert_close(got[2].sign, want[2].sign, rtol=0, atol=0)
    for a, c in zip(got[3], want[3], strict=True):
        torch.testing.assert_close(a / c.abs().max(), c / c.abs().max(), rtol=tol,
                                   atol=10 * tol)


def test_bf16_inputs_are_read_as_they_are(monkeypatch, launches):
    """Hedgehog with bf16 q, k, v: the module hands them to the kernels unpromoted (no fp32 copy
    of q, k or v is made), the output and the gradients come back in bf16 and equal the fp32
    run's to bf16's rounding."""
    module = effattn.build("hedgehog", head_dim=16, heads=2, seed=0, chunk_size=16)
    q, k, v = qkv(b=2, h=2, n=50, d=16, dtype=torch.float32, scale=0.5)
    seen = []
    original = fused_exponents._forward_slice

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(fused_exponents, "_forward_slice", spy)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = module(*inputs, causal=True)
        results[dtype] = (out, torch.autograd.grad(out.float().square().sum(), inputs))
    assert seen == [(torch.float32,) * 3, (torch.bfloat16,) * 3]
    (out, got), (ref, want) = results[torch.bfloat16], results[torch.float32]
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a.float() / c.abs().max(), c / c.abs().max(), rtol=0,
                                   atol=2e-2)
    assert launches["gpu"] == 0


def test_hedgehog_matches_its_reference_trains_and_decodes(launches):
    """Hedgehog's exp form through the kernels: float64 outputs and the gradients of its W and b
    against its reference; then in fp32 a few optimiser steps lower a regression loss, and
    decoding token by token and a prefill split mid-chunk give the causal forward's outputs."""
    module = effattn.build("hedgehog", head_dim=21, heads=3, seed=0, chunk_size=16).double()
    q, k, v = (t.requires_grad_() for t in qkv(n=63, d=21, dv=5, scale=0.5))
    mask = key_mask(2, 63)
    out = module(q, k, v, causal=True, key_padding_mask=mask)
    ref = module.spec.reference(module, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [q, k, v, *module.parameters()]
    probe = torch.randn_like(out)
    for a, c in zip(grads(out, params, probe), grads(ref, params, probe), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-7, atol=1e-7)
    assert launches["forward"] == 1 and launches["backward"] == 1 and launches["gpu"] == 0

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


@pytest.mark.parametrize("case", ["non-causal", "other-exponents", "compiled"])
def test_what_the_kernels_do_not_run_goes_elsewhere(case, launches):
    """Non-causal calls (the GPU strategy's key state and read-out), an exponents function that
    is not an AffineExponents (the GPU strategy's chunk-parallel form) and calls traced by
    torch.compile (fullgraph) launch no kernel and equal the reference."""
    q, k, v = qkv(b=2, h=3, n=40, d=21, dv=7)
    w, b = weights()
    exponents = map_of(w, b) if case == "other-exponents" else AffineExponents(w, b)

    def attend(q, k, v):
        return ex.attention(q, k, v, exponents, 10, is_causal=case != "non-causal",
                            chunk_size=16)

    if case == "compiled":
        torch._dynamo.reset()
        attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = attend(q, k, v)
    torch._dynamo.reset()
    ref = naive.exponent_attention(map_of(w, b)(q), map_of(w, b)(k), v,
                                   causal=case != "non-causal")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert launches["forward"] == 0
    assert launches["gpu"] == (0 if case == "non-causal" else 1)


def test_training_holds_less_than_the_gpu_strategy():
    """Accounted (bytes, not time): hedgehog at N = 1024, 128 features, fp32, B = 1, H = 2: a
    forward holds the outputs and a few scalars a token, not the slice's exponents, chunk
    states and float64 in-chunk factors, and training adds no recomputed graph of them."""
    module = effattn.build("hedgehog", head_dim=64, heads=2, seed=0)
    q, k, v = (t.float().requires_grad_() for t in qkv(b=1, h=2, n=1024, d=64))

    def forward():
        with torch.no_grad():
            module(q, k, v, causal=True)

    def train():
        module(q, k, v, causal=True).sum().backward()

    measured = {}
    for name in ("gpu", "triton"):
        with strategy.force(kernelized=name):
            measured[name] = (live_peak_bytes(forward), live_peak_bytes(train))
    (gpu_forward, gpu_train), (forward_bytes, train_bytes) = measured["gpu"], measured["triton"]
    assert forward_bytes < 0.3 * gpu_forward, measured
    assert train_bytes < 0.3 * gpu_train, measured
