"""Converting a Hugging Face decoder (a tiny random LlamaForCausalLM): linearize keeps every
weight, attention transfer, LoRA on q/k/v/o_proj, and generate() with RecurrentCache."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from effattn.convert import layer_errors, linearize, lora, merge_lora, transfer  # noqa: E402
from effattn.integrations.hf_cache import RecurrentCache  # noqa: E402
from effattn.kernelized.hybrid import WindowState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(dtype=torch.float32):
    cfg = LlamaConfig(vocab_size=40, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        # Random init leaves every score near 0 (uniform attention, which any method matches):
        # larger q and k spread the scores as a trained model's.
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    return model


def _tokens(n=21, batch=2, seed=1):
    return torch.randint(0, 40, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_linearize_to_softmax_leaves_the_logits_unchanged():
    model, x = _llama(torch.float64), _tokens()
    before = model(x).logits
    assert linearize(model, "softmax") == {}
    assert model.config._attn_implementation == "effattn-softmax"
    torch.testing.assert_close(model(x).logits, before, rtol=1e-10, atol=1e-10)


def test_linearize_keeps_every_weight_and_returns_the_new_parameters():
    model = _llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    new = linearize(model, "hedgehog", num_features=8, seed=3)
    assert new and all(".self_attn.effattn." in name for name in new)
    after = model.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    # besides the new parameters: the state of the generator that drew their initial values
    assert {k for k in set(after) - set(state) if not k.endswith("_extra_state")} == set(new)
    assert model.config.effattn_options == {"num_features": 8}
    assert model.config.effattn_seed == 3


def test_transfer_lowers_the_layer_error_and_trains_only_the_new_parameters():
    model, x = _llama(), _tokens(batch=4)
    new = linearize(model, "hedgehog", num_features=8)
    old = {k: v.clone() for k, v in model.named_parameters() if k not in new}
    before = layer_errors(model, x)
    batches = (_tokens(batch=4, seed=s) for s in range(100, 130))
    losses = transfer(model, batches, steps=30, parameters=new)
    after = layer_errors(model, x)
    assert len(before) == 2 and sum(after) < 0.85 * sum(before), (before, after)
    assert losses[-1] < losses[0]
    for key, value in old.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


def _generates_as_the_full_forward_in_a_fixed_state(model, prompt):
    """Greedy generate() of 6 and of 24 tokens with a RecurrentCache: its logits equal a full
    forward's over the generated sequence, and the cache holds the same bytes after both.
    Returns the caches."""
    sizes, caches = [], []
    for count in (6, 24):
        cache = RecurrentCache()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=count,
                             min_new_tokens=count, do_sample=False, past_key_values=cache,
                             output_logits=True, return_dict_in_generate=True)
        sizes.append(cache.nbytes())
        caches.append(cache)
        with torch.no_grad():
            full = model(out.sequences[:, :-1]).logits[:, prompt.shape[1] - 1:]
        torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)
    assert sizes[0] == sizes[1] > 0
    return caches


def test_generate_with_recurrent_cache_keeps_a_fixed_state_and_matches_a_full_forward():
    model, prompt = _llama(), _tokens(n=5, batch=1)
    linearize(model, "hedgehog", num_features=8, decoding=True)
    adapters = lora(model, rank=2)
    assert len(adapters) == 2 * 4 * 2
    with torch.no_grad():
        for p in adapters.values():
            p.normal_(0, 0.2)
    _generates_as_the_full_forward_in_a_fixed_state(model, prompt)
    x = _tokens()
    with torch.no_grad():
        adapted = model(x).logits
        assert merge_lora(model) == 2 * 4
        torch.testing.assert_close(model(x).logits, adapted, rtol=1e-5, atol=1e-5)


def test_the_window_hybrid_generates_with_a_ring_buffer_and_a_fixed_state():
    """linearize to hedgehog with window=4 and its factor: generate() keeps the ring of 4 keys
    and the state (the same bytes after 6 and 24 tokens) and matches a full forward."""
    model, prompt = _llama(), _tokens(n=5, batch=1)
    new = linearize(model, "hedgehog", num_features=8, window=4, window_factor=True,
                    decoding=True)
    assert sum(name.endswith("window_log_factor") for name in new) == 2
    for cache in _generates_as_the_full_forward_in_a_fixed_state(model, prompt):
        assert len(cache.layers) == 2
        for layer in cache.layers:
            state = layer.state
            assert isinstance(state, WindowState)
            # (B, H, W, D): a ring of 4 keys and values of each of the 4 heads (2 key-value
            # heads, repeated), after 5 + 6 or 5 + 24 tokens
            assert state.k.shape == state.v.shape == (1, 4, 4, 6)
            assert state.linear is not None and state.length == layer.seen


def test_linearize_errors_name_the_problem():
    with pytest.raises(KeyError, match="no_such_method"):
        linearize(_llama(), "no_such_method")
    with pytest.raises(ValueError, match="causal"):
        linearize(_llama(), "linformer")
    with pytest.raises(ValueError, match="cannot decode"):
        linearize(_llama(), "reformer", decoding=True)
    with pytest.raises(TypeError, match="no_such_option"):
        linearize(_llama(), "hedgehog", no_such_option=1)
