"""effattn-<method> as Hugging Face attention implementations: tiny random models, no download."""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import effattn  # noqa: E402
from effattn.integrations import transformers as hf  # noqa: E402

VOCAB, LENGTH = 100, 13
# Small but non-trivial settings: windows shorter than the sequence, few random features.
OPTIONS = {
    "performer": {"num_features": 32},
    "favor": {"num_features": 32},
    "rfa": {"num_features": 32},
    "local": {"window": 4},
    "reformer": {"bucket_size": 4, "n_hashes": 2},
    "sparse-fixed": {"stride": 4, "c": 2},
    "sparse-strided": {"stride": 4},
}
CAUSAL = [m for m in effattn.methods() if effattn.spec(m).causal]
DECODING = [m for m in effattn.methods() if effattn.spec(m).decoding]
PADDING = ["softmax", "performer", "linear", "local"]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def llama(method="softmax", **kw):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, **kw,
    )
    return _model(transformers.AutoModelForCausalLM, cfg, method)


def gpt2(method="softmax"):
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=256,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, pad_token_id=0,
    )
    return _model(transformers.AutoModelForCausalLM, cfg, method)


def bert(method="softmax"):
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256,
        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, pad_token_id=0,
    )
    return _model(transformers.AutoModel, cfg, method)


MODELS = {"llama": llama, "gpt2": gpt2, "bert": bert}


def _model(auto, cfg, method):
    cfg.effattn_options = OPTIONS.get(method, {})
    torch.manual_seed(0)
    return auto.from_config(cfg, attn_implementation=hf.name(method)).eval()


def outputs(model, ids, **kw):
    with torch.no_grad():
        out = model(ids, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def tokens(b=2, n=LENGTH, seed=0):
    return torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def test_import_effattn_does_not_import_transformers():
    code = "import sys, effattn; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", MODELS)
def test_softmax_matches_sdpa(arch):
    model = MODELS[arch]()
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    ours = [outputs(model, ids), outputs(model, ids, attention_mask=mask)]
    model.set_attn_implementation("sdpa")
    theirs = [outputs(model, ids), outputs(model, ids, attention_mask=mask)]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not ours[0].isnan().any()


@pytest.mark.parametrize("method", PADDING)
@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_match_unpadded(arch, method, side):
    model = MODELS[arch](method)
    ids, pad = tokens(), 5
    short = ids[1:, pad:]
    mask = torch.ones_like(ids)
    padded = ids.clone()
    valid = slice(pad, None) if side == "left" else slice(0, LENGTH - pad)
    pads = slice(0, pad) if side == "left" else slice(LENGTH - pad, None)
    padded[1, valid] = short[0]
    padded[1, pads] = 0
    mask[1, pads] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    batch = outputs(model, padded, attention_mask=mask, position_ids=positions)
    alone = outputs(model, short)
    torch.testing.assert_close(batch[1, valid], alone[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", CAUSAL)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_no_future_leakage(arch, method):
    model = MODELS[arch](method)
    ids, t = tokens(), 6
    changed = ids.clone()
    changed[:, t + 1 :] = tokens(seed=1)[:, t + 1 :]
    a, b = outputs(model, ids), outputs(model, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_layers_get_their_own_reproducible_features():
    a, b = llama("performer"), llama("performer")
    ids = tokens()
    torch.testing.assert_close(outputs(a, ids), outputs(b, ids), atol=0, rtol=0)
    features = {k: v for k, v in a.state_dict().items() if k.endswith("effattn.projection")}
    assert len(features) == 2 and all(v.shape[-2] == 32 for v in features.values())
    first, second = features.values()
    assert not torch.equal(first, second)
    assert torch.equal(features[next(iter(features))], b.state_dict()[next(iter(features))])


def test_register_with_options():
    assert hf.register("performer", num_features=8) == ["effattn-performer"]
    try:
        model = llama("local")
        model.config.effattn_options = {}
        model.set_attn_implementation("effattn-performer")
        outputs(model, tokens())
        assert model.model.layers[0].self_attn.effattn.projection.shape[-2] == 8
        model.config.effattn_options = {"num_features": 16}
        outputs(model, tokens())
        assert model.model.layers[0].self_attn.effattn.projection.shape[-2] == 16
    finally:
        hf.register("performer")


def test_unknown_method_and_option():
    with pytest.raises(KeyError, match="performer"):
        hf.register("nope")
    with pytest.raises(TypeError, match="num_features"):
        hf.register("linear", num_features=8)
    with pytest.raises(ValueError, match="scale"):
        hf.register("softmax", scale=0.5)


def test_method_that_cannot_do_causal_is_refused():
    with pytest.raises(ValueError, match="nystrom cannot do causal"):
        outputs(llama("nystrom"), tokens())


def test_packed_sequences_are_refused():
    """position_ids restarting without an attention mask: transformers masks each sequence."""
    model = llama()
    positions = torch.cat([torch.arange(7), torch.arange(LENGTH - 7)])[None].expand(2, -1)
    with pytest.raises(ValueError, match="packed sequences"):
        outputs(model, tokens(), position_ids=positions, use_cache=False)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_custom_4d_masks(kind):
    model = llama()
    ids = tokens()
    i = torch.arange(LENGTH)
    causal = (i[None, :] <= i[:, None]).expand(2, 1, LENGTH, LENGTH).clone()
    causal[1, :, :, :3] = False  # left padding of row 1, as a 4-D mask
    window = causal & (i[None, :] > i[:, None] - 4)
    chunks = causal & (i[None, :] // 4 == i[:, None] // 4)
    if kind == "float":
        causal, window, chunks = (
            torch.zeros(m.shape).masked_fill(~m, float("-inf")) for m in (causal, window, chunks)
        )
    ours = [outputs(model, ids, attention_mask=m) for m in (causal, window)]
    model.set_attn_implementation("sdpa")
    for a, m in zip(ours, (causal, window), strict=True):
        torch.testing.assert_close(a[:, 3:], outputs(model, ids, attention_mask=m)[:, 3:],
                                   atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[0], ours[1])
    model.set_attn_implementation("effattn-softmax")
    with pytest.raises(ValueError, match="neither causal"):
        outputs(model, ids, attention_mask=chunks)
    if kind == "float":
        with pytest.raises(ValueError, match="additive bias"):
            outputs(model, ids, attention_mask=causal + 0.5 * causal.isfinite())


def test_attention_dropout_is_refused():
    model = gpt2()
    model.config.attn_pdrop = 0.1
    model = _model(transformers.AutoModelForCausalLM, model.config, "softmax").train()
    with pytest.raises(ValueError, match="dropout"):
        model(tokens())


def generate(model, ids, new, **kw):
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            output_logits=True, return_dict_in_generate=True, **kw,
        )


@pytest.mark.parametrize(
    ("arch", "method"), [("llama", m) for m in DECODING] + [("gpt2", "performer")]
)
def test_generate_with_recurrent_cache_matches_full_forward(arch, method):
    model = MODELS[arch](method)
    ids = tokens(n=5)
    cache = hf.RecurrentCache()
    out = generate(model, ids, 16, past_key_values=cache)
    steps = torch.stack(out.logits, 1)
    full = outputs(model, out.sequences)
    torch.testing.assert_close(steps, full[:, 4:-1], atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1


@pytest.mark.parametrize("method", ["performer", "local"])
def test_recurrent_cache_does_not_grow(method):
    model, ids = llama(method), tokens(n=5)
    sizes = []
    for new in (16, 64):
        cache = hf.RecurrentCache()
        generate(model, ids, new, past_key_values=cache)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


def test_generate_left_padded_with_recurrent_cache():
    model = llama("performer")
    ids = tokens(n=7)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    batch = generate(model, ids, 8, attention_mask=mask, past_key_values=hf.RecurrentCache())
    alone = generate(model, ids[1:, 3:], 8, past_key_values=hf.RecurrentCache())
    torch.testing.assert_close(batch.sequences[1, 7:], alone.sequences[0, 4:])
    torch.testing.assert_close(torch.stack(batch.logits, 1)[1], torch.stack(alone.logits, 1)[0],
                               atol=1e-4, rtol=1e-4)


def test_default_cache_also_decodes_effattn_methods():
    """Without RecurrentCache, HF's cache keeps every key: one query against all of them."""
    model, ids = llama("performer"), tokens(n=5)
    ours = generate(model, ids, 8, past_key_values=hf.RecurrentCache())
    default = generate(model, ids, 8)
    torch.testing.assert_close(ours.sequences, default.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(default.logits),
                               atol=1e-4, rtol=1e-4)


def test_recurrent_cache_refusals():
    ids = tokens(n=5)
    with pytest.raises(ValueError, match="cannot decode"):
        generate(llama("reformer"), ids, 2, past_key_values=hf.RecurrentCache())
    with pytest.raises(NotImplementedError, match="beam search"):
        generate(llama("linear"), ids, 2, past_key_values=hf.RecurrentCache(), num_beams=2)
    model = llama()
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="never reached an effattn"):
        generate(model, ids, 2, past_key_values=hf.RecurrentCache())
