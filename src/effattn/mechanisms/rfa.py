"""Random Feature Attention (Peng et al. 2021, "Random Feature Attention", ICLR 2021).

q and k are normalised to unit length; with random Fourier features (Rahimi & Recht 2007)
φ(x) = F^(-1/2) [sin(w_i·x), cos(w_i·x)]_i, w_i ~ N(0, σ^-2 I),
E[φ(x)·φ(y)] = exp(-|x - y|²/2σ²) = exp((x·y - 1)/σ²) on the unit sphere, so
RFA approximates softmax(q̂ k̂^T / σ²) v (the paper writes w ~ N(0, σ² I); the kernel it states
needs the inverse variance, which is what is drawn here). ``scale`` has no effect: σ sets it.

Options: ``sigma`` per head (learned, as log σ, when ``learn_sigma``), ``feature_map`` "sincos"
or "arccos" (φ(x) = sqrt(2/F) relu(w·x): the arc-cosine kernel, not a softmax estimator), and
``gated``: S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T with the gate (B, H, N) passed in the
call (causal only). Random features are redrawn every ``redraw_interval`` training calls (the
authors resample every step) and fixed in eval mode.
q, k: (B, H, N|M, D), v: (B, H, M, Dv) -> (B, H, N, Dv); φ has 2F (sincos) or F (arccos) entries.

Precision: sin/cos features are signed; rounding is amplified by the normaliser's condition
number κ_i = Σ_j w_ij Σ_f |φ_f(q_i) φ_f(k_j)| / |Σ_j w_ij φ(q_i)·φ(k_j)| (kernelized.core,
"Precision of decoding"). On the unit sphere the kernel is at least exp(-2/σ²), so at σ = 1
κ_i stays ~3 and fp32 ``step`` and the causal forward agree to ~1e-6 (~4e-6 gated); small σ
makes the kernel of distant q, k tiny and κ_i large (1e4 at σ = 0.3), as for favor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from effattn.base import check_bool, check_choice, check_positive_int
from effattn.kernelized import features as fm
from effattn.kernelized.base import WINDOW_OPTIONS, KernelizedAttention
from effattn.kernelized.core import FeatureFn
from effattn.kernelized.flops import kernelized_flops
from effattn.kernelized.parallel import StateExchange
from effattn.kernelized.projections import gaussian_projection
from effattn.random import TensorGenerator
from effattn.registry import Budget, CallInput, MethodSpec, Problem, Variant, register

FEATURE_MAPS = {"sincos": fm.sincos, "arccos": fm.arccos}


UNIT_EPS = 1e-6


def unit(x: Tensor) -> Tensor:
    """x / max(|x|, ``UNIT_EPS``) along the head dim (zero vectors stay zero)."""
    return F.normalize(x, dim=-1, eps=UNIT_EPS)


class _ScaledUnit(torch.autograd.Function):
    """x̃ = s_h x / r with r = max(|x|, ``UNIT_EPS``): :func:`unit` (x) times a per-head s = 1/σ
    (H,), for x (B, H, L, D).

    It keeps x̃ (the map's input, which the caller holds anyway) and r (one value a token),
    not x, unit(x) and the norm's intermediates as autograd would (for a half-precision x, its
    fp32 copy too): a strategy that recomputes the map span by span then holds no N x D
    tensor of it beyond x̃. With g = ∂L/∂x̃, u = x̃ / s and c = g·x̃ (one value a token):

        ∂L/∂x = (s g - [|x| > ε] c u) / r,    ∂L/∂s_h = Σ_{b, l} c / s_h,

    the first being the derivative of x / |x|, (I - u u^T) / |x|, where |x| > ε, and 1 / ε
    below (where r is the constant ε).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, s: Tensor) -> Tensor:
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(UNIT_EPS)
        y = x * (s[:, None, None] / r)
        ctx.save_for_backward(y, r, s)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        y, r, s = ctx.saved_tensors
        c = (g * y).sum(-1, keepdim=True)
        d_s = None
        if ctx.needs_input_grad[1]:
            d_s = c.sum((0, 2, 3)) / s
        d_x = None
        if ctx.needs_input_grad[0]:
            s = s[:, None, None]
            d_x = g * (s / r)
            d_x.addcmul_(y, c.mul_(r > UNIT_EPS).div_(s * r), value=-1.0)
        return d_x, d_s


class RandomFeatureAttention(KernelizedAttention):
    """RFA with ``num_features`` iid Gaussian frequencies and per-head bandwidth sigma."""

    random_buffers = ("projection",)

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        num_features: int = 128,
        sigma: float = 1.0,
        learn_sigma: bool = False,
        feature_map: str = "sincos",
        gated: bool = False,
        redraw_interval: int | None = 1,
        chunk_size: int = 32,
        window: int | None = None,
        window_factor: bool = False,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale,
                         redraw_interval=redraw_interval, chunk_size=chunk_size,
                         window=window, window_factor=window_factor)
        self.num_features = check_positive_int("num_features", num_features)
        self.feature_map = check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
        self.eps = fm.denominator_eps(FEATURE_MAPS[self.feature_map], self.eps)
        if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or sigma <= 0:
            raise ValueError(f"sigma must be a positive number, got {sigma!r}")
        self.gated = check_bool("gated", gated)
        log_sigma = torch.full((heads,), math.log(sigma))
        if check_bool("learn_sigma", learn_sigma):
            self.log_sigma = nn.Parameter(log_sigma)
        else:
            self.register_buffer("log_sigma", log_sigma)
        self.register_buffer("projection", self._draw(self._train_generator())[0])

    def _draw(self, generator: TensorGenerator) -> tuple[Tensor]:
        return (gaussian_projection(self.num_features, self.head_dim, orthogonal=False,
                                    generator=generator),)

    @property
    def sigma(self) -> Tensor:
        """Per-head bandwidth (H,)."""
        return self.log_sigma.exp()

    @property
    def estimates_exp(self) -> bool:
        return FEATURE_MAPS[self.feature_map] in fm.UNBIASED_EXP

    @property
    def feature_dim(self) -> int:
        return self.num_features * (2 if self.feature_map == "sincos" else 1)

    def features(self, x: Tensor, *, is_query: bool) -> fm.Features:
        """φ of unit(x) with w = projection / σ_h (σ per head, broadcast over (B, H, L, F))."""
        return FEATURE_MAPS[self.feature_map](self._inputs(x), self.projection.to(x.dtype),
                                              is_query=is_query)

    def feature_fn(self) -> FeatureFn:
        if self.feature_map == "sincos":
            return fm.SineMap(self.projection, self._inputs, "sincos")
        return fm.ReluMap(self.projection, self._inputs, "arccos")

    def _inputs(self, x: Tensor) -> Tensor:
        """unit(x) / σ_h, what the projection multiplies (:class:`_ScaledUnit`)."""
        return _ScaledUnit.apply(x, (-self.log_sigma).exp().to(x.dtype))

    def window_logits(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, float, Tensor | None]:
        """The log of RFA's kernel exp((q̂·k̂ - 1)/σ²): q̂/σ², k̂ at scale 1, shifted by -1/σ²
        (per head; ``scale`` has no effect, as in the pure method)."""
        inverse = self.sigma.to(q.dtype).pow(-2)  # (H,)
        return unit(q) * inverse[:, None, None], unit(k), 1.0, -inverse

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_features={self.num_features}, "
                f"feature_map={self.feature_map!r}, gated={self.gated}")


def _flops(options: Mapping[str, Any], problem: Problem) -> float:
    paired = options["feature_map"] == "sincos"
    return kernelized_flops(problem, projections=options["num_features"],
                      feature_dim=options["num_features"] * (2 if paired else 1),
                      chunk_size=options["chunk_size"], window=options["window"])


def _target(q: Tensor, k: Tensor, v: Tensor, scale: float, options: Mapping[str, Any]) -> Tensor:
    """RFA's own kernel: softmax(q̂ k̂^T / σ²) v on unit-length q, k (``scale`` does not enter)."""
    from effattn import naive  # imported here: the references stay off the runtime path

    sigma = float(options["sigma"])
    return naive.softmax_attention(unit(q), unit(k), v, scale=1.0 / sigma**2)


def _reference(
    module: RandomFeatureAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
) -> Tensor:
    """The explicit kernel matrix of the module's features, gated through the explicit
    recurrence weights (1 - g_j) Π_{j<l<=i} g_l."""
    from effattn import naive  # imported here: the references stay off the runtime path

    hat_q, hat_k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    logits = (hat_q @ hat_k.transpose(-2, -1) - 1.0) / module.sigma.to(q.dtype)[:, None, None] ** 2
    return naive.rfa_attention(
        q, k, v, module.projection, module.sigma, feature_map=module.feature_map, causal=causal,
        key_padding_mask=key_padding_mask, gate=gate,
        hybrid=naive.window_hybrid(module, logits),
    )


register(
    MethodSpec(
        name="rfa",
        summary="Random Feature Attention: unit-norm q/k, random Fourier features, optional gate",
        paper="Peng et al. 2021, Random Feature Attention (ICLR 2021)",
        complexity="O((N + M) F D) time, O((N + M) F + F D) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={
            "num_features": 128,
            "sigma": 1.0,
            "learn_sigma": False,
            "feature_map": "sincos",
            "gated": False,
            "redraw_interval": 1,
            "chunk_size": 32,
            **WINDOW_OPTIONS,
        },
        flops=_flops,
        budget=Budget("num_features", (16, 32, 64, 128, 256, 512, 1024), target=_target),
        # The authors learn σ; the gate changes every decoding step (a learned σ does not).
        variants=(Variant({"learn_sigma": True}), Variant({"gated": True}, decoding=True),
                  Variant({"gated": True, "learn_sigma": True})),
        call_inputs=(CallInput(
            "gate", "per-head forget gate g_t of S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T",
            ("B", "H", "N"), enabled_by="gated", causal_only=True, bounds=(0.0, 1.0)),),
        reference=_reference,
        sequence_parallel=StateExchange(),
    ),
    RandomFeatureAttention,
)
