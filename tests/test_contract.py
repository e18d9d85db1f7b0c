"""The public contract (docs/methods.md, "The contract"), for every registered method."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import qkv, small_options

import effattn
from effattn import naive as R
from effattn.registry import CallInput
from effattn.sparse.parallel import Halo


def test_methods_sorted_and_specs_consistent():
    names = effattn.methods()
    assert names == sorted(names) and "softmax" in names
    for name in names:
        s = effattn.spec(name)
        assert s.name == name
        for cap in ("causal", "padding_mask", "cross", "decoding"):
            assert isinstance(getattr(s, cap), bool)
            if not getattr(s, cap):
                assert s.refusals[cap]
        with pytest.raises(TypeError):
            s.options["new"] = 1  # frozen mapping


def test_spec_needs_a_known_sequence_parallel_strategy_or_a_reason():
    promises = dict(name="x", summary="", paper="", complexity="", causal=True,
                    padding_mask=True, cross=True, decoding=True)
    with pytest.raises(ValueError, match="sequence_parallel=None needs a reason in refusals"):
        effattn.MethodSpec(**promises)
    with pytest.raises(ValueError, match="sequence_parallel must be a SequenceStrategy"):
        effattn.MethodSpec(**promises, sequence_parallel="halo")
    halo = Halo()
    assert effattn.MethodSpec(**promises, sequence_parallel=halo).sequence_parallel is halo


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError, match="softmax"):
        effattn.spec("no-such-method")
    with pytest.raises(KeyError, match="valid names"):
        effattn.build("no-such-method")


@pytest.mark.parametrize("name", effattn.methods())
def test_unknown_option_is_type_error(name):
    with pytest.raises(TypeError, match="bogus"):
        effattn.build(name, bogus=3)


BOOL_OPTIONS = [(name, key) for name in effattn.methods()
                for key, default in effattn.spec(name).options.items() if isinstance(default, bool)]


@pytest.mark.parametrize("name, key", BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["false", "True", 0, 1, None])
def test_bool_options_take_only_bools(name, key, value):
    # bool("false") is True: a string from a command line must not be coerced into its opposite.
    with pytest.raises(ValueError, match=f"{key} must be a bool"):
        effattn.build(name, head_dim=8, heads=2, max_len=16, **{key: value})


def test_layer_gate_flag_takes_only_bools():
    from effattn.nn import MultiheadAttention

    with pytest.raises(ValueError, match="gated must be a bool"):
        MultiheadAttention(16, 2, method="rfa", gated="false")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"head_dim": 0}, "head_dim"),
        ({"heads": -1}, "heads"),
        ({"max_len": 0}, "max_len"),
        ({"seed": 1.5}, "seed"),
        ({"scale": -1.0}, "scale"),
    ],
)
def test_bad_build_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        effattn.build("softmax", **kwargs)


def _bad_inputs():
    q, k, v = qkv(b=2, h=3, n=8, d=4, dtype=torch.float32)
    yield (q[0], k, v), {}, "q must be 4-D"
    yield (q, k.long(), v), {}, "floating-point"
    yield (q, k.double(), v), {}, "share a dtype"
    yield (q, k[:1], v), {}, "batch and heads"
    yield (q, k[..., :3], v), {}, "head dim"
    yield (q, k, v[:, :, :5]), {}, "same length M"
    yield (q, k[:, :, :5], v[:, :, :5]), {"causal": True}, "causal=True needs N == M"
    yield (q, k, v), {"key_padding_mask": torch.zeros(2, 8)}, "bool"
    yield (q, k, v), {"key_padding_mask": torch.zeros(2, 7, dtype=torch.bool)}, r"\(B, M\)"
    nan_q = q.clone()
    nan_q[0, 0, 0, 0] = float("nan")
    yield (nan_q, k, v), {}, "q contains NaN"


@pytest.mark.parametrize("args, kwargs, match", list(_bad_inputs()))
def test_bad_inputs_raise_value_error_naming_argument(args, kwargs, match):
    m = effattn.build("softmax", head_dim=4, heads=3)
    with pytest.raises(ValueError, match=match):
        m(*args, **kwargs)


def test_module_checks_heads_and_head_dim():
    q, k, v = qkv(b=1, h=3, n=8, d=4)
    with pytest.raises(ValueError, match="heads=2"):
        effattn.build("softmax", head_dim=4, heads=2)(q, k, v)
    with pytest.raises(ValueError, match="head_dim=8"):
        effattn.build("softmax", head_dim=8, heads=3)(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, m", [(1, 1), (63, 63), (17, 40)])
def test_softmax_matches_reference(causal, n, m):
    if causal and n != m:
        pytest.skip("causal needs N == M")
    q, k, v = qkv(n=n, m=m, dv=5)
    pad = torch.zeros(2, m, dtype=torch.bool)
    pad[0, : m // 3] = True
    for mask in (None, pad):
        out = effattn.attention(q, k, v, causal=causal, key_padding_mask=mask)
        ref = R.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(out, ref)


def test_softmax_fully_padded_rows_are_zero_not_nan():
    q, k, v = qkv(b=2, n=10)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0] = True
    mask[1, :4] = True
    out = effattn.attention(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    out = effattn.attention(q, k, v, causal=True, key_padding_mask=mask)
    assert torch.isfinite(out).all() and out[1, :, :4].abs().max() == 0


def test_softmax_step_equals_causal_forward_and_cache_grows():
    q, k, v = qkv(n=40, dv=7)
    m = effattn.build("softmax", head_dim=21, heads=3)
    state, outs = None, []
    for t in range(40):
        o, state = m.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(o)
    assert state.length == 40 and state.k.shape[2] >= 40
    torch.testing.assert_close(torch.cat(outs, 2), m(q, k, v, causal=True))


def test_step_rejects_more_than_one_token():
    q, k, v = qkv(n=2)
    m = effattn.build("softmax", head_dim=21, heads=3)
    with pytest.raises(ValueError, match="one token"):
        m.step(q, k, v)


# Options that make each method do its real work at N = 50: chunks, windows, blocks, buckets,
# landmarks and projections shorter than the sequence.
HALF_OPTIONS = {"chunk_size": 16, "window": 8, "global_tokens": (0, 7), "block_size": 8,
                "bucket_size": 8, "num_landmarks": 16, "proj_len": 16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", effattn.methods())
def test_half_precision_equals_fp32_to_its_rounding(name, dtype):
    """fp16 and bf16 inputs give an output of their dtype (the base class casts it) that equals
    the fp32 result on the same values to within the half-precision rounding of its inputs,
    intermediates and output: methods compute features and sums in fp32, softmax in SDPA's own
    half-precision kernel."""
    spec = effattn.spec(name)
    options = small_options(name, HALF_OPTIONS)
    module = effattn.build(name, head_dim=16, heads=2, max_len=64, seed=0, **options).eval()
    q, k, v = qkv(b=2, h=2, n=50, d=16, dtype=torch.float32, scale=0.5)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = module(q, k, v, causal=spec.causal)
    ref = module(q.float(), k.float(), v.float(), causal=spec.causal)
    assert out.dtype == dtype
    # About 4x the worst seen (3e-3 of the largest output in bf16, 3e-4 in fp16), relative to
    # the output's size: fnet's unnormalised DFT sums N Dv values.
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol,
                               atol=tol * max(1.0, ref.abs().max().item()))


class _Toy(effattn.AttentionMethod):
    """Causal softmax plus two call inputs: an optional offset (B, H, N) added to each output
    row, and, with gain=True, a factor (H,) in [0, 2] per head (causal only)."""

    spec = dataclasses.replace(
        effattn.spec("softmax"), name="toy", options={"gain": False},
        call_inputs=(
            CallInput("offset", "added to each output row", ("B", "H", "N")),
            CallInput("factor", "multiplies each head's output", ("H",), enabled_by="gain",
                      causal_only=True, bounds=(0.0, 2.0)),
        ),
    )

    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, gain=False):
        super().__init__(head_dim, heads, max_len, seed, scale)
        self.gain = gain

    def _finish(self, out, offset=None, factor=None):
        out = out if offset is None else out + offset[..., None]
        return out if factor is None else out * factor[:, None, None]

    def _attend(self, q, k, v, *, causal, key_padding_mask, **call):
        return self._finish(F.scaled_dot_product_attention(q, k, v, is_causal=causal), **call)

    def _step(self, q, k, v, state, **call):
        keys, values = (k, v) if state is None else (torch.cat([state[0], k], 2),
                                                     torch.cat([state[1], v], 2))
        out = F.scaled_dot_product_attention(q, keys, values)
        return self._finish(out, **call), (keys, values)


def test_call_inputs_are_checked_from_the_spec():
    q, k, v = qkv(b=2, h=3, n=8, d=4)
    offset, factor = torch.rand(2, 3, 8, dtype=q.dtype), torch.rand(3, dtype=q.dtype)
    plain, gained = _Toy(4, 3), _Toy(4, 3, gain=True)
    assert plain.call_inputs == _Toy.spec.call_inputs[:1]
    assert gained.call_inputs == _Toy.spec.call_inputs
    with pytest.raises(TypeError, match="unexpected call argument.* bias; its call inputs are: "
                                        "offset, factor"):
        plain(q, k, v, bias=offset)
    with pytest.raises(ValueError, match="factor is only taken with gain=True"):
        plain(q, k, v, causal=True, factor=factor)
    with pytest.raises(ValueError, match=r"toy with gain=True needs factor \(H\) in the call"):
        gained(q, k, v, causal=True)
    with pytest.raises(ValueError, match="needs causal=True: factor"):
        gained(q, k, v, factor=factor)
    with pytest.raises(ValueError, match=r"offset must be \(B, H, N\) = \(2, 3, 8\)"):
        plain(q, k, v, offset=offset[..., :5])
    with pytest.raises(ValueError, match="floating-point"):
        plain(q, k, v, offset=offset.long())
    with pytest.raises(ValueError, match=r"factor values must lie in \[0, 2\]"):
        gained(q, k, v, causal=True, factor=factor + 2)
    with pytest.raises(ValueError, match="offset contains NaN"):
        plain(q, k, v, offset=offset / 0 * 0)
    with pytest.raises(ValueError, match=r"needs factor \(H\)"):
        gained.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    full = gained(q, k, v, causal=True, offset=offset, factor=factor)
    # The base class's prefill steps token by token, cutting each input along its N only.
    out, state = gained.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5], offset=offset[..., :5],
                                factor=factor)
    last, _ = gained.step(q[:, :, 5:6], k[:, :, 5:6], v[:, :, 5:6], state,
                          offset=offset[..., 5:6], factor=factor)
    torch.testing.assert_close(torch.cat([out, last], 2), full[:, :, :6])


def test_layers_compute_the_required_call_inputs_or_refuse(monkeypatch):
    from effattn import registry
    from effattn.nn import MultiheadAttention

    monkeypatch.setitem(registry._REGISTRY, "toy", (_Toy.spec, _Toy))
    assert MultiheadAttention(8, 2, method="toy").call_inputs == ()
    with pytest.raises(ValueError, match="needs the call input.* factor, which "
                                         "MultiheadAttention cannot compute"):
        MultiheadAttention(8, 2, method="toy", gain=True)


def test_every_call_input_switch_is_the_module_attribute():
    for name in effattn.methods():
        spec = effattn.spec(name)
        for c in spec.call_inputs:
            if c.enabled_by is None:
                continue
            for on in (False, True):
                module = effattn.build(name, head_dim=8, heads=2, max_len=16,
                                       **{c.enabled_by: on})
                assert getattr(module, c.enabled_by) is on
                assert (c in module.call_inputs) is on
                assert (c in spec.enabled_inputs({c.enabled_by: on})) is on
            assert c.enabled_by not in spec.non_causal_options({c.enabled_by: True}) or (
                not c.causal_only)


@pytest.mark.parametrize("inputs, match", [
    ((CallInput("x", "", ("B",), enabled_by="nope"),), r"unknown option\(s\) \['nope'\]"),
    ((CallInput("causal", "", ("B",)),), r"call input name\(s\) \['causal'\]"),
    ((CallInput("x", "", ("B",)), CallInput("x", "", ("H",))), r"call input name\(s\) \['x'\]"),
    ((CallInput("x", "", ("B", "T")),), "spell it in"),
    ((CallInput("x", "", ()),), "spell it in"),
    ((CallInput("x", "", ("B",), kind="int"),), r"is an int: shape=\(\)"),
    ((CallInput("x", "", (), kind="bool"),), "has kind 'bool'"),
])
def test_spec_checks_its_call_inputs(inputs, match):
    promises = dict(name="x", summary="", paper="", complexity="", causal=True,
                    padding_mask=True, cross=True, decoding=True,
                    refusals={"sequence_parallel": "-"})
    with pytest.raises(ValueError, match=match):
        effattn.MethodSpec(**promises, call_inputs=inputs)


def test_build_says_a_call_input_goes_to_the_call():
    with pytest.raises(TypeError, match="gate go\\(es\\) to the call, not to build"):
        effattn.build("rfa", gated=True, gate=torch.ones(1))
