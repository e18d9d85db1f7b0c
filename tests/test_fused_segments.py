"""The triton strategy's segments (effattn.kernelized.fused_kernels: ``split``), run on the CPU
by Triton's interpreter: a launch's chunks walked in P segments side by side, the states
entering them from a first pass over each segment's keys and one batched product, the
gradients of the states leaving them alike from the queries' side.

The kernels split into segments against the same kernels in one walk (float64: outputs, state
after, checkpoints, running scales, every gradient), with φ read and formed inside, gated and
not, an entering state at the floor and a first segment whose keys are all padded; fp16 tiles
with deterministic algorithms; hedgehog's per-feature kernels alike; the number of segments a
device gets; a module's call through the strategy with segments against its float64
reference.
"""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from conftest import count_calls, make_kernelized, qkv  # noqa: E402

# triton_strategy: the strategy forced for every test (autouse), CPU cases only where Triton's
# interpreter runs them.
from test_fused_strategy import matches_reference, triton_strategy  # noqa: E402, F401

from effattn.kernelized import core, fused_kernels  # noqa: E402


def _inputs(kind, gated, device):
    """φ(Q), φ(K) (or x̃ with the projection for a map formed inside), the keys' log-weights,
    v, an entering state and its scales (one at the floor, with a zero state), the log-gates:
    B = H = 2, N = 100 (7 chunks of 16, the last not full), F = 70 (two feature blocks); the
    first 51 keys of one (batch, head) pair padded."""
    g = torch.Generator().manual_seed(3)
    b, h, n, f, dv = 2, 2, 100, 70, 5
    dt = torch.float64
    d = {"read": f, "exp": 21, "elu": f}[kind]
    if kind == "read":
        xq, xk = (torch.rand(b, h, n, f, generator=g, dtype=dt) for _ in range(2))
    else:
        xq, xk = (torch.randn(b, h, n, d, generator=g, dtype=dt) for _ in range(2))
    ls = torch.rand(b, h, n, generator=g, dtype=dt) * 40 - 20
    ls[0, 0, :51] = float("-inf")
    v = torch.randn(b, h, n, dv, generator=g, dtype=dt)
    kv = torch.rand(b, h, f, dv + 1, generator=g, dtype=dt)
    kv[1, 0] = 0.0
    log_scale = torch.tensor([[2.0, -3.0], [core.LOG_FLOOR, 9.0]], dtype=dt)
    lg = None
    if gated:
        lg = torch.log(torch.rand(b, h, n, generator=g, dtype=dt)).clamp_min(core.LOG_GATE_FLOOR)
    xq, xk, ls, v, kv, log_scale = (t.to(device) for t in (xq, xk, ls, v, kv, log_scale))
    lg = None if lg is None else lg.to(device)
    projection = None
    if kind == "exp":
        w = torch.randn(f, d, generator=g, dtype=dt).to(device)
        projection = fused_kernels.Projection(w, fused_kernels.row_max(xq, w),
                                              fused_kernels.row_max(xk, w))
    elif kind == "elu":
        projection = fused_kernels.Projection(None)
    return xq, xk, ls, v, kv, log_scale, lg, projection


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("kind, split, gated", [
    ("read", 3, False), ("read", 3, True), ("read", 7, True), ("exp", 3, True),
    ("elu", 3, False)], ids=["read-3", "read-3-gated", "read-7-gated", "exp-3-gated", "elu-3"])
def test_segments_equal_one_walk(kind, split, gated, device):
    """Split 3 (segments of 3, 3 and 1 chunks) and 7 (a chunk each): the forward's outputs at
    their row scales, the state after and the checkpoints (every 2 chunks, some at a segment's
    start) at their running scales, and the backward's gradients of φ (or x̃), v, the entering
    state and the products φ·dφ, equal one walk's."""
    xq, xk, ls, v, kv, log_scale, lg, projection = _inputs(kind, gated, device)
    runs = {}
    for count in (1, split):
        num, den, m, after, running, marks = fused_kernels.forward(
            xq, xk, ls, v, kv, log_scale, 16, 32, lg, projection, split=count)
        g = torch.Generator().manual_seed(5)
        d_out = torch.randn(num.shape, generator=g, dtype=num.dtype).to(device)
        div = (torch.rand(den.shape, generator=g, dtype=den.dtype) + 0.5).to(device)
        g_den = torch.randn(den.shape, generator=g, dtype=den.dtype).to(device)
        g_after = torch.randn(after.shape, generator=g, dtype=after.dtype).to(device)
        grads = fused_kernels.backward(xq, xk, ls, v, kv, m, running, d_out, div, g_den,
                                       g_after, 16, lg, projection, split=count)
        runs[count] = (num, den, m, after, running, marks, grads)
    num, den, m, after, running, marks, grads = runs[split]
    num1, den1, m1, after1, running1, marks1, grads1 = runs[1]
    _close(running, running1)
    _close(num * torch.exp(m - m1)[..., None], num1)
    _close(den * torch.exp(m - m1), den1)
    _close(after * torch.exp(running - running1)[..., -1:, None], after1)
    at = torch.exp(running - running1)[..., 2:-1:2, None, None]
    assert marks.shape[2] == at.shape[2] == 3
    _close(marks * at, marks1)
    d_q, d_k, d_v, d_kv, sums = grads
    want_q, want_k, want_v, want_kv, want_sums = grads1
    for a, b in zip((d_q, d_k, d_v, d_kv), (want_q, want_k, want_v, want_kv), strict=True):
        _close(a, b)
    assert (sums is None) == (projection is None)
    if sums is not None:
        for a, b in zip(sums, want_sums, strict=True):
            _close(a, b)


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_half_precision_and_deterministic_segments_equal_one_walk(gated, device):
    """fp16 φ and v (chunks of 32: N = 100 is 4 chunks, split in 2), with
    ``torch.use_deterministic_algorithms`` on (the feature blocks write their own buffers):
    outputs, state after and gradients within fp16's rounding of one walk's."""
    xq, xk, ls, v, kv, log_scale, lg, _ = _inputs("read", gated, device)
    xq, xk, v = xq.half(), xk.half(), v.half()
    ls, kv, log_scale = ls.float(), kv.float(), log_scale.float()
    lg = None if lg is None else lg.float()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = {}
        for count in (1, 2):
            num, den, m, after, running, _ = fused_kernels.forward(
                xq, xk, ls, v, kv, log_scale, 32, None, lg, split=count)
            g = torch.Generator().manual_seed(5)
            d_out = torch.randn(num.shape, generator=g).to(device)
            div = (torch.rand(den.shape, generator=g) + 0.5).to(device)
            g_den = torch.randn(den.shape, generator=g).to(device)
            grads = fused_kernels.backward(xq, xk, ls, v, kv, m, running, d_out, div, g_den,
                                           torch.randn(after.shape, generator=g).to(device),
                                           32, lg, split=count)
            runs[count] = (num * torch.exp(m)[..., None], den * torch.exp(m),
                           after * torch.exp(running[..., -1:, None]), *grads[:4])
    finally:
        torch.use_deterministic_algorithms(before)
    for a, b in zip(runs[2], runs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3 * b.abs().max().item())


def test_per_feature_segments_equal_one_walk(device):
    """Hedgehog's per-feature kernels (effattn.kernelized.fused_exponents_kernels), split into
    3 segments (3, 3 and 1 chunks): the shifts, the outputs, the state after,
    its maxima and the checkpoints equal one walk's, and so do the gradients of x̃, v, the
    entering state, the rows and the offsets. Keys whose exponents grow along the sequence
    (each segment raises the running maxima), an entering state at the floor for one (batch,
    head) pair and the first 51 keys of another padded."""
    from effattn.kernelized import fused_exponents_kernels as fek

    g = torch.Generator().manual_seed(11)
    b, h, n, f, d, dv = 2, 2, 100, 70, 21, 5
    dt = torch.float64
    xq, xk = (torch.randn(b, h, n, d, generator=g, dtype=dt) for _ in range(2))
    # Keys whose exponents grow along the sequence: each segment raises the running maxima.
    xk = xk * torch.linspace(0.5, 4.0, n, dtype=dt)[:, None]
    w = torch.randn(h, f, d, generator=g, dtype=dt)
    bias = torch.randn(h, f, generator=g, dtype=dt)
    ls = torch.zeros(b, h, n, dtype=dt)
    ls[0, 0, :51] = float("-inf")
    v = torch.randn(b, h, n, dv, generator=g, dtype=dt)
    kv = torch.rand(b, h, f, dv + 1, generator=g, dtype=dt)
    scale = torch.randn(b, h, f, generator=g, dtype=dt)
    kv[1, 0], scale[1, 0] = 0.0, core.LOG_FLOOR
    xq, xk, w, bias, ls, v, kv, scale = (
        t.to(device) for t in (xq, xk, w, bias, ls, v, kv, scale))
    runs = {}
    split = 3
    for count in (1, split):
        num, den, after, running, marks, shift = fek.forward(
            xq, xk, ls, v, kv, scale, w, bias, 16, 32, split=count)
        g = torch.Generator().manual_seed(5)
        d_out = torch.randn(num.shape, generator=g, dtype=dt).to(device)
        div = (torch.rand(den.shape, generator=g, dtype=dt) + 0.5).to(device)
        g_den = torch.randn(den.shape, generator=g, dtype=dt).to(device)
        g_after = torch.randn(after.shape, generator=g, dtype=dt).to(device)
        grads = fek.backward(xq, xk, ls, v, kv, running, shift, d_out, div, g_den, g_after, w,
                             bias, 16, split=count)
        runs[count] = (shift, num, den, after, running, marks, *grads)
    assert runs[1][5].shape[2] == 3
    for a, b_ in zip(runs[split], runs[1], strict=True):
        _close(a, b_)


def test_segments_fill_a_gpu_and_no_more(monkeypatch):
    """One program per multiprocessor is aimed at, a segment at least SEGMENT_CHUNKS chunks
    (so that a backward span of tens of chunks is not split); off a GPU, none."""
    cpu = torch.device("cpu")
    assert fused_kernels.multiprocessors(cpu) == 0
    assert fused_kernels.segments(cpu, 8, 4096) == 1
    monkeypatch.setattr(fused_kernels, "multiprocessors", lambda device: 132)
    assert fused_kernels.SEGMENT_PROGRAMS == 1 and fused_kernels.SEGMENT_CHUNKS == 64
    assert fused_kernels.segments(cpu, 8, 2048) == 17  # linear, B = 1, H = 8
    assert fused_kernels.segments(cpu, 32, 2048) == 5  # 256 features: 4 blocks
    assert fused_kernels.segments(cpu, 8, 400) == 6  # 400 chunks: segments of 64 at least
    assert fused_kernels.segments(cpu, 8, 100) == 1
    assert fused_kernels.segments(cpu, 8 * 16 * 4, 2048) == 1  # B = 8, H = 16, F = 256
    assert fused_kernels._split(7, 3) == (3, 3)
    assert fused_kernels._split(7, 7) == (1, 7)
    assert fused_kernels._split(2, 5) == (1, 2)
    assert fused_kernels._split(0, 5) == (1, 1)


@pytest.mark.parametrize("name, options", [("performer", {}), ("rfa", {"gated": True}),
                                           ("hedgehog", {})],
                         ids=["performer", "rfa-gated", "hedgehog"])
def test_a_module_split_into_segments_matches_reference(name, options, monkeypatch):
    """With a GPU's multiprocessors pretended (and segments of 2 chunks allowed), a causal
    call with padding (performer: its map formed inside; gated RFA: the gates' decays between
    segments; hedgehog: its per-feature kernels) splits the forward and the backward into
    segments, and its outputs and gradients (the gate's and the map's too) equal the float64
    reference."""
    monkeypatch.setattr(fused_kernels, "multiprocessors", lambda device: 16)
    monkeypatch.setattr(fused_kernels, "SEGMENT_CHUNKS", 2)
    # One combination for both cores: per row, and per feature (hedgehog's).
    calls = count_calls(monkeypatch, {"entering": (fused_kernels, "_entering"),
                                      "adjoints": (fused_kernels, "_adjoints")})
    module = make_kernelized(name, options)
    q, k, v = (t.requires_grad_(True) for t in qkv(n=130, d=21, dv=5, scale=0.5))
    extra, kw = (), {}
    if options:
        g = torch.Generator().manual_seed(1)
        gate = torch.sigmoid(3 * torch.randn(2, 3, 130, generator=g, dtype=torch.float64))
        extra, kw = (gate.requires_grad_(),), {"gate": gate}
    matches_reference(module, q, k, v, extra, **kw)
    # The forward's entering states, the backward's again, and its adjoints.
    assert calls == {"entering": 2, "adjoints": 1}
