"""The kernelized core for feature maps given by per-feature exponents, with a per-feature
stabiliser.

A map of this kind returns u (B, H, L, F) with φ(x) = exp(u) elementwise (Hedgehog's
[exp(x W + b), exp(-(x W + b))], Zhang et al. 2024). The row convention of
:mod:`effattn.kernelized.core` holds each key at one scale for all its features (φ over its row
max, times a log-scale), so a pair (q, k) whose peaks sit on different features has every
product exp(u_qf + u_kf - max_f u_qf - max_f u_kf) far below 1: with exponents around 70 in
fp32 that product underflows and the normaliser of a query can be lost. Here each feature has
its own scale, the running max of that feature over the keys a query can see::

    M_f(i) = max_{j <= i} u_kf(j)           (non-causal: over every key)
    c_i    = max_f (u_qf(i) + M_f(i))        (the log of the query's largest term)
    out_i  = Σ_{j<=i} Σ_f exp(u_qf(i) + u_kf(j) - c_i) [v_j, 1]   (numerator and denominator)

Every term is <= 1 and the largest is exactly 1, so the denominator of a query that sees a key
is at least 1 whatever the exponents: no underflow, no eps. The shift c_i cancels in the ratio.
No future key sets a scale: M_f(i) looks at keys j <= i only.

Causal, chunkwise (C tokens per chunk, R_c the running max at the end of chunk c, R_{-1} the
incoming state's):

- the state entering chunk c is held at R_{c-1}: S_c = Σ_{j < chunk c} exp(u_k(j) - R_{c-1})
  [v_j, 1]^T per feature row, every factor <= 1; moving on, its rows decay by
  exp(R_{c-1} - R_c) <= 1 (a per-feature, diagonal decay, as gated linear attention's);
- a query of chunk c reads it with exp(u_q + R_{c-1} - c_i) <= 1;
- inside the chunk, the pair products exp(u_q + R_c - c_i) exp(u_k - R_c) form a C x C GEMM;
  the query factor can exceed 1 by the growth of the running max inside the chunk (it is the
  chunk's later keys that raise R_c). Where no feature grows by more than
  :data:`FP32_GROWTH` inside its chunk (checked on the CPU, one host sync per slice), the GEMM
  runs in the input's dtype with c_i taken over the state and the query's own key (the keys in
  between can only raise it by that growth); otherwise in float64, whose range (e^±709) holds
  any growth up to :data:`GROWTH_LIMIT`, with the exact c_i. A compiled graph always takes
  float64 rather than the host sync. On the GPU strategy the causal form is
  :mod:`effattn.kernelized.exponents_gpu`'s (chunk-parallel, no host sync), and the non-causal
  slices are device-sized; on the triton strategy, for Hedgehog's map handed over as data
  (:class:`~effattn.kernelized.features.AffineExponents`), eager causal calls run
  :mod:`effattn.kernelized.fused_exponents`'s fused kernels (the exponents formed inside them,
  the in-chunk products exact at any growth), everything else the GPU strategy's.

The state is a :class:`~effattn.kernelized.core.RecurrentState` whose ``log_scale`` is per
feature, (B, H, F, 1); decoding (:func:`step_state`, :func:`read_normalised`) keeps it so, and
equals the forward up to rounding.

Gradients are written by hand, as the row core's (:mod:`effattn.kernelized.core`, "Recompute
instead of store"): recording, the forward keeps q, k, v, the output, two scalars per query
(its denominator and, causal, the shift c_i) and the state entering each slice; the backward
recomputes u = exponents(x) a slice at a time under autograd, forms ∂L/∂u and ∂L/∂v
analytically and backpropagates ∂L/∂u into the map's inputs and tensors. The shifts
(M, R, c) are constants that cancel (no gradient), and d/du exp(u - shift) is the term itself.
With G = ∂L/∂[num, den] of the queries (B, H, n, Dv + 1) and, per chunk,
Q = exp(u_q + R_{c-1} - c), K = exp(u_k - R_c), Q' = exp(u_q + R_c - c) (its exponent clamped
at :data:`GROWTH_LIMIT`, no gradient past it), A = (Q' K^T) ⊙ [j <= i] and ∂S the gradient of
the state S_{c+1} after the chunk::

    raw = Q S_c + A [V, 1],   S_{c+1} = exp(R_{c-1} - R_c) ⊙ S_c + K^T [V, 1]
    dA = (G [V, 1]^T) ⊙ [j <= i]
    ∂L/∂u_q = Q ⊙ (G S_c^T) + Q' ⊙ (dA K)
    ∂L/∂u_k = K ⊙ ([V, 1] ∂S^T + dA^T Q')
    ∂L/∂[V, 1] = A^T G + K ∂S,   ∂L/∂S_c = exp(R_{c-1} - R_c) ⊙ ∂S + Q^T G

(exp(R_{c-1} - R_c) ⊙ scales the state's feature rows; the in-chunk terms run in float64
where the forward's did). Non-causal, S = Σ_j exp(u_k(j) - o) [v_j, 1]^T and the read-out
P = exp(u_q + o - c): ∂L/∂u_k = K ⊙ ([V, 1] ∂S^T), ∂L/∂[V, 1] = K ∂S, ∂L/∂u_q = P ⊙ (G S^T),
∂S = P^T G. Long inputs run in slices of about ``slice_elements / SLICE_SHARE`` feature
values, forward and backward (``/ FORWARD_SLICE_SHARE`` without the backward), so training
memory grows with the slice, not the sequence.
Under torch.compile autograd records the forward as it is.

Shapes: B batch, H heads, N queries, M keys, F features (the width of u), Dv value dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn import strategy
from effattn.kernelized import core
from effattn.kernelized.core import (
    LOG_FLOOR,
    RESCALE_MARGIN,
    Normaliser,
    RecurrentState,
    lagged,
    with_ones,
)

# exponents(x (B, H, L, D)) -> u (B, H, L, F): the map is φ(x) = exp(u).
ExponentFn = Callable[[Tensor], Tensor]

# Largest exponent of the in-chunk query factor exp(u_q + R_c - c_i), i.e. of the growth of a
# feature's running max inside one chunk: float64 holds e^709. Larger growth would be clamped
# (and the products through it too small); exponents that grow by 700 inside 32 tokens are not
# a model anyone trains.
GROWTH_LIMIT = 700.0
# Below this largest in-chunk query exponent, the CPU computes the chunk in the input's dtype
# (fp32: products up to e^60 times F·C terms stay far from e^88); above it, in float64.
FP32_GROWTH = 60.0
# Recording for the hand-written backward, a slice of this core holds slice_elements /
# SLICE_SHARE feature values, forward and backward. It was 2 while autograd recomputed each
# slice; written by hand, a causal slice's forward and backward still hold four to seven
# (B, H, S, F) tensors at once (the exponents, the query and key factors, their gradients), the
# row core's one to three of φ, and a training step's peak follows the slice: hedgehog's at
# 4096 tokens (128 features, B·H = 8, fp32, 1 thread) is 61-64 MiB over the inputs at 2 and
# 52-54 at 4 causal (the row core's 57-58), 41-44 and 33-37 non-causal (the row core's 35-40),
# for 5-10% more time at 4 than at 2.
SLICE_SHARE = 4
# Without the backward (inference, or a compiled graph that records the forward), slices of
# slice_elements / FORWARD_SLICE_SHARE: the forward alone holds up to four, and its time falls
# with longer slices (hedgehog's non-causal forward at 4096 takes 10% less at 2 than at 4).
FORWARD_SLICE_SHARE = 2


def _padded(u_k: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    if key_padding_mask is None:
        return u_k
    return u_k.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))


def _state(state: RecurrentState | None, b: int, h: int, f: int, dv: int,
           like: Tensor) -> RecurrentState:
    """``state`` checked to be a per-feature state (B, H, F, Dv + 1) with log-scales
    (B, H, F, 1), or an empty one like ``like``."""
    if state is None:
        return RecurrentState(like.new_zeros(b, h, f, dv + 1),
                              like.new_full((b, h, f, 1), LOG_FLOOR), 0)
    if not isinstance(state, RecurrentState):
        raise ValueError(f"state must be a RecurrentState or None, got {type(state).__name__}")
    if state.kv.shape != (b, h, f, dv + 1) or state.log_scale.shape != (b, h, f, 1):
        raise ValueError(
            f"state has kv {tuple(state.kv.shape)} and log_scale "
            f"{tuple(state.log_scale.shape)}, expected {(b, h, f, dv + 1)} and {(b, h, f, 1)} "
            "(a per-feature state of the same method)"
        )
    return state


def _normaliser(den: Tensor, div: Tensor, top: Tensor) -> tuple[Tensor, Tensor]:
    """The normaliser den · exp(top) of a denominator den held at exp(top) (..., 1), divided
    as ``div``: its log (-inf where no key is seen) and sign, (...)."""
    log_abs = torch.where(den == 0, float("-inf"), torch.log(div) + top)[..., 0]
    return log_abs, (den > 0).to(den.dtype).detach()[..., 0]


def _divisors(den: Tensor) -> tuple[Tensor, Tensor]:
    """The denominators den (..., 1) as divided by, 1 where no key is seen (den = 0: the
    output 0 / 1 and its gradient stay 0), and the gradient factor of :func:`core._ratio_grad`,
    -1 / den (0 where no key is seen): what the row core's divisor is with eps = 0."""
    div = torch.where(den == 0, 1.0, den)
    return div, torch.where(den == 0, 0.0, -1.0 / div)


def _finish(raw: Tensor, top: Tensor,
            normaliser: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """[num, den] (..., Dv + 1) held at exp(top) (..., 1) -> num / den (0 where no key is
    seen), and (when asked) the normaliser den · exp(top) as its log (-inf where no key) and
    sign, (...)."""
    den = raw[..., -1:]
    div = _divisors(den)[0]
    if not normaliser:
        return raw[..., :-1] / div, None, None
    return raw[..., :-1] / div, *_normaliser(den, div, top)


def _exponent_inputs(exponents: ExponentFn, x: Tensor,
                     feature_tensors: Sequence[Tensor] | None) -> tuple[Tensor, ...]:
    """The tensors ``exponents`` reads, as inputs of the recomputing autograd functions: the
    row core's rule (:func:`effattn.kernelized.core._feature_inputs`: given ones are saved, so
    that one changed in place before the backward raises; else those found in the graph)."""
    return core._feature_inputs(lambda y, *, is_query: (exponents(y), None), x, True,
                           feature_tensors)


def _key_state(k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
               exponents: ExponentFn) -> tuple[Tensor, Tensor]:
    u_k = _padded(exponents(k), pad)
    with torch.no_grad():
        top = torch.maximum(u_k.amax(2, keepdim=True).clamp_min(LOG_FLOOR),
                            scale.transpose(-2, -1)).transpose(-2, -1)  # (B, H, F, 1)
    kv = (kv * torch.exp(scale - top)
          + torch.sub(u_k, top.transpose(-2, -1)).exp_().transpose(-2, -1) @ with_ones(v))
    return kv, top


def _key_slices(k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
                exponents: ExponentFn, step: int) -> tuple[Tensor, Tensor]:
    """The keys into the state (kv, scale), ``step`` at a time, the state rescaled per feature
    between slices."""
    for a, z in core._spans(k.shape[2], step):
        kv, scale = _key_state(k[:, :, a:z], v[:, :, a:z],
                               None if pad is None else pad[:, a:z], kv, scale, exponents)
    return kv, scale


def _slice_tokens(b: int, h: int, f: int, slice_elements: int, share: int,
                  multiple: int = 1) -> int:
    """Tokens per slice: about ``slice_elements / share`` feature values (B·H·S·F), a
    multiple of ``multiple`` (the chunk)."""
    tokens = slice_elements // share // max(1, b * h * f)
    return max(multiple, tokens // multiple * multiple)


def key_state(k: Tensor, v: Tensor, exponents: ExponentFn, feature_dim: int, *,
              key_padding_mask: Tensor | None = None, state: RecurrentState | None = None,
              slice_elements: int = 1 << 20,
              feature_tensors: Sequence[Tensor] | None = None) -> RecurrentState:
    """Non-causal: [S, z] = Σ_j exp(u_k(j) - o) [v_j, 1]^T with o_f the max of feature f over
    the keys (and the incoming state's scale): k (B, H, M, D), v (B, H, M, Dv) -> a state with
    per-feature log-scales o (B, H, F, 1). Slice by slice of the keys, the state rescaled per
    feature between them; recording, the forward keeps k, v and the scales only
    (:class:`_KeyState`). ``feature_tensors``: the tensors ``exponents`` reads (None: found)."""
    from effattn.kernelized import exponents_gpu

    slice_elements = exponents_gpu.slice_budget(slice_elements, k)
    b, h, m = k.shape[:3]
    state = _state(state, b, h, feature_dim, v.shape[-1], v)
    if core._recording():
        tensors = _exponent_inputs(exponents, k, feature_tensors)
        if core._needs_grad(k, v, state.kv, *tensors):
            step = _slice_tokens(b, h, feature_dim, slice_elements, SLICE_SHARE)
            kv, scale = _KeyState.apply(k, v, key_padding_mask, state.kv, state.log_scale,
                                        exponents, step, *tensors)
            return RecurrentState(kv, scale, state.position + m)
    step = _slice_tokens(b, h, feature_dim, slice_elements, FORWARD_SLICE_SHARE)
    kv, scale = _key_slices(k, v, key_padding_mask, state.kv, state.log_scale, exponents, step)
    return RecurrentState(kv, scale, state.position + m)


def _key_slice_backward(exponents: ExponentFn, k: Tensor, v: Tensor, pad: Tensor | None,
                        top: Tensor, d_kv: Tensor,
                        tensors: Sequence[Tensor]) -> tuple[Tensor, list[Tensor | None]]:
    """One key slice of :class:`_KeyState`'s backward, from dKV (B, H, F, Dv + 1) at the final
    scale o (``top``, B, H, F, 1): with K = exp(u_k - o) (0 where padded),
    ∂L/∂u_k = K ⊙ ([V, 1] dKV^T) and ∂L/∂v = K dKV (the value columns), the former
    backpropagated through the exponents recomputed under autograd. Returns ∂L/∂v and the
    gradients of k (a leaf) and ``tensors``."""
    with torch.enable_grad():
        u = exponents(k)
    keys = torch.sub(_padded(u.detach(), pad), top.transpose(-2, -1)).exp_()
    d_v = keys @ d_kv[..., :-1]
    d_u = (with_ones(v) @ d_kv.transpose(-2, -1)).mul_(keys)
    del keys
    return d_v, core._backprop((u,), (d_u,), (k, *tensors))


class _KeyState(torch.autograd.Function):
    """The state of :func:`key_state` from the state (kv, scale) before it, keeping k, v and
    the scales only. Backward, slice by slice of the keys (:func:`_key_slice_backward`); the
    incoming kv gets dKV ⊙ exp(scale - o)."""

    @staticmethod
    def forward(ctx: Any, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
                exponents: ExponentFn, step: int,
                *tensors: Tensor) -> tuple[Tensor, Tensor]:
        kv, top = _key_slices(k, v, pad, kv, scale, exponents, step)
        ctx.exponents, ctx.step = exponents, step
        ctx.save_for_backward(k, v, pad, scale if ctx.needs_input_grad[3] else None, top,
                              *tensors)
        ctx.mark_non_differentiable(top)
        return kv, top

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_kv: Tensor, _: Tensor | None) -> tuple[Tensor | None, ...]:
        k, v, pad, scale, top, *tensors = ctx.saved_tensors
        dk = torch.empty_like(k) if ctx.needs_input_grad[0] else None
        dv = torch.empty_like(v) if ctx.needs_input_grad[1] else None
        d_tensors: list[Tensor | None] = [None] * len(tensors)
        for a, z in core._spans(k.shape[2], ctx.step):
            d_v, grads = _key_slice_backward(
                ctx.exponents, core._leaf(k[:, :, a:z], dk is not None), v[:, :, a:z],
                None if pad is None else pad[:, a:z], top, d_kv, tensors)
            core._put(dk, a, z, grads[0])
            core._put(dv, a, z, d_v)
            d_tensors = [core._add(t, g) for t, g in zip(d_tensors, grads[1:], strict=True)]
        d_state = None if scale is None else d_kv * torch.exp(scale - top)
        return dk, dv, None, d_state, None, None, None, *d_tensors


def _read(u_q: Tensor, kv: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    phi, top = against(u_q, scale, is_query=True)
    assert top is not None
    return phi @ kv, top


def read_normalised(state: RecurrentState, u_q: Tensor,
                    normaliser: bool = True) -> tuple[Tensor, Normaliser | None]:
    """Queries' exponents u_q (B, H, N, F) read out of a per-feature ``state``: the output
    (B, H, N, Dv) and (when asked) its normaliser Σ_j φ(q_i)·φ(k_j) at the true scale."""
    out, log_abs, sign = _finish(*_read(u_q, state.kv, state.log_scale), normaliser)
    return out, None if log_abs is None or sign is None else Normaliser(log_abs, sign)


def against(u: Tensor, scale: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor | None]:
    """Exponents u (B, H, L, F) as features in the row core's convention, against the
    per-feature scale o (B, H, F, 1) of a state that holds the keys: keys exp(u - o) (<= 1 for
    every key the state holds; clamped at 1 for others, e.g. padding rows), queries
    exp(u + o - c) with their log-scale c = max_f (u + o). Then φ̃(q)·φ̃(k) e^c = φ(q)·φ(k),
    and φ̃(q) times the state's kv reads it at scale e^c (the window hybrid's band uses both).

    The clamp passes the gradient through: a key that set o, its exponents recomputed with
    other rounding, can land a rounding above it, and must keep its gradient."""
    offset = scale.transpose(-2, -1)  # (B, H, 1, F)
    if not is_query:
        shifted = torch.sub(u, offset)
        # Value 0 above the scale, gradient 1 (shifted - shifted.detach() is 0 with grad 1).
        return torch.where(shifted > 0, shifted - shifted.detach(), shifted).exp_(), None
    shifted = u + offset
    top = shifted.detach().amax(-1, keepdim=True)
    return shifted.sub_(top).exp_(), top


def read_queries(q: Tensor, state: RecurrentState, exponents: ExponentFn, *,
                 slice_elements: int = 1 << 20,
                 feature_tensors: Sequence[Tensor] | None = None) -> Tensor:
    """Non-causal read-out: q (B, H, N, D) -> (B, H, N, Dv), slice by slice of the queries;
    recording, the forward keeps q, the output and its denominators (:class:`_ReadQueries`)."""
    from effattn.kernelized import exponents_gpu

    slice_elements = exponents_gpu.slice_budget(slice_elements, q)
    b, h, n = q.shape[:3]
    f = state.kv.shape[2]
    if core._recording():
        tensors = _exponent_inputs(exponents, q, feature_tensors)
        if core._needs_grad(q, state.kv, *tensors):
            return _ReadQueries.apply(q, state.kv, state.log_scale, exponents,
                                      _slice_tokens(b, h, f, slice_elements, SLICE_SHARE),
                                      *tensors)
    step = _slice_tokens(b, h, f, slice_elements, FORWARD_SLICE_SHARE)
    outs = [_finish(*_read(exponents(q_s), state.kv, state.log_scale), False)[0]
            for q_s in q.split(step, 2)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _query_slice_backward(exponents: ExponentFn, q: Tensor, g: Tensor, kv: Tensor,
                          scale: Tensor, d_kv: Tensor | None,
                          tensors: Sequence[Tensor]) -> list[Tensor | None]:
    """One query slice of :class:`_ReadQueries`'s backward, from g = ∂L/∂[num, den]
    (B, H, n, Dv + 1): with P = exp(u_q + o - c), adds P^T g to ``d_kv`` (when given) and
    returns the gradients of q (a leaf) and ``tensors`` through ∂L/∂u_q = P ⊙ (g [S, z]^T)."""
    with torch.enable_grad():
        u = exponents(q)
    phi = against(u.detach(), scale, is_query=True)[0]
    if d_kv is not None:
        d_kv += phi.transpose(-2, -1) @ g
    return core._backprop((u,), ((g @ kv.transpose(-2, -1)).mul_(phi),), (q, *tensors))


class _ReadQueries(torch.autograd.Function):
    """out = num / den with [num, den] = P [S, z], P = exp(u_q + o - c) (:func:`read_queries`),
    keeping q, the output and its denominators. Backward, slice by slice of the queries
    (:func:`_query_slice_backward`)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, kv: Tensor, scale: Tensor, exponents: ExponentFn,
                step: int, *tensors: Tensor) -> Tensor:
        b, h, n = q.shape[:3]
        out = q.new_empty(b, h, n, kv.shape[-1] - 1)
        den = q.new_empty(b, h, n, 1)
        for a, z in core._spans(n, step):
            raw = _read(exponents(q[:, :, a:z]), kv, scale)[0]
            den[:, :, a:z] = raw[..., -1:]
            torch.div(raw[..., :-1], _divisors(raw[..., -1:])[0], out=out[:, :, a:z])
        ctx.exponents, ctx.step = exponents, step
        ctx.save_for_backward(q, kv, scale, out, den, *tensors)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, scale, out, den, *tensors = ctx.saved_tensors
        need_q, need_kv = ctx.needs_input_grad[:2]
        dq = torch.empty_like(q) if need_q else None
        d_kv = torch.zeros_like(kv) if need_kv else None
        d_tensors: list[Tensor | None] = [None] * len(tensors)
        for a, z in core._spans(q.shape[2], ctx.step):
            g = core._ratio_grad(d_out[:, :, a:z], out[:, :, a:z], *_divisors(den[:, :, a:z]))
            grads = _query_slice_backward(ctx.exponents, core._leaf(q[:, :, a:z], need_q), g, kv,
                                          scale, d_kv, tensors)
            core._put(dq, a, z, grads[0])
            d_tensors = [core._add(t, g) for t, g in zip(d_tensors, grads[1:], strict=True)]
        return dq, d_kv, None, None, None, *d_tensors


def step_state(state: RecurrentState | None, u_k: Tensor, v: Tensor) -> RecurrentState:
    """One decoding step: u_k (B, H, 1, F), v (B, H, 1, Dv) into ``state``, in place unless
    autograd records.

    As the row core's step, the scale is updated lazily: the key enters at
    exp(u_k - scale) <= e^RESCALE_MARGIN, and the state's rows are rescaled (a pass over the
    state) only when a key would exceed that: the read-out shifts each query by its own largest
    term, so a state held up to e^20 below its running max is as exact. On the CPU the check is
    a branch; on a GPU, or compiled, a rescale by exp(0) = 1 where no key exceeds it (no host
    sync per token)."""
    b, h, _, f = u_k.shape
    state = _state(state, b, h, f, v.shape[-1], u_k)
    kv, scale = state.kv, state.log_scale
    key = u_k.transpose(-2, -1)  # (B, H, F, 1)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (u_k, v, kv))
    compiling = torch.compiler.is_compiling()
    in_place = not (recording or compiling or (
        kv.is_inference() and not torch.is_inference_mode_enabled()))
    with torch.no_grad():
        exceeds = key - scale > RESCALE_MARGIN
    branch_free = compiling or strategy.choose("kernelized", kv.device) != "cpu"
    if branch_free or bool(exceeds.any()):
        with torch.no_grad():
            new = torch.where(exceeds, torch.maximum(scale, key), scale)
        decay = torch.exp(scale - new)
        kv, scale = (kv.mul_(decay) if in_place else kv * decay), new
    update = (torch.exp(key - scale), with_ones(v))
    kv = kv.addcmul_(*update) if in_place else torch.addcmul(kv, *update)
    return RecurrentState(kv, scale, state.position + 1)


def step(q: Tensor, k: Tensor, v: Tensor, state: RecurrentState | None,
         exponents: ExponentFn) -> tuple[Tensor, RecurrentState]:
    """q, k (B, H, 1, D), v (B, H, 1, Dv): the decoded output (B, H, 1, Dv) and the state."""
    state = step_state(state, exponents(k), v)
    return read_normalised(state, exponents(q), normaliser=False)[0], state


def _prefix_max(x: Tensor) -> Tensor:
    """Running max along the chunk's tokens of x (B, H, nc, C, F), by log2(C) doubling steps
    (ATen's cummax along a strided dim is several times slower)."""
    shift = 1
    while shift < x.shape[-2]:
        x = torch.maximum(x, F.pad(x[..., :-shift, :], (0, 0, shift, 0), value=float("-inf")))
        shift *= 2
    return x


def _chunked(u_q: Tensor, u_k: Tensor, v: Tensor, pad: Tensor | None,
             chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """u_q, u_k (B, H, n, F) and [v, 1] (B, H, n, Dv + 1), chunk-major (B, H, nc, C, ·): the
    (B, H, nc) batch of every GEMM is one contiguous stride. Padded keys and the keys of the
    tail after n are not there: exp(-inf) = 0, and the running max stays."""
    b, h, n = u_q.shape[:3]
    u_k = _padded(u_k, pad)
    v1 = with_ones(v)
    tail = -n % chunk
    if tail:
        u_q = torch.cat([u_q, u_q.new_zeros(b, h, tail, u_q.shape[-1])], 2)
        u_k = torch.cat([u_k, u_k.new_full((b, h, tail, u_k.shape[-1]), float("-inf"))], 2)
        v1 = torch.cat([v1, v1.new_zeros(b, h, tail, v1.shape[-1])], 2)
    u_q, u_k, v1 = (x.unflatten(2, (-1, chunk)) for x in (u_q, u_k, v1))
    return u_q, u_k, v1


def _running_max(uk_c: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """R_{c-1} and R_c (B, H, nc, 1, F) of chunk-major keys' exponents (B, H, nc, C, F) after
    a state at ``scale`` (B, H, F, 1)."""
    with torch.no_grad():
        ends = torch.cummax(uk_c.amax(-2), 2).values  # (B, H, nc, F)
        first = scale.transpose(-2, -1)  # (B, H, 1, F)
        end = torch.maximum(ends, first).clamp_min(LOG_FLOOR)
        return torch.cat([first, end[:, :, :-1]], 2)[..., None, :], end[..., None, :]


def _in_chunk(shifted: Tensor, uk_c: Tensor, end: Tensor, keys: Tensor,
              wide: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The in-chunk factors Q' = exp(u_q - c + R_c) and K = exp(u_k - R_c) (B, H, nc, C, F),
    from the queries' shifted exponents u_q - c, in float64 when ``wide`` (the query factor's
    exponent clamped at GROWTH_LIMIT; also returned: where it was, which gets no gradient),
    else in the input's dtype: K is ``keys``, and Q' is written over ``shifted`` (the callers'
    own, used up by then: one (B, H, n, F) tensor less)."""
    if not wide:
        return shifted.add_(end).exp_(), keys, None
    wide_end = end.double()
    exponent = shifted.double() + wide_end
    return (exponent.clamp_max(GROWTH_LIMIT).exp_(), (uk_c.double() - wide_end).exp_(),
            exponent > GROWTH_LIMIT)


def _causal_slice(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor,
                  scale: Tensor, exponents: ExponentFn, chunk: int,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """One slice of n tokens of the causal form, from the state (kv, scale) before it:
    [num, den] (B, H, n, Dv + 1) held at exp(c) (B, H, n, 1), the state after it and whether
    the in-chunk products ran in float64."""
    n = q.shape[2]
    uq_c, uk_c, v_c = _chunked(exponents(q), exponents(k), v, pad, chunk)
    before, end = _running_max(uk_c, scale)
    with torch.no_grad():
        # The shift of query i: the log of its largest term, here over the state and its own
        # key. The keys between the chunk's start and i can raise the true one, by at most
        # R_c - max(R_{c-1}, the chunk's smallest key), per feature: below FP32_GROWTH the
        # chunk's products fit fp32; above, the exact shift and float64.
        top = (uq_c + torch.maximum(before, uk_c)).amax(-1, keepdim=True)
        # A compiled graph takes the float64 products rather than a host sync.
        wide = (torch.compiler.is_compiling()
                or bool((end - torch.maximum(before, uk_c.amin(-2, keepdim=True))).amax()
                        > FP32_GROWTH))
        if wide:  # the running max of each feature up to i
            top = (uq_c + torch.maximum(before, _prefix_max(uk_c))).amax(-1, keepdim=True)
    # Each chunk's keys at the chunk's end scale, every factor <= 1.
    keys = torch.sub(uk_c, end).exp_()
    decay = torch.exp(before - end).transpose(-2, -1)  # (B, H, nc, F, 1), <= 1
    shifted = uq_c - top
    del uq_c
    queries = torch.add(shifted, before).exp_()
    # Each chunk reads the state entering it, then adds its keys to it: neither the per-chunk
    # states nor their deltas are stacked (F / C times the size of the outputs each).
    reads = []
    for q_c, k_c, v1_c, decay_c in zip(queries.unbind(2), keys.unbind(2), v_c.unbind(2),
                                       decay.unbind(2), strict=True):
        reads.append(q_c @ kv)
        kv = torch.addcmul(k_c.transpose(-2, -1) @ v1_c, kv, decay_c)
    del queries
    inter = torch.stack(reads, 2)
    del reads
    # Inside the chunk (see the module's docstring): exp(u_q + R_c - top) can exceed 1.
    q_f, k_f, _ = _in_chunk(shifted, uk_c, end, keys, wide)
    del shifted, uk_c
    scores = (q_f @ k_f.transpose(-2, -1)).tril_().to(v_c.dtype)
    raw = inter.add_(scores @ v_c).flatten(2, 3)[:, :, :n]
    # The state's scale a copy, not a view that keeps every chunk's maxima alive.
    return raw, top.flatten(2, 3)[:, :, :n], kv, end[:, :, -1].transpose(-2, -1).clone(), wide


def _causal_slice_grads(u_q: Tensor, u_k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor,
                        scale: Tensor, top: Tensor, wide: bool, chunk: int, g: Tensor,
                        d_final: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of one slice of :func:`_causal_slice` (the module's docstring), without
    autograd: from its exponents u_q, u_k (B, H, n, F), v (B, H, n, Dv), the state (kv, scale)
    entering it, the forward's shifts c (B, H, n, 1) and precision, g = ∂L/∂[num, den]
    (B, H, n, Dv + 1) and ∂L/∂(state after) (None: 0) -> ∂L/∂u_q, ∂L/∂u_k, ∂L/∂v and ∂L/∂kv.
    The in-chunk part first, then two loops over the chunks, as the row core's (one chunk's
    GEMMs at a time): forwards the states S_c are recomputed from kv and read into ∂L/∂u_q,
    backwards ∂S runs into ∂L/∂u_k and ∂L/∂v. The tail after n gets no gradient (its c is
    +inf: every factor of its queries is 0). Its own (B, H, n, F) tensors are dropped as soon
    as they are used up: this is a training step's peak."""
    n, dv = u_q.shape[2], v.shape[-1]
    uq_c, uk_c, v_c = _chunked(u_q, u_k, v, pad, chunk)
    before, end = _running_max(uk_c, scale)
    tail = -n % chunk
    if tail:
        top = F.pad(top, (0, 0, 0, tail), value=float("inf"))
        g = F.pad(g, (0, 0, 0, tail))
    top, g = top.unflatten(2, (-1, chunk)), g.unflatten(2, (-1, chunk))
    keys = torch.sub(uk_c, end).exp_()
    shifted = uq_c - top
    del uq_c
    queries = torch.add(shifted, before).exp_()
    q_f, k_f, clamped = _in_chunk(shifted, uk_c, end, keys, wide)
    del shifted, uk_c
    # Fresh C x C products, masked in place (j <= i).
    d_v = (q_f @ k_f.transpose(-2, -1)).tril_().to(v_c.dtype).transpose(-2, -1) @ g
    d_scores = (g @ v_c.transpose(-2, -1)).tril_().to(q_f.dtype)
    d_uk = (d_scores.transpose(-2, -1) @ q_f).mul_(k_f).to(keys.dtype)
    d_uq = q_f.mul_(d_scores @ k_f)  # q_f, this function's own, becomes its gradient
    del d_scores, k_f
    if clamped is not None:
        d_uq.masked_fill_(clamped, 0.0)
    d_uq = d_uq.to(keys.dtype)
    decay = torch.exp(before - end).transpose(-2, -1)  # (B, H, nc, F, 1)
    # Forwards: the state entering each chunk, read into ∂L/∂u_q.
    state = kv
    chunks = list(zip(queries.unbind(2), keys.unbind(2), v_c.unbind(2), g.unbind(2),
                      decay.unbind(2), d_uq.unbind(2), d_uk.unbind(2), d_v.unbind(2),
                      strict=True))
    for q_i, k_i, v_i, g_i, decay_i, d_uq_i, _, _ in chunks:
        d_uq_i.addcmul_(q_i, g_i @ state.transpose(-2, -1))
        state = torch.addcmul(k_i.transpose(-2, -1) @ v_i, state, decay_i)
    del state
    # Backwards: ∂S from the state after the slice, into ∂L/∂u_k and ∂L/∂[v, 1].
    d = torch.zeros_like(kv) if d_final is None else d_final
    for q_i, k_i, v_i, g_i, decay_i, _, d_uk_i, d_v_i in reversed(chunks):
        d_uk_i.addcmul_(k_i, v_i @ d.transpose(-2, -1))
        d_v_i += k_i @ d
        d = torch.addcmul(q_i.transpose(-2, -1) @ g_i, d, decay_i)
    return (d_uq.flatten(2, 3)[:, :, :n], d_uk.flatten(2, 3)[:, :, :n],
            d_v.flatten(2, 3)[:, :, :n, :dv], d)


def _causal_slice_backward(exponents: ExponentFn, q: Tensor, k: Tensor, v: Tensor,
                           pad: Tensor | None, kv: Tensor, scale: Tensor, top: Tensor,
                           wide: bool, chunk: int, g: Tensor, d_final: Tensor | None,
                           tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """One slice of :class:`_Causal`'s backward: the exponents of q, k (leaves) recomputed
    under autograd, their gradients (:func:`_causal_slice_grads`) backpropagated into q, k and
    ``tensors``. Returns ∂L/∂kv, ∂L/∂v and the gradients of q, k and ``tensors``. A function,
    so that the slice's recomputed graph is freed before the next slice's is built."""
    with torch.enable_grad():
        u_q, u_k = exponents(q), exponents(k)
    d_uq, d_uk, d_v, d_kv = _causal_slice_grads(u_q.detach(), u_k.detach(), v, pad, kv, scale,
                                                top, wide, chunk, g, d_final)
    return d_kv, d_v, core._backprop((u_q, u_k), (d_uq, d_uk), (q, k, *tensors))


class _Causal(torch.autograd.Function):
    """The causal form after the state (kv, scale), slice by slice (:func:`causal`), keeping
    q, k, v, the output, its denominators and shifts c (B, H, N, 1) and the state entering each
    slice (kv None: the empty state of ``feature_dim`` features, not kept but made again).
    Backward, slice by slice from the last: the gradient of [num, den] (the normaliser's log
    adding to the denominator's), then :func:`_causal_slice_backward`, whose ∂L/∂kv goes on to
    the previous slice."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None,
                kv: Tensor | None, scale: Tensor | None, exponents: ExponentFn, feature_dim: int,
                chunk: int, step: int, normaliser: bool, *tensors: Tensor) -> tuple[Tensor, ...]:
        b, h, n = q.shape[:3]
        out = q.new_empty(b, h, n, v.shape[-1])
        den, top = q.new_empty(b, h, n, 1), q.new_empty(b, h, n, 1)
        log_abs, sign = (q.new_empty(b, h, n) if normaliser else q.new_empty(0) for _ in "ls")
        entering: list[Tensor | None] = []
        wide = []
        for a, z in core._spans(n, step):
            entering += [kv, scale]
            if kv is None or scale is None:
                empty = _state(None, b, h, feature_dim, v.shape[-1], v)
                kv, scale = empty.kv, empty.log_scale
            raw, top_s, kv, scale, w = _causal_slice(
                q[:, :, a:z], k[:, :, a:z], v[:, :, a:z], None if pad is None else pad[:, a:z],
                kv, scale, exponents, chunk)
            den_s = raw[..., -1:]
            div = _divisors(den_s)[0]
            torch.div(raw[..., :-1], div, out=out[:, :, a:z])
            den[:, :, a:z], top[:, :, a:z] = den_s, top_s
            if normaliser:
                log_abs[:, :, a:z], sign[:, :, a:z] = _normaliser(den_s, div, top_s)
            wide.append(w)
        ctx.exponents, ctx.chunk, ctx.step, ctx.wide = exponents, chunk, step, wide
        ctx.feature_dim = feature_dim
        ctx.save_for_backward(q, k, v, pad, out, den, top, *entering, *tensors)
        ctx.mark_non_differentiable(scale, sign)
        return out, kv, scale, log_abs, sign

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_kv: Tensor, _: Tensor | None, d_log_abs: Tensor,
                 __: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, pad, out, den, top, *rest = ctx.saved_tensors
        slices = len(ctx.wide)
        entering, tensors = rest[:2 * slices], rest[2 * slices:]
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = (torch.empty_like(t) if need else None
                      for t, need in zip((q, k, v), (need_q, need_k, need_v), strict=True))
        d_tensors: list[Tensor | None] = [None] * len(tensors)
        spans = core._spans(q.shape[2], ctx.step)
        for i in range(slices - 1, -1, -1):
            a, z = spans[i]
            div, factor = _divisors(den[:, :, a:z])
            g = core._ratio_grad(d_out[:, :, a:z], out[:, :, a:z], div, factor)
            if d_log_abs.numel():  # log den + c: den receives d_log_abs / den (-factor)
                g[..., -1:].sub_(d_log_abs[:, :, a:z, None] * factor)
            kv, scale = entering[2 * i], entering[2 * i + 1]
            if kv is None or scale is None:
                empty = _state(None, *q.shape[:2], ctx.feature_dim, v.shape[-1], v)
                kv, scale = empty.kv, empty.log_scale
            d_kv, d_v, got = _causal_slice_backward(
                ctx.exponents, core._leaf(q[:, :, a:z], need_q), core._leaf(k[:, :, a:z], need_k),
                v[:, :, a:z], None if pad is None else pad[:, a:z], kv, scale, top[:, :, a:z],
                ctx.wide[i], ctx.chunk, g, d_kv, tensors)
            core._put(dq, a, z, got[0])
            core._put(dk, a, z, got[1])
            core._put(dv, a, z, d_v)
            d_tensors = [core._add(t, part) for t, part in zip(d_tensors, got[2:], strict=True)]
        d_kv = d_kv if ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, d_kv, None, None, None, None, None, None, *d_tensors


def causal(q: Tensor, k: Tensor, v: Tensor, exponents: ExponentFn, feature_dim: int,
           state: RecurrentState | None = None, *, key_padding_mask: Tensor | None = None,
           chunk_size: int = 32, slice_elements: int = 1 << 20, normaliser: bool = False,
           lag: int = 0, feature_tensors: Sequence[Tensor] | None = None,
           ) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """Causal linear attention of φ = exp(u) with the per-feature stabiliser (module
    docstring): q, k (B, H, N, D), v (B, H, N, Dv), from ``state`` (or empty) -> the output
    (B, H, N, Dv), the state after the last token and, with ``normaliser``, the queries'
    normalisers (differentiable). Slices of about ``slice_elements`` / :data:`SLICE_SHARE`
    (without the backward :data:`FORWARD_SLICE_SHARE`) feature values run one after the other;
    recording, the forward keeps the inputs, the output, two scalars per query and the state
    entering each slice (:class:`_Causal`), and gradients reach an incoming state that requires
    them. ``lag`` > 0: query i sees keys j <= i - lag, as the
    row core's lagged form (queries lag.. against keys ..N-1-lag, as views; the first ``lag``
    queries see no key; no entering state). ``feature_tensors``: the tensors ``exponents``
    reads (None: found in its graph)."""
    b, h, n = q.shape[:3]
    if k.shape[2] != n:
        raise ValueError(f"causal needs N == M, got {n} and {k.shape[2]}")
    if lag:
        def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                _: Tensor | None) -> tuple[Tensor, RecurrentState, Normaliser | None]:
            return causal(q, k, v, exponents, feature_dim, key_padding_mask=mask,
                          chunk_size=chunk_size, slice_elements=slice_elements,
                          normaliser=normaliser, feature_tensors=feature_tensors)

        return lagged(run, q, k, v, key_padding_mask, None, state, lag, normaliser,
                      lambda: _state(None, b, h, feature_dim, v.shape[-1], v))
    chosen = strategy.choose("kernelized", q.device)
    if chosen == "triton":
        from effattn.kernelized import fused_exponents

        if fused_exponents.takes(exponents):
            return fused_exponents.causal(
                q, k, v, exponents, feature_dim, state, key_padding_mask=key_padding_mask,
                chunk_size=chunk_size, slice_elements=slice_elements, normaliser=normaliser,
                feature_tensors=feature_tensors)
    if chosen != "cpu":
        from effattn.kernelized import exponents_gpu

        return exponents_gpu.causal(q, k, v, exponents, feature_dim, state,
                                    key_padding_mask=key_padding_mask, chunk_size=chunk_size,
                                    slice_elements=slice_elements, normaliser=normaliser)
    f = feature_dim
    given = state
    state = _state(state, b, h, f, v.shape[-1], v)
    kv, scale = state.kv, state.log_scale
    if core._recording():
        tensors = _exponent_inputs(exponents, q, feature_tensors)
        if core._needs_grad(q, k, v, kv, *tensors):
            if given is None:
                kv = scale = None
            step = _slice_tokens(b, h, f, slice_elements, SLICE_SHARE, chunk_size)
            out, kv, scale, log_abs, sign = _Causal.apply(
                q, k, v, key_padding_mask, kv, scale, exponents, f, chunk_size, step,
                normaliser, *tensors)
            return (out, RecurrentState(kv, scale, state.position + n),
                    Normaliser(log_abs, sign) if normaliser else None)
    parts = []
    for a, z in core._spans(n, _slice_tokens(b, h, f, slice_elements, FORWARD_SLICE_SHARE,
                                        chunk_size)):
        raw, top, kv, scale, _ = _causal_slice(
            q[:, :, a:z], k[:, :, a:z], v[:, :, a:z],
            None if key_padding_mask is None else key_padding_mask[:, a:z], kv, scale,
            exponents, chunk_size)
        parts.append(_finish(raw, top, normaliser))
    out, log_abs, sign = parts[0] if len(parts) == 1 else (
        None if p[0] is None else torch.cat(p, 2) for p in zip(*parts, strict=True))
    norm = Normaliser(log_abs, sign) if log_abs is not None and sign is not None else None
    return out, RecurrentState(kv, scale, state.position + n), norm


def attention(q: Tensor, k: Tensor, v: Tensor, exponents: ExponentFn, feature_dim: int, *,
              is_causal: bool, key_padding_mask: Tensor | None = None, chunk_size: int = 32,
              slice_elements: int = 1 << 20,
              feature_tensors: Sequence[Tensor] | None = None) -> Tensor:
    """Causal or non-causal attention (the core's ``attention`` for exponent maps)."""
    if is_causal:
        return causal(q, k, v, exponents, feature_dim, key_padding_mask=key_padding_mask,
                      chunk_size=chunk_size, slice_elements=slice_elements,
                      feature_tensors=feature_tensors)[0]
    state = key_state(k, v, exponents, feature_dim, key_padding_mask=key_padding_mask,
                      slice_elements=slice_elements, feature_tensors=feature_tensors)
    return read_queries(q, state, exponents, slice_elements=slice_elements,
                        feature_tensors=feature_tensors)
