"""Sliding windows, chunks, soft caps and sinks of Hugging Face models: tiny random
models of each family, no download.

effattn-softmax equals transformers' sdpa (eager where sdpa cannot express the feature) on a
left-padded batch, in forward and greedy generate, with the family's default config and with a
window (or chunk) shorter than the input; a window that hides nothing is no restriction for the
other methods; what a method cannot honour is refused at the first forward, naming the option.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import effattn  # noqa: E402
from effattn.integrations import transformers as hf  # noqa: E402

VOCAB, LENGTH, WINDOW = 100, 20, 6
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": None,
}
MIXED = {"layer_types": ["sliding_attention", "full_attention"]}
QWEN_WINDOW = {"use_sliding_window": True, "max_window_layers": 1}  # layer 1 windowed
# family: (config class, its own settings, the setting of a window of w, reference impl)
FAMILIES = {
    "mistral": ("MistralConfig", {}, lambda w: {"sliding_window": w}, "sdpa"),
    "qwen2": ("Qwen2Config", {}, lambda w: {**QWEN_WINDOW, "sliding_window": w}, "sdpa"),
    "gemma2": ("Gemma2Config", {"head_dim": 8}, lambda w: {"sliding_window": w}, "eager"),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, **MIXED}, lambda w: {"sliding_window": w},
               "sdpa"),
    "phi3": ("Phi3Config", {}, lambda w: {"sliding_window": w}, "sdpa"),
    "llama4": ("Llama4TextConfig", {
        "head_dim": 8, "intermediate_size_mlp": 64, "num_local_experts": 2,
        "no_rope_layers": [1, 1], "layer_types": ["chunked_attention", "full_attention"],
    }, lambda w: {"attention_chunk_size": w}, "sdpa"),
    "gpt_oss": ("GptOssConfig", {"head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1,
                                 **MIXED}, lambda w: {"sliding_window": w}, "eager"),
    "cohere2": ("Cohere2Config", MIXED, lambda w: {"sliding_window": w}, "sdpa"),
    "starcoder2": ("Starcoder2Config", {}, lambda w: {"sliding_window": w}, "sdpa"),
    "phimoe": ("PhimoeConfig", {"num_local_experts": 2}, lambda w: {"sliding_window": w}, "sdpa"),
    "qwen2_moe": ("Qwen2MoeConfig", {
        "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }, lambda w: {**QWEN_WINDOW, "sliding_window": w}, "sdpa"),
}
KERNELIZED = {"performer": {"num_features": 32}, "linear": {}, "rfa": {"num_features": 32}}


WINDOWED_REFERENCE = "effattn-test-windowed-reference"


def windowed_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=None, window_off=False, **kwargs):
    """Causal attention of the layer's effattn module by its dense reference (the method's
    spec.reference), one query at a time over the keys of its window (all earlier keys in a
    layer without one); no padding. For a model whose effattn modules were built."""
    attn = module.effattn
    groups = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    n, m = query.shape[2], key.shape[2]
    rows = []
    for i in range(n):
        end = m - n + i + 1
        start = 0 if sliding_window is None or window_off else max(0, end - sliding_window)
        rows.append(attn.spec.reference(attn, query[:, :, i:i + 1], key[:, :, start:end],
                                        value[:, :, start:end]))
    return torch.cat(rows, 2).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()
    transformers.AttentionInterface.register(WINDOWED_REFERENCE, windowed_reference)
    transformers.masking_utils.AttentionMaskInterface.register(
        WINDOWED_REFERENCE, transformers.masking_utils.sdpa_mask)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def config(family, window=None, **kw):
    """The family's tiny config; ``window``: a sliding window (Llama 4: chunk) of that size."""
    cls, own, windowed, _ = FAMILIES[family]
    extra = {} if window is None else windowed(window)
    return getattr(transformers, cls)(**{**COMMON, **own, **extra, **kw})


def model(family, impl, window=None, options=None, **kw):
    cfg = config(family, window, **kw)
    cfg.effattn_options = options or {}
    torch.manual_seed(0)
    name = impl if impl in ("sdpa", "eager") else hf.name(impl)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name).eval()


def batch(n=LENGTH, pad=5, seed=0):
    """Two rows, the second left-padded by ``pad``."""
    ids = torch.randint(2, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def logits(m, ids, mask=None, **kw):
    with torch.no_grad():
        return m(ids, attention_mask=mask, **kw).logits


def generate(m, ids, mask=None, new=12, **kw):
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


class Forwards:
    """Counts the model forwards that completed: a refusal at the first forward leaves 0."""

    def __init__(self, m):
        self.done = 0
        m.register_forward_hook(lambda *_: setattr(self, "done", self.done + 1))


@pytest.mark.parametrize("window", [None, WINDOW], ids=["default", "window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_matches_transformers(family, window):
    reference = FAMILIES[family][3]
    ours, theirs = model(family, "softmax", window), model(family, reference, window)
    ids, mask = batch()
    real = mask.bool()
    torch.testing.assert_close(logits(ours, ids, mask)[real], logits(theirs, ids, mask)[real],
                               atol=1e-4, rtol=1e-4)
    # 20 + 12 tokens: transformers' sliding-window cache drops the keys the window hides.
    seq, steps = generate(ours, ids, mask)
    seq_ref, steps_ref = generate(theirs, ids, mask)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(steps, steps_ref, atol=1e-4, rtol=1e-4)


def test_the_window_is_applied():
    ids, _ = batch(pad=0)
    windowed, full = logits(model("mistral", "softmax", WINDOW), ids), logits(
        model("mistral", "softmax", None, sliding_window=None), ids)
    assert (windowed - full).abs().max() > 1e-2
    torch.testing.assert_close(windowed, logits(model("mistral", "sdpa", WINDOW), ids),
                               atol=1e-5, rtol=1e-5)


def test_window_crossed_during_generation_with_the_sliding_window_cache():
    """Window 10, prompt 7: after 3 new tokens transformers' cache drops keys."""
    ids = batch(n=7, pad=0)[0]
    ours, theirs = model("mistral", "softmax", 10), model("mistral", "sdpa", 10)
    seq, steps = generate(ours, ids, new=16)
    seq_ref, steps_ref = generate(theirs, ids, new=16)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(steps, steps_ref, atol=1e-5, rtol=1e-5)
    steps_rec = generate(ours, ids, new=16, past_key_values=hf.RecurrentCache())[1]
    torch.testing.assert_close(steps_rec, steps_ref, atol=1e-5, rtol=1e-5)
    # RecurrentCache keeps softmax's keys of the window only: its size stops growing.
    sizes = []
    for new in (48, 96):
        cache = hf.RecurrentCache()
        generate(ours, ids, new=new, past_key_values=cache)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1]


def test_softcap_is_honoured():
    ours, theirs = (model("gemma2", impl, WINDOW, attn_logit_softcapping=2.0)
                    for impl in ("softmax", "eager"))
    uncapped = model("gemma2", "eager", WINDOW, attn_logit_softcapping=None)
    for m in (ours, theirs, uncapped):  # scores of a few units, where a cap of 2 bites
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.data.mul_(20)
            layer.self_attn.k_proj.weight.data.mul_(20)
    ids, mask = batch()
    real = mask.bool()
    ref = logits(theirs, ids, mask)[real]
    assert (logits(uncapped, ids, mask)[real] - ref).abs().max() > 1e-2
    torch.testing.assert_close(logits(ours, ids, mask)[real], ref, atol=1e-4, rtol=1e-4)
    assert ours.model.layers[0].self_attn.effattn.softcap == 2.0


def test_sinks_are_honoured():
    ours, theirs = model("gpt_oss", "softmax", WINDOW), model("gpt_oss", "eager", WINDOW)
    for m in (ours, theirs):
        for layer in m.model.layers:
            layer.self_attn.sinks.data = torch.tensor([3.0, -1.0, 0.5, 8.0])
    ids, mask = batch()
    real = mask.bool()
    ref = logits(theirs, ids, mask)[real]
    assert (logits(model("gpt_oss", "eager", WINDOW), ids, mask)[real] - ref).abs().max() > 1e-2
    torch.testing.assert_close(logits(ours, ids, mask)[real], ref, atol=1e-4, rtol=1e-4)
    seq, steps = generate(ours, ids, mask, past_key_values=hf.RecurrentCache())
    seq_ref, steps_ref = generate(theirs, ids, mask)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(steps, steps_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", KERNELIZED)
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
def test_a_window_longer_than_the_input_restricts_nothing(family, method):
    """Mistral's default window is 4096; Qwen2 and Gemma 3 windowed with their default."""
    kw = QWEN_WINDOW if family == "qwen2" else {}
    m = model(family, method, options=KERNELIZED[method], **kw)
    assert m.config.sliding_window >= 4096
    # The same weights and features without any window (Gemma 3's windowed layers have their
    # own rotary base: a window as long as the input instead).
    plain = {"mistral": {"sliding_window": None}, "qwen2": {},
             "gemma3": {"sliding_window": LENGTH}}[family]
    ids, mask = batch()
    torch.testing.assert_close(
        logits(m, ids, mask),
        logits(model(family, method, options=KERNELIZED[method], **plain), ids, mask),
        atol=0, rtol=0,
    )
    ids = ids[:1, :7]
    sizes = []
    for new in (8, 24):
        cache = hf.RecurrentCache()
        seq, steps = generate(m, ids, new=new, past_key_values=cache)
        torch.testing.assert_close(steps, logits(m, seq)[:, 6:-1], atol=1e-4, rtol=1e-4)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("method", ["softmax", *KERNELIZED])
@pytest.mark.parametrize(("family", "size"), [("phimoe", 64), ("qwen2_moe", 64), ("llama4", 64),
                                              ("llama4", 5)])
def test_recurrent_cache_decodes_windows_and_chunks(family, size, method):
    """A window or chunk of 64 restricts nothing on 7 + 16 tokens: the first decoding step's
    one-column mask is causal; chunks of 5 restart each row's state (left padding
    shifts the row's chunks)."""
    m = model(family, method, size, options=KERNELIZED.get(method))
    ids, mask = batch(n=7, pad=2)
    seq, steps = generate(m, ids, mask, new=16, past_key_values=hf.RecurrentCache())
    seq_ref, steps_ref = generate(m, ids, mask, new=16)  # transformers' cache: the forward form
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(steps, steps_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["softmax", "performer"])
def test_chunks_are_independent(method):
    """Every layer chunked by 6: the tokens of the second chunk, run alone at their positions,
    give the same logits as in the whole sequence."""
    m = model("llama4", method, WINDOW, options=KERNELIZED.get(method),
              layer_types=["chunked_attention", "chunked_attention"])
    ids, _ = batch(pad=0)
    whole = logits(m, ids)
    alone = logits(m, ids[:, 6:12], position_ids=torch.arange(6, 12)[None])
    torch.testing.assert_close(alone, whole[:, 6:12], atol=1e-5, rtol=1e-4)


def test_local_honours_its_own_window_only():
    ids, mask = batch()
    real = mask.bool()
    own = model("mistral", "local", WINDOW, options={"window": WINDOW})
    torch.testing.assert_close(logits(own, ids, mask)[real],
                               logits(model("mistral", "sdpa", WINDOW), ids, mask)[real],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"effattn-local cannot honour sliding_window=6: .*"
                                         r"build it with window=6"):
        logits(model("mistral", "local", WINDOW, options={"window": 4}), ids, mask)


@pytest.mark.parametrize("method", KERNELIZED)
def test_a_restricting_window_is_refused_at_the_first_forward(method):
    m = model("gemma3", method, WINDOW, options=KERNELIZED[method])
    forwards = Forwards(m)
    match = (rf"effattn-{method} cannot honour sliding_window=6: .* "
             r"set config.sliding_window = None")
    with pytest.raises(ValueError, match=match):
        generate(m, *batch())
    assert forwards.done == 0
    # Decoding with transformers' cache from a prompt the window does not restrict: each step's
    # single query attends to the keys of its window: the logits are those of the method's dense
    # reference with the window applied, over the generated sequence.
    ids = batch(n=4, pad=0)[0]
    seq, steps = generate(m, ids, new=12)
    # A cache that keeps every key (made without the config: no sliding layers): each step's
    # query gets all 4 + t keys and the window is applied to them.
    seq_all, steps_all = generate(m, ids, new=12, past_key_values=transformers.DynamicCache())
    assert torch.equal(seq_all, seq)
    m.set_attn_implementation(WINDOWED_REFERENCE)
    want = logits(m, seq[:, :-1])[:, 3:]
    torch.testing.assert_close(steps, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps_all, want, atol=1e-5, rtol=1e-5)
    # and a window is not all keys: the reference without it differs
    assert not torch.allclose(steps, logits(m, seq[:, :-1], window_off=True)[:, 3:], atol=1e-3)


def test_recurrent_cache_refuses_a_window_at_the_prompt_when_told_the_length():
    m = model("mistral", "performer", 10, options=KERNELIZED["performer"])
    ids = batch(n=7, pad=0)[0]
    forwards = Forwards(m)
    with pytest.raises(ValueError, match=r"sliding_window=10 with RecurrentCache \(max_length="
                                         r"23\): token 11 on"):
        generate(m, ids, new=16, past_key_values=hf.RecurrentCache(max_length=23))
    assert forwards.done == 0
    generate(m, ids, new=3, past_key_values=hf.RecurrentCache(max_length=10))
    # Not told, it can only refuse at the token where the window starts to hide keys.
    with pytest.raises(ValueError, match=r"RecurrentCache\(max_length=\) refuses this at the "
                                         "prompt"):
        generate(m, ids, new=16, past_key_values=hf.RecurrentCache())
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        hf.RecurrentCache(max_length=0)


@pytest.mark.parametrize("method", KERNELIZED)
def test_softcap_and_sinks_are_refused_at_the_first_forward(method):
    ids, mask = batch()
    for family, match in [("gemma2", r"logit soft-capping softcap=50\.0 \(config\.attn_logit_"
                                     r"softcapping\).*set config\.attn_logit_softcapping = None"),
                          ("gpt_oss", r"attention sinks s_aux=a tensor of shape \(4,\)")]:
        m = model(family, method, options=KERNELIZED[method])
        forwards = Forwards(m)
        with pytest.raises(ValueError, match=f"effattn-{method} cannot honour {match}"):
            generate(m, ids, mask)
        assert forwards.done == 0


def test_refusals_print_no_tensor():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                num_heads=4, decoder_start_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    m = transformers.T5Model(cfg).eval()
    m.set_attn_implementation("effattn-softmax")
    ids = batch(pad=0)[0]
    with pytest.raises(ValueError, match=r"position_bias=a tensor of shape \(1, 4, 20, 20\)") as e:
        m(input_ids=ids, decoder_input_ids=ids)
    assert "tensor(" not in str(e.value)


def test_options_conflicting_with_the_model_are_refused():
    m = model("gemma2", "softmax", options={"softcap": 30.0})
    with pytest.raises(ValueError, match="layer has softcap=50.0, the effattn options say "
                                         "softcap=30.0"):
        logits(m, batch()[0])
    assert "softcap" in effattn.spec("softmax").options


def test_position_aligned_patterns_are_refused_once_the_cache_drops_keys():
    m = model("mistral", "sparse-fixed", WINDOW, options={"stride": 4, "c": 2})
    ids = batch(n=4, pad=0)[0]
    generate(m, ids, new=2)  # 6 tokens: the cache has dropped none
    with pytest.raises(ValueError, match="cache dropped the keys before position 1"):
        generate(m, ids, new=8)
