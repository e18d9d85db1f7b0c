"""effattn.nn.MultiheadAttention as a drop-in for torch.nn.MultiheadAttention, and swap().

With the exact method the layer must equal torch's module: same signature, defaults, weights and
state_dict, same outputs and weights (float64, and float32 to 1e-6), alone and inside torch's
Transformer layers in train and eval mode (where torch would take its fused inference path).
"""

import copy
import inspect

import pytest
import torch
from torch import nn

import effattn
from effattn.nn import MultiheadAttention, swap

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def _layout(x, batch_first):
    """x (B, L, E) in the module's layout."""
    return x if batch_first else x.transpose(0, 1)


def test_signature_and_defaults_are_torchs():
    ours = inspect.signature(MultiheadAttention.__init__).parameters
    theirs = inspect.signature(nn.MultiheadAttention.__init__).parameters
    assert [(p.name, p.default) for p in list(ours.values())[:len(theirs)]] == [
        (p.name, p.default) for p in theirs.values()]
    assert all(p.kind == p.KEYWORD_ONLY for p in list(ours.values())[len(theirs):-1])


@pytest.mark.parametrize("kwargs", [
    {}, {"bias": False}, {"kdim": 10, "vdim": 6}, {"add_bias_kv": True, "add_zero_attn": True}])
def test_same_seed_same_weights_and_state_dicts_load_both_ways(kwargs):
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(21, 3, **kwargs)
    torch.manual_seed(3)
    mha = MultiheadAttention(21, 3, **kwargs)
    want, got = ref.state_dict(), mha.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert [n for n, _ in mha.named_parameters()] == [n for n, _ in ref.named_parameters()]
    fresh = MultiheadAttention(21, 3, **kwargs)
    fresh.load_state_dict(want)
    nn.MultiheadAttention(21, 3, **kwargs).load_state_dict(got)


def test_randomized_method_state_dict_adds_only_its_own_state():
    ref = nn.MultiheadAttention(16, 2)
    mha = MultiheadAttention(16, 2, method="performer", num_features=8, seed=0)
    missing, unexpected = mha.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("attn.") for k in missing)
    ref.load_state_dict({k: v for k, v in mha.state_dict().items()
                         if not k.startswith("attn.")})
    torch.testing.assert_close(ref.in_proj_weight, mha.in_proj_weight)


CASES = [
    {"batch_first": False},
    {"batch_first": True, "bias": False},
    {"batch_first": False, "kdim": 10, "vdim": 6},
    {"batch_first": True, "add_bias_kv": True},
    {"batch_first": False, "add_zero_attn": True, "add_bias_kv": True},
]


@pytest.mark.parametrize("kwargs", CASES, ids=str)
@pytest.mark.parametrize("dtype, tol", [(F64, 1e-10), (torch.float32, 1e-6)], ids=["f64", "f32"])
def test_softmax_equals_torch_module(kwargs, dtype, tol):
    """Self- and cross-attention; bool and float padding and causal masks, is_causal, weights
    per head or averaged, unbatched inputs: outputs, weights and input gradients."""
    ref = nn.MultiheadAttention(21, 3, dtype=dtype, **kwargs)
    mha = MultiheadAttention.from_torch(ref)
    bf = kwargs["batch_first"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 21, generator=g, dtype=dtype)
    kv = torch.randn(2, 9, kwargs.get("kdim", 21), generator=g, dtype=dtype)
    vv = torch.randn(2, 9, kwargs.get("vdim", 21), generator=g, dtype=dtype)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, 7:] = True
    fpad = torch.zeros(2, 11, dtype=dtype).masked_fill(pad, float("-inf"))
    causal = nn.Transformer.generate_square_subsequent_mask(11, dtype=dtype)
    bool_causal = torch.ones(11, 11, dtype=torch.bool).triu(1)

    def check(args, **call):
        want, w_want = ref(*args, **call)
        got, w_got = mha(*args, **call)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        if w_want is None:
            assert w_got is None
        else:
            torch.testing.assert_close(w_got, w_want, rtol=tol, atol=tol)
        leaf = args[0]
        if leaf.requires_grad:
            g_want, = torch.autograd.grad(want.sum(), leaf)
            g_got, = torch.autograd.grad(got.sum(), leaf)
            torch.testing.assert_close(g_got, g_want, rtol=tol, atol=tol)

    if kwargs.get("kdim") is None:
        q = _layout(x, bf).requires_grad_()
        check((q, q, q))
        check((q, q, q), key_padding_mask=pad, need_weights=False)
        check((q, q, q), key_padding_mask=fpad, average_attn_weights=False)
        check((q, q, q), attn_mask=causal, key_padding_mask=fpad)
        check((q, q, q), attn_mask=bool_causal, key_padding_mask=pad)
        check((q, q, q), attn_mask=causal, is_causal=True)
        if not (kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn")):
            # torch then trusts the hint over the mask and hides the appended keys (SDPA's
            # is_causal with M = N + 1); with need_weights it sees them, as the mask says.
            check((q, q, q), attn_mask=causal, is_causal=True, need_weights=False)
        check((q, q, q), attn_mask=causal.expand(6, 11, 11), key_padding_mask=fpad)
        check((x[0], x[0], x[0]), key_padding_mask=pad[0], attn_mask=bool_causal)  # unbatched
    k = _layout(kv, bf)
    check((_layout(x, bf).requires_grad_(), k, _layout(vv, bf)), key_padding_mask=pad[:, :9])


def test_softmax_attention_dropout_is_torchs():
    ref = nn.MultiheadAttention(16, 2, dropout=0.3, batch_first=True, dtype=F64)
    mha = MultiheadAttention.from_torch(ref)
    x = torch.randn(2, 7, 16, dtype=F64)
    torch.manual_seed(1)
    want, w_want = ref(x, x, x)
    torch.manual_seed(1)
    got, w_got = mha(x, x, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w_got, w_want)
    assert not torch.allclose(mha(x, x, x)[0], got)  # fresh weights dropped on each call
    ref.eval(), mha.eval()
    torch.testing.assert_close(mha(x, x, x, need_weights=False)[0],
                               ref(x, x, x, need_weights=False)[0])


def test_other_methods_refuse_what_needs_the_weights():
    with pytest.raises(ValueError, match="dropout=0.1"):
        MultiheadAttention(16, 2, 0.1, method="performer")
    for extra in ({"add_bias_kv": True}, {"add_zero_attn": True}):
        with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn"):
            MultiheadAttention(16, 2, method="linear", **extra)
    mha = MultiheadAttention(16, 2, method="linear")
    x = torch.randn(5, 2, 16)
    out, weights = mha(x, x, x)
    assert weights is None and out.shape == x.shape
    with pytest.raises(ValueError, match="dropout"):
        MultiheadAttention.from_torch(nn.MultiheadAttention(16, 2, dropout=0.1), "linear")
    converted = MultiheadAttention.from_torch(nn.MultiheadAttention(16, 2, dropout=0.1),
                                              "linear", dropout=0.0)
    assert converted.dropout == 0.0


def test_masks_other_than_causal_and_padding_are_refused():
    mha = MultiheadAttention(16, 2, batch_first=True, method="performer", num_features=8)
    x = torch.randn(2, 6, 16)
    window = torch.ones(6, 6, dtype=torch.bool).triu(2)
    with pytest.raises(ValueError, match="sub-quadratic methods never form"):
        mha(x, x, x, attn_mask=window)
    with pytest.raises(ValueError, match="attn_mask may only hold 0"):
        mha(x, x, x, attn_mask=torch.full((6, 6), 0.5))
    with pytest.raises(ValueError, match="key_padding_mask may only hold 0"):
        mha(x, x, x, key_padding_mask=torch.full((2, 6), -1e9))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, M\)"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="nested"):
        mha(torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(2, 16)]))


# ---------------------------------------------------------------- inside torch's Transformer
def _transformer(batch_first, dropout=0.0):
    torch.manual_seed(0)
    return nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=32,
                          dropout=dropout, batch_first=batch_first, dtype=F64)


def _transformer_inputs(batch_first):
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randn(3, 9, 16, generator=g, dtype=F64), torch.randn(3, 6, 16, generator=g,
                                                                           dtype=F64)
    src_pad = torch.zeros(3, 9, dtype=torch.bool)
    src_pad[1, 6:] = True
    tgt_pad = torch.zeros(3, 6, dtype=torch.bool)
    tgt_pad[2, 4:] = True
    return (_layout(src, batch_first), _layout(tgt, batch_first)), {
        "tgt_mask": nn.Transformer.generate_square_subsequent_mask(6, dtype=F64),
        "src_key_padding_mask": src_pad, "tgt_key_padding_mask": tgt_pad,
        "memory_key_padding_mask": src_pad}


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_swap_softmax_keeps_nn_transformer_outputs(batch_first, train):
    """Eval mode runs under no_grad, where torch's encoder takes its fused and nested-tensor
    path (batch_first=True, even heads): the swapped model must give the same result."""
    model = _transformer(batch_first).train(train)
    swapped = swap(copy.deepcopy(model), effattn.registry.DEFAULT_METHOD)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in swapped.modules())
    assert sum(isinstance(m, MultiheadAttention) for m in swapped.modules()) == 4
    args, masks = _transformer_inputs(batch_first)
    with torch.set_grad_enabled(train):
        torch.testing.assert_close(swapped(*args, **masks), model(*args, **masks))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_encoder_and_decoder_layers_with_our_attention_equal_torchs(train):
    enc = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True, dtype=F64).train(train)
    dec = nn.TransformerDecoderLayer(16, 2, 32, 0.0, batch_first=True, dtype=F64).train(train)
    ours_enc, ours_dec = copy.deepcopy(enc), copy.deepcopy(dec)
    ours_enc.self_attn = MultiheadAttention.from_torch(enc.self_attn)
    ours_dec.self_attn = MultiheadAttention.from_torch(dec.self_attn)
    ours_dec.multihead_attn = MultiheadAttention.from_torch(dec.multihead_attn)
    (src, tgt), masks = _transformer_inputs(True)
    causal = masks["tgt_mask"]
    with torch.set_grad_enabled(train):
        for kwargs in ({"src_key_padding_mask": masks["src_key_padding_mask"]},
                       {"src_mask": nn.Transformer.generate_square_subsequent_mask(9, dtype=F64),
                        "is_causal": True}):
            torch.testing.assert_close(ours_enc(src, **kwargs), enc(src, **kwargs))
        kwargs = {"tgt_mask": causal, "tgt_is_causal": True,
                  "memory_key_padding_mask": masks["memory_key_padding_mask"]}
        torch.testing.assert_close(ours_dec(tgt, src, **kwargs), dec(tgt, src, **kwargs))


def test_torchs_fused_inference_path_never_replaces_another_method():
    layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True, dtype=F64)
    layer.self_attn = MultiheadAttention.from_torch(layer.self_attn, "performer",
                                                    num_features=8, seed=0)
    layer.eval()
    src = torch.randn(2, 9, 16, dtype=F64)
    with torch.no_grad():
        fused_candidate = layer(src)
    torch.testing.assert_close(fused_candidate, layer(src))
    encoder = nn.TransformerEncoder(layer, 2)
    assert not encoder.use_nested_tensor


def test_swap_other_methods_train_and_refuse_what_they_cannot_do():
    model = _transformer(False, dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        swap(copy.deepcopy(model), "performer")
    swap(model, "performer", dropout=0.0, num_features=8, seed=0)
    seeds = {m.attn.seed for m in model.modules() if isinstance(m, MultiheadAttention)}
    assert len(seeds) == 4
    args, masks = _transformer_inputs(False)
    out = model(*args, **masks)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for m in model.modules():
        if isinstance(m, MultiheadAttention):
            assert m.in_proj_weight.grad is not None and m.in_proj_weight.grad.abs().sum() > 0
    non_causal = swap(_transformer(False), "nystrom", num_landmarks=3)
    with pytest.raises(ValueError, match="nystrom cannot do causal attention") as err:
        non_causal(*args, **masks)
    assert effattn.spec("nystrom").refusals["causal"] in str(err.value)
    assert isinstance(swap(nn.MultiheadAttention(16, 2), "linear"), MultiheadAttention)
