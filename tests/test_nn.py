"""MultiheadAttention, blocks, models and positional encodings."""

import math

import pytest
import torch
from conftest import small_options

import effattn
from effattn.nn import (
    DecoderLM,
    EncoderClassifier,
    EncoderDecoder,
    MultiheadAttention,
    SinusoidalPositionalEncoding,
    sinusoidal,
)
from effattn.nn.attention import gate_bias_init

pytestmark = pytest.mark.usefixtures("one_thread")


DECODING = [m for m in effattn.methods() if effattn.spec(m).decoding]


def _has_gated_rfa():
    return "rfa" in effattn.methods() and "gated" in effattn.spec("rfa").options


def _variants():
    """Every registered method (and gated RFA) with options fit for a 24-token test."""
    out = [(m, {}) for m in effattn.methods()]
    if _has_gated_rfa():
        out.append(("rfa", {"gated": True}))
    return out


# ---------------------------------------------------------------- MultiheadAttention vs torch
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_softmax_mha_matches_torch_self_attention(batch_first, bias):
    ref = torch.nn.MultiheadAttention(24, 3, bias=bias, batch_first=batch_first,
                                      dtype=torch.float64)
    mha = MultiheadAttention.from_torch(ref).double()
    shape = (2, 11, 24) if batch_first else (11, 2, 24)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, 7:] = True
    want, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    got, weights = mha(x, key_padding_mask=pad, need_weights=False)
    assert weights is None
    torch.testing.assert_close(got, want)
    g_want, = torch.autograd.grad(want.sum(), x)
    g_got, = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(g_got, g_want)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(11, dtype=torch.float64)
    want, _ = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    torch.testing.assert_close(mha(x, is_causal=True)[0], want)


def test_softmax_mha_matches_torch_cross_attention_with_kdim_vdim():
    ref = torch.nn.MultiheadAttention(16, 4, kdim=10, vdim=6, batch_first=True,
                                      dtype=torch.float64)
    mha = MultiheadAttention.from_torch(ref).double()
    q = torch.randn(3, 5, 16, dtype=torch.float64)
    k = torch.randn(3, 9, 10, dtype=torch.float64)
    v = torch.randn(3, 9, 6, dtype=torch.float64)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[0, :2] = True
    want, _ = ref(q, k, v, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(mha(q, k, v, key_padding_mask=pad)[0], want)


def test_mha_copies_weights_into_other_methods():
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    for method in effattn.methods():
        try:
            mha = MultiheadAttention.from_torch(ref, method, max_len=16)
        except ValueError as err:
            assert "no projections" in str(err)
            continue
        torch.testing.assert_close(mha.in_proj_weight[:16], ref.in_proj_weight[:16])
        torch.testing.assert_close(mha.out_proj.bias, ref.out_proj.bias)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiheadAttention.from_torch(torch.nn.MultiheadAttention(16, 2, add_bias_kv=True),
                                      "performer")


def test_mha_bad_arguments():
    mha = MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="is_causal"):
        mha(x, attn_mask=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="embed_dim"):
        MultiheadAttention(0, 1)
    with pytest.raises(ValueError, match=r"query must be 3-D \(B, L, E\) with E=16"):
        mha(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="disagree"):
        mha(x, torch.randn(3, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match="one token"):
        mha.step(x)
    with pytest.raises(KeyError, match="valid names"):
        MultiheadAttention(16, 4, method="no-such-method")
    with pytest.raises(TypeError, match="unknown option"):
        MultiheadAttention(16, 4, method="softmax", bogus=1)


@pytest.mark.parametrize("method, options", _variants(), ids=lambda v: str(v))
def test_mha_runs_every_method(method, options):
    s = effattn.spec(method)
    mha = MultiheadAttention(16, 2, batch_first=True, method=method, max_len=24, seed=0,
                             **options)
    x = torch.randn(2, 24, 16)
    causal = bool(options.get("gated"))
    out, _ = mha(x, is_causal=causal)
    assert out.shape == x.shape and torch.isfinite(out).all()
    if not s.causal:
        with pytest.raises(ValueError, match=method):
            mha(x, is_causal=True)


@pytest.mark.parametrize("method", DECODING)
def test_mha_step_equals_causal_forward(method):
    variants = [{}]
    if method == "rfa" and _has_gated_rfa():
        variants.append({"gated": True})
    for options in variants:
        mha = MultiheadAttention(16, 2, batch_first=True, method=method, seed=0,
                                 **options).double().eval()
        x = torch.randn(2, 9, 16, dtype=torch.float64)
        full, _ = mha(x, is_causal=True)
        state, outs = None, []
        for t in range(9):
            o, state = mha.step(x[:, t:t + 1], state)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, 1), full)
        head, state = mha.prefill(x[:, :4])
        tail, state = mha.prefill(x[:, 4:], state)
        torch.testing.assert_close(torch.cat((head, tail), 1), full)


@pytest.mark.skipif(not _has_gated_rfa(), reason="gated RFA is not registered yet")
def test_gated_rfa_gate_is_a_per_head_sigmoid_of_the_input():
    mha = MultiheadAttention(16, 4, batch_first=True, method="rfa", seed=0,
                             gated=True).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    q, k, v = (mha._heads(x, i) for i in range(3))
    gate = torch.sigmoid(x @ mha.gate_proj.weight.T + mha.gate_proj.bias).transpose(1, 2)
    want = mha._merge(mha.attn(q, k, v, causal=True, gate=gate))
    torch.testing.assert_close(mha(x, is_causal=True)[0], want)
    with pytest.raises(ValueError, match="self-attention"):
        mha(x, torch.randn(2, 5, 16, dtype=torch.float64))


def test_gate_bias_init_spreads_timescales():
    g = torch.sigmoid(gate_bias_init(6))
    tau = 1 / (1 - g)
    torch.testing.assert_close(tau[[0, -1]], torch.tensor([2.0, 64.0]), rtol=1e-4, atol=0)
    assert bool((tau.diff() > 0).all())


@pytest.mark.skipif("fnet" not in effattn.methods(), reason="fnet is not registered yet")
def test_fnet_layer_has_no_projections():
    mha = MultiheadAttention(16, 4, batch_first=True, method="fnet")
    assert sum(p.numel() for p in mha.parameters()) == 0
    x = torch.randn(2, 8, 16)
    assert mha(x)[0].shape == x.shape
    with pytest.raises(ValueError, match="one sequence"):
        mha(x, torch.randn(2, 8, 16), torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match="fnet cannot do recurrent decoding") as err:
        mha.step(x[:, :1])
    assert effattn.spec("fnet").refusals["decoding"] in str(err.value)


# ---------------------------------------------------------------- positions
def test_sinusoidal_formula_and_offsets():
    pe = sinusoidal(torch.arange(50), 8, torch.float64)
    p, i = 37, 2
    assert pe[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 8)))
    assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 8)))
    torch.testing.assert_close(pe[0], torch.tensor([0.0, 1.0] * 4, dtype=torch.float64))
    enc = SinusoidalPositionalEncoding(8)
    x = torch.zeros(1, 50, 8)
    full = enc(x)
    torch.testing.assert_close(enc(x[:, :1], offset=37), full[:, 37:38])
    far = sinusoidal(torch.tensor([1_000_000]), 8)
    assert torch.isfinite(far).all() and far.abs().max() <= 1
    with pytest.raises(ValueError, match="even"):
        SinusoidalPositionalEncoding(7)


# ---------------------------------------------------------------- models
def test_classifier_ignores_padding_and_pools():
    for pool in ("mean", "cls"):
        torch.manual_seed(0)
        model = EncoderClassifier(12, 5, 16, 2, 2, pool=pool, max_len=20).double().eval()
        tokens = torch.randint(1, 12, (3, 9))
        tokens[1, 6:] = 0
        longer = torch.cat((tokens, torch.zeros(3, 4, dtype=torch.long)), 1)
        torch.testing.assert_close(model(longer), model(tokens))
        assert model.masks_padding
    with pytest.raises(ValueError, match="pool"):
        EncoderClassifier(12, 5, pool="max")
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        EncoderClassifier(12, 5)(torch.full((1, 3), 12))
    with pytest.raises(ValueError, match="int64"):
        EncoderClassifier(12, 5)(torch.zeros(1, 3))


def test_classifier_with_method_that_cannot_mask_padding_attends_it():
    no_mask = [m for m in effattn.methods() if not effattn.spec(m).padding_mask]
    if not no_mask:
        pytest.skip("every registered method takes a padding mask")
    model = EncoderClassifier(12, 5, 16, 2, 1, no_mask[0], max_len=16)
    assert not model.masks_padding
    tokens = torch.randint(1, 12, (2, 16))
    tokens[0, 10:] = 0
    assert torch.isfinite(model(tokens)).all()


@pytest.mark.parametrize("method", DECODING)
def test_decoder_lm_step_equals_forward(method):
    model = DecoderLM(20, 16, 2, 2, method, seed=1, max_len=32).double().eval()
    tokens = torch.randint(0, 20, (2, 10))
    full = model(tokens)
    state, outs = None, []
    for t in range(10):
        logits, state = model.step(tokens[:, t], state)
        outs.append(logits)
    torch.testing.assert_close(torch.stack(outs, 1), full)
    assert state.position == 10 and len(state.layers) == 2
    # A prompt prefilled in parallel, then decoded token by token.
    logits, state = model.prefill(tokens[:, :6])
    torch.testing.assert_close(logits, full[:, :6])
    for t in range(6, 10):
        logits, state = model.step(tokens[:, t], state)
        torch.testing.assert_close(logits, full[:, t])
    logits, state = model.prefill(tokens[:, :3], None)
    logits, state = model.prefill(tokens[:, 3:10], state)
    torch.testing.assert_close(logits, full[:, 3:10])


CAUSAL_ENTRIES = [(m, {}) for m in effattn.methods() if effattn.spec(m).causal] + [
    ("rfa", {"gated": True})]
# Small budgets, so that windows, buckets and chunks do not cover the whole sequence.
SMALL = {"window": 8, "bucket_size": 4, "chunk_size": 8, "stride": 4}


@pytest.mark.parametrize("method, options", CAUSAL_ENTRIES, ids=str)
def test_decoder_lm_has_no_future_leakage(method, options):
    small = small_options(method, SMALL)
    model = DecoderLM(20, 16, 2, 2, method, max_len=40, seed=0, **small, **options).double().eval()
    tokens = torch.randint(0, 20, (2, 40), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 27:] = (changed[:, 27:] + 1) % 20
    out, out_changed = model(tokens), model(changed)
    torch.testing.assert_close(out_changed[:, :27], out[:, :27], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(out_changed[:, 27:], out[:, 27:])


def test_models_refuse_with_the_spec_reason():
    non_causal = [m for m in effattn.methods() if not effattn.spec(m).causal]
    for method in non_causal:
        reason = effattn.spec(method).refusals["causal"]
        with pytest.raises(ValueError, match="DecoderLM") as err:
            DecoderLM(10, 16, 2, 1, method, max_len=16)
        assert reason in str(err.value)
    no_cross = [m for m in effattn.methods() if effattn.spec(m).causal
                and not effattn.spec(m).cross]
    for method in no_cross:
        with pytest.raises(ValueError, match="cross_method"):
            EncoderDecoder(10, 10, 16, 2, 1, method, max_len=16)
        EncoderDecoder(10, 10, 16, 2, 1, method, cross_method="softmax", max_len=16)
    with pytest.raises(ValueError, match="causal self-attention only"):
        EncoderClassifier(10, 2, method="rfa", gated=True)
    with pytest.raises(ValueError, match="one token"):
        DecoderLM(10, 16, 2, 1).step(torch.zeros(2, 2, dtype=torch.long))


def test_encoder_decoder_step_equals_forward_and_masks_source_padding():
    torch.manual_seed(0)
    model = EncoderDecoder(15, 11, 16, 2, 2, dec_layers=1, cross_method="softmax",
                           seed=0).double().eval()
    src = torch.randint(1, 15, (2, 7))
    src[1, 5:] = 0
    tgt = torch.randint(0, 11, (2, 6))
    full = model(src, tgt)
    state, outs = model.start(src), []
    for t in range(6):
        logits, state = model.step(tgt[:, t], state)
        outs.append(logits)
    torch.testing.assert_close(torch.stack(outs, 1), full)
    logits, state = model.prefill(tgt[:, :4], model.start(src))
    torch.testing.assert_close(logits, full[:, :4])
    logits, state = model.step(tgt[:, 4], state)
    torch.testing.assert_close(logits, full[:, 4])
    longer = torch.cat((src, torch.zeros(2, 3, dtype=torch.long)), 1)
    torch.testing.assert_close(model(longer, tgt), full)
    assert len(model.encoder) == 2 and len(model.decoder) == 1


@pytest.mark.skipif(not _has_gated_rfa(), reason="gated RFA is not registered yet")
def test_gated_models_gate_only_causal_self_attention():
    model = EncoderDecoder(10, 10, 16, 2, 1, "rfa", cross_method="softmax", gated=True,
                           max_len=16)
    assert model.encoder[0].self_attn.call_inputs == ()
    assert model.decoder[0].self_attn.call_inputs == ("gate",)
    assert model.decoder[0].cross_attn.call_inputs == ()
