"""The ``triton`` strategy of the kernelized engine: the causal scan in fused Triton kernels.

The GPU strategy (:mod:`effattn.kernelized.gpu`) forms the chunk-parallel sums with a few
hundred ATen operations per call, whatever N: on a GPU each is a kernel launch, and it holds
the chunk states ((N / C) F (Dv + 1) values) and the C x C blocks of every chunk of a slice at
once. This strategy runs the causal form in one kernel
(:mod:`effattn.kernelized.fused_kernels`): each program walks the chunks of one (batch, head,
feature block) in order with its state in registers, and writes only the outputs, so that what
a forward holds beyond φ(Q), φ(K) is the output itself and a few scalars per token; its backward
is two more kernels (queries in order, keys in reverse with the states' adjoint). The
sums, the scales (every exponent <= 0, no future key setting a scale), the eps floor of the
divisor and the lost-row check are the other strategies'; the results agree to rounding.

The maps handed to the core as data, their projection not trained, are formed inside the
kernels (:func:`_map`): performer's positive map and its hyperbolic pair
(:class:`~effattn.kernelized.features.PositiveMap`, φ = exp(x̃ w^T - m), with the row maxima m
from one more small kernel), the trigonometric maps
(:class:`~effattn.kernelized.features.SineMap`, φ = sin(x̃ w^T + b): performer's trig, FAVOR's
random-phase cosine, RFA's sin/cos with its learned σ), the rectified ones
(:class:`~effattn.kernelized.features.ReluMap`, φ = relu(x̃ w^T) + a floor: performer's relu,
RFA's arc-cosine) and Taylor's (:class:`~effattn.kernelized.features.TaylorMap`, each feature
a product of two affine maps of x̃). The kernels read x̃ (N x D: x·√scale, RFA's unit(x)/σ,
or Taylor's N x P projection) and the projection in place of φ(Q), φ(K) (N x F), and the
backward kernels return the gradient of x̃ rather than of φ (autograd takes it on to q, k, σ
and Taylor's learned projection), so that nothing of size N x F is held.
The linear transformer's elu + 1 (:class:`~effattn.kernelized.features.EluMap`, F = D, no
projection) is formed from q and k themselves, read in their own dtype: a bf16 call holds no
fp32 copy of them either.

What it runs and what it hands on:

- causal, eager (gated RFA too: its gates are decays within and between chunks; and the
  window hybrid's normalised form: its log |d| comes from the kernels' denominators and row
  scales): the fused kernels, in the GPU strategy's slices
  (:func:`effattn.kernelized.gpu.slice_tokens`), each handing its state to the next; training
  keeps q, k, v, the output, two scalars per token and a checkpoint state every S_b tokens
  (written by the forward kernel), and the backward recomputes φ span by span of S_b tokens
  (:func:`backward_span_tokens`, :class:`_FusedCausal`);
- calls traced by ``torch.compile`` (whose inductor fuses the GPU strategy's ATen operations
  itself): the GPU strategy;
- non-causal and cross-attention (two batched GEMMs already), and decoding: the GPU strategy's
  functions.

Where a launch's (feature block, batch-head) programs would leave a GPU's multiprocessors idle
(B = 1, H = 8: 8 to 32 programs), the kernels split its chunks into segments walked side by
side (:func:`effattn.kernelized.fused_kernels.segments`; the module docstring there says how),
in the forward and in the backward's spans alike.

Hedgehog's exp map, whose per-feature core scales each feature by its own running max, has
kernels of its own (:mod:`effattn.kernelized.fused_exponents`), which
:func:`effattn.kernelized.exponents.causal` calls under this strategy.

It is chosen only when asked for (``EFFATTN_STRATEGY=kernelized=triton`` or
``effattn.strategy.force(kernelized="triton")``): on one H200 (bf16, B = 1, H = 8, causal) it
held 4x to 7x less than the GPU strategy in forward+backward but took 1.05x to 2.5x its time
(docs/gpu.md, "Measured on a GPU"; ``benchmarks/gpu_peers.py``, suite ``triton``). It needs the
``triton`` package (a dependency of CUDA builds of torch). On CPU tensors the kernels run under
Triton's interpreter, for tests: ``TRITON_INTERPRET=1`` set before effattn's kernels are first
imported.

``chunk_size`` is rounded up to a power of two of at least 16 (the smallest tile of Triton's
``tl.dot``) and capped by dtype (:func:`effattn.kernelized.fused_kernels.tile`: 32 in half
precision, 16 in fp32 and fp64, what the kernels' registers and shared memory allow): the chunk
only sets where the exact C x C blocks end, not the result.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn.base import compute_dtype
from effattn.kernelized import core, gpu
from effattn.kernelized import features as fm
from effattn.kernelized.core import FeatureFn, Normaliser, RecurrentState

if TYPE_CHECKING:  # imported at the first use: it imports triton
    from effattn.kernelized.fused_kernels import Projection

key_state = gpu.key_state
read_queries = gpu.read_queries
# Its causal form takes q, k, v (and a gate) in half precision: q and k are promoted slice by
# slice and span by span, one at a time (features overflow in half precision:
# effattn.base.compute_dtype), the kernels read v as it is, and the output comes back in their
# dtype, so that no fp32 copy of them is held: a module may hand them over as they are
# (:func:`effattn.kernelized.core.promotes_inside`).
PROMOTES_INSIDE = True

# The backward recomputes spans of BACKWARD_SLICE_SCALE times the CPU strategy's causal budget,
# from checkpoint states the forward kernel writes at their starts: what a span's backward
# holds (φ(Q), φ(K), the feature map's graph, their fp32 gradients: about 8 F values a token)
# then stays under what an inference forward holds of a slice (φ(Q), φ(K) of a GPU-strategy
# slice, SLICE_SCALE = 64 times that budget). Shorter spans hold less and launch more (a feature
# map and its backward per span).
BACKWARD_SLICE_SCALE = 8


def _kernels() -> Any:
    """:mod:`effattn.kernelized.fused_kernels`, imported at the first use (it imports triton),
    with a clear error where triton is missing."""
    try:
        from effattn.kernelized import fused_kernels
    except ImportError as err:
        raise RuntimeError(
            "the kernelized engine's triton strategy needs the triton package (CUDA builds of "
            f"torch bring it; `pip install triton` elsewhere): {err}"
        ) from None
    return fused_kernels


def runs(x: Tensor) -> bool:
    """Whether the kernels can run tensors like x: on CUDA, or on the CPU under Triton's
    interpreter."""
    from triton import knobs

    return x.device.type == "cuda" or bool(knobs.runtime.interpret)


def causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    state: RecurrentState | None,
    *,
    feature_dim: int,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk_size: int,
    eps: float,
    slice_elements: int,
    feature_tensors: Sequence[Tensor] | None,
    normaliser: bool,
) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """Causal kernelized attention of q, k (B, H, N, D), v (B, H, N, Dv) after ``state``
    (:func:`effattn.kernelized.gpu.causal`'s contract), in the fused kernels where they apply
    (module docstring), else by the GPU strategy.

    Raises RuntimeError where triton is missing or, on CPU tensors, not interpreting; and
    :class:`~effattn.kernelized.core.DenominatorUnderflowError` as the other strategies do.
    """
    if torch.compiler.is_compiling():
        dt = compute_dtype(q.dtype)
        q, k, v, gate = q.to(dt), k.to(dt), v.to(dt), None if gate is None else gate.to(dt)
        return gpu.causal(q, k, v, features, state, feature_dim=feature_dim,
                          key_padding_mask=key_padding_mask, gate=gate, chunk_size=chunk_size,
                          eps=eps, slice_elements=slice_elements,
                          feature_tensors=feature_tensors, normaliser=normaliser)
    _kernels()
    if not runs(q):
        raise RuntimeError(
            "the kernelized engine's triton strategy runs CUDA tensors, or CPU tensors under "
            "Triton's interpreter (TRITON_INTERPRET=1 before effattn's kernels are imported); "
            f"got tensors on {q.device}"
        )
    b, h, n = q.shape[:3]
    step = gpu.slice_tokens(b * h, feature_dim, v.shape[-1], chunk_size, slice_elements)
    position = 0 if state is None else state.position
    if core._recording():
        tensors = core._feature_inputs(features, q, True, feature_tensors)
        if feature_tensors is None:
            tensors = core._unique(tensors + core._feature_inputs(features, k, False, None))
        if core._needs_grad(q, k, v, gate, None if state is None else state.kv, *tensors):
            kv, scale = (None, None) if state is None else (state.kv, state.log_scale)
            back = backward_span_tokens(b * h, feature_dim, v.shape[-1], chunk_size,
                                        slice_elements, compute_dtype(q.dtype))
            out, kv, scale, log_abs, sign = _FusedCausal.apply(
                q, k, v, gate, key_padding_mask, kv, scale, features, chunk_size, eps,
                (step, back), normaliser, *tensors)
            return (out, RecurrentState(kv, scale, position + n),
                    Normaliser(log_abs, sign) if normaliser else None)
    out, after, norm, _ = _sliced(q, k, v, gate, key_padding_mask, state, features, chunk_size,
                                  eps, step, None, normaliser)
    return out, RecurrentState(after.kv, after.log_scale, position + n), norm


def backward_span_tokens(batch_heads: int, feature_dim: int, value_dim: int, chunk_size: int,
                         slice_elements: int, dtype: torch.dtype) -> int:
    """Tokens per span of :class:`_FusedCausal`'s backward: ``BACKWARD_SLICE_SCALE`` times the
    CPU strategy's causal budget, a multiple of the kernels' chunk for ``dtype`` (where
    checkpoints can be written)."""
    chunk = _kernels().tile(chunk_size, dtype)
    return core.causal_slice_tokens(batch_heads, feature_dim, value_dim, chunk,
                                    slice_elements * BACKWARD_SLICE_SCALE)


class _Slice:
    """What one slice's forward leaves for its backward: the entering state, the checkpoint
    states (B, H, n_marks, F, Dv + 1) entering its backward spans after the first, the row
    scales m and the denominators (B, H, n, 1), and the running scales R_0..R_nc
    (B, H, nc + 1)."""

    def __init__(self, state: RecurrentState, marks: Tensor, m: Tensor, den: Tensor,
                 running: Tensor) -> None:
        self.state, self.marks, self.m, self.den, self.running = state, marks, m, den, running


def _log_weights(key_log_scale: Tensor | None, pad: Tensor | None, gate: Tensor | None,
                 like: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The keys' log-weights (B, H, n) as the kernels read them: the log-scales (0 in
    ``dtype``, shaped as ``like``'s first three dimensions, for maps without them) plus
    log(1 - g) with a gate g, -inf at padded keys (a padded key has no
    weight and sets no scale); and the log-gates (B, H, n) (None ungated), floored at
    ``LOG_GATE_FLOOR`` and 0 at padded tokens (which leave the state alone), as the other
    strategies form them (:func:`effattn.kernelized.chunkwise._factors`)."""
    if key_log_scale is None:
        ls = like.new_zeros(like.shape[:3], dtype=dtype)
    else:
        ls = key_log_scale[..., 0]
    log_gate = None
    if gate is not None:
        # log(1 - g), 1 - g floored at the dtype's smallest normal number first: at a gate of
        # exactly 1 (a saturated sigmoid) log's gradient would be 0 * inf = NaN. Such a gate gets
        # 0 from its key's weight (the other strategies, which multiply by 1 - g, get the exact
        # value).
        ls = ls + torch.log((1.0 - gate).clamp_min(torch.finfo(gate.dtype).tiny))
        log_gate = core.log_gates(gate)
    if pad is not None:
        ls = ls.masked_fill(pad[:, None, :], float("-inf"))
        if log_gate is not None:
            log_gate = log_gate.masked_fill(pad[:, None, :], 0.0)
    return ls.contiguous(), None if log_gate is None else log_gate.contiguous()


def _map(features: FeatureFn, q: Tensor, k: Tensor,
         ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Projection | None]:
    """What the kernels read of q and k (B, H, n, D): (φ(Q), φ(K), the queries' and keys'
    log-scales, None); for a map given as data whose projection is not trained (the positive
    maps, :class:`~effattn.kernelized.features.PositiveMap`, the trigonometric ones,
    :class:`~effattn.kernelized.features.SineMap`, and the rectified ones,
    :class:`~effattn.kernelized.features.ReluMap`) and for Taylor's
    (:class:`~effattn.kernelized.features.TaylorMap`, whose learned projection is part of its
    inputs) x̃ = the map's inputs of q, k in place of φ, and the
    :class:`~effattn.kernelized.fused_kernels.Projection` with which the kernels form φ
    themselves, so that no N x F features are held; for elu + 1
    (:class:`~effattn.kernelized.features.EluMap`) q and k themselves, in their own dtype.
    Differentiable in q, k (every form, and in the tensors the map's inputs read, such as RFA's
    learned σ) where grad mode is on. Other than for elu + 1, half-precision q, k are promoted
    here, one at a time (:func:`effattn.base.compute_dtype`): a promoted copy lives only while
    its own map is formed."""
    dt = compute_dtype(q.dtype)
    if isinstance(features, fm.EluMap):
        # q and k as they are, half precision too: the kernels convert their tiles.
        return q, k, None, None, _kernels().Projection(None)
    if isinstance(features, fm.TaylorMap):
        xq, xk = features.inputs(q.to(dt)), features.inputs(k.to(dt))
        return xq, xk, None, None, _taylor_projection(xq.shape[-1], xq.dtype, xq.device)
    formed = (fm.PositiveMap, fm.SineMap, fm.ReluMap)
    if isinstance(features, formed) and not features.w.requires_grad:
        xq, xk = features.inputs(q.to(dt)), features.inputs(k.to(dt))
        kernels = _kernels()
        if isinstance(features, fm.ReluMap):
            w = features.w.to(xq.dtype).contiguous()
            floors = w.new_full(w.shape[:1], features.floor())
            return (xq, xk, features.log_scale(xq, is_query=True),
                    features.log_scale(xk, is_query=False),
                    kernels.Projection(w, floors=floors))
        w = features.rows().to(xq.dtype).contiguous()
        if isinstance(features, fm.SineMap):
            return (xq, xk, features.log_scale(xq, is_query=True),
                    features.log_scale(xk, is_query=False),
                    kernels.Projection(w, phases=features.phases().to(xq.dtype)))
        mq = kernels.row_max(xq.detach().contiguous(), w)
        mk = kernels.row_max(xk.detach().contiguous(), w)
        f = w.shape[0]
        return (xq, xk, fm.positive_log_scale(xq, mq[..., None], f, is_query=True),
                fm.positive_log_scale(xk, mk[..., None], f, is_query=False),
                kernels.Projection(w, mq, mk))
    phi_q, query_log_scale = features(q.to(dt), is_query=True)
    phi_k, key_log_scale = features(k.to(dt), is_query=False)
    core._check_shapes(phi_q, phi_k, None, key_log_scale)
    return phi_q, phi_k, query_log_scale, key_log_scale, None


@functools.cache
def _taylor_projection(p: int, dtype: torch.dtype, device: torch.device) -> Projection:
    """Taylor's factors (:meth:`~effattn.kernelized.features.TaylorMap.factors`) of a
    P-dimensional x̃ as the kernels read them, built once per (P, dtype, device) rather than
    in every slice and backward span (constants: dozens of small operations to build)."""
    a, c, b, e = fm.TaylorMap.factors(p, torch.empty(0, dtype=dtype, device=device))
    return _kernels().Projection(a, second=c, biases=torch.stack([b, e]))


def _forward_slice(q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, pad: Tensor | None,
                   state: RecurrentState | None, features: FeatureFn, chunk: int,
                   eps: float, back: int | None, normaliser: bool,
                   ) -> tuple[Tensor, RecurrentState, Normaliser | None, Tensor | None, _Slice]:
    """One slice: the output (B, H, n, Dv, in q's dtype), the state after, with
    ``normaliser`` each query's :class:`~effattn.kernelized.core.Normaliser` (else None), the
    lost-row flag (None: not checked) and what its backward needs, with checkpoints every
    ``back`` tokens (None: none)."""
    kernels = _kernels()
    b, h = q.shape[:2]
    phi_q, phi_k, query_log_scale, key_log_scale, projection = _map(features, q, k)
    # v as it is: the kernels convert its tiles (no promoted copy).
    gate = None if gate is None else gate.to(compute_dtype(q.dtype))
    dt = compute_dtype(q.dtype)
    ls, log_gate = _log_weights(key_log_scale, pad, gate, phi_k, dt)
    f = phi_k.shape[-1] if projection is None or projection.w is None else projection.w.shape[0]
    state = core._state_of(state, b, h, f, v.shape[-1], ls)
    num, den, m, kv, running, marks = kernels.forward(
        phi_q.contiguous(), phi_k.contiguous(), ls, v.contiguous(), state.kv,
        state.log_scale.reshape(b, h), chunk, back, log_gate, projection)
    den, m = den[..., None], m[..., None]
    out = num.div_(core._divisor(den, eps, m)).to(q.dtype)
    after = RecurrentState(kv.to(dt),
                           running[..., -1:, None].to(state.log_scale.dtype))
    norm = Normaliser(*core._normaliser(den, eps, m, query_log_scale)) if normaliser else None
    # A gate can decay what a query sees to a legitimate 0: only ungated rows are checked.
    lost = None if gate is not None else core._lost_rows(den, eps, m)
    return out, after, norm, lost, _Slice(state, marks, m, den, running)


def _sliced(q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, pad: Tensor | None,
            state: RecurrentState | None,
            features: FeatureFn, chunk: int, eps: float, step: int, back: int | None,
            normaliser: bool) -> tuple[Tensor, RecurrentState, Normaliser | None, list[_Slice]]:
    """:func:`_forward_slice` slice after slice of ``step`` tokens (checkpoints every ``back``);
    raises on lost rows after the last (one host sync). The output is in q's dtype
    (half-precision inputs give a half-precision output, as softmax attention's kernels do):
    each slice's is converted before the next slice's work, and joined at the end. (One
    tensor allocated at the start and written slice by slice would hold the whole output
    during the first slice's work too, the larger peak wherever a slice's work outweighs the
    output.)"""
    outs, norms, lost, slices = [], [], [], []
    for a, e in core._spans(q.shape[2], step):
        out, state, norm, flag, saved = _forward_slice(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None if gate is None else gate[:, :, a:e],
            None if pad is None else pad[:, a:e], state, features, chunk, eps, back, normaliser)
        outs.append(out)
        norms.append(norm)
        lost.append(flag)
        slices.append(saved)
    core._raise_if_lost(lost, compute_dtype(q.dtype))
    norm = None
    if normaliser:
        norm = Normaliser(torch.cat([x.log_abs for x in norms], 2),
                          torch.cat([x.sign for x in norms], 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), state, norm, slices


class _FusedCausal(torch.autograd.Function):
    """:func:`causal` in the fused kernels, keeping q, k, v, the output, and per slice what
    :class:`_Slice` lists (states every S_b tokens, S_b = :func:`backward_span_tokens`, and a
    few scalars per token): O(N (D + Dv)) between forward and backward, no φ and no chunk state
    beyond the checkpoints.

    Backward, span by span of S_b tokens from the last
    (:func:`effattn.kernelized.core._backward_in_spans`): φ(Q), φ(K) and the log-scales
    recomputed under autograd; the gradient of [num, den] from the output's (the divisor's
    rule, :func:`effattn.kernelized.core._ratio_grad`) and, for the hybrid, from the
    normaliser's log |d| (1 / d to the denominator where d is it, and all of it to the query's
    log-scale); the backward kernels from the span's
    checkpoint for dφ(Q), dφ(K), dv and the state entering the span; ∂L/∂ls_j =
    φ(k_j)·dφ(k_j); then autograd through the feature map to q, k and its tensors.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None,
                key_padding_mask: Tensor | None, kv: Tensor | None, log_scale: Tensor | None,
                features: FeatureFn, chunk: int, eps: float, steps: tuple[int, int],
                normaliser: bool, *tensors: Tensor) -> tuple[Tensor, ...]:
        step, back = steps
        out, state, norm, slices = _sliced(
            q, k, v, gate, key_padding_mask,
            None if kv is None else RecurrentState(kv, log_scale), features, chunk, eps, step,
            back, normaliser)
        ctx.features, ctx.chunk, ctx.eps, ctx.normaliser = features, chunk, eps, normaliser
        # Each span: its tokens, and where its entering state is (slice, checkpoint or -1).
        ctx.spans, ctx.where = [], []
        for i, (a, e) in enumerate(core._spans(q.shape[2], step)):
            for j, start in enumerate(range(a, e, back)):
                ctx.spans.append((start, min(e, start + back)))
                ctx.where.append((i, a, j - 1))
        saved = [t for s in slices for t in (s.state.kv, s.marks, s.m, s.den, s.running)]
        # The state after the last slice: a gate's gradient reads the state after each span.
        ctx.save_for_backward(q, k, v, gate, key_padding_mask, out, state.kv, *saved, *tensors)
        if norm is None:
            norm = Normaliser(out.new_empty(0), out.new_empty(0))
        ctx.mark_non_differentiable(state.log_scale, norm.sign)
        return out, state.kv, state.log_scale, norm.log_abs, norm.sign

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_kv: Tensor | None, _: Tensor | None,
                 d_log_abs: Tensor | None, __: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, gate, pad, out, final, *rest = ctx.saved_tensors
        spans = ctx.spans
        slices = len({w[0] for w in ctx.where})
        saved, tensors = rest[:5 * slices], rest[5 * slices:]
        kernels = _kernels()
        chunk = kernels.tile(ctx.chunk, compute_dtype(q.dtype))

        def after(i: int) -> Tensor:
            """The state after span i: the next span's checkpoint, the next slice's entering
            state, or the last."""
            s, _, mark = ctx.where[i]
            if i + 1 < len(spans) and ctx.where[i + 1][0] == s:
                return saved[5 * s + 1][:, :, mark + 1]
            return final if i + 1 == len(spans) else saved[5 * (s + 1)]

        def span(i: int, leaves: list[Tensor | None],
                 d_after: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
            a, e = spans[i]
            s, start, mark = ctx.where[i]
            kv, marks, m, den, running = saved[5 * s:5 * s + 5]
            if mark >= 0:
                kv = marks[:, :, mark]
            # The span's rows of the slice's scalars; its chunks' running scales (and the next).
            r0, r1 = a - start, e - start
            m, den = m[:, :, r0:r1], den[:, :, r0:r1]
            running = running[..., r0 // chunk:-(-r1 // chunk) + 1].contiguous()
            q_s, k_s, v_s, gate_s = leaves
            with torch.enable_grad():
                # Half-precision leaves promoted here, under autograd: their gradients come
                # back in their own dtype.
                phi_q, phi_k, query_log_scale, key_log_scale, projection = _map(
                    ctx.features, q_s, k_s)
                gate_c = None if gate_s is None else gate_s.to(compute_dtype(q_s.dtype))
                ls, log_gate = _log_weights(key_log_scale, None if pad is None else pad[:, a:e],
                                            gate_c, phi_k, compute_dtype(q_s.dtype))
            div = core._divisor(den, ctx.eps, m)[..., 0]
            back = torch.where(div == den[..., 0], -1.0 / div, 0.0)
            # The gradient of [num, den] from the output's (core._ratio_grad's rule): the
            # kernels read it and the output as saved (in q's dtype, as flash attention keeps
            # it for the same product) in place, with no promoted copy of either.
            d_out_s = d_out[:, :, a:e]
            g_den = kernels.divisor_grad(d_out_s, out[:, :, a:e], back)
            d_query_scale = None
            if ctx.normaliser and d_log_abs is not None:
                # log |d| + the scales: d receives d_log_abs / d where it is the denominator.
                d_query_scale = d_log_abs[:, :, a:e, None]
                g_den.sub_(d_query_scale[..., 0] * back)
            pq, pk = phi_q.detach().contiguous(), phi_k.detach().contiguous()
            d_q, d_k, d_v, d_kv_in, sums = kernels.backward(
                pq, pk, ls.detach(), v_s.detach().contiguous(), kv, m[..., 0].contiguous(),
                running, d_out_s, div, g_den, d_after, ctx.chunk,
                None if log_gate is None else log_gate.detach(), projection)
            # The output depends on φ(k_j) and its log-weight only through φ(k_j) e^{ls_j}:
            # ∂L/∂ls_j = φ(k_j)·dφ(k_j) (the kernels' sums, where they form φ themselves).
            keys = (pk.to(d_k.dtype) * d_k).sum(-1) if sums is None else sums[1]
            d_log_gate = None
            if log_gate is not None and log_gate.requires_grad:
                queries = (pq.to(d_q.dtype) * d_q).sum(-1) if sums is None else sums[0]
                d_log_gate = _log_gate_grad(queries, keys, d_after, after(i))
            got = core._backprop(
                (phi_q, phi_k, ls, log_gate, query_log_scale),
                (d_q.to(phi_q.dtype), d_k.to(phi_k.dtype), keys.to(ls.dtype),
                 None if d_log_gate is None else d_log_gate.to(log_gate.dtype),
                 None if query_log_scale is None else d_query_scale),
                [q_s, k_s, *([] if gate_s is None else [gate_s]), *tensors])
            d_values = d_v.to(v_s.dtype) if v_s.requires_grad else None
            d_gate = None
            if gate_s is not None:
                d_gate = got.pop(2)
            return d_kv_in.to(kv.dtype), [got[0], got[1], d_values, d_gate, *got[2:]]

        needs = ctx.needs_input_grad
        grads, d_kv, d_tensors = core._backward_in_spans(
            (q, k, v, gate), needs[:4], spans, len(tensors), d_kv, span)
        # One gradient per input of forward: q, k, v, gate, the mask, kv, log_scale, features,
        # chunk, eps, steps, normaliser, then the feature tensors.
        return (*grads, None, d_kv if needs[5] else None, None, None, None, None, None, None,
                *d_tensors)


def _log_gate_grad(queries: Tensor, keys: Tensor, d_after: Tensor | None,
                   after: Tensor) -> Tensor:
    """∂L/∂(log g_t) (B, H, n) of a span from Q_i = φ(q_i)·dφ(q_i), K_j = φ(k_j)·dφ(k_j)
    (B, H, n), the gradient of the state after the span and that state (B, H, F, Dv + 1).

    log g_t enters every weight exp(G_i - G_j) with j < t <= i (G the cumulative log-gate):
    a query's terms all carry e^{G_i} (so Q_i is the gradient of its G_i), a key's e^{-G_j}
    (K_j of its -G_j), and the state after the span e^{G_n} (<dS, S>). The pairs j < t <= i are
    those with i >= t less those with j >= t, so

        ∂L/∂(log g_t) = Σ_{i >= t} Q_i - Σ_{j >= t} K_j + <dS_after, S_after>."""
    d = (queries - keys).flip(-1).cumsum(-1).flip(-1)
    if d_after is not None:
        d = d + (d_after.to(d.dtype) * after.to(d.dtype)).sum((-2, -1))[..., None]
    return d
