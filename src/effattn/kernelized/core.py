"""The linear-attention core shared by every kernelized method.

Given feature maps φ(Q) (B, H, N, F), φ(K) (B, H, M, F) and V (B, H, M, Dv)::

    out_i = Σ_j w_ij φ(q_i)·φ(k_j) v_j / Σ_j w_ij φ(q_i)·φ(k_j)

where w_ij = 1 (non-causal), [j <= i] (causal) or, for gated attention (Peng et al. 2021, RFA
section 3.1), w_ij = [j <= i] (1 - g_j) Π_{j<l<=i} g_l, the unrolled form of
S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T.

Two conventions make every feature map numerically safe without ever looking at future keys:

- ``key_log_scale`` (B, H, M, 1): the true key features are ``phi_k * exp(key_log_scale)``.
  Exponential feature maps return per-token-normalised features plus that log-scale; the core
  rescales keys by a max that is shared by the keys being summed: per sequence when non-causal;
  when causal, each query's keys at the running max of the key log-scales it can see (a prefix
  max inside a chunk, per complete chunk in the state), so that no future key sets the scale.
  The shared factor cancels between numerator and denominator.
- The normaliser is computed as an extra column of V ([V, 1]), so numerator and denominator come
  out of the same GEMMs.

Long sequences are processed in slices of S tokens (:func:`kernelized_attention`): features of
one slice are computed, consumed and dropped, so no N x F tensor is ever materialised and the
slice stays in cache. A slice hands a :class:`RecurrentState` to the next; decoding is the same
state fed one token at a time.

Precision of decoding. The causal forward (chunkwise GEMMs, and prefill, the same code) and
:func:`linear_attention_step` (one token at a time) sum the same terms w_ij φ(q_i)·φ(k_j) [v_j, 1]
with the same stabilisers (only differences of log-scales are ever formed), in different orders.
Their rounding is amplified by the condition number of the normaliser::

    κ_i = Σ_j w_ij Σ_f |φ_f(q_i) φ_f(k_j)| / |Σ_j w_ij φ(q_i)·φ(k_j)|  >= 1

κ_i = 1 for non-negative maps. Signed ones (trigonometric, random-phase cosine, RFA's sin/cos)
estimate a small kernel value as noise of either sign, so the sum cancels: for unit-variance q,
k at D = 64 the median κ_i is 50-500 (it grows like √i: Σ_j |.| grows like i, the noise like
√i) and the few queries whose estimate passes near 0 reach 1e4-1e6. Forward, prefill and step,
each against the exact result and against each other, elementwise::

    |o_i - o'_i| <= 4 ε κ_i (μ + √i + √F) (|o_i| + max_{j<=i} |v_j|)

with ε the unit roundoff (2^-24 in fp32, 2^-53 in float64), i the position (from 1), F the
width of φ and μ = 1 + the largest feature argument |w·x̃ + b| plus the largest log-scale
|x̃|²/2 of q and k, whose absolute rounding is relative error of the features (μ ~ 25 for
unit-variance entries at D = 64, ~110 for rows of norm 30). Over ~200 configurations measured
(D 8-128, F 16-4096, up to 16,384 tokens, rows of norm up to 200) the worst was 0.41 of it;
tests/test_kernelized_trust.py holds every kernelized method to it. So in fp32, decoding and
the forward with trigonometric or random-phase cosine features differ by 1e-4 to 1e-3 relative
on the queries of large κ_i, and by ~1e-6 where κ_i and μ are small; in float64 by ~1e-12
relative. Not covered: products of positive features that approach fp32's underflow (see
:class:`DenominatorUnderflowError`), and, against the exact result only, elu(x) + 1 of entries
below about -10, which is computed to absolute rather than relative precision.

Shapes: B batch, H heads, N queries, M keys, F features, Dv value dim, C chunk, S slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.kernelized.features import LOG2E

# Smallest log-scale the core works with: keeps exp(a - b) finite when every key is padding. It
# must lie below every real key's log-scale, about -|x̃|²/2 for positive features (below -1e4
# already for entries ~50 at D = 16): a key clamped up to the floor would vanish.
LOG_FLOOR = -1.0e30
# log(g) is clamped here so that g = 0 (a full reset) stays finite in log space.
LOG_GATE_FLOOR = -30.0
# A decoding step keeps the state at a lazily updated scale: it adds its key at
# exp(key scale - state scale) <= e^RESCALE_MARGIN and rescales the whole state only when a key
# would exceed that. A memory-bound step costs its passes over the state, so this saves one per
# step (two with a gate); e^20 of headroom leaves fp32 ~1e29 of range.
RESCALE_MARGIN = 20.0
# The chunk scan of a causal block runs over at most this many chunks at a time.
SCAN_CHUNKS = 16
# A slice holds about this many feature values (B * H * S * F): 4 MiB in fp32, cache-sized.
SLICE_ELEMENTS = 1 << 20

# features(x, is_query=...) -> (phi, key_log_scale or None); see kernelized.features.
FeatureFn = Callable[..., tuple[Tensor, "Tensor | None"]]


def _shared_max(log_scale: Tensor, dim: int) -> Tensor:
    with torch.no_grad():
        return log_scale.amax(dim=dim, keepdim=True).clamp_min(LOG_FLOOR)


class _KeyValueProducts(torch.autograd.Function):
    """φ(K)^T W (..., F, Dv + 1) whose backward hands φ(K) a contiguous (..., M, F) gradient.

    Autograd's matmul of the transposed view gives φ(K) the transpose of a (..., F, M) product, so
    every elementwise pass of the feature map's backward (exp2's grad · result, the projection's
    input) would walk an M x F tensor across its strides; here the product is formed as
    W dKV^T, in the layout of φ(K).
    """

    @staticmethod
    def forward(phi_k: Tensor, w: Tensor) -> Tensor:
        return phi_k.transpose(-2, -1) @ w

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        phi_k, w = ctx.saved_tensors
        grad_phi = w @ grad.transpose(-2, -1) if ctx.needs_input_grad[0] else None
        grad_w = phi_k @ grad if ctx.needs_input_grad[1] else None
        return grad_phi, grad_w


def _key_value_products(phi_k: Tensor, w: Tensor) -> Tensor:
    """Σ_j φ(k_j) w_j^T: phi_k (..., M, F), w (..., M, Dv + 1) -> (..., F, Dv + 1)."""
    return _KeyValueProducts.apply(phi_k, w)


def _with_ones(v: Tensor) -> Tensor:
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _ratio(out: Tensor, eps: float, log_scale: Tensor) -> Tensor:
    """[num, den] held at scale exp(log_scale) -> num / den, with |den| pushed to ``eps`` at the
    true scale (as the reference does), so that the result does not depend on where a
    stabiliser put the scale: a key far larger than the others in its chunk must not push its
    neighbours' denominators under eps. The sign is kept (trigonometric features can give
    negative denominators); a query that sees no key gets 0. ``eps = 0`` (non-negative
    features) only keeps 0 / 0 at 0: any positive denominator, however small, is divided by."""
    log_eps = math.log(eps) if eps > 0 else -math.inf
    with torch.no_grad():
        # In log space: eps / exp(log_scale) overflows for the tiny true scales of positive
        # features (exp(-|x|²/2)), and 0 * inf would be NaN.
        floor = torch.exp(log_eps - log_scale)
    den = out[..., -1:]
    den = torch.where(den >= 0, torch.maximum(den, floor), torch.minimum(den, -floor))
    # num = den = 0 when no key is seen: 0 / 1 keeps the output and its gradient at 0.
    return out[..., :-1] / torch.where(den == 0, 1.0, den)


def _lost_rows(out: Tensor, eps: float, log_scale: Tensor) -> Tensor | None:
    """True (0-d) if a query that sees a key got a denominator of exactly 0; None: not checked.

    For non-negative features (``eps = 0``) the denominator Σ_j w_ij φ(q_i)·φ(k_j) of a query
    that sees a key is a sum of terms that are positive in exact arithmetic, so 0 means they
    underflowed (or, for arccos features, all happen to be 0): the output row would be a silent
    0. A scale above LOG_FLOOR marks a query that sees a key (a scale stays at the floor until
    its state holds an unpadded one). Reading the flag is a host sync: the callers gather one
    per slice and read them once (:func:`_raise_if_lost`); skipped while compiling.
    """
    if eps != 0 or torch.compiler.is_compiling():
        return None
    return ((out[..., -1:] == 0) & (log_scale > LOG_FLOOR)).any()


class DenominatorUnderflowError(ValueError):
    """A query that sees keys got a zero denominator (see :func:`_lost_rows`)."""


def _raise_if_lost(lost: list[Tensor | None], dtype: torch.dtype) -> None:
    flags = [flag for flag in lost if flag is not None]
    if flags and bool(torch.stack(flags).any()):
        raise DenominatorUnderflowError(
            f"the attention denominator Σ_j φ(q_i)·φ(k_j) is exactly 0 in {dtype} for a query "
            "that sees keys: the random-feature estimate underflows for logits this large"
        )


def _check_shapes(phi_q: Tensor, phi_k: Tensor, v: Tensor, key_log_scale: Tensor | None) -> None:
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi_q and phi_k must have the same feature dim F: {tuple(phi_q.shape)} vs "
            f"{tuple(phi_k.shape)}"
        )
    if phi_k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"phi_k {tuple(phi_k.shape)} and v {tuple(v.shape)} disagree on (B, H, M)")
    if key_log_scale is not None and key_log_scale.shape != (*phi_k.shape[:-1], 1):
        raise ValueError(
            f"key_log_scale must be (B, H, M, 1) = {(*phi_k.shape[:-1], 1)}, "
            f"got {tuple(key_log_scale.shape)}"
        )


@dataclass
class RecurrentState:
    """Fixed-size state of kernelized attention, handed from slice to slice and step to step.

    kv: (B, H, F, Dv + 1), the running [S, z] (S = Σ w_j φ(k_j) v_j^T, z = Σ w_j φ(k_j)),
    stored divided by exp(log_scale); log_scale: (B, H, 1, 1); position: tokens consumed.
    Its size does not depend on the position.
    """

    kv: Tensor
    log_scale: Tensor
    position: int = 0

    @classmethod
    def empty(cls, b: int, h: int, f: int, dv: int, like: Tensor) -> RecurrentState:
        return cls(like.new_zeros(b, h, f, dv + 1), like.new_full((b, h, 1, 1), LOG_FLOOR), 0)

    @property
    def s(self) -> Tensor:
        """S at the state's scale, (B, H, F, Dv)."""
        return self.kv[..., :-1]

    @property
    def z(self) -> Tensor:
        """z at the state's scale, (B, H, F)."""
        return self.kv[..., -1]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.log_scale.numel() * (
            self.log_scale.element_size()
        )

    def nbytes_in_use(self) -> int:
        """All of it: the state has a fixed size from the first token on."""
        return self.nbytes()


def _state_for(state: RecurrentState | None, phi_k: Tensor, v: Tensor) -> RecurrentState:
    b, h, _, f = phi_k.shape
    if state is None:
        return RecurrentState.empty(b, h, f, v.shape[-1], phi_k)
    if not isinstance(state, RecurrentState):
        raise ValueError(f"state must be a RecurrentState or None, got {type(state).__name__}")
    if state.kv.shape != (b, h, f, v.shape[-1] + 1):
        raise ValueError(
            f"state.kv has shape {tuple(state.kv.shape)}, expected {(b, h, f, v.shape[-1] + 1)}"
        )
    return state


def accumulate_keys(
    state: RecurrentState | None,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
) -> RecurrentState:
    """Non-causal: add a slice of keys, S += Σ_j φ(k_j) [v_j, 1]^T, rescaling by a running max.

    phi_k (B, H, M, F), v (B, H, M, Dv), key_log_scale (B, H, M, 1), key_padding_mask (B, M).
    """
    _check_shapes(phi_k, phi_k, v, key_log_scale)
    state = _state_for(state, phi_k, v)
    v1 = _with_ones(v)
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
    if key_log_scale is None:
        # Features at their true scale, 0, once the state holds an unpadded key; until then
        # the scale stays at the floor, which marks a state without keys (see _lost_rows).
        scale = state.log_scale.clamp_min(0.0)
        if pad is not None:
            v1 = v1.masked_fill(pad, 0.0)
            scale = torch.where(pad.all(-2, keepdim=True), state.log_scale, scale)
    else:
        if pad is not None:
            key_log_scale = key_log_scale.masked_fill(pad, float("-inf"))
        scale = torch.maximum(state.log_scale, _shared_max(key_log_scale, -2))
        v1 = v1 * torch.exp(key_log_scale - scale)
    kv = state.kv * torch.exp(state.log_scale - scale) + _key_value_products(phi_k, v1)
    return RecurrentState(kv, scale, state.position + phi_k.shape[2])


def _read_out(state: RecurrentState, phi_q: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    out = phi_q @ state.kv
    return _ratio(out, eps, state.log_scale), _lost_rows(out, eps, state.log_scale)


def _causal_block(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: RecurrentState | None,
    key_log_scale: Tensor | None,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk_size: int,
    eps: float,
) -> tuple[Tensor, RecurrentState, list[Tensor | None]]:
    """Causal attention over a block of L tokens that follows ``state``, chunkwise.

    Inside each chunk of C tokens a masked C x C product, weighted by exp(a_i - a_j) (gate decay
    and stabiliser prefix max, see :func:`_causal_group`); across chunks the running state, found
    for up to ``SCAN_CHUNKS`` chunks at a time by a recurrence (:func:`_chunk_scan`). Per-key
    scalars (stabiliser scale, 1 - g, padding, decay to the chunk end) multiply the rows of
    [V, 1] (width Dv + 1), per-query ones multiply output rows: the only work on L x F data is
    GEMMs. Returns the output (B, H, L, Dv), the state after the block and the underflow flags of
    its groups (see :func:`_lost_rows`; ungated only).
    """
    _check_shapes(phi_q, phi_k, v, key_log_scale)
    state = _state_for(state, phi_k, v)
    outs, lost = [], []
    pieces = _slices(SCAN_CHUNKS * chunk_size, (phi_q, 2), (phi_k, 2), (v, 2),
                     (key_log_scale, 2), (key_padding_mask, 1), (gate, 2))
    for q_g, k_g, v_g, ls_g, pad_g, gate_g in zip(*pieces, strict=True):
        out, state, lost_g = _causal_group(
            q_g, k_g, v_g, state, ls_g, pad_g, gate_g, chunk_size, eps
        )
        outs.append(out)
        lost.append(lost_g)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), state, lost


def _causal_group(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: RecurrentState,
    key_log_scale: Tensor | None,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk: int,
    eps: float,
) -> tuple[Tensor, RecurrentState, Tensor | None]:
    b, h, n, f = phi_q.shape
    v1 = _with_ones(v)
    dv1 = v1.shape[-1]
    log_gate = None
    if gate is not None:
        v1 = v1 * (1.0 - gate)[..., None]
        log_gate = torch.log(gate).clamp_min(LOG_GATE_FLOOR)
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :]
        v1 = v1.masked_fill(pad[..., None], 0.0)
        if log_gate is not None:
            log_gate = log_gate.masked_fill(pad, 0.0)  # a padded token leaves the state alone
        if key_log_scale is None:
            # Scale 0 from the first unpadded key on, the floor before it: queries that see no
            # key keep the floor (see _lost_rows).
            key_log_scale = v.new_zeros(*v.shape[:-1], 1)
        key_log_scale = key_log_scale.masked_fill(pad[..., None], float("-inf"))

    tail = (-n) % chunk
    if tail:
        phi_q = F.pad(phi_q, (0, 0, 0, tail))
        phi_k = F.pad(phi_k, (0, 0, 0, tail))
        v1 = F.pad(v1, (0, 0, 0, tail))
        if log_gate is not None:
            log_gate = F.pad(log_gate, (0, tail))
        if key_log_scale is not None:
            key_log_scale = F.pad(key_log_scale, (0, 0, 0, tail), value=float("-inf"))
    nc = (n + tail) // chunk
    # Copied once if strided (a group cut from a longer block), not by each GEMM below.
    q_c = phi_q.contiguous().view(b, h, nc, chunk, f)
    k_c = phi_k.contiguous().view(b, h, nc, chunk, f)
    v_c = v1.reshape(b, h, nc, chunk, dv1)

    # Query i of a chunk sums its keys j <= i at the prefix-max scale P_i = max_{j<=i} ls_j: a
    # key later in the chunk cannot set the scale of earlier queries (their keys would underflow
    # against it). Key j enters at exp(ls_j - P_j) <= 1 and moves to scale P_i through
    # exp(P_j - P_i) <= 1, a C x C factor of the same form as the gate's decay exp(cum_i - cum_j):
    # both are exp(a_i - a_j) with a = cum - P. The last prefix max is the chunk's max, the
    # scale of its delta for later chunks, which only see it complete.
    # Only differences of a enter, so its stabiliser part is taken from the chunk's max,
    # P_last - P_j >= 0: the log-scales themselves can be large (|x̃|²/2 ~ 56 for trigonometric
    # keys of norm 30 at D = 64), and -P_j * log2(e) rounded at that size put ~ε|P| of error into
    # every weight exp2(a_i - a_j) (5e-6 at 56, 1e-4 at 1024), which decoding, subtracting
    # log-scales first, does not have.
    log_weight = None  # a up to a constant per chunk (B, H, nc, C), None when every a is 0
    if key_log_scale is None:
        prefix = v1.new_zeros(b, h, nc, chunk, 1)
    else:
        ls_c = key_log_scale.reshape(b, h, nc, chunk, 1)
        with torch.no_grad():
            prefix = torch.cummax(ls_c, -2).values.clamp_min_(LOG_FLOOR)  # P, (B, H, nc, C, 1)
        v_c = v_c * torch.exp(ls_c - prefix)
        log_weight = prefix[..., -1:, 0] - prefix[..., 0]
    if log_gate is not None:
        cum = log_gate.reshape(b, h, nc, chunk).cumsum(-1)  # inclusive, within the chunk
        log_weight = cum if log_weight is None else cum + log_weight
    chunk_max = prefix[..., -1:, :]  # (B, H, nc, 1, 1)

    scores = q_c @ k_c.transpose(-1, -2)  # (B, H, nc, C, C)
    if log_weight is None:
        intra = scores.tril_() @ v_c  # (B, H, nc, C, Dv + 1)
        deltas = _key_value_products(k_c, v_c)  # (B, H, nc, F, Dv + 1), at scale chunk_max
    else:
        upper = torch.ones(chunk, chunk, dtype=torch.bool, device=scores.device).triu_(1)
        log2_weight = log_weight * LOG2E  # exp2 on the C x C weights (see features.LOG2E)
        weight = (log2_weight[..., :, None] - log2_weight[..., None, :]).masked_fill_(
            upper, float("-inf")
        ).exp2_()
        # In place when the weights carry no gradient (no gate): mul then keeps only them.
        scores = scores * weight if weight.requires_grad else scores.mul_(weight)
        intra = scores @ v_c
        to_end = torch.exp(log_weight[..., -1:] - log_weight)[..., None]  # exp(a_last - a_j)
        deltas = _key_value_products(k_c, v_c * to_end)
    chunk_log_decay = None if log_gate is None else cum[..., -1]  # (B, H, nc)

    states, state_scale, final = _chunk_scan(state, deltas, chunk_max[..., 0, 0], chunk_log_decay)
    common = torch.maximum(prefix, state_scale)  # (B, H, nc, C, 1): query i's output scale
    inter_weight = torch.exp(state_scale - common)
    if log_gate is not None:
        inter_weight = inter_weight * cum.exp()[..., None]  # decay of the entering state to i
    # In place on fresh GEMM outputs (bmm keeps its inputs, not its output, for backward).
    out = (q_c @ states).mul_(inter_weight).add_(intra.mul_(torch.exp(prefix - common)))
    final.position = state.position + n
    out_scale = common.reshape(b, h, nc * chunk, 1)[:, :, :n]
    out = out.reshape(b, h, nc * chunk, dv1)[:, :, :n]
    # A gate can decay what a query sees to a legitimate 0: only ungated rows are checked.
    lost = None if gate is not None else _lost_rows(out, eps, out_scale)
    return _ratio(out, eps, out_scale), final, lost


def _chunk_scan(
    state: RecurrentState, deltas: Tensor, chunk_max: Tensor, chunk_log_decay: Tensor | None
) -> tuple[Tensor, Tensor, RecurrentState]:
    """States before each chunk and after the last, by the recurrence over the chunk axis.

    With ΔS_c at log-scale r_c, a_c the total gate of chunk c and the incoming state S_0 = S_in at
    scale R_0 = s, the state before chunk c + 1 is kept at R_{c+1} = max(R_c, r_c):

        S_{c+1} = exp(R_c - R_{c+1} + log a_c) S_c + exp(r_c - R_{c+1}) ΔS_c.

    Every exponent is <= 0: nothing overflows, and no subtraction of large partial sums can cancel
    (unlike an exclusive cumsum formed as cumsum - ΔS). Two elementwise passes per chunk over a
    cache-sized (F, Dv + 1) state: the same states as one (nc + 1) x nc GEMM over the chunk axis,
    whose inner dimension (nc <= SCAN_CHUNKS) is too short for a GEMM to run anywhere near its
    rate. Returns the states (B, H, nc, F, Dv + 1), their scales R_0..R_{nc-1} (B, H, nc, 1, 1)
    and the state after the last chunk.
    """
    b, h, nc = deltas.shape[:3]
    scales = torch.cat([state.log_scale.reshape(b, h, 1), chunk_max], -1)  # (B, H, nc + 1)
    running = torch.cummax(scales, -1).values  # R_0 .. R_nc
    log_keep = running[..., :-1] - running[..., 1:]
    if chunk_log_decay is not None:
        log_keep = log_keep + chunk_log_decay
    keep = torch.exp(log_keep)[..., None, None]  # (B, H, nc, 1, 1)
    enter = torch.exp(chunk_max - running[..., 1:])[..., None, None]
    kv = state.kv.to(deltas.dtype)
    states = []
    # unbind, not indexing: the backward of nc selected views would allocate nc zero tensors of
    # the group's size, that of one unbind is a single stack.
    for delta, k_c, e_c in zip(deltas.unbind(2), keep.unbind(2), enter.unbind(2), strict=True):
        states.append(kv)
        kv = (delta * e_c).addcmul_(kv, k_c)  # in place on mul's fresh output
    scale = running[..., None, None]
    return torch.stack(states, 2), scale[:, :, :nc], RecurrentState(kv, scale[:, :, nc])


def slice_tokens(batch_heads: int, feature_dim: int, chunk_size: int, slice_elements: int) -> int:
    """Tokens per slice: about ``slice_elements`` feature values, a multiple of the chunk."""
    tokens = max(1, slice_elements // max(1, batch_heads * feature_dim))
    return max(chunk_size, tokens // chunk_size * chunk_size)


def kernelized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    *,
    feature_dim: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    slice_elements: int = SLICE_ELEMENTS,
) -> Tensor:
    """Kernelized attention from raw q, k, v, computing ``features`` slice by slice.

    q (B, H, N, D), k (B, H, M, D), v (B, H, M, Dv) -> (B, H, N, Dv). ``features(x, is_query=)``
    returns (φ, key_log_scale); ``feature_dim`` is its width F, used to size the slices.

    Args:
        key_padding_mask: optional bool (B, M), True marks padded keys; they leave numerator
            and denominator (and, gated, do not decay the state).
        causal: query i sees keys j <= i (N == M); computed chunkwise (:func:`kernelized_causal`).
        gate: optional (B, H, N) in [0, 1], causal only (gated RFA).
        chunk_size: C of the chunkwise causal form; any N works (the tail chunk is padded).
        eps: floor of |denominator| at the true scale, for features that can cancel; 0 for
            non-negative ones (:func:`effattn.kernelized.features.denominator_eps`).

    Non-causal cost: 2·(N + M)·F·(Dv + 1) flops per (B, H) besides the features. Causal adds the
    C x C intra-chunk products, 2·N·C·(F + Dv + 1), and (N/C)·F·(Dv + 1) states. Peak memory
    O(S·F + F·Dv), not O(N·F), when no gradient is recorded.
    Raises :class:`DenominatorUnderflowError` (a ValueError), after the last slice (one host
    sync), where a query that sees a key gets a denominator of 0 (see :func:`_lost_rows`).
    """
    if gate is not None and not causal:
        raise ValueError("gate needs causal=True: gated attention is a causal recurrence")
    if causal:
        return kernelized_causal(
            q, k, v, features, feature_dim=feature_dim, key_padding_mask=key_padding_mask,
            gate=gate, chunk_size=chunk_size, eps=eps, slice_elements=slice_elements,
        )[0]
    state = key_state(k, v, features, feature_dim=feature_dim,
                      key_padding_mask=key_padding_mask, slice_elements=slice_elements)
    return read_queries(q, state, features, feature_dim=feature_dim, eps=eps,
                        slice_elements=slice_elements)


def key_state(
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    *,
    feature_dim: int,
    key_padding_mask: Tensor | None = None,
    slice_elements: int = SLICE_ELEMENTS,
) -> RecurrentState:
    """[S, z] = φ(K)^T [V, 1] of all keys k (B, H, M, D), v (B, H, M, Dv), slice by slice.

    The non-causal half of :func:`kernelized_attention`, and the memory a decoder's
    cross-attention forms once per source.
    """
    step = slice_tokens(k.shape[0] * k.shape[1], feature_dim, 1, slice_elements)
    state = None
    for k_s, v_s, pad_s in zip(*_slices(step, (k, 2), (v, 2), (key_padding_mask, 1)), strict=True):
        phi_k, log_scale = features(k_s, is_query=False)
        state = accumulate_keys(state, phi_k, v_s, key_log_scale=log_scale, key_padding_mask=pad_s)
    return state


def read_queries(
    q: Tensor,
    state: RecurrentState,
    features: FeatureFn,
    *,
    feature_dim: int,
    eps: float = 1e-6,
    slice_elements: int = SLICE_ELEMENTS,
) -> Tensor:
    """Queries q (B, H, N, D) against a finished :func:`key_state`, in slices: (B, H, N, Dv)."""
    step = slice_tokens(q.shape[0] * q.shape[1], feature_dim, 1, slice_elements)
    outs, lost = zip(*(_read_out(state, features(q_s, is_query=True)[0], eps)
                       for q_s in q.split(step, 2)), strict=True)
    _raise_if_lost(list(lost), q.dtype)
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _slices(step: int, *tensors: tuple[Tensor | None, int]) -> list[list[Tensor | None]]:
    """Each (tensor, dim) cut into pieces of ``step`` along dim; None stays None in every piece.

    ``split`` rather than ``narrow``: the backward of S narrowed views allocates S zero tensors
    of the full input's size (O(S·N) work), that of one split is a single concatenation.
    """
    parts = [None if t is None else list(t.split(step, dim)) for t, dim in tensors]
    count = max(len(p) for p in parts if p is not None)
    return [[None] * count if p is None else p for p in parts]


def kernelized_causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    state: RecurrentState | None = None,
    *,
    feature_dim: int,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    slice_elements: int = SLICE_ELEMENTS,
) -> tuple[Tensor, RecurrentState]:
    """Causal :func:`kernelized_attention` that continues ``state`` and returns the state after.

    This is prefill for decoding: the prompt runs chunkwise, and decoding picks up the state.
    """
    b, h, n = q.shape[:3]
    if k.shape[2] != n:
        raise ValueError(f"causal needs N == M, got {n} and {k.shape[2]}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if gate is not None and gate.shape != (b, h, n):
        raise ValueError(f"gate must be (B, H, N) = {(b, h, n)}, got {tuple(gate.shape)}")
    # At most one scan group per slice: the features of a slice are fresh contiguous tensors,
    # while a group cut out of a longer slice is a strided view that every batched GEMM of the
    # group would copy.
    step = min(slice_tokens(b * h, feature_dim, chunk_size, slice_elements),
               SCAN_CHUNKS * chunk_size)
    outs, lost = [], []
    pieces = _slices(step, (q, 2), (k, 2), (v, 2), (key_padding_mask, 1), (gate, 2))
    for q_s, k_s, v_s, pad_s, gate_s in zip(*pieces, strict=True):
        phi_q, _ = features(q_s, is_query=True)
        phi_k, log_scale = features(k_s, is_query=False)
        out, state, lost_s = _causal_block(
            phi_q, phi_k, v_s, state, log_scale, pad_s, gate_s, chunk_size, eps
        )
        outs.append(out)
        lost += lost_s
    _raise_if_lost(lost, q.dtype)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), state


def linear_attention_step(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: RecurrentState | None,
    *,
    key_log_scale: Tensor | None = None,
    gate: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, RecurrentState]:
    """One recurrent step: φ(q_t), φ(k_t) (B, H, 1, F), v_t (B, H, 1, Dv) -> (B, H, 1, Dv), state.

    S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T (g_t = 1, no (1 - g) factor, when ungated),
    o_t = φ(q_t) S_t / φ(q_t) z_t. Matches :func:`kernelized_causal` token by token, without its
    chunk machinery (this is the decoding hot loop).

    The step consumes ``state``, as the softmax KV cache is appended in place: unless autograd
    records (a tensor involved requires grad), the state's tensor is updated in place and
    handed on in the returned state. Copy it (``copy.deepcopy``) to branch from one state.
    """
    _check_shapes(phi_q, phi_k, v, key_log_scale)
    state = _state_for(state, phi_k, v)
    v1 = _with_ones(v)
    scale = state.log_scale
    if gate is not None:
        if gate.shape != phi_k.shape[:3]:
            raise ValueError(
                f"gate must be (B, H, 1) = {tuple(phi_k.shape[:3])}, got {tuple(gate.shape)}"
            )
        g = gate[..., None]
        # The decay g S_{t-1} is a shift of the state's scale, not a pass over the state.
        scale = scale + torch.log(g).clamp_min(LOG_GATE_FLOOR)
        v1 = v1 * (1.0 - g)
    key_scale = torch.zeros_like(scale) if key_log_scale is None else key_log_scale
    kv = state.kv
    recording = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (phi_q, phi_k, v, key_log_scale, gate, kv, state.log_scale)
    )
    # Without autograd the step reuses the state's memory: a fresh multi-MiB state per step
    # would be page-faulted in by the allocator, which costs more than the update itself.
    # Compiled, it stays functional (torch.compile cannot trace the inference-mode queries, and
    # plans the graph's buffers itself).
    compiling = torch.compiler.is_compiling()
    in_place = not compiling and not recording and (
        torch.is_inference_mode_enabled() or not kv.is_inference()
    )
    exceeds = (key_scale - scale > RESCALE_MARGIN).any()
    if compiling or bool(exceeds):
        new_scale = torch.maximum(scale, key_scale)
        if compiling:
            # Branch-free, no host sync: a rescale by exp(0) = 1 unless a key exceeds the margin
            # (a compiler fuses it with the update below into one pass over the state).
            new_scale = torch.where(exceeds, new_scale, scale)
        decay = torch.exp(scale - new_scale)
        kv = kv.mul_(decay) if in_place else kv * decay
        scale = new_scale
    # S += φ(k) [v, 1]^T as one elementwise pass over the state (an outer product, no GEMM).
    update = (phi_k.transpose(-2, -1), v1 * torch.exp(key_scale - scale))
    kv = kv.addcmul_(*update) if in_place else torch.addcmul(kv, *update)
    return _ratio(phi_q @ kv, eps, scale), RecurrentState(kv, scale, state.position + 1)
