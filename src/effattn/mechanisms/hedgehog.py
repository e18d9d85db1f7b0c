"""Hedgehog (Zhang, Bhatia, Kumbong, Ré 2024, "The Hedgehog & the Porcupine: Expressive Linear
Attentions with Softmax Mimicry", ICLR 2024): a kernelized attention whose feature map is
trained to mimic softmax.

Each head h has its own affine map u = x W_h + b_h, W_h (D, F), b_h (F,), and

    "exp":         φ(x) = [exp(u), exp(-u)]                    (the paper's map)
    "softmax_dim": φ(x) = [softmax(u), softmax(-u)]            (LoLCATs, Zhang et al. 2024)

(2F features; each softmax runs over its own F features), out_i = Σ_j φ(q_i)·φ(k_j) v_j /
Σ_j φ(q_i)·φ(k_j). The map is trained, by the model's loss or by attention distillation
(cross-entropy between softmax(scale q kᵀ) and the normalised φ(q_i)·φ(k_j), on the teacher's
own q, k), so it is a parameter (``weight`` (H, D, F), ``bias`` (H, F)), not a random draw.

The map acts on q and k as they are, as in both papers: ``scale`` has no effect (the learned W
absorbs any scale). Initialisation: W_h = the identity (for F != D, its first min(F, D) rows and
columns; columns beyond D are N(0, 1e-4) draws from the module's seed, since zero columns would
get equal gradients and stay equal forever) and b = 0. At the identity φ(q)·φ(k) =
2 Σ_f cosh(q_f + k_f), which weights keys close to uniformly: on the error study's Gaussian and
peaked inputs (tools/approx.py) it is never worse than the uniform average, slightly better
than it (0.73 against 0.79 of relative error at qk_std = 1), and applying it to √scale · q
instead, as the random-feature maps do, only moves it closer to uniform.

Numerics: the exp form hands the core its exponents u (:meth:`exponents`), and the core
(:mod:`effattn.kernelized.exponents`) shifts each feature by its own running max over the keys
a query can see (per sequence, or causally over the prefix), so that the largest term of every
normaliser is exactly 1 whatever the exponents: no exponent, however large (hundreds in fp32),
can overflow or underflow it, and no future key sets a scale. A single scale per row, as the
other maps use, would not do: a query and a key whose peaks sit on different features give
products exp(-|u_q| - |u_k|), which underflow fp32 once the exponents reach about 70, as they
did in training. The softmax form is bounded by construction and keeps the row convention; it
is non-negative (eps = 0), so a normaliser can underflow only when every product
Σ_f φ_f(q)φ_f(k) does, which the core reports as a ValueError rather than a zero row.
q, k: (B, H, N|M, D), v: (B, H, M, Dv) -> (B, H, N, Dv). Cost as performer with 2F features
and F projections (the exp form: 2F, one GEMM onto [W, -W] that gives u and -u without another
pass): the per-head projection is one batched GEMM over the (batch, head) pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from effattn.base import check_choice, check_positive_int
from effattn.kernelized import features as fm
from effattn.kernelized.base import WINDOW_OPTIONS, KernelizedAttention
from effattn.kernelized.core import DenominatorUnderflowError
from effattn.kernelized.flops import kernelized_flops
from effattn.kernelized.parallel import StateExchange
from effattn.random import normal
from effattn.registry import Budget, MethodSpec, Problem, Variant, register

FEATURE_MAPS = ("exp", "softmax_dim")
# Standard deviation of the weight columns beyond D (F > D): small enough to leave the map at
# init close to the identity's, large enough to make those columns differ.
EXTRA_COLUMN_STD = 1e-2


class HedgehogAttention(KernelizedAttention):
    """Hedgehog with ``num_features`` = F learned projections per head (None: F = D) and 2F
    features."""

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        num_features: int | None = None,
        feature_map: str = "exp",
        chunk_size: int = 32,
        window: int | None = None,
        window_factor: bool = False,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale, chunk_size=chunk_size,
                         window=window, window_factor=window_factor,
                         eps=fm.denominator_eps(fm.learned_exp))  # both maps: 0, non-negative
        f = head_dim if num_features is None else check_positive_int("num_features", num_features)
        self.num_features = f
        self.feature_map = check_choice("feature_map", feature_map, FEATURE_MAPS)
        weight = torch.eye(head_dim, f).repeat(heads, 1, 1)  # (H, D, F)
        if f > head_dim:
            extra = normal(self._train_generator(), heads, head_dim, f - head_dim)
            weight[..., head_dim:] = EXTRA_COLUMN_STD * extra.float()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(heads, f))

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    def feature_parameters(self) -> tuple[nn.Parameter, ...]:
        """The parameters :meth:`features` reads (a backward that recomputes the features
        differentiates them): W and b."""
        return (self.weight, self.bias)

    def features(self, x: Tensor, *, is_query: bool) -> fm.Features:
        w, b = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if self.feature_map == "softmax_dim":
            return fm.learned_softmax(x, w, b)
        return fm.learned_exp(x, w, b, is_query=is_query)

    def exponents(self, x: Tensor) -> Tensor:
        """The exp form's exponents u (B, H, L, 2F), φ(x) = exp(u): [x W_h + b_h, -(x W_h + b_h)],
        for the per-feature stabilised core (:mod:`effattn.kernelized.exponents`)."""
        return fm.AffineExponents(self.weight, self.bias)(x)

    def exponent_map(self) -> Callable[[Tensor], Tensor] | None:
        """The exp form runs the per-feature stabilised core on :meth:`exponents`, handed over
        as data (:class:`~effattn.kernelized.features.AffineExponents`), which the triton
        strategy forms inside its kernels."""
        if self.feature_map != "exp":
            return None
        return fm.AffineExponents(self.weight, self.bias)

    def _underflow(self, err: DenominatorUnderflowError, q: Tensor, k: Tensor | None) -> ValueError:
        """The core's underflow error with the size that causes it here: the largest exponent
        |x W_h + b_h| over q (and k), not a bound on scale q·k, which this map does not use."""
        rows = q if k is None else torch.cat([q, k], 2)
        with torch.no_grad():
            w, b = self.weight.to(rows.dtype), self.bias.to(rows.dtype)
            top = (fm.project_heads(rows, w) + b[:, None, :]).abs().max().item()
        return ValueError(f"{self.spec.name}: {err} (the map's exponents |x W + b| reach "
                          f"{top:.3g}); compute in float64 or scale q, k down")

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_features={self.num_features}, "
                f"feature_map={self.feature_map!r}")


def _reference(
    module: HedgehogAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The explicit kernel matrix of the module's map φ(q)·φ(k), with its W and b."""
    from effattn import naive  # imported here: the references stay off the runtime path

    logits = module.scale * q @ k.transpose(-2, -1)
    return naive.hedgehog_attention(q, k, v, module.weight, module.bias,
                                    feature_map=module.feature_map, causal=causal,
                                    key_padding_mask=key_padding_mask,
                                    hybrid=naive.window_hybrid(module, logits))


def _flops(options: Mapping[str, Any], problem: Problem) -> float:
    f = options["num_features"] or problem.head_dim
    # The exp form projects onto [W, -W] (its exponents in one GEMM), the softmax form onto W.
    projections = 2 * f if options["feature_map"] == "exp" else f
    return kernelized_flops(problem, projections=projections, feature_dim=2 * f,
                            chunk_size=options["chunk_size"], window=options["window"])


register(
    MethodSpec(
        name="hedgehog",
        summary="Hedgehog: a learned per-head exp feature map that mimics softmax",
        paper="Zhang et al. 2024, The Hedgehog & the Porcupine: Expressive Linear Attentions "
        "with Softmax Mimicry (ICLR 2024)",
        complexity="O((N + M) F D) time, O((N + M) F + F D) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={"num_features": None, "feature_map": "exp", "chunk_size": 32,
                 **WINDOW_OPTIONS},
        flops=_flops,
        budget=Budget("num_features", (16, 32, 64, 128, 256),
                      note="the map at its initialisation (identity W, zero b), not trained"),
        variants=(Variant({"feature_map": "softmax_dim"}),),
        reference=_reference,
        sequence_parallel=StateExchange(),
    ),
    HedgehogAttention,
)
