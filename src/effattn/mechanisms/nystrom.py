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
per token (m_q = min(m, N), m_k = min(m, M)).

Exact limit, decided per sequence by its unpadded lengths (never by the padded N, M): when its
unpadded queries and its unpadded keys each number at most m, every landmark is a single token
and the three kernels are one matrix S (up to the zero rows and columns of empty landmarks), so
S pinv(S) S V = S V: that sequence's output is computed as S V, softmax(Q K̃^T) times the
landmark keys' own values, which is exact softmax attention, with no pseudo-inverse (whose
rounding S pinv(S) S V would only add, badly when S is ill-conditioned).

Padding: key landmarks average unpadded keys only, segments being cut over the unpadded keys;
padded keys are masked out of softmax(Q̃ K^T), and landmarks holding no unpadded token drop out
of all three kernels (their rows and columns are zero, and the pseudo-inverse of a matrix with
zero rows and columns is zero there). With N == M the mask is taken to mark padded tokens, so
query landmarks average unpadded queries only as well: the outputs at unpadded positions are
then those of the unpadded sequence alone. This only chooses which queries are averaged, never
which keys are seen. A row with no unpadded key outputs zeros.

Breakdown on peaked logits: the estimate needs a well-conditioned landmark kernel. When a landmark
key lies far (tens of logits) below the maximum of every landmark query, its column of
softmax(Q̃ K̃^T) is ~0 (exactly 0 once it underflows): the kernel is numerically singular, the
exact pinv has entries ~1/σ_min (the estimate diverges), and the iteration, whose Z is
S^T g(S S^T), has a ~0 row for that landmark, so a query whose weight sits on it outputs ~0.
Such rows are refused, not returned: the row sums of the approximate attention matrix
softmax(Q K̃^T) Z softmax(Q̃ K^T) (1 for softmax attention, and for the estimate whenever Z
inverts the kernel) come for free as one more column of values, and an unpadded query whose row
sum is off 1 by more than ``MASS_TOLERANCE`` raises a ValueError (in eager mode; a compiled
forward does not read values back to the host, and returns such rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effattn.base import AttentionMethod, check_positive_int, compute_dtype
from effattn.random import resolve_seed
from effattn.registry import Budget, MethodSpec, Problem, register

# Largest |row sum - 1| of the approximate attention matrix accepted for an unpadded query. On
# q, k ~ N(0, s^2) and on the planted-peak data of tools/approx.py the sums stay within 0.8-1.35
# while the estimate is still an approximation; past this, the query has lost (or doubled) at
# least half of its attention and the estimate is dominated by the singular landmark kernel.
MASS_TOLERANCE = 0.5


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


def check_row_sums(mass: Tensor, query_ok: Tensor, num_landmarks: int) -> None:
    """Raise a ValueError when a query's approximate attention weights do not sum to about 1.

    mass (B, H, N): row sums of softmax(Q K̃^T) Z softmax(Q̃ K^T); query_ok (B, N): the queries
    whose output counts (unpadded, in a sequence with an unpadded key). See the module doc.
    Eager only: reading the flag is a host sync, and a graph break under torch.compile.
    """
    if torch.compiler.is_compiling():
        return
    bad = ~((mass - 1).abs() <= MASS_TOLERANCE) & query_ok[:, None, :]
    if bool(bad.any()):
        b, h, i = bad.nonzero()[0].tolist()
        raise ValueError(
            f"nystrom cannot approximate these q, k: the Nyström weights of query {i} (batch "
            f"{b}, head {h}) sum to {mass[b, h, i].item():.3g}, not about 1; the landmark kernel "
            f"softmax(Q̃ K̃^T) is numerically singular (logits too peaked for "
            f"num_landmarks={num_landmarks}). Scale q, k down, or use num_landmarks >= the "
            "sequence length (exact softmax attention)"
        )


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
    # Without a mask every segment holds a token: no landmark needs masking.
    landmark_mask = None if key_padding_mask is None else valid_k[:, None, None, :]

    all_exact = num_landmarks >= max(n, m)
    if all_exact:
        mixed = torch.einsum("bml,bhld->bhmd", avg_k, v)
    else:
        # kernel_2 = softmax(Q̃ K̃^T), with empty landmarks as zero columns and zero rows.
        logits = (scale * q_land @ k_land.transpose(-2, -1)).masked_fill(
            ~valid_k[:, None, None, :], float("-inf")
        )
        kernel_2 = torch.softmax(logits, -1) * valid_q[:, None, :, None].to(q.dtype)
        pinv = iterative_pinv(kernel_2, pinv_iterations)
        # kernel_3 V and kernel_1 (pinv kernel_3 V) are attentions over M keys and over m_k
        # landmarks, done by the fused kernel (O(N) memory). Rows of empty query landmarks in
        # kernel_3 V need no zeroing: the matching columns of the pinv are zero. The last
        # column, pinv kernel_3 1 = pinv 1, turns into the row sums of the approximation.
        key_mask = None if key_padding_mask is None else keep_k[:, None, None, :]
        values = F.scaled_dot_product_attention(q_land, k, v, attn_mask=key_mask, scale=scale)
        mixed = torch.cat([pinv @ values, pinv.sum(-1, keepdim=True)], -1)
        if key_padding_mask is not None:
            # Unpadded lengths within the landmarks: that sequence is exact (see the module doc);
            # chosen per sequence with a select, not a host-side branch.
            exact = (keep_q.sum(-1) <= num_landmarks) & (keep_k.sum(-1) <= num_landmarks)
            v_land = torch.einsum("bml,bhld->bhmd", avg_k, v)
            v_land = torch.cat([v_land, torch.ones_like(v_land[..., :1])], -1)
            mixed = torch.where(exact[:, None, None, None], v_land, mixed)
    out = F.scaled_dot_product_attention(q, k_land, mixed, attn_mask=landmark_mask, scale=scale)
    if not all_exact:
        out, mass = out[..., :-1], out[..., -1]
        check_row_sums(mass.detach(), keep_q & ~empty[:, None], num_landmarks)
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

    Refuses peaked logits (a ValueError "nystrom cannot approximate these q, k: ... numerically
    singular"): with logits of hundreds or more (q, k entries ~50 at D = 16 give about 1e4),
    the landmark kernel softmax(Q̃ K̃^T) has columns that underflow to 0, so it is numerically
    singular in float32 and float64 alike, and the estimate's row sums are far from 1 (see the
    module doc, "Breakdown on peaked logits"). Only the exact limit (at most ``num_landmarks``
    unpadded tokens) answers there.
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
            generator = torch.Generator().manual_seed(resolve_seed(seed))
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


def _reference(
    module: Nystromformer,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Nyström attention one sequence at a time from explicit kernels and pinv steps, with the
    module's landmarks, iterations and convolution."""
    from effattn import naive  # imported here: the references stay off the runtime path

    conv = None if module.conv_weight is None else module.conv_weight.to(q.dtype)
    return naive.nystrom_attention(
        q, k, v, key_padding_mask=key_padding_mask, scale=module.scale,
        num_landmarks=module.num_landmarks, pinv_iterations=module.pinv_iterations,
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
            "sequence_parallel": "every output needs the landmarks, means of segments that "
            "span the whole sequence",
        },
        reference=_reference,
    ),
    Nystromformer,
)
