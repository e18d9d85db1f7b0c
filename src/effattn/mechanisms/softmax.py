"""Exact scaled dot-product attention, through PyTorch's fused ``scaled_dot_product_attention``.

out = softmax(scale * q k^T + mask) v  (Vaswani et al. 2017, "Attention Is All You Need").
q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).

Three exact variants that SDPA cannot express are computed from each row's output and
log-sum-exp: by the blockwise engine (:func:`effattn.sparse.banded_attention`, O(N D) memory) in
self-attention, and in cache-sized slices of rows (:func:`rows_over_keys`) where the queries are
not aligned with their keys (cross-attention, a KV cache):

- ``softcap=c`` (build option): logit soft-capping, the scores are ``c tanh(s / c)`` with
  s = scale q.k (Gemma 2, Team Gemma 2024, "Gemma 2: Improving Open Language Models at a
  Practical Size");
- ``sliding_window=w`` (call input, causal): query i sees key j iff 0 <= i - j < w
  (Mistral's and Gemma's ``sliding_window``; Beltagy et al. 2020); the banded engine computes
  only the band, O(N w D);
- ``sinks=`` (H,) (call input): attention sinks, a per-head logit in the normaliser that has no
  value (GPT-OSS; Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"):
  out_i = sum_j e^{s_ij} v_j / (e^{sink_h} + sum_j e^{s_ij}) = out'_i sigmoid(lse_i - sink_h),
  with out'_i, lse_i the softmax output and log-sum-exp without the sink.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.base import AttentionMethod, compute_dtype, read_deferred_values
from effattn.parallel import SequenceGroup, SequenceStrategy
from effattn.registry import CallInput, MethodSpec, Problem, register
from effattn.sparse import banded_attention, engine_dtype


def visible_rows(key_padding_mask: Tensor, n: int, causal: bool) -> Tensor:
    """(B, 1, N, 1) bool: does query i see at least one unpadded key?

    A query whose visible keys are all padding has an empty softmax; it outputs zeros.
    """
    unpadded = ~key_padding_mask
    if causal:
        seen = unpadded.cumsum(-1)[:, :n] > 0
    else:
        seen = unpadded.any(-1, keepdim=True).expand(-1, n)
    return seen[:, None, :, None]


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor:
    """Add a sink logit sinks[h] (H,) to the normaliser of softmax rows out (B, H, N, Dv) whose
    log-sum-exp is lse (B, H, N): out e^{lse} / (e^{lse} + e^{sink}) = out sigmoid(lse - sink).
    Rows without keys (lse = -inf) stay 0."""
    if sinks is None:
        return out
    return out * torch.sigmoid(lse - sinks.to(lse.dtype)[:, None])[..., None]


# Scores of one slice of rows in rows_over_keys: cache-sized (8 MiB in fp32).
SLICE_ELEMENTS = 1 << 21


def rows_over_keys(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Callable[[int, int], Tensor],
    *,
    scale: float,
    softcap: float | None = None,
    key_prefix: Callable[[int, int], int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax of q (B, H, n, D) over the keys k (B, H, m, D), v (B, H, m, Dv) that
    ``allowed(r0, r1)`` (bool, broadcastable to (B, H, r1 - r0, m)) allows to rows r0 .. r1 - 1,
    with scores s = scale q.k, or ``softcap tanh(s / softcap)``.

    Returns out (B, H, n, Dv) and lse (B, H, n) = log sum_allowed exp(s); rows without an
    allowed key give 0 and -inf (no NaN in the gradients). Rows go in slices of about
    SLICE_ELEMENTS scores; ``key_prefix(r0, r1)``, when given, bounds the keys rows r0 .. r1 - 1
    may see to that many first ones, so causal slices skip the scores of future keys.
    Differentiated by autograd, which keeps each slice's scores: meant for few rows (decoding,
    prefill after a cache) and for the cross-attention that SDPA cannot compute (a soft cap,
    sinks), whose backward then holds its N x M scores.
    """
    n, m = q.shape[-2], k.shape[-2]
    rows = max(1, SLICE_ELEMENTS // max(1, q.shape[0] * q.shape[1] * m))
    if key_prefix is not None:
        # At least 8 slices: the scored prefix then averages about 9/16 of the keys, not all.
        rows = min(rows, -(-n // 8))
    outs, lses = [], []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        keys = m if key_prefix is None else max(1, min(m, key_prefix(r0, r1)))
        scores = torch.matmul(q[..., r0:r1, :], k[..., :keys, :].transpose(-2, -1)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed(r0, r1)[..., :keys], float("-inf"))
        # The row max only stabilises the exponent; it cancels, so it carries no gradient.
        top = scores.detach().amax(-1, keepdim=True)
        top = top.masked_fill(~torch.isfinite(top), 0.0)
        p = torch.exp(scores - top)
        total = p.sum(-1, keepdim=True)
        nonempty = total > 0
        total = torch.where(nonempty, total, torch.ones_like(total))
        outs.append((p @ v[..., :keys, :]) / total)
        lses.append(torch.where(nonempty, top + torch.log(total), float("-inf")).squeeze(-1))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, -2), torch.cat(lses, -1)


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention; rows with no visible key give 0 instead of NaN.

    ``softcap``, ``window`` (causal only) and ``sinks`` (H,) as in the module docstring; without
    them (or with a window as long as the sequence, which restricts nothing) this is SDPA.
    """
    n, m = q.shape[2], k.shape[2]
    banded = window is not None and window < n
    if softcap is None and sinks is None and not banded:
        read_deferred_values()
        if key_padding_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        keep = ~key_padding_mask[:, None, None, :]
        if causal:
            keep = keep & torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
        return out.masked_fill(~visible_rows(key_padding_mask, n, causal), 0.0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dtype = engine_dtype(q.dtype, q.device) if n == m else compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if n == m:
        # Every pattern of self-attention is a band: causal (n - 1, 0), windowed causal
        # (window - 1, 0), non-causal (n - 1, n - 1); the engine skips the blocks outside it.
        out, lse = banded_attention(
            q, k, v, left=window - 1 if banded else n - 1, right=0 if causal else n - 1,
            scale=scale, key_mask=key_padding_mask, softcap=softcap,
        )
    else:
        read_deferred_values()
        keep = (torch.ones(1, 1, 1, m, dtype=torch.bool, device=q.device)
                if key_padding_mask is None else ~key_padding_mask[:, None, None, :])
        out, lse = rows_over_keys(q, k, v, lambda r0, r1: keep, scale=scale, softcap=softcap)
    return with_sinks(out, lse, sinks)


@dataclass
class KVCache:
    """Keys and values of positions ``start`` .. ``length - 1``, in buffers that grow by doubling
    (amortised O(1) appends).

    k: (B, H, capacity, D), v: (B, H, capacity, Dv); slot s holds position ``start + s``.
    ``start`` moves on only when a sliding window no longer needs the positions before it
    (:meth:`forget_before`), so a windowed decoder holds O(window) positions.
    """

    k: Tensor
    v: Tensor
    length: int
    start: int = 0

    @classmethod
    def empty(cls, k: Tensor, v: Tensor, capacity: int = 16) -> KVCache:
        """An empty cache for keys/values shaped like k (B, H, *, D) and v (B, H, *, Dv)."""
        return cls(k.new_empty(*k.shape[:2], capacity, k.shape[3]),
                   v.new_empty(*v.shape[:2], capacity, v.shape[3]), 0)

    @property
    def held(self) -> int:
        """Positions in the buffers."""
        return self.length - self.start

    def keys(self) -> tuple[Tensor, Tensor]:
        """k (B, H, held, D), v (B, H, held, Dv) of positions start .. length - 1 (views)."""
        return self.k[:, :, : self.held], self.v[:, :, : self.held]

    def extend(self, k: Tensor, v: Tensor) -> None:
        """Append L positions, k (B, H, L, D) and v (B, H, L, Dv)."""
        begin, end = self.held, self.held + k.shape[2]
        if end > self.k.shape[2]:
            capacity = max(2 * self.k.shape[2], 1 << (end - 1).bit_length())
            self.k = _grow(self.k, capacity)
            self.v = _grow(self.v, capacity)
        self.k[:, :, begin:end] = k
        self.v[:, :, begin:end] = v
        self.length += k.shape[2]

    def forget_before(self, position: int) -> None:
        """Positions before ``position`` will not be attended to again: drop them once they are
        half of what is held (the move then costs O(1) per position dropped)."""
        drop = min(position, self.length) - self.start
        if drop <= 0 or 2 * drop < self.held:
            return
        keep = self.held - drop
        self.k[:, :, :keep] = self.k[:, :, drop : drop + keep].clone()
        self.v[:, :, :keep] = self.v[:, :, drop : drop + keep].clone()
        self.start += drop

    def nbytes(self) -> int:
        """Bytes held by the cache (its full capacity, which is what it occupies)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def nbytes_in_use(self) -> int:
        """Bytes of the positions held; the buffers grow by doubling beyond them."""
        return self.nbytes() // self.k.shape[2] * self.held


def _grow(buf: Tensor, capacity: int) -> Tensor:
    out = buf.new_empty(*buf.shape[:2], capacity, buf.shape[3])
    out[:, :, : buf.shape[2]] = buf
    return out


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` as a float if it is a positive finite number, None if None, else ValueError."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
        0 < softcap < math.inf
    ):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    return float(softcap)


class SoftmaxAttention(AttentionMethod):
    """Exact softmax attention (the reference every other method is measured against).

    ``softcap``: logit soft-capping (see the module docstring). Call inputs ``sliding_window=``
    (int, causal) and ``sinks=`` ((H,) logits) in forward, prefill and step.
    """

    engine_reads_values = True  # stateless: read before SDPA or the banded engine's kernel

    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, softcap=None):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.softcap = check_softcap(softcap)

    def extra_repr(self) -> str:
        cap = "" if self.softcap is None else f", softcap={self.softcap:g}"
        return super().extra_repr() + cap

    def _attend(self, q, k, v, *, causal, key_padding_mask, sliding_window=None, sinks=None):
        return softmax_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=self.scale,
            softcap=self.softcap, window=sliding_window, sinks=sinks,
        )

    def _step(self, q, k, v, state, sliding_window=None, sinks=None):
        return self._prefill(q, k, v, state, sliding_window=sliding_window, sinks=sinks)

    def _prefill(self, q, k, v, state, sliding_window=None, sinks=None):
        if state is None:
            state = KVCache.empty(k, v)
        elif not isinstance(state, KVCache):
            raise ValueError(f"softmax state must be a KVCache, got {type(state).__name__}")
        past, n = state.length, q.shape[2]
        # The first query's reach: the keys before it are never attended to again.
        first = 0 if sliding_window is None else max(0, past - sliding_window + 1)
        if first < state.start:
            raise ValueError(
                f"softmax: the state dropped the positions before {state.start} (an earlier call "
                f"had a shorter window); this call needs them from {first} on"
            )
        state.extend(k, v)
        keys, values = state.keys()
        if n == 1:
            # One query sees every held key from its window's start on: no mask at all.
            out = softmax_attention(
                q, keys[:, :, first - state.start :], values[:, :, first - state.start :],
                scale=self.scale, softcap=self.softcap, sinks=sinks,
            )
        elif past == 0 and state.start == 0:
            # A block from the start is plain (windowed) causal attention.
            out = softmax_attention(q, keys, values, causal=True, scale=self.scale,
                                    softcap=self.softcap, window=sliding_window, sinks=sinks)
        else:
            position = state.start + torch.arange(state.held, device=q.device)
            reach = math.inf if sliding_window is None else sliding_window

            def allowed(r0: int, r1: int) -> Tensor:
                i = past + torch.arange(r0, r1, device=q.device)[:, None]
                return (position <= i) & (position > i - reach)

            dtype = compute_dtype(q.dtype)
            out, lse = rows_over_keys(
                q.to(dtype), keys.to(dtype), values.to(dtype), allowed, scale=self.scale,
                softcap=self.softcap,
                key_prefix=lambda r0, r1: past + r1 - state.start,
            )
            out = with_sinks(out, lse, sinks)
        if sliding_window is not None:
            state.forget_before(state.length - sliding_window + 1)
        return out, state


class AllGather(SequenceStrategy):
    """Sequence parallelism of exact attention: every rank all-gathers K and V, O(N) per rank,
    and attends with its own queries over the whole sequence (a soft cap, sliding window and
    sinks included, as the module computes them)."""

    def attend(
        self,
        attn: AttentionMethod,
        group: SequenceGroup,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        sliding_window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        d = k.shape[-1]
        kv = _gather_slices(torch.cat([k, v], -1), group)
        keys, values = kv[..., :d], kv[..., d:]
        keep = None
        if key_padding_mask is not None:
            mask = _gather_slices(key_padding_mask[:, None, :, None], group)
            keep = ~mask[:, :, None, :, 0]  # (B, 1, 1, N)
        if causal:
            i = torch.arange(group.offset, group.offset + q.shape[2], device=q.device)[:, None]
            j = torch.arange(group.total, device=q.device)[None, :]
            seen = (j <= i) if sliding_window is None else (j <= i) & (j > i - sliding_window)
            keep = seen if keep is None else keep & seen
        softcap = attn.softcap
        if softcap is not None or sinks is not None:
            # SDPA has neither: the blockwise engine's rows give the output and the log-sum-exp
            # that the sinks need.
            rows = torch.ones(1, 1, q.shape[2], group.total, dtype=torch.bool, device=q.device)
            rows = rows if keep is None else rows & keep
            dtype = compute_dtype(q.dtype)
            out, lse = rows_over_keys(q.to(dtype), keys.to(dtype), values.to(dtype),
                                      lambda r0, r1: rows[..., r0:r1, :], scale=attn.scale,
                                      softcap=softcap)
            return with_sinks(out, lse, sinks)
        if keep is None:
            return F.scaled_dot_product_attention(q, keys, values, scale=attn.scale)
        # A query without a visible key outputs 0: its mask row is opened so that the softmax
        # stays finite (no NaN in the gradients), then its output is cleared.
        visible = keep.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep | ~visible,
                                             scale=attn.scale)
        return out.masked_fill(~visible, 0.0)


def _gather_slices(x: Tensor, group: SequenceGroup) -> Tensor:
    """Every rank's x (B, H, n_r, X), padded to the longest slice for the all-gather, joined
    along the sequence: (B, H, N, X). Differentiable when x is floating point."""
    padded = F.pad(x, (0, 0, 0, max(group.lengths) - x.shape[2]))
    gathered = group.all_gather(padded)
    return torch.cat([g[:, :, :n] for g, n in zip(gathered, group.lengths, strict=True)], 2)


def _reference(
    module: SoftmaxAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax(scale q k^T) v with the explicit N x M score matrix (soft cap, sliding window,
    sinks)."""
    from effattn import naive  # imported here: the references stay off the runtime path

    return naive.softmax_attention(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=module.scale,
        softcap=module.softcap, window=sliding_window, sinks=sinks,
    )


def _flops(options: Mapping[str, Any], p: Problem) -> float:
    """2·B·H·pairs·(D + Dv): q k^T and the weights times v; causal scores N (N + 1) / 2 pairs."""
    pairs = p.n * (p.n + 1) / 2 if p.causal else p.n * p.m
    return 2.0 * p.batch * p.heads * pairs * (p.head_dim + p.value_dim)


register(
    MethodSpec(
        name="softmax",
        summary="exact scaled dot-product attention (fused SDPA; soft cap, window and sinks "
        "on the blockwise engine)",
        paper="Vaswani et al. 2017, Attention Is All You Need",
        complexity="O(N M D) time, O(N + M) memory with the fused kernel",
        causal=True,
        padding_mask=True,
        cross=True,
        decoding=True,
        options={"softcap": None},
        flops=_flops,
        call_inputs=(
            CallInput("sliding_window", "causal sliding window: query i sees key j iff "
                      "0 <= i - j < sliding_window (Mistral's, Gemma's sliding_window)", (),
                      causal_only=True, bounds=(1, math.inf), kind="int"),
            CallInput("sinks", "per-head logit of a sink in the normaliser, with no value "
                      "(GPT-OSS's attention sinks)", ("H",)),
        ),
        bench_default=True,
        published={"lra_listops": 36.37},
        reference=_reference,
        sequence_parallel=AllGather(),
    ),
    SoftmaxAttention,
)
