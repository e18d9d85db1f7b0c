"""Feature maps φ of kernelized attention, in the form the core consumes.

Every map returns ``(phi, log_scale)``. For keys, the true features are
``phi * exp(log_scale)`` with log_scale (..., L, 1) or None. For queries, any factor shared by
all features of one query cancels between numerator and denominator, so query features are
returned with such factors dropped (log_scale None): a per-row max for exponential maps, the
exp(|q|²/2) of trigonometric ones, the 1/sqrt(F) normalisations everywhere. The true,
unnormalised features are written out in ``effattn.naive.kernelized`` for the tests.

x is (B, H, L, D); for softmax-kernel maps it is already multiplied by sqrt(scale), so that
x̃_q · x̃_k = scale · q · k. w is the (F, D) projection. Shapes of phi: (B, H, L, F) or
(B, H, L, 2F) for the maps that pair features (hyperbolic, trig, sincos).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    return (phi, None) if is_query else (phi, m - _half_sq_norm(x))


def hyperbolic(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """φ(x) = (2F)^(-1/2) exp(-|x|²/2) [exp(w x), exp(-w x)]: antithetic positive features."""
    phi, m = _exp_projection(x, w, pair=True)  # one F-wide GEMM; the antithetic half negates it
    return (phi, None) if is_query else (phi, m - _half_sq_norm(x))


def trig(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """φ(x) = F^(-1/2) exp(|x|²/2) [sin(w x), cos(w x)]: the paper's trigonometric features."""
    return _sin_cos(x, w), None if is_query else _half_sq_norm(x)


def relu(x: Tensor, w: Tensor, *, is_query: bool) -> Features:
    """Performer's generalised attention: φ(x) = relu(w x) + 1e-3 (not a softmax estimator)."""
    # clamp_min saves its input for backward (relu saves its output, which add_ would clobber).
    return project(x, w).clamp_min(0.0).add_(1e-3), None


def random_phase_cos(x: Tensor, w: Tensor, phase: Tensor, *, is_query: bool) -> Features:
    """Original FAVOR: φ(x) = sqrt(2/F) exp(|x|²/2) cos(w x + b), b ~ U(0, 2π)."""
    # Not in place: the biased projection is a view of addmm's output (see project).
    phi = project(x, w, phase).cos()
    return phi, None if is_query else _half_sq_norm(x)


def sincos(x_unit: Tensor, w: Tensor) -> Features:
    """RFA: φ(x) = F^(-1/2) [sin(w x), cos(w x)] on unit-norm x (Rahimi & Recht 2007)."""
    return _sin_cos(x_unit, w), None


def arccos(x_unit: Tensor, w: Tensor) -> Features:
    """RFA's arc-cosine variant: φ(x) = sqrt(2/F) relu(w x) (arc-cosine kernel of order 1)."""
    return project(x_unit, w).relu_(), None


def elu_plus_one(x: Tensor) -> Features:
    """Linear transformer (Katharopoulos et al. 2020): φ(x) = elu(x) + 1."""
    return F.elu(x).add_(1.0), None


# φ >= 0: the normaliser is a sum of non-negative terms. It can be tiny (exp(q̃·k̃) small for
# every key, softmax still well defined) but never cancels, so an eps floor could only cut it.
NONNEGATIVE = frozenset({positive, hyperbolic, relu, arccos, elu_plus_one})


def denominator_eps(feature_map: Callable[..., Features], eps: float = 1e-6) -> float:
    """The core's ``eps`` for ``feature_map``: 0 for non-negative maps, else ``eps``."""
    return 0.0 if feature_map in NONNEGATIVE else eps
