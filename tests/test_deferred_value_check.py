"""The value check read by the engine, right before its kernel (``engine_reads_values``).

The banded methods and softmax have no per-call state, so their forward forms the NaN/inf flag
at the check and reads it (the host sync) only where the engine launches: the FlexAttention
strategy after its BlockMask lookup, the CPU engine before its plans, SDPA before its call.
The contract must not move: a bad input raises the same ``ValueError`` naming the argument, on
every path, before anything is returned, and even when the engine fails first. The order of the
read and the launch is checked with FlexAttention's compiled branch stubbed (it runs on a CPU).
"""

import pytest
import torch

import effattn
from effattn import base, strategy
from effattn.mechanisms import softmax
from effattn.sparse import blockwise, flex

B, H, N, D = 2, 2, 40, 8

READING = [
    ("local", {"window": 6}, False, {}),
    ("local", {"window": 6}, True, {}),
    ("longformer", {"window": 6}, False, {}),
    ("sparse-strided", {"stride": 5}, True, {}),
    ("sparse-fixed", {"stride": 5}, True, {}),
    ("softmax", {}, True, {"sliding_window": 7}),
    ("softmax", {}, False, {}),  # SDPA
    ("softmax", {"softcap": 5.0}, True, {}),
]
IDS = [f"{m}-{'causal' if c else 'full'}-{'-'.join(map(str, {**o, **call}.values()))}"
       for m, o, c, call in READING]


def _inputs(poison=None, value=float("nan")):
    g = torch.Generator().manual_seed(0)
    given = {name: torch.randn(B, H, N, D, generator=g) for name in "qkv"}
    if poison is not None:
        given[poison][1, 0, 3, 2] = value
    return given


@pytest.mark.parametrize("banded", ["cpu", "flex"])
@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize(("method", "options", "causal", "call"), READING, ids=IDS)
def test_a_bad_input_still_raises_naming_it(method, options, causal, call, arg, banded):
    module = effattn.build(method, head_dim=D, heads=H, seed=0, **options).eval()
    assert module.engine_reads_values
    given = _inputs(arg)
    with strategy.force(banded=banded), torch.no_grad():
        with pytest.raises(ValueError, match=f"^{arg} contains NaN or inf"):
            module(given["q"], given["k"], given["v"], causal=causal, **call)
        good = _inputs()
        out = module(good["q"], good["k"], good["v"], causal=causal, **call)
    assert torch.isfinite(out).all()
    assert base._deferred.get() is None


def test_a_bad_sink_still_raises_naming_it():
    module = effattn.build("softmax", head_dim=D, heads=H).eval()
    given = _inputs()
    sinks = torch.tensor([0.0, float("inf")])
    with pytest.raises(ValueError, match="^sinks contains NaN or inf"):
        module(given["q"], given["k"], given["v"], causal=True, sinks=sinks)


@pytest.fixture
def events(monkeypatch):
    """The order of the BlockMask lookup, the value check's read and the kernel's launch in a
    call through FlexAttention's compiled branch, its kernel a stub."""
    seen = []
    lookup, read = flex.block_mask, base._read_values

    def looked_up(*args, **kwargs):
        seen.append("mask")
        return lookup(*args, **kwargs)

    def reading(*args):
        seen.append("read")
        read(*args)

    def kernel(q, k, v, **kwargs):
        seen.append("launch")
        return torch.zeros_like(q), torch.zeros(q.shape[:3])

    monkeypatch.setattr(flex, "block_mask", looked_up)
    monkeypatch.setattr(base, "_read_values", reading)
    monkeypatch.setattr(flex, "compiled_on", lambda device: True)
    monkeypatch.setattr(flex, "_kernel", lambda: kernel)
    monkeypatch.setattr(flex, "COMPILE_SECONDS", {})
    return seen


@pytest.mark.parametrize(("method", "options", "causal", "call"),
                         [case for case in READING if case[0] != "softmax" or case[3]], ids=[
                             i for i, case in zip(IDS, READING, strict=True)
                             if case[0] != "softmax" or case[3]])
def test_flex_reads_the_check_after_its_preparation_right_before_the_launch(
        method, options, causal, call, events):
    module = effattn.build(method, head_dim=D, heads=H, seed=0, **options).eval()
    given = _inputs()
    with strategy.force(banded="flex"), torch.no_grad():
        module(given["q"], given["k"], given["v"], causal=causal, **call)
    assert events == ["mask", "read", "launch"]


def test_a_module_whose_engine_does_not_read_it_reads_it_first(events):
    """bigbird draws its random blocks per training call: a call that raises must not draw, so
    its check is read where it is formed, before anything else."""
    module = effattn.build("bigbird", head_dim=D, heads=H, seed=0, block_size=8).eval()
    assert not module.engine_reads_values
    given = _inputs()
    with strategy.force(banded="flex"), torch.no_grad():
        module(given["q"], given["k"], given["v"])
    assert events == ["read", "mask", "launch"]


def test_bad_input_raises_its_own_error_when_the_engine_fails_first(monkeypatch):
    """Anything failing between the check and the read (here the engine itself) gives way to
    the input's ValueError; with good inputs the engine's own error comes through."""
    def failing(*args, **kwargs):
        raise RuntimeError("the engine failed")

    monkeypatch.setattr(flex, "block_mask", failing)
    module = effattn.build("local", head_dim=D, heads=H, window=6).eval()
    with strategy.force(banded="flex"), torch.no_grad():
        bad = _inputs("k", float("inf"))
        with pytest.raises(ValueError, match="^k contains NaN or inf") as raised:
            module(bad["q"], bad["k"], bad["v"])
        assert isinstance(raised.value.__context__, RuntimeError)
        good = _inputs()
        with pytest.raises(RuntimeError, match="the engine failed"):
            module(good["q"], good["k"], good["v"])
    assert base._deferred.get() is None


def test_validate_and_the_functional_check_read_at_once():
    """Outside a forward call (wrappers call validate, then compute themselves) nothing waits
    for an engine: the check reads where it is formed."""
    module = effattn.build("local", head_dim=D, heads=H, window=6)
    bad = _inputs("v")
    with pytest.raises(ValueError, match="^v contains NaN or inf"):
        module.validate(bad["q"], bad["k"], bad["v"])
    with pytest.raises(ValueError, match="^v contains NaN or inf"):
        base.check_qkv(bad["q"], bad["k"], bad["v"])
    base.read_deferred_values()  # outside a call: nothing to read, no error


def test_an_engine_that_never_reads_is_read_at_the_end(monkeypatch):
    """A path that launches no kernel of its own still raises before returning: the call's
    scope reads what the engine left."""
    for engine in (blockwise, flex, softmax):
        monkeypatch.setattr(engine, "read_deferred_values", lambda: None)
    module = effattn.build("local", head_dim=D, heads=H, window=6).eval()
    bad = _inputs("q")
    with torch.no_grad(), pytest.raises(ValueError, match="^q contains NaN or inf"):
        module(bad["q"], bad["k"], bad["v"])
    assert base._deferred.get() is None
