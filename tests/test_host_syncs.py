"""Host syncs on the kernelized GPU strategy's hot paths, counted on the CPU.

On CUDA every read of a device tensor's value by the host (``bool``, ``item``, ``tolist``,
``float``, ``int``, ``__index__``) waits for the device's queue of launches. The fixture wraps
those reads (it counts them, the calls go on as before) and names the function that made each;
the tests force the GPU strategy and pin the reads of each path per call: forward (causal,
non-causal), backward, the public ``step`` (decoding), ``prefill`` and a decoder's memory.

What may remain, and why (docs/gpu.md, "Host syncs"):

- ``_read_values``: the contract's NaN/inf check of q, k, v and the call inputs' bounds, one
  read for all of them (eager only);
- ``_raise_if_lost``: the core's lost-row check, one per forward, prefill or memory read, where
  the features are non-negative;
- ``cancels``: the non-causal window hybrid's choice between its two forms, one per forward,
  which also holds its lost-row flag;
- ``_maybe_redraw``: the redraw schedule of training calls reads the module's call counter,
  a CPU tensor on every device (not a device sync; see the test of it below).

Counts, not timings: the tests hold on a busy machine.
"""

import sys
from collections import Counter

import pytest
import torch

import effattn
from effattn import strategy

READS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__")
# Reads of the host-side call counter: not a sync on any device.
HOST_SIDE = {"_maybe_redraw"}
B, H, N, D = 2, 2, 20, 8

KERNELIZED = [
    ("performer", {}),
    ("performer", {"feature_map": "trig"}),
    ("favor", {}),
    ("rfa", {}),
    ("rfa", {"gated": True}),
    ("linear", {}),
    ("hedgehog", {}),
    ("hedgehog", {"feature_map": "softmax_dim"}),
    ("taylor", {}),
    ("performer", {"window": 5}),
    ("rfa", {"window": 5, "gated": True}),
    ("hedgehog", {"window": 5}),
    ("linear", {"window": 5, "window_factor": True}),
]


def _id(variant):
    name, opts = variant
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def build(name, opts):
    options = dict(opts)
    if "chunk_size" in effattn.spec(name).options:
        options.setdefault("chunk_size", 8)
    if name in ("performer", "favor", "rfa"):
        options.setdefault("num_features", 16)
    if name == "local":
        options.setdefault("window", 4)
    return effattn.build(name, head_dim=D, heads=H, seed=0, **options)


def inputs():
    """q, k, v (B, H, N, D) in fp32 and a gate (B, H, N) inside (0, 1)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    gate = 0.05 + 0.9 * torch.rand(B, H, N, generator=g)
    return q, k, v, gate


def call_inputs(module, gate, at=slice(None)):
    """The gate for modules that take one, cut at ``at`` along N."""
    return {"gate": gate[:, :, at]} if getattr(module, "gated", False) else {}


@pytest.fixture
def syncs(monkeypatch):
    """The host reads of tensor values made so far: a Counter by the name of the function that
    made each (``.clear()`` it between calls)."""
    seen = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            seen[sys._getframe(1).f_code.co_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.fixture(autouse=True)
def _gpu_strategy():
    with strategy.force(kernelized="gpu"):
        yield


def device_syncs(seen):
    """The counted reads less those of host-side tensors, by function."""
    return {site: n for site, n in seen.items() if site not in HOST_SIDE}


def assert_forward_syncs(seen, *, hybrid_non_causal=False):
    """One value check, at most one lost-row check (or, non-causal hybrid, its choice of form,
    which includes it), nothing else."""
    by_design = "cancels" if hybrid_non_causal else "_raise_if_lost"
    got = device_syncs(seen)
    assert got.get("_read_values") == 1, got
    assert got.get(by_design, 0) <= 1, got
    assert set(got) <= {"_read_values", by_design}, got
    seen.clear()


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_and_backward(variant, training, syncs):
    """Causal and non-causal forward: one sync besides the lost-row check (the value check);
    their backward: none."""
    module = build(*variant).train(training)
    q, k, v, gate = inputs()
    q.requires_grad_(True)
    syncs.clear()
    out = module(q, k, v, causal=True, **call_inputs(module, gate))
    assert_forward_syncs(syncs)
    out.sum().backward()
    assert device_syncs(syncs) == {}
    if getattr(module, "gated", False):
        return  # the gate is defined for causal attention only
    out = module(q, k, v)
    assert_forward_syncs(syncs, hybrid_non_causal=module.window is not None)
    out.sum().backward()
    assert device_syncs(syncs) == {}


def decoding_variants():
    plain = [(name, {}) for name in effattn.methods()
             if effattn.spec(name).decoding and (name, {}) not in KERNELIZED]
    return KERNELIZED + plain


@pytest.mark.parametrize("variant", decoding_variants(), ids=_id)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_every_public_step_takes_one_sync(variant, grad, syncs):
    """The public step of every decoding method: one sync per token, the value check (the
    kernelized state update is branch-free on this strategy)."""
    module = build(*variant).eval()
    q, k, v, gate = inputs()
    state = None
    with torch.set_grad_enabled(grad):
        for t in range(12):  # past the window of the hybrids and across chunks
            at = slice(t, t + 1)
            syncs.clear()
            _, state = module.step(q[:, :, at], k[:, :, at], v[:, :, at], state,
                                   **call_inputs(module, gate, at))
            assert device_syncs(syncs) == {"_read_values": 1}, (t, dict(syncs))


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
def test_prefill_then_step(variant, syncs):
    """Prefill: the value check and at most the lost-row check; the steps after it one."""
    module = build(*variant).eval()
    q, k, v, gate = inputs()
    syncs.clear()
    _, state = module.prefill(q[:, :, :9], k[:, :, :9], v[:, :, :9],
                              **call_inputs(module, gate, slice(0, 9)))
    assert_forward_syncs(syncs)
    _, state = module.prefill(q[:, :, 9:15], k[:, :, 9:15], v[:, :, 9:15], state,
                              **call_inputs(module, gate, slice(9, 15)))
    assert_forward_syncs(syncs)
    for t in range(15, N):
        at = slice(t, t + 1)
        module.step(q[:, :, at], k[:, :, at], v[:, :, at], state,
                    **call_inputs(module, gate, at))
        assert device_syncs(syncs) == {"_read_values": 1}
        syncs.clear()


@pytest.mark.parametrize("name", ["performer", "linear", "hedgehog", "taylor"])
def test_memory_and_its_reads(name, syncs):
    """A decoder's cross-attention memory: one value check to build it; each read at most the
    lost-row check."""
    module = build(name, {}).eval()
    q, k, v, _ = inputs()
    syncs.clear()
    memory = module.memory(k, v)
    assert set(device_syncs(syncs)) <= {"_read_values", "_raise_if_lost"}
    assert device_syncs(syncs)["_read_values"] == 1
    syncs.clear()
    for t in range(3):
        module.attend_memory(q[:, :, t:t + 1], memory)
        assert set(device_syncs(syncs)) <= {"_raise_if_lost"}
        assert sum(syncs.values()) <= 1
        syncs.clear()


def test_the_redraw_schedule_reads_a_host_tensor(syncs):
    """The one read left out of the counts: the training call counter, which ``.to(device)``
    leaves on the CPU, so reading it waits for no device."""
    moved = build("rfa", {}).to("meta")
    assert moved.projection.device.type == "meta"
    assert moved._calls.device.type == "cpu"
    module = build("rfa", {}).train()
    q, k, v, _ = inputs()
    syncs.clear()
    module(q, k, v, causal=True)
    assert syncs["_maybe_redraw"] == 1


# The errors the value check promises, each still raised and naming its argument.

def _poison(t, value, at=(1, 0, 3, 2)):
    t = t.clone()
    t[at] = value
    return t


@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("variant", [("performer", {}), ("rfa", {"gated": True}),
                                     ("linear", {"window": 5})], ids=_id)
def test_nan_or_inf_names_the_argument(arg, value, variant):
    module = build(*variant).eval()
    q, k, v, gate = inputs()
    given = dict(q=q, k=k, v=v)
    given[arg] = _poison(given[arg], value)
    match = f"^{arg} contains NaN or inf"
    with pytest.raises(ValueError, match=match):
        module(given["q"], given["k"], given["v"], causal=True, **call_inputs(module, gate))
    with pytest.raises(ValueError, match=match):
        module.prefill(given["q"], given["k"], given["v"], **call_inputs(module, gate))
    one = {name: t[:, :, 3:4] for name, t in given.items()}
    with pytest.raises(ValueError, match=match):
        module.step(one["q"], one["k"], one["v"], **call_inputs(module, gate, slice(3, 4)))
    if arg != "q" and module.window is None:
        with pytest.raises(ValueError, match=match):
            module.memory(given["k"], given["v"])


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), float("inf")])
def test_a_gate_out_of_range_names_the_gate(bad):
    module = build("rfa", {"gated": True}).eval()
    q, k, v, gate = inputs()
    gate = _poison(gate, bad, at=(1, 1, 4))
    with pytest.raises(ValueError, match=r"^gate values must lie in \[0, 1\]"):
        module(q, k, v, causal=True, gate=gate)
    with pytest.raises(ValueError, match=r"^gate values must lie in \[0, 1\]"):
        module.step(q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5], gate=gate[:, :, 4:5])
    # Both bad: the first in the order q, k, v, call inputs is named.
    with pytest.raises(ValueError, match="^v contains NaN"):
        module(q, k, _poison(v, float("nan")), causal=True, gate=gate)


def test_the_gate_bounds_are_closed():
    module = build("rfa", {"gated": True}).eval()
    q, k, v, gate = inputs()
    gate[0, 0, :2] = 0.0
    gate[1, 1, 5:] = 1.0
    assert torch.isfinite(module(q, k, v, causal=True, gate=gate)).all()


def test_an_overflowing_sum_of_finite_values_is_not_an_error(syncs):
    """The sums are read first; only when they are not finite is each tensor read, and finite
    values pass. Half precision is summed in fp32: its large finite inputs take one sync."""
    module = build("linear", {}).eval()
    q, k, v, _ = inputs()
    syncs.clear()
    module(q, k, torch.full_like(v, 3e38), causal=True)  # no ValueError
    assert syncs["_read_values"] > 1
    syncs.clear()
    half = tuple(t.half() for t in (q, k, torch.full_like(v, 6e4)))
    module(*half, causal=True)
    assert device_syncs(syncs).get("_read_values") == 1


def test_the_functional_form_checks_values_once(syncs):
    """``effattn.attention`` checks the layout before building, the module's forward the
    values: one value check, as a module's call."""
    q, k, v, _ = inputs()
    syncs.clear()
    effattn.attention(q, k, v, method="linear", causal=True, seed=0)
    assert device_syncs(syncs) == {"_read_values": 1, "_raise_if_lost": 1}
    with pytest.raises(ValueError, match="^k contains NaN or inf"):
        effattn.attention(q, _poison(k, float("nan")), v, method="linear")
