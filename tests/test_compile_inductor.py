"""The kernelized GPU strategy's causal form (forced on the CPU) under inductor, the default
backend of torch.compile: fullgraph, outputs and q, k, v gradients equal to eager in fp32.

aot_eager (tests/test_compile.py) does not generate code, but it does functionalize: an in-place
op on a chunk-major view of a head-major GEMM output (``tril_`` in gpu.chunk_parallel) once
failed to trace there too. The methods cover both branches of the chunk-parallel form: unit
weights (linear, taylor) and log weights (performer's stabiliser; rfa's, with a gate). Eval
mode, so that rfa and performer draw no new features between the eager and the compiled call
(in training they redraw on every call, and the two would differ by that alone).

One compilation per method, about 10-20 s each on 2 shared CPU cores: marked slow, run with
``pytest -m slow tests/test_compile_inductor.py``.
"""

import pytest
import torch
from conftest import qkv

import effattn
from effattn import strategy
from effattn.kernelized import gpu

B, H, N, D, CHUNK = 1, 2, 100, 16, 16  # 7 chunks, the last 4 tokens short


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [("linear", {}), ("taylor", {}), ("performer", {}),
                                           ("rfa", {"gated": True})],
                         ids=["linear", "taylor", "performer", "rfa-gated"])
def test_gpu_strategy_causal_under_inductor_matches_eager(name, options, request, monkeypatch):
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("inductor codegen takes 10-20 s a method: run with -m slow")
    module = effattn.build(name, head_dim=D, heads=H, seed=0, chunk_size=CHUNK,
                           **options).eval()
    kwargs = {"causal": True}
    if options.get("gated"):
        kwargs["gate"] = torch.rand(B, H, N, generator=torch.Generator().manual_seed(1))
    runs = []
    chunk_parallel = gpu.chunk_parallel
    monkeypatch.setattr(gpu, "chunk_parallel", lambda *a, **k: runs.append(1) or chunk_parallel(
        *a, **k))
    inputs = qkv(b=B, h=H, n=N, d=D, dtype=torch.float32)
    weight = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(2))

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return out.detach(), torch.autograd.grad((out * weight).sum(), leaves)

    with strategy.force(kernelized="gpu"):
        out_e, grads_e = run(lambda q, k, v: module(q, k, v, **kwargs))
        assert runs, "the GPU strategy did not run"
        compiled = torch.compile(lambda q, k, v: module(q, k, v, **kwargs), fullgraph=True,
                                 dynamic=False)
        out_c, grads_c = run(compiled)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)
