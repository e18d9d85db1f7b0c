"""torch.compile(fullgraph=True): every method traces without a graph break, eval and training.

The all-methods test uses the ``aot_eager`` backend: dynamo and AOTAutograd trace the forward and
the backward exactly as with inductor (that is what fullgraph checks), without generating code,
so compiled outputs must equal eager ones to the last bit. Gradients agree to rounding: in eager
mode the kernelized methods' backward recomputes the features slice by slice (an autograd
function whose backward calls autograd, which dynamo does not trace), while the compiled graph
records the forward and keeps them (kernelized.core, "Recompute instead of store").
Inductor itself runs on one method (marked slow).
"""

import copy

import pytest
import torch
from conftest import padding, qkv, small_options
from torch._dynamo.testing import CompileCounterWithBackend

import effattn
from effattn.registry import spec

B, H, N, D = 2, 2, 40, 8
# Small budgets, and a redraw on the third training call, so that it happens in the test.
SMALL = {"num_features": 16, "num_landmarks": 8, "proj_len": 16, "window": 8, "block_size": 8,
         "bucket_size": 8, "chunk_size": 16, "redraw_interval": 2, "global_tokens": (0, 5)}


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _build(name: str, training: bool) -> effattn.AttentionMethod:
    options = small_options(name, SMALL)
    return effattn.build(name, head_dim=D, heads=H, max_len=N, seed=0, **options).double().train(
        training
    )


def _case(name: str, call: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    """Inputs of one call: causal and padded wherever the method's spec allows."""
    s = spec(name)
    kwargs = {"causal": s.causal}
    if s.padding_mask:
        kwargs["key_padding_mask"] = padding(B, N, seed=call)
    return qkv(b=B, h=H, n=N, d=D, seed=call), kwargs


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", effattn.methods())
def test_method_compiles_fullgraph_and_matches_eager(name, training):
    eager = _build(name, training)
    module = copy.deepcopy(eager)
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    for call in range(3 if training else 2):
        (q, k, v), kwargs = _case(name, call)
        inputs_e = [t.clone().requires_grad_(training) for t in (q, k, v)]
        inputs_c = [t.clone().requires_grad_(training) for t in (q, k, v)]
        out_e, out_c = eager(*inputs_e, **kwargs), compiled(*inputs_c, **kwargs)
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-12)
        if training:
            out_e.square().sum().backward()
            out_c.square().sum().backward()
            for te, tc in zip(inputs_e, inputs_c, strict=True):
                grad_e = torch.zeros_like(te) if te.grad is None else te.grad
                grad_c = torch.zeros_like(tc) if tc.grad is None else tc.grad
                torch.testing.assert_close(grad_c, grad_e, rtol=1e-12, atol=1e-12)
    # One graph for every call: no recompilation on the redraw schedule or the call counter.
    assert backend.frame_count == 1
    # The module's random state moved as in eager (draws, redraws, call count).
    if isinstance(eager, effattn.random.RandomizedAttention):
        state_e, state_c = eager.get_extra_state(), module.get_extra_state()
        assert torch.equal(state_c["generator"], state_e["generator"])
        assert state_c["calls"] == state_e["calls"] == (3 if training else 0)
    for (key, value_e), value_c in zip(eager.state_dict().items(), module.state_dict().values(),
                                       strict=True):
        if isinstance(value_e, torch.Tensor):
            assert torch.equal(value_c, value_e), key


@pytest.mark.parametrize("name, options", [("performer", {}), ("rfa", {"gated": True}),
                                           ("linear", {})])
def test_decoding_step_compiles_fullgraph_and_matches_eager(name, options):
    """The lazy rescale is branch-free when compiled: keys whose log-scale jumps past the
    margin (small keys after large ones, for positive features) must still match eager."""
    options = {**small_options(name, SMALL), **options}
    module = effattn.build(name, head_dim=D, heads=H, seed=0, **options).double().eval()
    backend = CompileCounterWithBackend("aot_eager")
    step = torch.compile(module.step, backend=backend, fullgraph=True)
    q, k, v = qkv(b=B, h=H, n=12, d=D)
    k[:, :, :6] *= 6.0
    gate = torch.rand(B, H, 12, dtype=torch.float64) if options.get("gated") else None
    state_e = state_c = None
    for t in range(12):
        one = slice(t, t + 1)
        kwargs = {} if gate is None else {"gate": gate[:, :, one]}
        out_e, state_e = module.step(q[:, :, one], k[:, :, one], v[:, :, one], state_e, **kwargs)
        out_c, state_c = step(q[:, :, one], k[:, :, one], v[:, :, one], state_c, **kwargs)
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-12)
        torch.testing.assert_close(state_c.kv, state_e.kv, rtol=0, atol=1e-12)
        torch.testing.assert_close(state_c.log_scale, state_e.log_scale, rtol=0, atol=0)
    # state=None, then the position specialised once, then dynamic: no recompile per token.
    assert backend.frame_count <= 3


def test_value_checks_stay_in_eager_and_leave_the_compiled_graph():
    """NaN/inf and gate-range checks raise eagerly; compiled, they are not in the graph."""
    module = effattn.build("rfa", head_dim=D, heads=H, seed=0, gated=True, num_features=16)
    q, k, v = qkv(b=B, h=H, n=16, d=D, dtype=torch.float32)
    gate = torch.full((B, H, 16), 0.5)
    with pytest.raises(ValueError, match="gate values must lie in"):
        module(q, k, v, causal=True, gate=gate + 1)
    bad_q = q.clone()
    bad_q[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="q contains NaN or inf"):
        module(bad_q, k, v, causal=True, gate=gate)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert torch.isnan(compiled(bad_q, k, v, causal=True, gate=gate + 1)).any()
    # Shapes are not values: a compiled call still raises the eager message (the raise ends the
    # graph there, so this one is compiled without fullgraph).
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager")
    with pytest.raises(ValueError, match="gate must be"):
        compiled(q, k, v, causal=True, gate=gate[..., :5])


@pytest.mark.slow
def test_inductor_compiles_performer_training(request):
    """The real backend (C++ codegen), causal and padded, forward and backward.

    About 55 s on 2 shared CPU cores with a cold inductor cache (7 s warm), so it runs only when
    selected:
    ``pytest -m slow tests/test_compile.py``.
    """
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("inductor codegen takes about a minute: run with -m slow")
    eager = _build("performer", training=True)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, fullgraph=True)
    for call in range(3):
        (q, k, v), kwargs = _case("performer", call)
        inputs_e = [t.clone().requires_grad_() for t in (q, k, v)]
        inputs_c = [t.clone().requires_grad_() for t in (q, k, v)]
        out_e, out_c = eager(*inputs_e, **kwargs), compiled(*inputs_c, **kwargs)
        torch.testing.assert_close(out_c, out_e, rtol=1e-9, atol=1e-10)
        out_e.square().sum().backward()
        out_c.square().sum().backward()
        for te, tc in zip(inputs_e, inputs_c, strict=True):
            torch.testing.assert_close(tc.grad, te.grad, rtol=1e-9, atol=1e-10)
    assert torch.equal(module.projection, eager.projection)


def test_prefill_and_memory_compile_fullgraph_and_match_eager():
    module = _build("performer", training=False)
    q, k, v = qkv(b=B, h=H, n=N, d=D)
    prefill = torch.compile(module.prefill, backend="aot_eager", fullgraph=True)
    (out_c, state_c), (out_e, state_e) = prefill(q, k, v), module.prefill(q, k, v)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-12)
    torch.testing.assert_close(state_c.kv, state_e.kv, rtol=0, atol=1e-12)
    memory = torch.compile(module.memory, backend="aot_eager", fullgraph=True)
    read = torch.compile(module.attend_memory, backend="aot_eager", fullgraph=True)
    mask = padding(B, N)
    torch.testing.assert_close(read(q, memory(k, v, mask)),
                               module.attend_memory(q, module.memory(k, v, mask)),
                               rtol=0, atol=1e-12)
