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
from test_exponents_gpu import (  # noqa: E402
    check_equals_strategy,
    check_hedgehog_trains_and_decodes,
    check_incoming_state,
    check_lag_and_normaliser,
)

import effattn  # noqa: E402
from effattn import naive, strategy  # noqa: E402
from effattn.kernelized import exponents as ex  # noqa: E402
from effattn.kernelized import exponents_gpu, fused, fused_exponents  # noqa: E402
from effattn.kernelized import fused_exponents_kernels as kernels  # noqa: E402
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
    """tests/test_exponents_gpu.py's check through the kernels (none launched where no query
    sees a key)."""
    check_lag_and_normaliser(lag)
    assert launches["gpu"] == 0 and (launches["forward"] > 0) == (lag < 63)


def test_an_incoming_state_gives_the_whole_sequence(launches):
    check_incoming_state(AffineExponents)
    assert launches["forward"] > 0 and launches["gpu"] == 0


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


def test_fp32_equals_the_gpu_strategy(launches):
    """From an incoming state, with padding, the normaliser and slices of one chunk: equal to
    the GPU strategy's to fp32's rounding (the state's running maxima to 1e-6: the kernels'
    GEMM and torch's round the exponents differently)."""
    check_equals_strategy("gpu", torch.float32, AffineExponents, scale_tol=1e-6)
    assert launches["forward"] > 0


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
    against its reference; then tests/test_exponents_gpu.py's training and decoding check."""
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
    assert launches == {"forward": 1, "backward": 1, "gpu": 0}
    check_hedgehog_trains_and_decodes()
    assert launches["gpu"] == 0


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
