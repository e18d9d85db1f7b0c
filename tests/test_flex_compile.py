"""The flex strategy inside an outer torch.compile (a user compiling a model, fullgraph=True).

The cached BlockMask comes from the ``effattn::flex_block_mask`` operator, one opaque node, and
flex_attention is traced into the outer graph. On the CPU (CI) the strategy is forced and the
graph is inference only (torch 2.13 has no FlexAttention backward there). Under aot_eager (the
graph run by FlexAttention's eager form) and, for BigBird, under inductor (its CPU kernel), the
compiled outputs must equal the eager forced-flex call and the float64 reference; the graph
holds FlexAttention, and the BlockMask is built once per pattern and shape and shared with the
eager calls.
"""

import pytest
import torch
from conftest import padding, qkv
from torch._dynamo.testing import CompileCounterWithBackend

import effattn
from effattn import strategy
from effattn.sparse import Band, Blocks, Globals
from effattn.sparse import flex as flex_strategy
from effattn.sparse.pieces import Columns, Summary

pytest.importorskip("torch.nn.attention.flex_attention")

HEADS, HEAD_DIM, N = 3, 16, 129

# Global tokens and per-head random blocks: mask_mods that read tables (the operator's outputs).
MODULES = [
    ("local", {"window": 16}),
    ("longformer", {"window": 10, "global_tokens": (3, 40, 128)}),
    ("bigbird", {"block_size": 8}),
]


def _modules(methods):
    return [effattn.build(method, heads=HEADS, head_dim=HEAD_DIM, seed=3, **options).eval()
            for method, options in MODULES if method in methods]


def _call(modules, q, k, v, keep):
    # The padding mask computed in the graph: inductor's CPU kernel needs a copy (flex._copy).
    mask = None if keep is None else keep == 0
    return [module(q, k, v, key_padding_mask=mask) for module in modules]


@pytest.mark.parametrize(("backend", "padded", "methods"), [
    ("aot_eager", False, ("local", "longformer", "bigbird")),
    ("aot_eager", True, ("local", "longformer", "bigbird")),
    # About 20 s of C++ compilation with a cold inductor cache.
    pytest.param("inductor", True, ("bigbird",), marks=pytest.mark.slow),
])
def test_compiled_model_runs_flex_with_the_cached_block_mask(monkeypatch, backend, padded,
                                                             methods):
    """The modules in one compiled graph: FlexAttention's eager form under aot_eager, inductor's
    CPU kernel under inductor."""
    modules = _modules(methods)
    q, k, v = qkv(h=HEADS, n=N, d=HEAD_DIM)
    mask = padding(q.shape[0], N) if padded else None
    keep = None if mask is None else (~mask).long()
    builds = []
    real = flex_strategy.build_block_mask

    def counted(*args, **kwargs):
        builds.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_strategy, "build_block_mask", counted)
    monkeypatch.setattr(flex_strategy, "_block_masks", type(flex_strategy._block_masks)())
    torch._dynamo.reset()
    backend = CompileCounterWithBackend(backend)
    compiled = torch.compile(_call, backend=backend, fullgraph=True)
    x = [t.float() for t in (q, k, v)]
    with torch.no_grad(), strategy.force(banded="flex"):
        out = compiled(modules, *x, keep)
        again = compiled(modules, *x, keep)
        # Built by the first compiled call, one per pattern, cached for the second.
        assert len(builds) == len(modules)
        eager = _call(modules, *x, keep)
    torch._dynamo.reset()
    assert len(builds) == len(modules)  # the eager calls read the same cache
    # A CUDA graph would replay the first call's BlockMask: the operator keeps out of them.
    assert torch.Tag.cudagraph_unsafe in torch.ops.effattn.flex_block_mask.default.tags
    # One graph, holding FlexAttention (not the blockwise engine) for each module.
    assert backend.frame_count == 1
    targets = [node.target for node in backend.graphs[0].graph.nodes]
    assert targets.count(torch.ops.higher_order.flex_attention) >= len(modules)
    for module, got, repeat, want in zip(modules, out, again, eager, strict=True):
        assert torch.equal(repeat, got)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        ref = module.spec.reference(module, q, k, v, key_padding_mask=mask)
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-4)


def test_a_new_length_retraces_once_with_n_symbolic():
    """A second length retraces with N symbolic (dynamo's automatic dynamic shapes), ints of the
    pattern derived from N included (Sparse Transformer's default stride); a third reuses it."""
    module = effattn.build("sparse-fixed", heads=HEADS, head_dim=HEAD_DIM, stride=None, c=3)
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    for n in (63, 129, 200):
        q, k, v = (x.float() for x in qkv(h=HEADS, n=n, d=HEAD_DIM))
        with torch.no_grad():
            blockwise = module(q, k, v, causal=True)
            with strategy.force(banded="flex"):
                out = compiled(q, k, v, causal=True)
        torch.testing.assert_close(out, blockwise, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()
    assert backend.frame_count == 2
    assert all(torch.ops.higher_order.flex_attention in [node.target for node in graph.graph.nodes]
               for graph in backend.graphs)


def test_callers_of_the_log_sum_exp_get_it_under_an_eager_backend():
    """softmax's sinks merge by the lse: it comes from a second FlexAttention call, which only an
    eager backend runs (torch 2.13's compiled CPU kernel returns no lse; the graph drops the
    call where the caller drops the lse)."""
    module = effattn.build("softmax", heads=HEADS, head_dim=HEAD_DIM)
    call = {"causal": True, "sliding_window": 9, "sinks": torch.linspace(-1.0, 2.0, HEADS)}
    q, k, v = (x.float() for x in qkv(h=HEADS, n=63, d=HEAD_DIM))
    torch._dynamo.reset()
    with torch.no_grad():
        blockwise = module(q, k, v, **call)
        with strategy.force(banded="flex"):
            out = torch.compile(module, backend="aot_eager", fullgraph=True)(q, k, v, **call)
    torch._dynamo.reset()
    torch.testing.assert_close(out, blockwise, atol=1e-5, rtol=1e-4)


def test_compiled_training_on_the_cpu_is_refused_clearly():
    """Forced flex, an input that requires a gradient, on the CPU: the eager strategy's
    NotImplementedError, which dynamo reports as the graph's failure under fullgraph=True."""
    module = effattn.build("local", heads=HEADS, head_dim=HEAD_DIM, window=8)
    q, k, v = (x.float() for x in qkv(h=HEADS, n=40, d=HEAD_DIM))
    q.requires_grad_()
    torch._dynamo.reset()
    with strategy.force(banded="flex"):
        with pytest.raises(NotImplementedError, match="inference only"):
            torch.compile(module, backend="aot_eager")(q, k, v, causal=True)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="inference only"):
            torch.compile(module, backend="aot_eager", fullgraph=True)(q, k, v, causal=True)
    torch._dynamo.reset()


def test_each_tensor_field_that_is_set_has_one_table():
    """The operator returns the pieces' tables one after another, which the graph splits by the
    pieces' tensor fields: one table per tensor field that is set (pieces.py's contract)."""
    cpu, n = torch.device("cpu"), 40
    key_blocks = torch.tensor([[0, 1], [1, -1], [2, 0], [3, 1], [4, 2]])
    pattern = torch.ones(8, 16, dtype=torch.bool)
    pieces = [Band(3, 2), Columns(5), Summary(8, 2), Globals(torch.tensor([1, 7])),
              Blocks(None, 8), Blocks(None, 8, pattern[:, :8]), Blocks(key_blocks, 8),
              Blocks(key_blocks, 8, pattern)]
    for piece in pieces:
        held = [value for value in vars(piece).values() if isinstance(value, torch.Tensor)]
        assert len(piece.tables(n, cpu)) == len(held), piece
