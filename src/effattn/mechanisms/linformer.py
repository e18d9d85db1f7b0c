"""Linformer: attention over learned projections of the keys and values along the sequence.

head = softmax(scale · Q (E K)^T) (F V)   (Wang et al. 2020, "Linformer: Self-Attention with
Linear Complexity"), with E, F ∈ R^(P x max_len) learned and sliced to the first M columns for
a sequence of M keys. q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv);
e, f: (H, P, L) per head or (P, L) shared by the heads, L >= M. Cost O(N·P·D + M·P·D).

Padded keys and values are zeroed before the projection, so they add nothing to E K and F V.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effattn.base import AttentionMethod, compute_dtype
from effattn.random import resolve_seed
from effattn.registry import Budget, MethodSpec, Problem, register

SHARE_MODES = ("none", "kv", "headwise")


def _project(p: Tensor, x: Tensor) -> Tensor:
    """p (H, P, M) or (P, M) times x (B, H, M, D) along the sequence -> (B, H, P, D)."""
    if p.dim() == 2:
        return torch.einsum("pm,bhmd->bhpd", p, x)
    return torch.einsum("hpm,bhmd->bhpd", p, x)


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e: Tensor,
    f: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(scale q (E k)^T) (F v) with E, F the first M columns of ``e``, ``f``.

    Unlike exact attention, a row whose keys are all padding still attends to P (zero)
    projected keys and values, so it outputs zeros.
    """
    m = k.shape[2]
    for arg, p in (("e", e), ("f", f)):
        if p.dim() not in (2, 3) or p.shape[-1] < m or (p.dim() == 3 and p.shape[0] != q.shape[1]):
            raise ValueError(
                f"{arg} must be (H, P, L) or (P, L) with H = {q.shape[1]} and L >= M = {m}, "
                f"got {tuple(p.shape)}"
            )
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :, None]
        k = k.masked_fill(pad, 0.0)
        v = v.masked_fill(pad, 0.0)
    k_proj = _project(e[..., :m], k)
    v_proj = _project(f[..., :m], v)
    return F.scaled_dot_product_attention(q, k_proj, v_proj, scale=scale)


class Linformer(AttentionMethod):
    """Linformer attention with learned sequence projections E, F.

    Args:
        proj_len: P, the number of projected keys/values.
        share: ``"none"``: E and F per head, shape (H, P, max_len) each; ``"kv"``: one per-head
            matrix used as both E and F; ``"headwise"``: E and F of shape (P, max_len) shared by
            the heads.
        max_len: required; any length up to it uses the first L columns of E and F.

    E and F start with i.i.d. N(0, 1/proj_len) entries, the Johnson-Lindenstrauss scaling of the
    paper's analysis (E[E^T E] = I), drawn from ``seed``.
    """

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        proj_len: int,
        share: str,
    ) -> None:
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        if max_len is None:
            raise ValueError("linformer needs max_len (the projections E, F are max_len wide)")
        if isinstance(proj_len, bool) or not isinstance(proj_len, int) or proj_len < 1:
            raise ValueError(f"proj_len must be a positive int, got {proj_len!r}")
        if share not in SHARE_MODES:
            raise ValueError(f"share must be one of {SHARE_MODES}, got {share!r}")
        self.proj_len = proj_len
        self.share = share
        generator = torch.Generator().manual_seed(resolve_seed(seed))
        shape = (proj_len, max_len) if share == "headwise" else (heads, proj_len, max_len)
        std = 1.0 / math.sqrt(proj_len)
        self.e = nn.Parameter(torch.randn(shape, generator=generator) * std)
        if share == "kv":
            self.register_parameter("f", None)
        else:
            self.f = nn.Parameter(torch.randn(shape, generator=generator) * std)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, proj_len={self.proj_len}, share={self.share!r}, "
            f"max_len={self.max_len}"
        )

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dtype = compute_dtype(q.dtype)
        e = self.e.to(dtype)
        f = e if self.f is None else self.f.to(dtype)
        return linformer_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), e, f,
            key_padding_mask=key_padding_mask, scale=self.scale,
        )


def _reference(
    module: Linformer,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The explicit N x M mixing matrix softmax(scale q (E k)^T) F of the module's E, F."""
    from effattn import naive  # imported here: the references stay off the runtime path

    f = module.e if module.f is None else module.f
    return naive.linformer_attention(
        q, k, v, module.e.to(q.dtype), f.to(q.dtype), key_padding_mask=key_padding_mask,
        scale=module.scale,
    )


def _flops(options: Mapping[str, Any], p: Problem) -> float:
    """k and v projected to P rows, then N queries over them: 2·B·H·(P M + N P)·(D + Dv)."""
    k = min(options["proj_len"], p.m)
    return 2.0 * p.batch * p.heads * (k * p.m + p.n * k) * (p.head_dim + p.value_dim)


register(
    MethodSpec(
        name="linformer",
        summary="learned low-rank projection (E, F) of keys and values along the sequence",
        paper="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity",
        complexity="O((N + M) P D) time, O((N + M) P) memory",
        causal=False,
        padding_mask=True,
        cross=True,
        decoding=False,
        options={"proj_len": 256, "share": "none"},
        flops=_flops,
        budget=Budget("proj_len", (16, 32, 64, 128, 256),
                      note="untrained random projections: not an approximation of softmax"),
        published={"lra_listops": 35.70},
        refusals={
            "causal": "the projections E K and F V mix every position, future tokens included",
            "decoding": "each new token changes every projected key and value (no causal form)",
            "sequence_parallel": "every projected key and value sums over the whole sequence "
            "(an all-reduce of E K and F V could split it; no strategy does that yet)",
        },
        reference=_reference,
    ),
    Linformer,
)
