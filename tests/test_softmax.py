"""softmax's exact variants beyond SDPA: soft cap, causal sliding window, attention sinks.

Outputs and gradients against the dense reference are in tests/test_references.py; here the
decoding paths (prefill and step continue a KVCache and equal the causal forward), the bounded
cache of a window, the banded computation (no N x N scores) and the refusals.
"""

import pytest
import torch
from conftest import padding, qkv

import effattn
from effattn import naive
from effattn.sparse import Band, Blocks, Columns, Globals, blockwise, sparse_attention

H, D = 3, 21


def _module(softcap=None):
    return effattn.build("softmax", head_dim=D, heads=H, softcap=softcap).double()


def _sinks(device="cpu"):
    return torch.randn(H, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(5)).to(device)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("sinks", [False, True])
def test_prefill_and_steps_equal_the_causal_forward(softcap, window, sinks, device):
    m = _module(softcap).to(device)
    q, k, v = (t.to(device) for t in qkv(n=63, d=D))
    sinks = _sinks(device) if sinks else None
    call = {"sliding_window": window, "sinks": sinks}
    outs, state = [], None
    for a, b in ((0, 20), (20, 21), (21, 22), (22, 40), (40, 41), (41, 63)):
        piece = slice(a, b)
        fn = m.step if b - a == 1 else m.prefill
        out, state = fn(q[:, :, piece], k[:, :, piece], v[:, :, piece], state, **call)
        outs.append(out)
    ref = naive.softmax_attention(q, k, v, causal=True, scale=m.scale, softcap=softcap,
                                  window=window, sinks=sinks)
    torch.testing.assert_close(torch.cat(outs, 2), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m(q, k, v, causal=True, **call), ref, rtol=1e-12, atol=1e-12)


def test_a_window_bounds_the_cache():
    m, (q, k, v) = _module(), qkv(b=1, n=300, d=D)
    state = None
    for t in range(300):
        one = slice(t, t + 1)
        _, state = m.step(q[:, :, one], k[:, :, one], v[:, :, one], state, sliding_window=16)
        assert min(t + 1, 15) <= state.held <= 32
    assert state.k.shape[2] <= 64 and state.length == 300
    with pytest.raises(ValueError, match="dropped the positions before"):
        m.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], state, sliding_window=64)


def test_long_windowed_and_capped_inputs_are_banded_never_n_by_n(monkeypatch):
    seen, original = [], blockwise._scores

    def spy(out, q, k, scale, biases, softcap=None):
        seen.append(q.shape[-2] * k.shape[-2] * q.shape[:-2].numel())
        return original(out, q, k, scale, biases, softcap)

    monkeypatch.setattr(blockwise, "_scores", spy)
    q, k, v = qkv(b=1, h=1, n=2048, d=8, dtype=torch.float32)
    m = effattn.build("softmax", head_dim=8, heads=1, softcap=20.0)
    m(q, k, v, causal=True, sliding_window=64)
    assert sum(seen) <= 2048 * 65 * 2.5
    seen.clear()
    m(q, k, v, causal=True)  # a soft cap alone: the causal band, in cache-sized slices
    # (a forward slice scores about twice SLICE_ELEMENTS: it holds no ds)
    assert max(seen) <= 4 * blockwise.SLICE_ELEMENTS < 2048 * 2048


def _allowed(piece, n, device="cpu"):
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    if isinstance(piece, Band):
        return (i - j <= piece.left) & (j - i <= piece.right) & ((i - j) % piece.dilation == 0)
    if isinstance(piece, Blocks):
        return i // piece.block_size == j // piece.block_size
    return (i != j) & ((i - j) % piece.stride == 0) & ((j < i) | (not piece.causal))


@pytest.mark.parametrize("piece", [Band(62, 62), Band(9, 0), Band(10, 4, 2), Band(9, 0, 3, 8),
                                   Blocks(None, 10), Columns(8, causal=True)],
                         ids=["full", "causal-window", "dilated", "dilated-causal",
                              "blocks", "columns"])
def test_the_engine_caps_its_scores_exactly_in_forward_and_backward(piece, device):
    # Every piece computed by query blocks, the gathered layouts of dilated bands and columns
    # included; out and lse (which sinks read) against the dense formula, with their gradients.
    q, k, v = (t.to(device).requires_grad_() for t in qkv(n=63, d=D, dv=10))
    mask, scale, cap = padding(2, 63).to(device), 0.7, 1.5
    out, lse = sparse_attention(q, k, v, [piece], scale=scale, key_mask=mask, softcap=cap)
    scores = cap * torch.tanh(scale * q @ k.transpose(-2, -1) / cap)
    allowed = _allowed(piece, 63, device) & ~mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref = torch.softmax(scores, -1).nan_to_num(0.0) @ v
    seen = allowed.expand(2, H, 63, 63).any(-1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(4)
    probe = torch.randn(out.shape, generator=g, dtype=out.dtype).to(device)
    probe_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype).to(device) * seen
    got = torch.autograd.grad((out * probe).sum() + (lse * probe_lse).sum(), (q, k, v))
    ref_lse = ref_lse.masked_fill(~seen, 0.0)
    want = torch.autograd.grad((ref * probe).sum() + (ref_lse * probe_lse).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=lambda t, n=name: f"d{n}: {t}")


def test_the_engine_refuses_a_cap_on_dense_pieces():
    q, k, v = qkv(n=16, d=D)
    with pytest.raises(ValueError, match="softcap=2.0 is not supported with Globals"):
        sparse_attention(q, k, v, [Band(3, 0), Globals(torch.tensor([0]))], scale=1.0,
                         softcap=2.0)


def test_a_window_as_long_as_the_input_is_plain_sdpa(monkeypatch, device):
    calls = []
    monkeypatch.setattr(blockwise, "sparse_attention", lambda *a, **kw: calls.append(1))
    q, k, v = (t.to(device) for t in qkv(n=40, d=D))
    m = _module().to(device)
    out = m(q, k, v, causal=True, sliding_window=40)
    assert not calls
    torch.testing.assert_close(out, m(q, k, v, causal=True))


def test_sinks_take_their_gradient_and_bf16_keeps_its_dtype():
    q, k, v = qkv(b=1, n=16, d=D, dtype=torch.bfloat16)
    sinks = torch.zeros(H, dtype=torch.bfloat16, requires_grad=True)
    out = effattn.build("softmax", head_dim=D, heads=H, softcap=5.0)(q, k, v, sinks=sinks)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("build", "call", "match"),
    [
        ({"softcap": 0}, {}, "softcap must be a positive number"),
        ({"softcap": True}, {}, "softcap must be a positive number"),
        ({}, {"sliding_window": 8}, "with sliding_window=8 needs causal=True"),
        ({}, {"sliding_window": 0, "causal": True}, r"sliding_window must lie in \[1, inf\]"),
        ({}, {"sliding_window": 2.0, "causal": True}, "sliding_window must be an int"),
        ({}, {"sinks": torch.zeros(2, dtype=torch.float64)}, r"sinks must be \(H\) = \(3,\)"),
        ({}, {"sinks": torch.zeros(3, dtype=torch.long)}, "floating-point"),
        ({}, {"sinks": torch.tensor([0.0, float("nan"), 0.0], dtype=torch.float64)}, "NaN"),
    ],
)
def test_bad_options_and_call_inputs_raise(build, call, match):
    q, k, v = qkv(n=8, d=D)
    with pytest.raises(ValueError, match=match):
        effattn.build("softmax", head_dim=D, heads=H, **build).double()(q, k, v, **call)


def test_other_methods_do_not_take_the_call_inputs():
    q, k, v = qkv(n=8, d=D)
    with pytest.raises(TypeError):
        effattn.build("linear", head_dim=D, heads=H)(q, k, v, causal=True, sinks=_sinks())
    local = effattn.build("local", head_dim=D, heads=H, window=4).double()
    torch.testing.assert_close(local(q, k, v, causal=True, sliding_window=4),
                               local(q, k, v, causal=True))
    with pytest.raises(ValueError, match="not the required sliding_window=5"):
        local(q, k, v, causal=True, sliding_window=5)
