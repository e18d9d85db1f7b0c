"""Cross-attention memories (formed once per source) and autoregressive generation."""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn.base import KeyValueMemory
from effattn.kernelized.base import KernelizedAttention
from effattn.kernelized.core import RecurrentState
from effattn.nn import DecoderLM, EncoderDecoder, generate, sample_next

pytestmark = pytest.mark.usefixtures("one_thread")


CROSS = [m for m in effattn.methods() if effattn.spec(m).cross]
DECODING = [m for m in effattn.methods() if effattn.spec(m).decoding]
# (method, options): every decoding-capable method, gated RFA too.
DECODERS = [(m, {}) for m in DECODING] + [("rfa", {"gated": True})]
# Decoding-capable methods that can also cross-attend: an EncoderDecoder on one mechanism.
ENC_DEC = [(m, o) for m, o in DECODERS if effattn.spec(m).cross]


def _build(method, **kw):
    return effattn.build(method, head_dim=21, heads=3, max_len=80, seed=0, **kw).double().eval()


@pytest.mark.parametrize("method", CROSS)
def test_memory_read_equals_forward(method):
    q, k, v = qkv(n=5, m=63, dv=17)
    mask = padding(2, 63) if effattn.spec(method).padding_mask else None
    attn = _build(method)
    if isinstance(attn, KernelizedAttention):
        attn.slice_elements = 200  # several slices of keys and of queries
    memory = attn.memory(k, v, key_padding_mask=mask)
    torch.testing.assert_close(attn.attend_memory(q, memory),
                               attn(q, k, v, key_padding_mask=mask))
    # Read again by other queries (a later decoding step): the memory is not consumed.
    torch.testing.assert_close(attn.attend_memory(q[:, :, 2:3], memory),
                               attn(q[:, :, 2:3], k, v, key_padding_mask=mask))


@pytest.mark.parametrize("method", [m for m in CROSS if m in DECODING])
def test_kernelized_memory_has_a_size_independent_of_the_source(method):
    attn = _build(method)
    sizes = set()
    for m in (7, 70):
        _, k, v = qkv(m=m, n=m)
        memory = attn.memory(k, v)
        if method == "softmax":
            assert isinstance(memory, KeyValueMemory) and memory.k.shape[2] == m
            continue
        assert isinstance(memory, RecurrentState)
        sizes.add(memory.nbytes())
    assert method == "softmax" or len(sizes) == 1


def test_memory_refusals_and_bad_memories():
    q, k, v = qkv(n=5, m=9)
    with pytest.raises(ValueError, match="local cannot do cross-attention"):
        _build("local", window=4).memory(k, v)
    with pytest.raises(ValueError, match="expected .B, H=3"):
        _build("softmax").memory(k[:, :2], v[:, :2])
    performer = _build("performer")
    with pytest.raises(ValueError, match="memory must be performer.memory"):
        performer.attend_memory(q, _build("softmax").memory(k, v))
    with pytest.raises(ValueError, match="memory must be performer.memory"):
        performer.attend_memory(q[:1], performer.memory(k, v))
    with pytest.raises(ValueError, match="memory must come from softmax.memory"):
        _build("softmax").attend_memory(q, performer.memory(k, v))
    with pytest.raises(ValueError, match="key_padding_mask"):
        performer.memory(k, v, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))


def _greedy_by_full_forward(model, prompt, steps, src=None):
    """Greedy decoding that reruns the whole model on the growing sequence at every step."""
    seq = prompt
    for _ in range(steps):
        logits = model(seq) if src is None else model(src, seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


@pytest.mark.parametrize("method, options", DECODERS, ids=str)
def test_greedy_generation_equals_decoding_with_the_full_forward(method, options):
    model = DecoderLM(23, 24, 2, 2, method, seed=3, max_len=64, **options).double().eval()
    prompt = torch.randint(0, 23, (3, 5), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, 14)
    assert out.shape == (3, 19) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, _greedy_by_full_forward(model, prompt, 14))


@pytest.mark.parametrize("method, options", ENC_DEC, ids=str)
def test_encoder_decoder_generation_equals_the_full_forward(method, options):
    model = EncoderDecoder(17, 13, 24, 2, 2, method, seed=2, max_len=64,
                           **options).double().eval()
    g = torch.Generator().manual_seed(4)
    src = torch.randint(1, 17, (2, 11), generator=g)
    src[1, 8:] = 0  # padding of the second source
    bos = torch.full((2, 1), 1)
    out = generate(model, bos, 9, src=src)
    assert torch.equal(out, _greedy_by_full_forward(model, bos, 9, src=src))
    memories = [layer.cross.memory for layer in model.start(src).layers]
    kernelized = method != "softmax"
    assert all(isinstance(m, RecurrentState) == kernelized for m in memories)


def test_decoding_state_does_not_grow_for_kernelized_methods():
    for method, options in DECODERS:
        model = DecoderLM(11, 16, 2, 2, method, seed=0, **options).eval()
        sizes = []
        with torch.no_grad():
            _, state = model.prefill(torch.ones(2, 3, dtype=torch.long))
            for t in range(40):
                _, state = model.step(torch.full((2,), t % 11), state)
                if t in (4, 39):
                    sizes.append(sum(layer.self_state.nbytes() for layer in state.layers))
        if method in ("performer", "favor", "rfa", "linear", "local"):
            assert sizes[0] == sizes[1], method
        elif method == "softmax":
            assert sizes[1] > sizes[0]


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = DecoderLM(19, 16, 2, 1, "performer", seed=0).eval()
    prompt = torch.randint(0, 19, (4, 3))

    def sample(seed, **kw):
        return generate(model, prompt, 12, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(5), sample(5))
    assert not torch.equal(sample(5), sample(6))
    assert torch.equal(sample(7, top_k=1), generate(model, prompt, 12))
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]]).repeat(200, 1)
    drawn = sample_next(logits, temperature=2.0, top_k=2,
                        generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {1, 2}


def test_eos_stops_each_sequence():
    model = DecoderLM(7, 16, 2, 1, "linear", seed=0).eval()
    prompt = torch.randint(0, 7, (5, 2))
    free = generate(model, prompt, 10)
    eos = int(free[0, 4])  # sequence 0 emits it at its third new token
    out = generate(model, prompt, 10, eos_id=eos)
    for row, ref in zip(out, free, strict=True):
        hits = (ref[2:] == eos).nonzero()
        if len(hits) == 0:
            assert torch.equal(row, ref)
        else:
            first = 2 + int(hits[0])
            assert torch.equal(row[: first + 1], ref[: first + 1])
            assert (row[first:] == eos).all()
    assert generate(model, prompt, 0).equal(prompt)


def test_generate_bad_arguments():
    lm = DecoderLM(7, 16, 2, 1).eval()
    enc_dec = EncoderDecoder(7, 7, 16, 2, 1).eval()
    prompt = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="src must be given exactly"):
        generate(enc_dec, prompt, 3)
    with pytest.raises(ValueError, match="src must be given exactly"):
        generate(lm, prompt, 3, src=prompt)
    with pytest.raises(ValueError, match="DecoderLM or EncoderDecoder"):
        generate(torch.nn.Linear(2, 2), prompt, 3)
    with pytest.raises(ValueError, match="prompt must be a .B, P."):
        generate(lm, torch.zeros(2, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(lm, prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(lm, prompt, 3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(lm, prompt, 3, top_k=5)
