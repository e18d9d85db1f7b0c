"""The public contract of shared/design.md, for every registered method."""

import pytest
import torch
from conftest import qkv

import effattn
from effattn import reference as R


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
    with pytest.raises(ValueError, match="sequence_parallel must be one of"):
        effattn.MethodSpec(**promises, sequence_parallel="scatter")
    assert effattn.MethodSpec(**promises, sequence_parallel="halo").sequence_parallel == "halo"


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


def test_bf16_inputs_keep_dtype():
    q, k, v = qkv(dtype=torch.bfloat16, n=16)
    out = effattn.attention(q, k, v)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
