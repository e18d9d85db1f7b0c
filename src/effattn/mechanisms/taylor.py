"""Taylor feature map of Based (Arora et al. 2024, "Simple linear attention language models
balance the recall-throughput tradeoff").

exp(t) ~ 1 + t + t²/2 as a kernel of explicit features: on a per-head projection of q and k to
P dimensions (Based: P = 16),

    x̃ = sqrt(scale) · x W_h,    φ(x̃) = [1, x̃, vec(x̃ x̃ᵀ)/√2],
    φ(q̃)·φ(k̃) = 1 + t + t²/2,   t = q̃·k̃ = scale · qᵀ W_h W_hᵀ k,

and out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j). The quadratic part is stored as the upper
triangle of x̃ x̃ᵀ (x̃_i²/√2, and x̃_i x̃_j once for i < j): the same kernel in
1 + P + P(P + 1)/2 features (153 at P = 16, against 273 for the full vec).

The projection W_h (D, P) makes t match the softmax logit scale · q·k: E[W_h W_hᵀ] = I, so that
t is scale · q·k in expectation, and exactly so where P >= D. It is drawn from the module's seed
per head as the orthonormal basis Q (D, P) of a uniformly random P-dimensional subspace
(E[Q Qᵀ] = (P / D) I) times sqrt(D / P) for P < D, and as P-dimensional orthonormal rows
(W_h W_hᵀ = I: t = scale · q·k for every q, k) for P >= D, where the larger P buys nothing.
Based writes φ(x) = [1, x / d^(1/4), vec(x xᵀ) / (√2 √d)] on its own d-dimensional projections,
the case W = I, P = D here. ``learn_projection=True`` makes W a parameter (trained with the model
or by distillation, as Based trains its q, k maps), False a fixed buffer; both are saved in the
state_dict.

Numerics: the kernel 1 + t + t²/2 = ((1 + t)² + 1)/2 is >= 1/2 for every t, so the normaliser is
a sum of terms >= 1/2: it never cancels to 0 (eps = 0) nor underflows, and nothing needs a
log-scale (polynomial features overflow fp32 only for |x̃| ~ 1e9). The features themselves are
signed, so a kernel value near its minimum is a difference of larger products: rounding is
amplified by κ = Σ_f |φ_f(q)φ_f(k)| / φ(q)·φ(k) <= 2 (1 + |q̃||k̃| + |q̃|²|k̃|²/2), typically
~5-10 for unit-variance q, k at D = 64 (decoding equals the forward to 1e-5 in fp32 in the
tests, 1e-12 in float64).
q, k: (B, H, N|M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).

Measured (1 thread, B = 1, H = 8, D = 64, P = 16, N = 4096, fp32, paired and alternated,
median of 7 ratios, on 2 shared cores at a load of 9-12): the full P² form (273 features, built
as one broadcast product) took 1.35x the forward time of the symmetric one and 1.19x its
forward+backward, causal 1.39x and 1.26x: the core's GEMMs, whose width is the feature count,
dominate. Built by gathering the triangle's index pairs instead of row by row, the symmetric
form was slower than the full one (1.15x its forward).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from effattn.base import check_bool, check_positive_int
from effattn.kernelized import features as fm
from effattn.kernelized.base import WINDOW_OPTIONS, KernelizedAttention
from effattn.kernelized.core import FeatureFn
from effattn.kernelized.flops import kernelized_flops
from effattn.kernelized.parallel import StateExchange
from effattn.random import TensorGenerator, normal
from effattn.registry import Budget, MethodSpec, Problem, Variant, register


def taylor_feature_dim(proj_dim: int) -> int:
    """1 + P + P(P + 1)/2: the constant, the linear and the upper-triangle quadratic features."""
    return 1 + proj_dim + proj_dim * (proj_dim + 1) // 2


def draw_projection(generator: TensorGenerator, heads: int, dim: int, proj_dim: int) -> Tensor:
    """(H, D, P) projections with E[W_h W_hᵀ] = I_D (see the module docstring), in float32."""
    if proj_dim < dim:
        q, _ = torch.linalg.qr(normal(generator, heads, dim, proj_dim))  # (H, D, P) orthonormal
        return (q * math.sqrt(dim / proj_dim)).float()
    q, _ = torch.linalg.qr(normal(generator, heads, proj_dim, dim))  # (H, P, D) orthonormal
    return q.transpose(-2, -1).contiguous().float()  # orthonormal rows: W_h W_hᵀ = I_D


class TaylorAttention(KernelizedAttention):
    """Based's 2nd-order Taylor map on a per-head projection to ``proj_dim`` = P dimensions."""

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        proj_dim: int = 16,
        learn_projection: bool = True,
        chunk_size: int = 32,
        window: int | None = None,
        window_factor: bool = False,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale, chunk_size=chunk_size,
                         window=window, window_factor=window_factor,
                         eps=fm.denominator_eps(fm.taylor))
        self.proj_dim = check_positive_int("proj_dim", proj_dim)
        self.learn_projection = check_bool("learn_projection", learn_projection)
        w = draw_projection(self._train_generator(), heads, head_dim, proj_dim)
        if learn_projection:
            self.projection = nn.Parameter(w)
        else:
            self.register_buffer("projection", w)

    @property
    def feature_dim(self) -> int:
        return taylor_feature_dim(self.proj_dim)

    def feature_parameters(self) -> tuple[nn.Parameter, ...]:
        """The parameters :meth:`features` reads (a backward that recomputes the features
        differentiates them): the projection when it is learned, else none."""
        return (self.projection,) if self.learn_projection else ()

    def features(self, x: Tensor, *, is_query: bool) -> fm.Features:
        return fm.taylor(self._inputs(x))

    def feature_fn(self) -> FeatureFn:
        return fm.TaylorMap(self._inputs)

    def _inputs(self, x: Tensor) -> Tensor:
        """x̃ = sqrt(scale) x W_h (B, H, L, P): sqrt(scale) folded into the (H, D, P) weights
        rather than applied to x (L x D)."""
        return fm.project_heads(x, self.projection.to(x.dtype) * math.sqrt(self.scale))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, proj_dim={self.proj_dim}, "
                f"learn_projection={self.learn_projection}")


def _reference(
    module: TaylorAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The explicit kernel matrix 1 + t + t²/2 of t = scale · qᵀ W_h W_hᵀ k (not the features)."""
    from effattn import naive  # imported here: the references stay off the runtime path

    logits = module.scale * q @ k.transpose(-2, -1)
    return naive.taylor_attention(q, k, v, module.projection, scale=module.scale, causal=causal,
                                  key_padding_mask=key_padding_mask,
                                  hybrid=naive.window_hybrid(module, logits))


def _flops(options: Mapping[str, Any], problem: Problem) -> float:
    # The projection is a GEMM; the quadratic features are elementwise products.
    p = options["proj_dim"]
    return kernelized_flops(problem, projections=p, feature_dim=taylor_feature_dim(p),
                            chunk_size=options["chunk_size"], window=options["window"])


register(
    MethodSpec(
        name="taylor",
        summary="Based: 2nd-order Taylor features of exp on a small projection of q and k",
        paper="Arora et al. 2024, Simple linear attention language models balance the "
        "recall-throughput tradeoff (ICML 2024)",
        complexity="O((N + M) P² D) time, O((N + M) P² + P² D) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={"proj_dim": 16, "learn_projection": True, "chunk_size": 32,
                 **WINDOW_OPTIONS},
        flops=_flops,
        budget=Budget("proj_dim", (4, 8, 16, 32, 64),
                      note="the projection as drawn (E[W Wᵀ] = I), not trained"),
        variants=(Variant({"learn_projection": False}),),
        reference=_reference,
        sequence_parallel=StateExchange(),
    ),
    TaylorAttention,
)
