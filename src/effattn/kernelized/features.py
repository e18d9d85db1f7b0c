"""Feature maps φ of kernelized attention, in the form the core consumes.

Every map returns ``(phi, log_scale)``: the true features are ``phi * exp(log_scale)``, with
log_scale (..., L, 1) or None (0). For queries, any factor shared by all features of one query
cancels between numerator and denominator, so query features come with such factors dropped
(a per-row max for exponential maps, the exp(|q|²/2) of trigonometric ones) and their log as
the log-scale, which the pure method ignores. The query's log-scale also carries the constants
of both sides (the 1/sqrt(F) of query and key: a key's log-scale leaves them out), so that
``exp(ls_q + ls_k) phi_q·phi_k`` is the kernel value itself: the window hybrid
(``effattn.kernelized.hybrid``) adds it to exact exponentials of logits, where no factor
cancels. The true, unnormalised features are written out in ``effattn.naive.kernelized`` for
the tests.

x is (B, H, L, D); for softmax-kernel maps it is already multiplied by sqrt(scale), so that
x̃_q · x̃_k = scale · q · k. w is the (F, D) projection shared by the heads, or, for the learned
maps (Hedgehog's), each head's own (H, D, F). Shapes of phi: (B, H, L, F) or (B, H, L, 2F) for
the maps that pair features (hyperbolic, trig, sincos, the learned exp and softmax);
1 + P + P(P + 1)/2 for the Taylor map of a P-dimensional x̃.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Features = tuple[Tensor, Tensor | None]


def project(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., L, D) @ w^T (D, F) [+ bias (F,)] as one 2-D GEMM (addmm folds the bias in).

    Without a bias the result is a fresh tensor, not a view of the GEMM's output, so that the
    in-place exponential on it costs autograd no view bookkeeping (a CopySlices node that
    copies and zero-fills N x F buffers in backward).
    """
    if bias is None:
        return F.linear(x, w)
    u = torch.addmm(bias, x.reshape(-1, x.shape[-1]), w.T)
    return u.view(*x.shape[:-1], w.shape[0])


def _sin_cos(x: Tensor, w: Tensor) -> Tensor:
    """[sin(w x), cos(w x)] (..., L, 2F) from one (..., L, F) projection: the GEMM is F wide, not
    2F (as [w; w] with a phase of π/2 would be), for one extra copy of the result into place."""
    u = project(x, w)
    return torch.cat([u.sin(), u.cos()], -1)


# exp(u) = 2^(u·log2(e)): on the CPU, ATen's exp2 runs several times faster than its exp at the
# same accuracy (1 ulp), and the exponential is the feature map's main cost after its GEMM.
LOG2E = 1.0 / math.log(2.0)


class _Exp2Projection(torch.autograd.Function):
    """φ = exp(w x - rowmax), or of [w x, -w x] (``pair``), computed as exp2 of log2(e) w x.

    Forward: one GEMM, then the row max and exp2 in place on its output. Backward, with
    g = dφ ⊙ φ (exp's derivative is itself; the max is a constant that cancels):
    dx = g w and dw = g^T x (for a pair, g_+ - g_-), one elementwise pass over the N x F
    gradient against autograd's three to five (exp2's grad · result · ln 2 in two, the negation
    and the sum of the pair's halves). x (..., L, D), w (F, D) -> φ (..., L, F or 2F), and the
    row max in natural log (..., L, 1).
    """

    @staticmethod
    def forward(x: Tensor, w: Tensor, pair: bool) -> tuple[Tensor, Tensor]:
        u = project(x, w * LOG2E)
        if pair:
            u = torch.cat([u, -u], -1)
        m = u.amax(-1, keepdim=True)
        return u.sub_(m).exp2_(), m * math.log(2.0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, bool], output: Features) -> None:
        x, w, ctx.pair = inputs
        ctx.save_for_backward(x, w, output[0])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(
        ctx: Any, grad_phi: Tensor, _: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, phi = ctx.saved_tensors
        g = grad_phi * phi
        if ctx.pair:
            g_plus, g_minus = g.chunk(2, -1)
            g = g_plus - g_minus
        grad_x = g @ w if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None


def _exp_projection(x: Tensor, w: Tensor, *, pair: bool = False) -> tuple[Tensor, Tensor]:
    """exp(w x - m) with m the row max (see :class:`_Exp2Projection`), and m (detached)."""
    return _Exp2Projection.apply(x, w, pair)


def _half_sq_norm(x: Tensor) -> Tensor:
    return 0.5 * (x * x).sum(-1, keepdim=True)


def positive(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """FAVOR+ positive features: φ(x) = F^(-1/2) exp(w x - |x|²/2)  (Choromanski et al. 2020)."""
    phi, m = _exp_projection(x, w)
    return phi, positive_log_scale(x, m, w.shape[0], is_query=is_query)


def positive_log_scale(x: Tensor, m: Tensor, num_features: int, *, is_query: bool) -> Tensor:
    """The log-scale (..., L, 1) of :func:`positive`'s (or :func:`hyperbolic`'s) features
    exp(w_f x - m) of x (..., L, D), with m (..., L, 1) the row maxima of w_f x over their
    ``num_features`` rows w_f (for a pair, w and -w): m - |x|²/2, less log of that count for
    queries."""
    log_scale = m - _half_sq_norm(x)
    return log_scale - math.log(num_features) if is_query else log_scale


@dataclass(frozen=True)
class PositiveMap:
    """:func:`positive` (``pair``: :func:`hyperbolic`, its antithetic pair) of ``x * x_scale``
    with the projection ``w`` (F, D), as data: a :data:`~effattn.kernelized.core.FeatureFn`
    like any map, and readable by a strategy that forms φ_f = exp(w_f x̃ - m) inside its own
    kernels (:mod:`effattn.kernelized.fused`: no N x F features in memory). Performer's default
    map and its hyperbolic one."""

    w: Tensor
    x_scale: float
    pair: bool = False

    def __call__(self, x: Tensor, *, is_query: bool) -> Features:
        fn = hyperbolic if self.pair else positive
        return fn(self.inputs(x), self.w.to(x.dtype), is_query=is_query)

    def inputs(self, x: Tensor) -> Tensor:
        """x̃ = x * x_scale, what the projection multiplies."""
        return x * self.x_scale

    def rows(self) -> Tensor:
        """The rows w_f of φ_f = exp(w_f x̃ - m), in φ's order: w (F, D), or [w; -w] (2F, D)
        for a pair."""
        return torch.cat([self.w, -self.w]) if self.pair else self.w


def hyperbolic(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """φ(x) = (2F)^(-1/2) exp(-|x|²/2) [exp(w x), exp(-w x)]: antithetic positive features."""
    phi, m = _exp_projection(x, w, pair=True)  # one F-wide GEMM; the antithetic half negates it
    return phi, positive_log_scale(x, m, 2 * w.shape[0], is_query=is_query)


def trig(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """φ(x) = F^(-1/2) exp(|x|²/2) [sin(w x), cos(w x)]: the paper's trigonometric features."""
    return _sin_cos(x, w), trig_log_scale(x, w.shape[0], is_query=is_query)


def trig_log_scale(x: Tensor, num_features: int, *, is_query: bool) -> Tensor:
    """:func:`trig`'s log-scale: |x|²/2, less log F for queries."""
    log_scale = _half_sq_norm(x)
    return log_scale - math.log(num_features) if is_query else log_scale


# What performer's relu features add to relu(w x), so that no key's features are all 0.
RELU_FLOOR = 1e-3


def relu(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """Performer's generalised attention: φ(x) = relu(w x) + 1e-3 (not a softmax estimator)."""
    # clamp_min saves its input for backward (relu saves its output, which add_ would clobber).
    return project(x, w).clamp_min(0.0).add_(RELU_FLOOR), None


def random_phase_cos(x: Tensor, w: Tensor, phase: Tensor, *, is_query: bool) -> Features:
    """Original FAVOR: φ(x) = sqrt(2/F) exp(|x|²/2) cos(w x + b), b ~ U(0, 2π)."""
    # Not in place: the biased projection is a view of addmm's output (see project).
    phi = project(x, w, phase).cos()
    return phi, random_phase_log_scale(x, w.shape[0], is_query=is_query)


def random_phase_log_scale(x: Tensor, num_features: int, *, is_query: bool) -> Tensor:
    """:func:`random_phase_cos`'s log-scale: |x|²/2, plus log(2/F) for queries."""
    log_scale = _half_sq_norm(x)
    return log_scale + math.log(2.0 / num_features) if is_query else log_scale


def sincos(x_unit: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """RFA: φ(x) = F^(-1/2) [sin(w x), cos(w x)] on unit-norm x (Rahimi & Recht 2007)."""
    return _sin_cos(x_unit, w), sincos_log_scale(x_unit, w.shape[0], is_query=is_query)


def sincos_log_scale(x: Tensor, num_features: int, *, is_query: bool) -> Tensor | None:
    """:func:`sincos`'s log-scale: -log F for queries, none for keys."""
    return _constant(x, -math.log(num_features)) if is_query else None


@dataclass(frozen=True)
class SineMap:
    """A trigonometric map of ``inputs(x)`` = x̃ with the projection ``w`` (F, D), as data (a
    :data:`~effattn.kernelized.core.FeatureFn` like any map): ``kind`` "trig" (:func:`trig`,
    performer's), "sincos" (:func:`sincos`, RFA's) or "phase" (:func:`random_phase_cos`,
    FAVOR's, with its ``phase`` (F,)). Each feature is sin(r_f x̃ + c_f) of a row r_f of
    :meth:`rows` and a phase c_f of :meth:`phases` (cos u = sin(u + π/2)), times the
    log-scale's factor (:meth:`log_scale`): so a strategy can form φ inside its own kernels
    (:mod:`effattn.kernelized.fused`: no N x F features in memory)."""

    w: Tensor
    inputs: Callable[[Tensor], Tensor]
    kind: str
    phase: Tensor | None = None

    def __call__(self, x: Tensor, *, is_query: bool) -> Features:
        x = self.inputs(x)
        w = self.w.to(x.dtype)
        if self.kind == "phase":
            return random_phase_cos(x, w, self.phase.to(x.dtype), is_query=is_query)
        return (trig if self.kind == "trig" else sincos)(x, w, is_query=is_query)

    def rows(self) -> Tensor:
        """The rows r_f, in φ's order: w (F, D), or [w; w] (2F, D) for a sin/cos pair."""
        return self.w if self.kind == "phase" else torch.cat([self.w, self.w])

    def phases(self) -> Tensor:
        """The phases c_f, in φ's order: the random phase + π/2, or [0, π/2] per pair."""
        if self.kind == "phase":
            return self.phase + math.pi / 2
        zeros = self.w.new_zeros(self.w.shape[0])
        return torch.cat([zeros, zeros + math.pi / 2])

    def log_scale(self, x: Tensor, *, is_query: bool) -> Tensor | None:
        """The log-scale (..., L, 1) of the features of x̃ (..., L, D) (None: 0)."""
        scale = {"trig": trig_log_scale, "sincos": sincos_log_scale,
                 "phase": random_phase_log_scale}[self.kind]
        return scale(x, self.w.shape[0], is_query=is_query)


def arccos(x_unit: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """RFA's arc-cosine variant: φ(x) = sqrt(2/F) relu(w x) (arc-cosine kernel of order 1)."""
    phi = project(x_unit, w).relu_()
    return phi, arccos_log_scale(x_unit, w.shape[0], is_query=is_query)


def arccos_log_scale(x: Tensor, num_features: int, *, is_query: bool) -> Tensor | None:
    """:func:`arccos`'s log-scale: log(2/F) for queries (both sides' sqrt(2/F)), none for
    keys."""
    return _constant(x, math.log(2.0 / num_features)) if is_query else None


@dataclass(frozen=True)
class ReluMap:
    """A rectified map of ``inputs(x)`` = x̃ with the projection ``w`` (F, D), as data (a
    :data:`~effattn.kernelized.core.FeatureFn` like any map): ``kind`` "relu" (:func:`relu`,
    performer's generalised attention) or "arccos" (:func:`arccos`, RFA's). Each feature is
    relu(w_f x̃) + :meth:`floor`, times the log-scale's factor (:meth:`log_scale`): so a
    strategy can form φ inside its own kernels (:mod:`effattn.kernelized.fused`: no N x F
    features in memory)."""

    w: Tensor
    inputs: Callable[[Tensor], Tensor]
    kind: str

    def __call__(self, x: Tensor, *, is_query: bool) -> Features:
        x = self.inputs(x)
        return (relu if self.kind == "relu" else arccos)(x, self.w.to(x.dtype),
                                                          is_query=is_query)

    def floor(self) -> float:
        """What every feature adds to relu(w_f x̃): :data:`RELU_FLOOR` for relu, 0 for
        arccos."""
        return RELU_FLOOR if self.kind == "relu" else 0.0

    def log_scale(self, x: Tensor, *, is_query: bool) -> Tensor | None:
        """The log-scale (..., L, 1) of the features of x̃ (..., L, D) (None: 0)."""
        if self.kind == "relu":
            return None
        return arccos_log_scale(x, self.w.shape[0], is_query=is_query)


def _constant(x: Tensor, value: float) -> Tensor:
    """A log-scale of ``value`` for every row of x (..., L, D): (..., L, 1)."""
    return x.new_full((*x.shape[:-1], 1), value)


def elu_plus_one(x: Tensor) -> Features:
    """Linear transformer (Katharopoulos et al. 2020): φ(x) = elu(x) + 1."""
    return F.elu(x).add_(1.0), None


@dataclass(frozen=True)
class EluMap:
    """:func:`elu_plus_one` as data (a :data:`~effattn.kernelized.core.FeatureFn` like any
    map): φ = elu(x) + 1 of x itself (F = D), which a strategy can form inside its own kernels
    from x as it is (:mod:`effattn.kernelized.fused`: no N x F features and no fp32 copy of
    half-precision inputs in memory)."""

    def __call__(self, x: Tensor, *, is_query: bool) -> Features:
        return elu_plus_one(x)


def project_heads(x: Tensor, w: Tensor) -> Tensor:
    """x (B, H, L, D) times each head's own w (H, D, P) -> (B, H, L, P), as one batched GEMM over
    the B·H (batch, head) pairs (no loop over heads)."""
    return torch.matmul(x, w)


class _Exp2HeadProjection(torch.autograd.Function):
    """Hedgehog's φ from one per-head affine map u = x W_h + b_h: exp([u, -u] - rowmax), or, with
    ``normalise``, [softmax(u), softmax(-u)] (each half over its own F features), computed as
    exp2 of log2(e) u (see :data:`LOG2E`).

    Forward: one batched GEMM that folds the bias in (baddbmm over the B·H pairs), then the
    pair, the row max (per half when normalising) and exp2 in place on fresh tensors, and for
    the softmax the halves' sums. Backward, with G = dφ ⊙ φ per feature (exp's derivative is
    itself; the max is a constant that cancels), minus φ Σ_half G for the softmax (its
    normaliser's derivative): g = G_+ - G_- (u enters the two halves with opposite signs), then
    dx = g W_h^T, dW_h = Σ_b x^T g and db_h = Σ_{b, L} g. x (B, H, L, D), w (H, D, F), b (H, F)
    -> φ (B, H, L, 2F) and the row max in natural log (B, H, L, 1) (meaningful for the exp form
    only, where the true features are φ · exp(max)).
    """

    @staticmethod
    def forward(x: Tensor, w: Tensor, b: Tensor, normalise: bool) -> tuple[Tensor, Tensor]:
        batch, heads, length, dim = x.shape
        f = w.shape[-1]
        # (B·H, L, D) @ (B·H, D, F) + (B·H, 1, F): for B = 1 the expanded weights stay views.
        u = torch.baddbmm(
            (b * LOG2E)[None, :, None, :].expand(batch, -1, -1, -1).reshape(-1, 1, f),
            x.reshape(-1, length, dim),
            (w * LOG2E).expand(batch, -1, -1, -1).reshape(-1, dim, f),
        ).view(batch, heads, length, f)
        pair = torch.cat([u, -u], -1)
        if not normalise:
            m = pair.amax(-1, keepdim=True)
            return pair.sub_(m).exp2_(), m * math.log(2.0)
        halves = pair.view(batch, heads, length, 2, f)
        halves.sub_(halves.amax(-1, keepdim=True)).exp2_()
        halves.div_(halves.sum(-1, keepdim=True))
        return pair, pair.new_zeros(batch, heads, length, 1)

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Tensor, Tensor, Tensor, bool], output: Features
    ) -> None:
        x, w, _, ctx.normalise = inputs
        ctx.save_for_backward(x, w, output[0])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(
        ctx: Any, grad_phi: Tensor, _: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, w, phi = ctx.saved_tensors
        g = grad_phi * phi
        g_plus, g_minus = g.chunk(2, -1)
        if ctx.normalise:
            phi_plus, phi_minus = phi.chunk(2, -1)
            g_plus = g_plus - phi_plus * g_plus.sum(-1, keepdim=True)
            g_minus = g_minus - phi_minus * g_minus.sum(-1, keepdim=True)
        g = g_plus - g_minus
        grad_x = g @ w.transpose(-2, -1) if ctx.needs_input_grad[0] else None
        grad_w = (x.transpose(-2, -1) @ g).sum(0) if ctx.needs_input_grad[1] else None
        grad_b = g.sum((0, 2)) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def learned_exp(x: Tensor, w: Tensor, b: Tensor, *, is_query: bool) -> Features:
    """Hedgehog (Zhang et al. 2024): φ(x) = [exp(x W_h + b_h), exp(-(x W_h + b_h))] per head h.

    x (B, H, L, D), w (H, D, F), b (H, F) -> (B, H, L, 2F). Returned over the row max of the 2F
    exponents (so every value is <= 1), which queries and keys give back as their log-scale.
    """
    return _Exp2HeadProjection.apply(x, w, b, False)


def learned_softmax(x: Tensor, w: Tensor, b: Tensor) -> Features:
    """LoLCATs' form of Hedgehog's map: φ(x) = [softmax(x W_h + b_h), softmax(-(x W_h + b_h))],
    each softmax over its F features. Bounded (entries in [0, 1]): no log-scale.

    x (B, H, L, D), w (H, D, F), b (H, F) -> (B, H, L, 2F).
    """
    return _Exp2HeadProjection.apply(x, w, b, True)[0], None


@dataclass(frozen=True, eq=False)
class AffineExponents:
    """The exponents of Hedgehog's exp map as data: u = [x W_h + b_h, -(x W_h + b_h)] per head h
    (x (B, H, L, D), W (H, D, F), b (H, F) -> u (B, H, L, 2F), φ = exp(u)), an
    :data:`~effattn.kernelized.exponents.ExponentFn` like any other, which the triton strategy
    forms inside its kernels from x and :meth:`rows` (:mod:`effattn.kernelized.fused_exponents`:
    no N x F exponents in memory)."""

    weight: Tensor
    bias: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.weight.to(x.dtype), self.bias.to(x.dtype)
        # One GEMM with [W, -W] and the bias folded in: no pass to negate or concatenate u.
        w, b = torch.cat([w, -w], -1), torch.cat([b, -b], -1)
        batch, heads, length, dim = x.shape
        f = w.shape[-1]
        return torch.baddbmm(
            b[None, :, None, :].expand(batch, -1, -1, -1).reshape(-1, 1, f),
            x.reshape(-1, length, dim),
            w.expand(batch, -1, -1, -1).reshape(-1, dim, f),
        ).view(batch, heads, length, f)

    def rows(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Each head's rows of u = x w_h^T + b_h, (H, 2F, D), and offsets (H, 2F), in
        ``dtype``, differentiable in W and b: the map as the kernels read it."""
        w, b = self.weight.to(dtype).transpose(-2, -1), self.bias.to(dtype)
        return torch.cat([w, -w], 1), torch.cat([b, -b], -1)


# 1/√2: the diagonal of the Taylor map's x xᵀ/√2 (the off-diagonal pairs appear once, with √2).
_HALF_SQRT = math.sqrt(0.5)


def taylor(x: Tensor) -> Features:
    """Based (Arora et al. 2024): the 2nd-order Taylor map of exp on x̃ (B, H, L, P),
    φ(x̃) = [1, x̃, vec(x̃ x̃ᵀ)/√2], so that φ(x̃)·φ(ỹ) = 1 + t + t²/2 with t = x̃·ỹ.

    The quadratic part is the upper triangle of x̃ x̃ᵀ: x̃_i²/√2 on the diagonal and x̃_i x̃_j
    (i < j) once, which carries the off-diagonal pair's √2 · (1/√2): the same kernel with
    P(P + 1)/2 quadratic features instead of P², 1 + P + P(P + 1)/2 in all (153 at P = 16).
    Built row by row of the triangle (two products per row, one concatenation); on the CPU this
    beats the full outer product, whose P² features make every GEMM of the core 1.8x as wide
    (see effattn.mechanisms.taylor for the measurement). Signed features, a kernel >= 1/2.
    """
    half = x * _HALF_SQRT
    parts = [x.new_ones(*x.shape[:-1], 1), x]
    for i in range(x.shape[-1]):
        xi = x[..., i : i + 1]
        parts.append(xi * half[..., i : i + 1])
        if i + 1 < x.shape[-1]:
            parts.append(xi * x[..., i + 1 :])
    return torch.cat(parts, -1), None


@dataclass(frozen=True)
class TaylorMap:
    """:func:`taylor` of ``inputs(x)`` = x̃ (B, H, L, P) as data (a
    :data:`~effattn.kernelized.core.FeatureFn` like any map), so that a strategy can form φ
    inside its own kernels (:mod:`effattn.kernelized.fused`: no N x F features in memory)
    from x̃ and :meth:`factors`. The learned projection that forms x̃ stays in ``inputs``:
    autograd takes the gradient of x̃ to it."""

    inputs: Callable[[Tensor], Tensor]

    def __call__(self, x: Tensor, *, is_query: bool) -> Features:
        return taylor(self.inputs(x))

    @staticmethod
    def factors(p: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:func:`taylor`'s features of a P-dimensional x̃, in its order, as products of two
        affine maps: φ_f = (a_f·x̃ + b_f)(c_f·x̃ + e_f). Returns a, c (F, P) and b, e (F,), in
        ``like``'s dtype and device: the constant 1 is 1 · 1, x̃_i is x̃_i · 1, the diagonal
        x̃_i²/√2 is (x̃_i/√2) x̃_i and x̃_i x̃_j (i < j) is x̃_i · x̃_j."""
        f = 1 + p + p * (p + 1) // 2
        a, c = like.new_zeros(f, p), like.new_zeros(f, p)
        b, e = like.new_zeros(f), like.new_ones(f)
        b[0] = 1.0
        rows = torch.arange(p, device=like.device)
        a[1 + rows, rows] = 1.0
        at = 1 + p
        for i in range(p):
            a[at:at + p - i, i] = 1.0
            a[at, i] = _HALF_SQRT
            c[at + rows[: p - i], rows[i:]] = 1.0
            e[at:at + p - i] = 0.0
            at += p - i
        return a, c, b, e


# φ >= 0: the normaliser is a sum of non-negative terms. It can be tiny (exp(q̃·k̃) small for
# every key, softmax still well defined) but never cancels, so an eps floor could only cut it.
NONNEGATIVE = frozenset({positive, hyperbolic, relu, arccos, elu_plus_one, learned_exp,
                         learned_softmax})
# Random features whose kernel averages, over the draws, to exactly the exponential of the
# method's logits (Performer's positive, hyperbolic and trig maps, FAVOR's random-phase cosine,
# RFA's sin/cos): their estimate needs no scale of its own. Not relu or arccos (other kernels),
# nor a deterministic or learned map.
UNBIASED_EXP = frozenset({positive, hyperbolic, trig, random_phase_cos, sincos})
# Signed features whose kernel is positive: the Taylor kernel 1 + t + t²/2 = ((1 + t)² + 1)/2
# is >= 1/2 for every t, so its normaliser never cancels to 0 either (a sum of terms >= 1/2).
POSITIVE_KERNEL = frozenset({taylor})


def denominator_eps(feature_map: Callable[..., Features], eps: float = 1e-6) -> float:
    """The core's ``eps`` for ``feature_map``: 0 for non-negative maps and positive kernels, else
    ``eps``."""
    return 0.0 if feature_map in NONNEGATIVE or feature_map in POSITIVE_KERNEL else eps
