"""Random attention: every query attends to its own random subset of the keys.

out_i = Σ_{j in A_i} exp(s_ij) v_j / Σ_{j in A_i} exp(s_ij), s = scale · q k^T, where A_i is the
sampled key set of query i without padded keys (and without keys j > i when causal); an empty A_i
gives 0. q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv). (Random attention
as an ablation baseline, e.g. the random part of BigBird, Zaheer et al. 2020, at key level.)

Sampling. S = min(M, max(1, ceil(ratio·M))) keys per query, drawn per head and query (shared by
the batch) without replacement by stratified sampling: the candidate range is cut into S strata
of near-equal size (sizes differ by at most 1) and one key is drawn uniformly from each. Every key
of a stratum of size s is taken with probability 1/s (≈ S/M), no key twice, and ratio = 1 takes
every key, i.e. exact softmax. This costs O(N·S) random numbers; the top-S of M random scores per
query would give uniform subsets but cost O(N·M) draws and top-k work, as much as dense attention.
The price: two keys of one stratum are never sampled together.
- causal: query i has min(S, i + 1) keys: key i itself, so every query keeps one key, and
  min(S, i + 1) - 1 strata over [0, i). Nothing depends on later tokens.
- padding: the sample ignores the mask, so values at padded positions cannot change it; padded
  keys are dropped after sampling.
The pattern is (H, N, S) int32, -1 in unused slots (causal queries with fewer than S keys).

Computation: the sampled keys and values are gathered in blocks of queries, O(N·S·D) time. The
backward recomputes the blocks instead of keeping (N, S, D) gathers, so memory is the pattern
(4 bytes per sampled pair) plus one block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn.base import compute_dtype
from effattn.random import RandomizedAttention, RandomSource, uniform
from effattn.registry import Budget, MethodSpec, register

# Elements of one block's gathered keys (B, H, C, S, D): about 16 MB in float32.
_BLOCK_ELEMENTS = 1 << 22
# Queries per batch of random numbers when sampling (bounds the float64 temporaries).
_SAMPLE_ROWS = 1024


def subset_size(m: int, ratio: float) -> int:
    """S = min(M, max(1, ceil(ratio·M))) (ceil tolerant to rounding in ratio·M)."""
    return min(m, max(1, math.ceil(ratio * m - 1e-9)))


def sample_subsets(
    heads: int,
    n: int,
    m: int,
    size: int,
    *,
    causal: bool = False,
    generator: RandomSource = None,
) -> Tensor:
    """Stratified random key subsets: (H, N, S) int32 key indices, -1 in unused slots.

    Not causal: S strata over [0, M). Causal (N == M): slot c_i - 1 = i with
    c_i = min(S, i + 1), slots t < c_i - 1 from stratum t of [0, i), the rest -1.
    """
    if not 1 <= size <= m:
        raise ValueError(f"size must be in [1, M={m}], got {size}")
    if causal and n != m:
        raise ValueError(f"causal sampling needs N == M, got N={n}, M={m}")
    out = torch.empty(heads, n, size, dtype=torch.int32)
    t = torch.arange(size)
    for start in range(0, n, _SAMPLE_ROWS):
        stop = min(n, start + _SAMPLE_ROWS)
        u = uniform(generator, heads, stop - start, size)
        if causal:
            i = torch.arange(start, stop)[:, None]
            strata = torch.clamp(i + 1, max=size) - 1  # strata over [0, i)
            per = strata.clamp_min(1)
            lo, hi = t * i // per, (t + 1) * i // per
        else:
            lo, hi = t * m // size, (t + 1) * m // size
        idx = torch.minimum(lo + (u * (hi - lo)).long(), hi - 1)
        if causal:
            idx = torch.where(t < strata, idx, torch.where(t == strata, i, -1))
        out[:, start:stop] = idx
    return out


def _block_rows(q: Tensor, v: Tensor, indices: Tensor) -> int:
    """Queries per block so that one block's gathers hold about _BLOCK_ELEMENTS numbers."""
    b, h, _, d = q.shape
    return max(1, _BLOCK_ELEMENTS // (b * h * indices.shape[-1] * max(d, v.shape[-1])))


def _gather(
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    key_padding_mask: Tensor | None,
    causal: bool,
    start: int,
    stop: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sampled keys (B, H, C, S, D), values (B, H, C, S, Dv), keep mask (B, H, C, S) and the
    flat row of each sample in k.reshape(B·H·M, D), for queries [start, stop)."""
    b, h, m, d = k.shape
    idx = indices[:, start:stop].long()  # (H, C, S)
    keep = (idx >= 0).expand(b, -1, -1, -1)
    if causal:
        keep = keep & (idx <= torch.arange(start, stop, device=idx.device)[:, None])
    idx = idx.clamp_min(0)
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, idx]
    offset = (torch.arange(b * h, device=k.device) * m).view(b, h, 1, 1)
    flat = (idx + offset).reshape(-1)
    shape = (b, h, *idx.shape[1:])
    keys = k.reshape(b * h * m, d).index_select(0, flat).view(*shape, d)
    values = v.reshape(b * h * m, v.shape[-1]).index_select(0, flat).view(*shape, v.shape[-1])
    return keys, values, keep, flat


def _exp_clamped(x: Tensor) -> Tensor:
    """exp on [-80, 0]: underflowing exp takes a slow path on CPU, and e^-80 is below float64
    resolution next to the row maximum. Masked entries are zeroed by the caller."""
    return x.clamp(-80.0, 0.0).exp()


class _SubsetAttention(torch.autograd.Function):
    """Blockwise attention over gathered samples; the backward recomputes each block."""

    @staticmethod
    def forward(ctx, q, k, v, indices, key_padding_mask, causal, scale):
        b, h, n, _ = q.shape
        out = q.new_empty(b, h, n, v.shape[-1])
        lse = q.new_empty(b, h, n)
        step = _block_rows(q, v, indices)
        for start in range(0, n, step):
            stop = min(n, start + step)
            keys, values, keep, _ = _gather(k, v, indices, key_padding_mask, causal, start, stop)
            scores = torch.einsum("bhcd,bhcsd->bhcs", q[:, :, start:stop] * scale, keys)
            top = scores.masked_fill(~keep, float("-inf")).amax(dim=-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, 0.0)
            weights = _exp_clamped(scores - top).masked_fill(~keep, 0.0)
            den = weights.sum(dim=-1, keepdim=True)
            out[:, :, start:stop] = torch.einsum("bhcs,bhcse->bhce", weights, values) / torch.where(
                den > 0, den, 1.0
            )
            lse[:, :, start:stop] = torch.where(den > 0, den.log() + top, float("-inf"))[..., 0]
        ctx.save_for_backward(q, k, v, indices, key_padding_mask, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, indices, key_padding_mask, out, lse = ctx.saved_tensors
        causal, scale = ctx.causal, ctx.scale
        b, h, n, d = q.shape
        m, dv = k.shape[2], v.shape[-1]
        grad_q = torch.zeros_like(q)
        grad_k = q.new_zeros(b * h * m, d)
        grad_v = q.new_zeros(b * h * m, dv)
        step = _block_rows(q, v, indices)
        for start in range(0, n, step):
            stop = min(n, start + step)
            keys, values, keep, flat = _gather(
                k, v, indices, key_padding_mask, causal, start, stop
            )
            q_block, g = q[:, :, start:stop], grad_out[:, :, start:stop]
            scores = torch.einsum("bhcd,bhcsd->bhcs", q_block * scale, keys)
            norm = lse[:, :, start:stop, None]
            norm = torch.where(torch.isfinite(norm), norm, 0.0)
            p = _exp_clamped(scores - norm).masked_fill(~keep, 0.0)
            dp = torch.einsum("bhce,bhcse->bhcs", g, values)
            ds = p * (dp - (g * out[:, :, start:stop]).sum(dim=-1, keepdim=True))
            grad_q[:, :, start:stop] = scale * torch.einsum("bhcs,bhcsd->bhcd", ds, keys)
            grad_k.index_add_(0, flat, (scale * ds[..., None] * q_block[..., None, :]).view(-1, d))
            grad_v.index_add_(0, flat, (p[..., None] * g[..., None, :]).view(-1, dv))
        return grad_q, grad_k.view_as(k), grad_v.view_as(v), None, None, None, None


def random_subset_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Softmax of each query over its sampled keys; see the module docstring.

    indices: (H, N, S) integer key indices in [0, M), -1 for an unused slot; distinct within a
    row (as :func:`sample_subsets` draws them: a repeated index would count twice).
    """
    h, n, m = q.shape[1], q.shape[2], k.shape[2]
    if indices.dim() != 3 or indices.shape[:2] != (h, n) or indices.is_floating_point():
        raise ValueError(
            f"indices must be an integer (H, N, S) = ({h}, {n}, S) tensor, got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    # Value checks read back to the host: eager only (a graph break under torch.compile).
    if (not torch.compiler.is_compiling() and indices.numel()
            and (indices.min() < -1 or indices.max() >= m)):
        raise ValueError(f"indices must lie in [-1, M={m}), got [{indices.min()}, {indices.max()}]")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _SubsetAttention.apply(q, k, v, indices, key_padding_mask, causal, scale)


class RandomSubsetAttention(RandomizedAttention):
    """Each query attends to ``ratio`` of the keys, a stratified random subset.

    The pattern depends on (N, M, causal), so it is drawn at call time: in training mode from the
    module's generator (fresh every call), in eval mode from a generator restarted at the
    module's seed, so eval calls repeat it (see :class:`effattn.random.RandomizedAttention`, which
    also saves that state with the state_dict).
    """

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        ratio: float = 0.1,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale)
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 0 < ratio <= 1
        ):
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def subsets(self, n: int, m: int, causal: bool) -> Tensor:
        """The (H, N, S) pattern for N queries over M keys (see :func:`sample_subsets`).

        Eval mode: always the same for (N, M, causal). Training mode: a fresh draw (advances the
        module's generator, as each forward call does).
        """
        return sample_subsets(
            self.heads, n, m, subset_size(m, self.ratio), causal=causal,
            generator=self._call_generator(),
        )

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        dt = compute_dtype(q.dtype)
        indices = self.subsets(q.shape[2], k.shape[2], causal).to(q.device)
        return random_subset_attention(
            q.to(dt),
            k.to(dt),
            v.to(dt),
            indices,
            causal=causal,
            key_padding_mask=key_padding_mask,
            scale=self.scale,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ratio={self.ratio}"


def _reference(
    module: RandomSubsetAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Masked softmax over the explicit (H, N, M) mask of the module's eval-mode subsets."""
    from effattn import naive  # imported here: the references stay off the runtime path

    n, m = q.shape[2], k.shape[2]
    # The eval-mode draw, whatever the module's mode: subsets() would advance a training
    # module's generator.
    indices = sample_subsets(
        module.heads, n, m, subset_size(m, module.ratio), causal=causal,
        generator=module._eval_generator(),
    )
    return naive.random_subset_attention(
        q, k, v, indices, causal=causal, key_padding_mask=key_padding_mask, scale=module.scale
    )


register(
    MethodSpec(
        name="random",
        summary="each query attends to a stratified random subset of ratio·M keys",
        paper="random-attention baseline (cf. Zaheer et al. 2020, Big Bird, random attention)",
        complexity="O(N S D) time with S = ceil(ratio M); O(N S) memory for the pattern",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=False,
        options={"ratio": 0.1},
        budget=Budget("ratio", (0.05, 0.1, 0.2, 0.4, 0.8)),
        refusals={
            "decoding": "the pattern is drawn for a whole sequence length at once; no "
            "fixed-size recurrent state (every query needs random access to all past keys)",
            "sequence_parallel": "each query's sampled keys lie anywhere in the sequence",
        },
        reference=_reference,
    ),
    RandomSubsetAttention,
)
