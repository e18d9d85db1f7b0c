"""Checkpoints: a module's random state (features, hash rotations, random blocks, redraw counters,
generators) travels with its state_dict, so a checkpoint loaded into a fresh build continues
exactly as the module it was saved from would."""

import copy
import io
import pickle

import pytest
import torch
from conftest import qkv

import effattn
from effattn.nn import DecoderLM, EncoderClassifier

N, D = 63, 21
# Small sizes, and options that make every random part draw: redraws on every training call,
# several random blocks, hashes, subsets.
OPTIONS = {
    "bigbird": {"block_size": 8, "num_random_blocks": 2},
    "favor": {"num_features": 16, "redraw_interval": 1},
    "linformer": {"proj_len": 8},
    "local": {"window": 8},
    "longformer": {"window": 8},
    "nystrom": {"num_landmarks": 8, "conv_kernel": 3},
    "performer": {"num_features": 16, "redraw_interval": 1},
    "random": {"ratio": 0.3},
    "reformer": {"n_hashes": 2, "bucket_size": 8},
    "rfa": {"num_features": 16, "redraw_interval": 1, "learn_sigma": True},
    "sparse-fixed": {"stride": 8},
    "sparse-strided": {"stride": 8},
}


def _build(method, seed):
    return effattn.build(method, head_dim=D, heads=3, max_len=N, seed=seed,
                         **OPTIONS.get(method, {}))


def _train_step(attn):
    """Training-mode forward and backward; the output and the gradients of q, k, v."""
    q, k, v = (t.requires_grad_() for t in qkv(n=N, d=D))
    out = attn.train()(q, k, v)
    out.square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _assert_same_continuation(a, b):
    """a and b give identical eval outputs, then identical training steps (redraws included)."""
    q, k, v = qkv(n=N, d=D, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(b.eval()(q, k, v), a.eval()(q, k, v), rtol=0, atol=0)
    for _ in range(2):
        for x, y in zip(_train_step(b), _train_step(a), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("method", effattn.methods())
def test_loaded_state_continues_like_the_saved_module(method):
    a = _build(method, seed=0)
    _train_step(a)
    b = _build(method, seed=1)
    b.load_state_dict(a.state_dict())
    _assert_same_continuation(a, b)


@pytest.mark.parametrize("method", effattn.methods())
def test_deepcopy_and_pickle_keep_the_random_state(method):
    for clone in (copy.deepcopy, lambda module: pickle.loads(pickle.dumps(module))):
        a = _build(method, seed=None)
        _train_step(a)
        _assert_same_continuation(a, clone(a))


@pytest.mark.parametrize("method", effattn.methods())
def test_model_checkpoint_round_trip_through_torch_save(method):
    causal = effattn.spec(method).causal

    def model():
        # seed=None: each build draws its modules' seeds from the global RNG.
        if causal:
            return DecoderLM(12, 12, 2, 2, method, max_len=N, **OPTIONS.get(method, {}))
        return EncoderClassifier(12, 4, 12, 2, 2, method, max_len=N, **OPTIONS.get(method, {}))

    tokens = torch.randint(1, 12, (2, N), generator=torch.Generator().manual_seed(0))
    a = model().train()
    a(tokens).square().sum().backward()
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = model()
    b.load_state_dict(torch.load(buffer), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(b.eval()(tokens), a.eval()(tokens), rtol=0, atol=0)
    for _ in range(2):
        torch.testing.assert_close(b.train()(tokens), a.train()(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["bigbird", "performer"])
def test_state_dict_without_random_state_is_refused_when_strict(method):
    state = {k: v for k, v in _build(method, seed=0).state_dict().items()
             if not k.endswith("_extra_state")}
    b = _build(method, seed=1)
    with pytest.raises(RuntimeError, match="Missing key.*_extra_state"):
        b.load_state_dict(state)
    b.load_state_dict(state, strict=False)
    with pytest.raises(ValueError, match="extra state"):
        b.set_extra_state({"generator": None})


@pytest.mark.parametrize("method, options", [("linformer", {}), ("nystrom", {"conv_kernel": 3})])
def test_unseeded_parameters_follow_the_global_seed(method, options):
    torch.manual_seed(5)
    a = effattn.build(method, head_dim=8, heads=2, max_len=16, **options)
    torch.manual_seed(5)
    b = effattn.build(method, head_dim=8, heads=2, max_len=16, **options)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
