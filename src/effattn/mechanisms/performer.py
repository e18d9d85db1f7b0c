"""Performer / FAVOR+ (Choromanski et al. 2020, "Rethinking Attention with Performers").

softmax(scale · q k^T) v is estimated with random features φ so that
E[φ(q̃)·φ(k̃)] = exp(q̃·k̃), q̃ = q·sqrt(scale), k̃ = k·sqrt(scale); then
out = φ(Q)(φ(K)^T [V, 1]) normalised by its last column, in O((N + M)·F·D).

Feature maps (see kernelized.features): "positive" exp(w x - |x|²/2) (FAVOR+, default),
"hyperbolic" (antithetic pairs, 2F features), "trig" (sin/cos, 2F features, unbounded
variance near small kernel values), "relu" (generalised attention, not a softmax estimator).
q, k: (B, H, N|M, D), v: (B, H, M, Dv) -> (B, H, N, Dv). One projection (F, D) shared by heads.

Precision: "trig" features are signed, so the normaliser Σ_{j<=i} φ(q_i)·φ(k_j) cancels and
rounding is amplified by κ_i = Σ_{j<=i} Σ_f |φ_f(q_i) φ_f(k_j)| / |Σ_{j<=i} φ(q_i)·φ(k_j)|
(median ~100-300 over 33-200 tokens for unit-variance q, k or rows of norm 30 at D = 64,
growing like √i; 1e4-1e6 on a few queries); the other maps are non-negative, κ_i = 1.
``step``, ``prefill`` and the causal forward sum in different orders and agree elementwise
within 4 ε κ_i (μ + √i + √F) (|o_i| + max_{j<=i} |v_j|) (ε = 2^-24 in fp32; μ ~ 25 for
unit-variance entries, ~110 at norm 30; see kernelized.core, "Precision of decoding"): with
"trig" in fp32 to 1e-4 to 1e-3 relative on the queries of large κ_i, in float64 to ~1e-12;
with the other maps to ~1e-6 (2e-5 on single entries at norm 30, where μ is large).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from effattn.base import check_bool, check_choice, check_positive_int
from effattn.kernelized import features as fm
from effattn.kernelized.base import WINDOW_OPTIONS, KernelizedAttention
from effattn.kernelized.core import FeatureFn
from effattn.kernelized.flops import kernelized_flops
from effattn.kernelized.parallel import StateExchange
from effattn.kernelized.projections import gaussian_projection
from effattn.random import TensorGenerator
from effattn.registry import Budget, MethodSpec, Problem, register

FEATURE_MAPS = {
    "positive": fm.positive,
    "hyperbolic": fm.hyperbolic,
    "trig": fm.trig,
    "relu": fm.relu,
}


class PerformerAttention(KernelizedAttention):
    """FAVOR+ with ``num_features`` random projections (orthogonal by default)."""

    random_buffers = ("projection",)

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        num_features: int = 256,
        feature_map: str = "positive",
        orthogonal: bool = True,
        redraw_interval: int | None = 1000,
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
        self.orthogonal = check_bool("orthogonal", orthogonal)
        self.register_buffer("projection", self._draw(self._train_generator())[0])

    def _draw(self, generator: TensorGenerator) -> tuple[Tensor]:
        return (gaussian_projection(self.num_features, self.head_dim, orthogonal=self.orthogonal,
                                    generator=generator),)

    @property
    def estimates_exp(self) -> bool:
        return FEATURE_MAPS[self.feature_map] in fm.UNBIASED_EXP

    @property
    def feature_dim(self) -> int:
        paired = self.feature_map in ("hyperbolic", "trig")
        return self.num_features * (2 if paired else 1)

    def features(self, x: Tensor, *, is_query: bool) -> fm.Features:
        return FEATURE_MAPS[self.feature_map](
            self._inputs(x), self.projection.to(x.dtype), is_query=is_query
        )

    def feature_fn(self) -> FeatureFn:
        if self.feature_map in ("positive", "hyperbolic"):
            return fm.PositiveMap(self.projection, math.sqrt(self.scale),
                                  pair=self.feature_map == "hyperbolic")
        if self.feature_map == "trig":
            return fm.SineMap(self.projection, self._inputs, "trig")
        return fm.ReluMap(self.projection, self._inputs, "relu")

    def _inputs(self, x: Tensor) -> Tensor:
        return x * math.sqrt(self.scale)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_features={self.num_features}, "
                f"feature_map={self.feature_map!r}, orthogonal={self.orthogonal}")


def _reference(
    module: PerformerAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The explicit kernel matrix of the module's true features φ(q̃)·φ(k̃)."""
    from effattn import naive  # imported here: the references stay off the runtime path

    logits = module.scale * q @ k.transpose(-2, -1)
    return naive.performer_attention(
        q, k, v, module.projection, feature_map=module.feature_map, causal=causal,
        key_padding_mask=key_padding_mask, scale=module.scale,
        hybrid=naive.window_hybrid(module, logits),
    )


def _flops(options: Mapping[str, Any], problem: Problem) -> float:
    paired = options["feature_map"] in ("hyperbolic", "trig")
    return kernelized_flops(problem, projections=options["num_features"],
                      feature_dim=options["num_features"] * (2 if paired else 1),
                      chunk_size=options["chunk_size"], window=options["window"])


register(
    MethodSpec(
        name="performer",
        summary="FAVOR+: positive orthogonal random features for the softmax kernel",
        paper="Choromanski et al. 2020, Rethinking Attention with Performers (ICLR 2021)",
        complexity="O((N + M) F D) time, O((N + M) F + F D) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={
            "num_features": 256,
            "feature_map": "positive",
            "orthogonal": True,
            "redraw_interval": 1000,
            "chunk_size": 32,
            **WINDOW_OPTIONS,
        },
        flops=_flops,
        budget=Budget("num_features", (16, 32, 64, 128, 256, 512, 1024)),
        bench_default=True,
        published={"lra_listops": 18.01},
        reference=_reference,
        sequence_parallel=StateExchange(),
    ),
    PerformerAttention,
)
