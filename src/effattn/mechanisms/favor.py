"""Original FAVOR: trigonometric random features with a random phase (Choromanski et al. 2020,
"Masked Language Modeling for Proteins via Linearly Scalable Long-Context Transformers").

φ(x) = sqrt(2/F) exp(|x|²/2) cos(w x + b), w ~ N(0, I) (orthogonal blocks by default),
b ~ U(0, 2π): E[φ(x)·φ(y)] = exp(x·y) on x = q·sqrt(scale), y = k·sqrt(scale).
Features can be negative, so the normaliser can approach 0 (the reason FAVOR+ replaced it).
q, k: (B, H, N|M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).

Precision: the normaliser's terms are signed, so rounding is amplified by its condition number
κ_i = Σ_{j<=i} Σ_f |φ_f(q_i) φ_f(k_j)| / |Σ_{j<=i} φ(q_i)·φ(k_j)| (median ~50-200 over 33-200
tokens for unit-variance q, k at D = 64, growing like √i; 1e4-1e6 on the few queries whose
estimate passes near 0). ``step``, ``prefill`` and the causal forward sum in different orders
and agree elementwise within 4 ε κ_i (μ + √i + √F) (|o_i| + max_{j<=i} |v_j|) (ε = 2^-24 in
fp32; μ ~ 25 for unit-variance entries, ~110 at norm 30; see kernelized.core, "Precision of
decoding"): in fp32 to 1e-4 to 1e-3 relative on those queries, in float64 to ~1e-12. Float64,
or FAVOR+ (performer's positive features, κ_i = 1), avoids it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from effattn.base import check_bool, check_positive_int
from effattn.kernelized import features as fm
from effattn.kernelized.base import WINDOW_OPTIONS, KernelizedAttention
from effattn.kernelized.core import FeatureFn
from effattn.kernelized.flops import kernelized_flops
from effattn.kernelized.parallel import StateExchange
from effattn.kernelized.projections import gaussian_projection
from effattn.random import TensorGenerator, uniform
from effattn.registry import Budget, MethodSpec, Problem, register


class FavorAttention(KernelizedAttention):
    """FAVOR with ``num_features`` random-phase cosine features."""

    random_buffers = ("projection", "phase")

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        num_features: int = 256,
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
        self.orthogonal = check_bool("orthogonal", orthogonal)
        w, b = self._draw(self._train_generator())
        self.register_buffer("projection", w)
        self.register_buffer("phase", b)

    def _draw(self, generator: TensorGenerator) -> tuple[Tensor, Tensor]:
        w = gaussian_projection(
            self.num_features, self.head_dim, orthogonal=self.orthogonal, generator=generator
        )
        b = uniform(generator, self.num_features)
        return w, (2 * math.pi * b).float()

    @property
    def estimates_exp(self) -> bool:
        return True

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def features(self, x: Tensor, *, is_query: bool) -> fm.Features:
        return fm.random_phase_cos(
            self._inputs(x), self.projection.to(x.dtype), self.phase.to(x.dtype),
            is_query=is_query,
        )

    def feature_fn(self) -> FeatureFn:
        return fm.SineMap(self.projection, self._inputs, "phase", self.phase)

    def _inputs(self, x: Tensor) -> Tensor:
        return x * math.sqrt(self.scale)


def _reference(
    module: FavorAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The explicit kernel matrix of the module's random-phase cosine features."""
    from effattn import naive  # imported here: the references stay off the runtime path

    logits = module.scale * q @ k.transpose(-2, -1)
    return naive.favor_attention(
        q, k, v, module.projection, module.phase, causal=causal,
        key_padding_mask=key_padding_mask, scale=module.scale,
        hybrid=naive.window_hybrid(module, logits),
    )


def _flops(options: Mapping[str, Any], problem: Problem) -> float:
    return kernelized_flops(problem, projections=options["num_features"],
                      feature_dim=options["num_features"], chunk_size=options["chunk_size"],
                      window=options["window"])


register(
    MethodSpec(
        name="favor",
        summary="original FAVOR: random-phase cosine features for the softmax kernel",
        paper="Choromanski et al. 2020, Masked Language Modeling for Proteins via Linearly "
        "Scalable Long-Context Transformers",
        complexity="O((N + M) F D) time, O((N + M) F + F D) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={
            "num_features": 256,
            "orthogonal": True,
            "redraw_interval": 1000,
            "chunk_size": 32,
            **WINDOW_OPTIONS,
        },
        flops=_flops,
        budget=Budget("num_features", (16, 32, 64, 128, 256, 512, 1024)),
        reference=_reference,
        sequence_parallel=StateExchange(),
    ),
    FavorAttention,
)
