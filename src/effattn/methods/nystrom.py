"""Nyströmformer: softmax attention through a Nyström approximation built on segment-mean landmarks.

out = softmax(Q K̃^T) · pinv(softmax(Q̃ K̃^T)) · softmax(Q̃ K^T) · V   (+ depthwise conv of V)
(Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention").
Every kernel is softmax(scale · x y^T): the paper's D^(-1/4) on each of Q and K, for any scale
(landmarks are means, so scaling Q and K by sqrt(scale) first is the same). Q̃ (m_q landmarks) and
K̃ (m_k landmarks) are the means of consecutive segments of the queries and of the keys; the pinv
is the 6-step iteration of the paper. q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) ->
(B, H, N, Dv). Cost O((N + M) m D) time and O((N + M) m) memory for m landmarks.

Lengths that m does not divide get uneven segments: with n tokens, segment i holds the tokens of
rank r with floor(i n / m) <= r < floor((i + 1) n / m). A sequence shorter than m has one landmark
per token (m_q = min(m, N), m_k = min(m, M)); when every landmark is a single token
(m >= N and m >= M) the three kernels are the same matrix S and the exact pseudo-inverse is used,
so that S pinv(S) S V = S V is exact softmax attention.

Padding: key landmarks average unpadded keys only, segments being cut over the unpadded keys;
padded keys are masked out of softmax(Q̃ K^T), and landmarks holding no unpadded token drop out
of all three kernels (their rows and columns are zero, and the pseudo-inverse of a matrix with
zero rows and columns is zero there). With N == M the mask is taken to mark padded tokens, so
query landmarks average unpadded queries only as well: the outputs at unpadded positions are
then those of the unpadded sequence alone. This only chooses which queries are averaged, never
which keys are seen. A row with no unpadded key outputs zeros.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effattn.base import AttentionMethod, check_positive_int, compute_dtype
from effattn.registry import Budget, MethodSpec, Problem, register


def segment_averaging(keep: Tensor, m: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """keep (B, L) bool -> (A (B, m, L), valid (B, m) bool).

    A @ x gives the means of m consecutive segments of the kept tokens of x; ``valid`` says
    which segments hold at least one kept token.
    """
    count = keep.sum(-1, keepdim=True).clamp_min(1)
    rank = keep.cumsum(-1) - 1
    # Token of rank r lies in segment i iff floor(i n/m) <= r < floor((i+1) n/m), that is
    # i = ceil((r+1) m/n) - 1; dropped tokens go to segment m, which is never read.
    segment = ((rank + 1) * m + count - 1).div(count, rounding_mode="floor") - 1
    segment = segment.masked_fill(~keep, m)
    members = segment[:, None, :] == torch.arange(m, device=keep.device)[None, :, None]
    sizes = members.sum(-1)
    return members.to(dtype) / sizes.clamp_min(1)[..., None].to(dtype), sizes > 0


def iterative_pinv(s: Tensor, iterations: int) -> Tensor:
    """Approximate pinv of s (..., a, b), nonnegative, by the paper's iteration.

    Z <- 1/4 Z (13 I - S Z (15 I - S Z (7 I - S Z))) from Z0 = S^T / (max row sum · max column
    sum); the norms are taken per matrix, so one sequence never changes another's result.
    """
    norm = s.sum(-1).amax(-1) * s.sum(-2).amax(-1)
    z = s.transpose(-2, -1) / norm.clamp_min(torch.finfo(s.dtype).tiny)[..., None, None]
    eye = torch.eye(s.shape[-2], dtype=s.dtype, device=s.device)
    for _ in range(iterations):
        sz = s @ z
        z = 0.25 * z @ (13 * eye - sz @ (15 * eye - sz @ (7 * eye - sz)))
    return z


def depthwise_conv(v: Tensor, weight: Tensor) -> Tensor:
    """Per-head convolution of v (B, H, M, Dv) along the sequence, zero-padded at the ends.

    weight (H, kernel), kernel odd: out[i] = sum_t weight[h, t] v[i + t - kernel // 2], the same
    kernel for every feature of the head.
    """
    heads, kernel = weight.shape
    return F.conv2d(v, weight.view(heads, 1, kernel, 1), padding=(kernel // 2, 0), groups=heads)


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    num_landmarks: int = 64,
    pinv_iterations: int = 6,
    conv_weight: Tensor | None = None,
) -> Tensor:
    """Nyström attention; ``conv_weight`` (H, kernel) adds ``depthwise_conv`` of V (N == M)."""
    b, _, n, d = q.shape
    m = k.shape[2]
    if conv_weight is not None and n != m:
        raise ValueError(
            f"conv_weight adds a convolution of V at key positions: it needs N == M, got N={n}, "
            f"M={m}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keep_k = (
        torch.ones(b, m, dtype=torch.bool, device=k.device)
        if key_padding_mask is None
        else ~key_padding_mask
    )
    # A sequence with no unpadded key is computed unmasked and zeroed at the end: no softmax row
    # is ever empty, so no NaN reaches the outputs or the gradients.
    empty = ~keep_k.any(-1)
    keep_k = keep_k | empty[:, None]
    keep_q = keep_k if n == m else torch.ones(b, n, dtype=torch.bool, device=q.device)
    avg_q, valid_q = segment_averaging(keep_q, min(num_landmarks, n), q.dtype)
    avg_k, valid_k = segment_averaging(keep_k, min(num_landmarks, m), k.dtype)
    q_land = torch.einsum("bml,bhld->bhmd", avg_q, q)
    k_land = torch.einsum("bml,bhld->bhmd", avg_k, k)

    # kernel_2 = softmax(Q̃ K̃^T), with empty landmarks as zero columns and zero rows.
    logits = (scale * q_land @ k_land.transpose(-2, -1)).masked_fill(
        ~valid_k[:, None, None, :], float("-inf")
    )
    kernel_2 = torch.softmax(logits, -1) * valid_q[:, None, :, None].to(q.dtype)
    if num_landmarks >= max(n, m):
        pinv = torch.linalg.pinv(kernel_2)
    else:
        pinv = iterative_pinv(kernel_2, pinv_iterations)
    # kernel_3 V and kernel_1 (pinv kernel_3 V) are attentions over M keys and over m_k
    # landmarks, done by the fused kernel (O(N) memory). Rows of empty query landmarks in
    # kernel_3 V need no zeroing: the matching columns of the pinv are zero.
    key_mask = None if key_padding_mask is None else keep_k[:, None, None, :]
    values = F.scaled_dot_product_attention(q_land, k, v, attn_mask=key_mask, scale=scale)
    landmark_mask = None if bool(valid_k.all()) else valid_k[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q, k_land, pinv @ values, attn_mask=landmark_mask, scale=scale
    )
    if conv_weight is not None:
        out = out + depthwise_conv(v.masked_fill(~keep_k[:, None, :, None], 0.0), conv_weight)
    if key_padding_mask is not None:
        out = out.masked_fill(empty[:, None, None, None], 0.0)
    return out


class Nystromformer(AttentionMethod):
    """Nyström attention with ``num_landmarks`` landmarks and ``pinv_iterations`` pinv steps.

    ``conv_kernel`` (odd int or None): a learned per-head convolution of V along the sequence,
    added to the output (self-attention only); weights start U(-1/sqrt(kernel), 1/sqrt(kernel)),
    PyTorch's default conv initialisation, drawn from ``seed``.
    """

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        num_landmarks: int,
        pinv_iterations: int,
        conv_kernel: int | None,
    ) -> None:
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        check_positive_int("num_landmarks", num_landmarks)
        check_positive_int("pinv_iterations", pinv_iterations)
        if conv_kernel is not None:
            check_positive_int("conv_kernel", conv_kernel)
            if conv_kernel % 2 == 0:
                raise ValueError(f"conv_kernel must be odd, got {conv_kernel!r}")
        self.num_landmarks = num_landmarks
        self.pinv_iterations = pinv_iterations
        self.conv_kernel = conv_kernel
        if conv_kernel is None:
            self.register_parameter("conv_weight", None)
        else:
            generator = torch.Generator()
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            bound = 1.0 / math.sqrt(conv_kernel)
            weight = (torch.rand(heads, conv_kernel, generator=generator) * 2 - 1) * bound
            self.conv_weight = nn.Parameter(weight)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_landmarks={self.num_landmarks}, "
            f"pinv_iterations={self.pinv_iterations}, conv_kernel={self.conv_kernel}"
        )

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dtype = compute_dtype(q.dtype)
        conv = None if self.conv_weight is None else self.conv_weight.to(dtype)
        return nystrom_attention(
            q.to(dtype), k.to(dtype), v.to(dtype),
            key_padding_mask=key_padding_mask, scale=self.scale,
            num_landmarks=self.num_landmarks, pinv_iterations=self.pinv_iterations,
            conv_weight=conv,
        )


def _flops(options: Mapping[str, Any], p: Problem) -> float:
    """Three kernels 2·(N m + m² + m M)·D, the iterative pseudo-inverse 8·m³ per iteration, the
    products in the cheapest order 2·(m M + m² + N m)·Dv, a depthwise convolution 2·N·Dv·c."""
    lm = min(options["num_landmarks"], p.n, p.m)
    kernels = (p.n * lm + lm * lm + lm * p.m) * p.head_dim
    products = (lm * p.m + lm * lm + p.n * lm) * p.value_dim
    conv = p.n * p.value_dim * (options["conv_kernel"] or 0)
    pinv = 4 * lm**3 * options["pinv_iterations"]
    return 2.0 * p.batch * p.heads * (kernels + products + conv + pinv)


register(
    MethodSpec(
        name="nystrom",
        summary="Nyström approximation with segment-mean landmarks and an iterative pseudo-inverse",
        paper="Xiong et al. 2021, Nyströmformer: A Nyström-Based Algorithm for Approximating "
        "Self-Attention",
        complexity="O((N + M) m D) time, O((N + M) m) memory for m landmarks",
        causal=False,
        padding_mask=True,
        cross=True,
        decoding=False,
        options={"num_landmarks": 64, "pinv_iterations": 6, "conv_kernel": None},
        flops=_flops,
        budget=Budget("num_landmarks", (8, 16, 32, 64, 128, 256, 512)),
        bench_default=True,
        refusals={
            "causal": "segment-mean landmarks average future tokens into every kernel, so masking "
            "the kernels would not make the output causal",
            "decoding": "the landmarks change with every new token (no causal form)",
        },
    ),
    Nystromformer,
)
