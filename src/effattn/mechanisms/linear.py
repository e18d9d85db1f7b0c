"""Linear transformer (Katharopoulos et al. 2020, "Transformers are RNNs").

φ(x) = elu(x) + 1; out_i = φ(q_i) Σ_j φ(k_j) v_j^T / φ(q_i) Σ_j φ(k_j), causal as the
recurrence S_t = S_{t-1} + φ(k_t) v_t^T. Not a softmax estimator, so ``scale`` has no effect.
q, k: (B, H, N|M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from effattn.kernelized import features as fm
from effattn.kernelized.base import WINDOW_OPTIONS, KernelizedAttention
from effattn.kernelized.core import FeatureFn
from effattn.kernelized.flops import kernelized_flops
from effattn.kernelized.parallel import StateExchange
from effattn.registry import MethodSpec, Problem, register


class LinearTransformerAttention(KernelizedAttention):
    """Deterministic elu + 1 features: F = D, nothing to draw."""

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        chunk_size: int = 32,
        window: int | None = None,
        window_factor: bool = False,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale, chunk_size=chunk_size,
                         window=window, window_factor=window_factor,
                         eps=fm.denominator_eps(fm.elu_plus_one))

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def features(self, x: Tensor, *, is_query: bool) -> fm.Features:
        return fm.elu_plus_one(x)

    def feature_fn(self) -> FeatureFn:
        return fm.EluMap()


def _reference(
    module: LinearTransformerAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The explicit kernel matrix (elu(q) + 1)·(elu(k) + 1); the module has no parameters."""
    from effattn import naive  # imported here: the references stay off the runtime path

    logits = module.scale * q @ k.transpose(-2, -1)
    return naive.linear_transformer_attention(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask,
        hybrid=naive.window_hybrid(module, logits),
    )


def _flops(options: Mapping[str, Any], problem: Problem) -> float:
    # The feature map is elementwise: no projection, F = D.
    return kernelized_flops(problem, projections=0, feature_dim=problem.head_dim,
                      chunk_size=options["chunk_size"], window=options["window"])


register(
    MethodSpec(
        name="linear",
        summary="linear transformer: elu(x) + 1 feature map",
        paper="Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive "
        "Transformers with Linear Attention",
        complexity="O((N + M) D^2) time, O((N + M) D + D^2) memory",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={"chunk_size": 32, **WINDOW_OPTIONS},
        flops=_flops,
        bench_default=True,
        published={"lra_listops": 16.13},
        reference=_reference,
        sequence_parallel=StateExchange(),
    ),
    LinearTransformerAttention,
)
