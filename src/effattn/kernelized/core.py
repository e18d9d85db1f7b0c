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

This module holds what the engine's strategies share, and its entry points: the state, the
floors, the divisor and its eps, the normaliser and the lost-row check; the non-causal key
state and read-out with their recomputing backward (each strategy sizes their slices);
the lagged causal form; decoding (:func:`step_state`); :class:`CoreConfig`. The strategies
live in modules of their own, one layer above this one::

    core.py        conventions, entry points, dispatch, decoding  (imports no strategy)
    chunkwise.py   the causal form's chunk-major layout and per-token factors (on core)
    cpu.py         the CPU strategy: cache-sized slices, a chunk loop, a hand-written backward
    gpu.py         the GPU strategy: device-sized slices, chunk-parallel, a recomputing backward
    fused.py       the triton strategy: the causal scan in fused Triton kernels
                   (fused_kernels.py), the GPU strategy for the rest
    exponents.py   the per-feature core of exponent maps (on core; its GPU form
                   exponents_gpu.py, its triton form fused_exponents.py with the kernels
                   of fused_exponents_kernels.py), which :class:`CoreConfig` runs for them

cpu.py and gpu.py import this module and chunkwise.py, never each other (fused.py builds on
gpu.py). :func:`key_state`,
:func:`read_queries` and the causal form ask :mod:`effattn.strategy` which strategy runs them
and call that module's function of the same name (:func:`_strategy_module`, the one dispatch
point, imports it at the call: an import at the top would be a cycle). :func:`step_state` is
shared; it only takes its branch-free form (no host sync per decoded token) on the GPU
strategies (gpu, triton).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn import strategy

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


def with_ones(v: Tensor) -> Tensor:
    """[v, 1]: v (..., Dv) with a column of ones (the normaliser's), (..., Dv + 1)."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def log_gates(gate: Tensor) -> Tensor:
    """log g of gates g in [0, 1], floored at ``LOG_GATE_FLOOR``: the floor taken on g, so that
    the gradient stays finite (0 below the floor) at g = 0, where ``log(g).clamp_min`` gives
    0 * inf = NaN."""
    return torch.log(gate.clamp_min(math.exp(LOG_GATE_FLOOR)))


def _divisor(den: Tensor, eps: float, log_scale: Tensor) -> Tensor:
    """The denominator Σ_j w_ij φ(q_i)·φ(k_j) (..., 1), held at scale exp(log_scale), as divided
    by: |den| pushed to ``eps`` at the true scale (as the reference does), so that the result
    does not depend on where a stabiliser put the scale: a key far larger than the others in its
    chunk must not push its neighbours' denominators under eps. The sign is kept (trigonometric
    features can give negative denominators); 0 (a query that sees no key) becomes 1, so that
    the output 0 / 1 and its gradient stay 0. ``eps = 0`` (non-negative features) only keeps
    0 / 0 at 0: any positive denominator, however small, is divided by."""
    log_eps = math.log(eps) if eps > 0 else -math.inf
    with torch.no_grad():
        # In log space: eps / exp(log_scale) overflows for the tiny true scales of positive
        # features (exp(-|x|²/2)), and 0 * inf would be NaN.
        floor = torch.exp(log_eps - log_scale)
    den = torch.where(den >= 0, torch.maximum(den, floor), torch.minimum(den, -floor))
    return torch.where(den == 0, 1.0, den)


def _ratio(out: Tensor, eps: float, log_scale: Tensor) -> Tensor:
    """[num, den] held at scale exp(log_scale) -> num / den, with den as :func:`_divisor`."""
    return out[..., :-1] / _divisor(out[..., -1:], eps, log_scale)


def _ratio_into(out: Tensor, raw: Tensor, eps: float, log_scale: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_ratio` of ``raw`` written into ``out`` (no autograd), and what its backward needs
    (:func:`_ratio_grad`): the divisor d (..., 1) and back = -1/d where the gradient reaches the
    denominator, 0 where the eps floor or the 0 -> 1 rule replaced it."""
    den = raw[..., -1:]
    div = _divisor(den, eps, log_scale)
    torch.div(raw[..., :-1], div, out=out)
    return div, torch.where(div == den, -1.0 / div, 0.0)


def _ratio_grad(d_out: Tensor, out: Tensor, div: Tensor, back: Tensor) -> Tensor:
    """Gradient of [num, den] from that of out = num / d: [d_out / d, -(d_out·out) / d]
    (the second 0 where d is not the denominator; see :func:`_ratio_into`). (..., Dv + 1)."""
    return torch.cat([d_out / div, (d_out * out).sum(-1, keepdim=True).mul_(back)], -1)


def _lost_rows(out: Tensor, eps: float, log_scale: Tensor) -> Tensor | None:
    """True (0-d) if a query that sees a key got a denominator of 0 or a subnormal one; None: not
    checked.

    For non-negative features (``eps = 0``) the denominator Σ_j w_ij φ(q_i)·φ(k_j) of a query
    that sees a key is a sum of terms that are positive in exact arithmetic, so 0 means they
    underflowed (or, for arccos features, all happen to be 0): the output row would be a silent
    0. Below the dtype's smallest normal number they have nearly underflowed: the ratio has lost
    its precision and its gradient, 1 / den, overflows to inf (seen with hedgehog's exp features
    at logits ~1e4 in fp32, whose query and key maxima sit on different features). A scale
    above LOG_FLOOR marks a query that sees a key (a scale stays at the floor until
    its state holds an unpadded one). Reading the flag is a host sync: the callers gather one
    per slice and read them once (:func:`_raise_if_lost`); skipped while compiling.
    """
    if eps != 0 or torch.compiler.is_compiling():
        return None
    tiny = torch.finfo(out.dtype).tiny
    return ((out[..., -1:] < tiny) & (log_scale > LOG_FLOOR)).any()


def _check_chunk(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_lag(lag: int) -> None:
    """``lag`` of the causal form (query i sees keys j <= i - lag): an int >= 0."""
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be an int >= 0, got {lag!r}")


class DenominatorUnderflowError(ValueError):
    """A query that sees keys got a zero or subnormal denominator (see :func:`_lost_rows`)."""


def _raise_if_lost(lost: list[Tensor | None], dtype: torch.dtype) -> None:
    flags = [flag for flag in lost if flag is not None]
    if flags and bool(torch.stack(flags).any()):
        raise DenominatorUnderflowError(
            f"the attention denominator Σ_j φ(q_i)·φ(k_j) is 0 in {dtype} (or subnormal, where "
            "its gradient overflows) for a query that sees keys: the product of the stabilised "
            "features underflows for logits this large"
        )


def _check_shapes(
    phi_q: Tensor, phi_k: Tensor, v: Tensor | None, key_log_scale: Tensor | None
) -> None:
    """φ(Q), φ(K) of the same width, φ(K) and v (None: not checked) on the same keys and the
    keys' log-scales one per key; any leading shape (the causal form's is chunk-major)."""
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi_q and phi_k must have the same feature dim F: {tuple(phi_q.shape)} vs "
            f"{tuple(phi_k.shape)}"
        )
    if v is not None and phi_k.shape[:-1] != v.shape[:-1]:
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
    return _state_of(state, b, h, f, v.shape[-1], phi_k)


def _state_of(
    state: RecurrentState | None, b: int, h: int, f: int, dv: int, like: Tensor
) -> RecurrentState:
    """``state``, checked to be (B, H, F, Dv + 1), or an empty one like ``like``."""
    if state is None:
        return RecurrentState.empty(b, h, f, dv, like)
    if not isinstance(state, RecurrentState):
        raise ValueError(f"state must be a RecurrentState or None, got {type(state).__name__}")
    if state.kv.shape != (b, h, f, dv + 1):
        raise ValueError(
            f"state.kv has shape {tuple(state.kv.shape)}, expected {(b, h, f, dv + 1)}"
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
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
    if key_log_scale is None:
        # Features at their true scale, 0, once the state holds an unpadded key; until then
        # the scale stays at the floor, which marks a state without keys (see _lost_rows).
        scale = state.log_scale.clamp_min(0.0)
        if pad is not None:
            scale = torch.where(pad.all(-2, keepdim=True), state.log_scale, scale)
    else:
        seen = key_log_scale if pad is None else key_log_scale.masked_fill(pad, float("-inf"))
        scale = torch.maximum(state.log_scale, _shared_max(seen, -2))
    v1 = _weighted_values(v, key_log_scale, pad, scale)
    kv = state.kv * torch.exp(state.log_scale - scale) + _key_value_products(phi_k, v1)
    return RecurrentState(kv, scale, state.position + phi_k.shape[2])


def _weighted_values(
    v: Tensor, key_log_scale: Tensor | None, pad: Tensor | None, scale: Tensor
) -> Tensor:
    """The keys' rows of [V, 1] at a state's scale: [v_j, 1] exp(ls_j - scale), 0 where padded.

    v (B, H, M, Dv), key_log_scale (B, H, M, 1) or None (true scale 0, weight 1), pad
    (B, 1, M, 1) or None, scale (B, H, 1, 1) -> (B, H, M, Dv + 1).
    """
    v1 = with_ones(v)
    if key_log_scale is None:
        return v1 if pad is None else v1.masked_fill(pad, 0.0)
    if pad is not None:
        key_log_scale = key_log_scale.masked_fill(pad, float("-inf"))
    return v1 * torch.exp(key_log_scale - scale)


def _read_out(state: RecurrentState, phi_q: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    out = phi_q @ state.kv
    return _ratio(out, eps, state.log_scale), _lost_rows(out, eps, state.log_scale)


def slice_tokens(batch_heads: int, feature_dim: int, chunk_size: int, slice_elements: int) -> int:
    """Tokens per slice: about ``slice_elements`` feature values, a multiple of the chunk."""
    tokens = max(1, slice_elements // max(1, batch_heads * feature_dim))
    return max(chunk_size, tokens // chunk_size * chunk_size)


def causal_slice_tokens(
    batch_heads: int, feature_dim: int, value_dim: int, chunk_size: int, slice_elements: int
) -> int:
    """Tokens per slice of the causal form, a multiple of the chunk: about ``slice_elements / 2``
    values of φ and of [V, 1] together (B·H·S·(F + Dv + 1)). A causal slice's backward holds
    its φ(Q), φ(K), their gradients, the recomputed state, and (S, Dv + 1)-sized factors and
    gradients; the state entering each slice is kept from forward to backward, so shorter
    slices cost checkpoints. Sized by φ alone, a slice's backward held most of a causal
    forward+backward's peak."""
    return slice_tokens(batch_heads, feature_dim + value_dim + 1, chunk_size, slice_elements // 2)


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
    chunk_size: int = 32,
    eps: float = 1e-6,
    slice_elements: int = SLICE_ELEMENTS,
    feature_tensors: Sequence[Tensor] | None = None,
) -> Tensor:
    """Kernelized attention from raw q, k, v, computing ``features`` slice by slice.

    q (B, H, N, D), k (B, H, M, D), v (B, H, M, Dv) -> (B, H, N, Dv). ``features(x, is_query=)``
    returns (φ, key_log_scale); ``feature_dim`` is its width F, used to size the slices;
    ``feature_tensors`` are the tensors ``features`` reads (see :func:`_feature_inputs`).

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
    O(S·F + F·Dv), not O(N·F), in training too: the backward recomputes the features slice by
    slice (:class:`_KeyState`, :class:`_ReadQueries`, the CPU strategy's
    :class:`effattn.kernelized.cpu._Causal`).
    Raises :class:`DenominatorUnderflowError` (a ValueError), after the last slice (one host
    sync), where a query that sees a key gets a denominator of 0 (see :func:`_lost_rows`).
    """
    if gate is not None and not causal:
        raise ValueError("gate needs causal=True: gated attention is a causal recurrence")
    if causal:
        return kernelized_causal(
            q, k, v, features, feature_dim=feature_dim, key_padding_mask=key_padding_mask,
            gate=gate, chunk_size=chunk_size, eps=eps, slice_elements=slice_elements,
            feature_tensors=feature_tensors,
        )[0]
    state = key_state(k, v, features, feature_dim=feature_dim, key_padding_mask=key_padding_mask,
                      slice_elements=slice_elements, feature_tensors=feature_tensors)
    return read_queries(q, state, features, feature_dim=feature_dim, eps=eps,
                        slice_elements=slice_elements, feature_tensors=feature_tensors)


def key_state(
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    *,
    feature_dim: int,
    key_padding_mask: Tensor | None = None,
    slice_elements: int = SLICE_ELEMENTS,
    feature_tensors: Sequence[Tensor] | None = None,
) -> RecurrentState:
    """[S, z] = φ(K)^T [V, 1] of all keys k (B, H, M, D), v (B, H, M, Dv), slice by slice.

    The non-causal half of :func:`kernelized_attention`, and the memory a decoder's
    cross-attention forms once per source. Recording gradients, it keeps k and v only
    (:class:`_KeyState`), in slices sized by the strategy (:func:`_strategy_module`).
    """
    return _strategy_module(k).key_state(k, v, features, feature_dim=feature_dim,
                                         key_padding_mask=key_padding_mask,
                                         slice_elements=slice_elements,
                                         feature_tensors=feature_tensors)


def key_state_in_slices(
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    key_padding_mask: Tensor | None,
    feature_tensors: Sequence[Tensor] | None,
    step: int,
    back: int,
) -> RecurrentState:
    """:func:`key_state` in slices of ``step`` keys forward and ``back`` keys backward: the
    strategies' shared form, each sizing the slices for its device."""
    if _recording():
        tensors = _feature_inputs(features, k, False, feature_tensors)
        if _needs_grad(k, v, *tensors):
            kv, scale = _KeyState.apply(k, v, key_padding_mask, features, step, back, *tensors)
            return RecurrentState(kv, scale, k.shape[2])
    return _key_state(k, v, features, key_padding_mask, step)


def _key_state(
    k: Tensor, v: Tensor, features: FeatureFn, key_padding_mask: Tensor | None, step: int
) -> RecurrentState:
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
    feature_tensors: Sequence[Tensor] | None = None,
) -> Tensor:
    """Queries q (B, H, N, D) against a finished :func:`key_state`, in slices: (B, H, N, Dv).

    Recording gradients, it keeps q, the output and the divisors only (:class:`_ReadQueries`),
    in slices sized by the strategy (:func:`_strategy_module`).
    """
    return _strategy_module(q).read_queries(q, state, features, feature_dim=feature_dim,
                                            eps=eps, slice_elements=slice_elements,
                                            feature_tensors=feature_tensors)


def read_queries_in_slices(
    q: Tensor,
    state: RecurrentState,
    features: FeatureFn,
    eps: float,
    feature_tensors: Sequence[Tensor] | None,
    step: int,
    back: int,
) -> Tensor:
    """:func:`read_queries` in slices of ``step`` queries forward and ``back`` backward: the
    strategies' shared form, each sizing the slices for its device."""
    if _recording():
        tensors = _feature_inputs(features, q, True, feature_tensors)
        if _needs_grad(q, state.kv, *tensors):
            return _ReadQueries.apply(q, state.kv, state.log_scale, features, eps, step, back,
                                      *tensors)
    outs, lost = zip(*(_read_out(state, features(q_s, is_query=True)[0], eps)
                       for q_s in q.split(step, 2)), strict=True)
    _raise_if_lost(list(lost), q.dtype)
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _strategy(x: Tensor) -> str:
    """The kernelized engine's strategy for tensors like x (see :mod:`effattn.strategy`)."""
    return strategy.choose("kernelized", x.device)


def _strategy_module(x: Tensor) -> ModuleType:
    """The module of the strategy that runs tensors like x: :mod:`effattn.kernelized.cpu`,
    :mod:`effattn.kernelized.gpu` or :mod:`effattn.kernelized.fused` (``triton``), each with
    ``key_state``, ``read_queries`` and ``causal`` of one signature. Imported here, not at the
    top: each imports this module."""
    chosen = _strategy(x)
    if chosen == "gpu":
        from effattn.kernelized import gpu

        return gpu
    if chosen == "triton":
        from effattn.kernelized import fused

        return fused
    from effattn.kernelized import cpu

    return cpu


def promotes_inside(x: Tensor) -> bool:
    """Whether the strategy that runs tensors like x takes half-precision q, k, v (and gate) to
    its causal form and promotes them itself, slice by slice (the ``triton`` strategy's
    ``PROMOTES_INSIDE``), so that a caller need not hold fp32 copies of them; the others are
    given them in the compute dtype (:func:`effattn.base.compute_dtype`)."""
    return bool(_strategy_module(x).PROMOTES_INSIDE)


def _slices(step: int, *tensors: tuple[Tensor | None, int]) -> list[list[Tensor | None]]:
    """Each (tensor, dim) cut into pieces of ``step`` along dim; None stays None in every piece.

    ``split`` rather than ``narrow``: the backward of S narrowed views allocates S zero tensors
    of the full input's size (O(S·N) work), that of one split is a single concatenation.
    """
    parts = [None if t is None else list(t.split(step, dim)) for t, dim in tensors]
    count = max(len(p) for p in parts if p is not None)
    return [[None] * count if p is None else p for p in parts]


# Recompute instead of store (FlashAttention's trade, Dao et al. 2022, applied to linear
# attention): recording gradients, the forward keeps q, k, v, the output, its divisors and the
# fixed-size states, and the backward recomputes φ(Q), φ(K) a slice at a time and backpropagates
# through the feature map with autograd. Autograd through the forward would keep every slice's
# N x F features (and, causal, N/C states of F x (Dv + 1)): 3x SDPA's training memory.
# The backward's slices are a quarter of the forward's: it holds three or four N x F-sized
# tensors of a slice at once (φ, dφ and the feature map's own), the forward one or two.
BACKWARD_SLICE_SHARE = 4


def _recording() -> bool:
    """Whether the recomputing autograd functions apply: gradients on, and eager (under
    torch.compile autograd records the forward as it is: dynamo does not trace a backward that
    calls autograd itself)."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _needs_grad(*tensors: Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _feature_inputs(
    features: FeatureFn, x: Tensor, is_query: bool, feature_tensors: Sequence[Tensor] | None
) -> tuple[Tensor, ...]:
    """The tensors that ``features`` reads, as inputs of a recomputing autograd function.

    Given (a module's parameters and buffers), they are saved for backward, so that one changed
    in place between forward and backward (a redraw) raises, as for any saved tensor, rather than
    being recomputed with; those that require grad get their gradients. Not given, the ones that
    require grad are found in the autograd graph of φ of one token of x: its leaves.
    """
    if feature_tensors is not None:
        return tuple(feature_tensors)
    with torch.enable_grad():
        phi, log_scale = features(x[:, :, :1].detach(), is_query=is_query)
    found: dict[int, Tensor] = {}
    seen, stack = set(), []
    for t in (phi, log_scale):
        if t is not None and t.requires_grad:
            if t.grad_fn is None:
                found[id(t)] = t
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf that requires grad
        if leaf is not None:
            found[id(leaf)] = leaf
        stack.extend(fn for fn, _ in node.next_functions)
    return tuple(found.values())


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(total, a + step)) for a in range(0, total, step)]


def _leaf(x: Tensor | None, grad: bool) -> Tensor | None:
    """x cut off from the graph, recording its own gradient when ``grad``."""
    return None if x is None else x.detach().requires_grad_(grad)


def _backprop(
    outputs: Sequence[Tensor | None], grads: Sequence[Tensor | None], inputs: Sequence[Tensor]
) -> list[Tensor | None]:
    """Vector-Jacobian product of a recomputed piece of graph: d outputs -> d inputs (None
    where an input does not require grad or is not reached)."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
             if o is not None and g is not None and o.requires_grad]
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    result: list[Tensor | None] = [None] * len(inputs)
    if pairs and wanted:
        # retain_graph: a feature map may read a tensor computed outside it (w = 2 w0, a
        # dtype cast of a parameter), whose graph every slice's backward goes through.
        got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted],
                                  [g for _, g in pairs], retain_graph=True, allow_unused=True)
        for i, g in zip(wanted, got, strict=True):
            result[i] = g
    return result


def _backward_in_spans(
    inputs: Sequence[Tensor | None],
    needs: Sequence[bool],
    spans: Sequence[tuple[int, int]],
    n_tensors: int,
    d_state: Tensor | None,
    span: Callable[[int, list[Tensor | None], Tensor | None],
                   tuple[Tensor | None, Sequence[Tensor | None]]],
) -> tuple[list[Tensor | None], Tensor | None, list[Tensor | None]]:
    """The loop of a causal backward that recomputes span by span, from the last: for each
    span i (positions a..b of ``spans``), ``span(i, leaves, d_state)`` gets the inputs' rows
    a..b cut off from the graph (recording their own gradient where ``needs``) and the gradient
    of the state after the span, and returns the gradient of the state before it and those of
    the inputs' rows and of the ``n_tensors`` feature tensors. Returns the inputs' gradients
    (B, H, L, ·) (None where not needed), the entering state's and the feature tensors'
    (summed over the spans)."""
    grads = [torch.empty_like(t) if t is not None and need else None
             for t, need in zip(inputs, needs, strict=True)]
    d_tensors: list[Tensor | None] = [None] * n_tensors
    for i in range(len(spans) - 1, -1, -1):
        a, b = spans[i]
        leaves = [_leaf(None if t is None else t[:, :, a:b], need)
                  for t, need in zip(inputs, needs, strict=True)]
        d_state, got = span(i, leaves, d_state)
        for total, part in zip(grads, got[:len(inputs)], strict=True):
            _put(total, a, b, part)
        d_tensors = [_add(t, g) for t, g in zip(d_tensors, got[len(inputs):], strict=True)]
    return grads, d_state, d_tensors


def _put(total: Tensor | None, a: int, b: int, part: Tensor | None) -> None:
    """Positions a..b of a gradient (B, H, L, ·): ``part``, or 0 where nothing reached them."""
    if total is not None:
        total[:, :, a:b] = 0.0 if part is None else part


def _add(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    if part is None:
        return total
    return part if total is None else total.add_(part)


def _key_slice_backward(
    features: FeatureFn,
    k: Tensor,
    v: Tensor,
    pad: Tensor | None,
    scale: Tensor,
    d_kv: Tensor,
    tensors: Sequence[Tensor],
) -> list[Tensor | None]:
    """One key slice of :class:`_KeyState`'s backward: gradients of k, v (leaves) and
    ``tensors`` from dKV (B, H, F, Dv + 1). A function, so that the slice's recomputed graph is
    freed before the next slice's is built."""
    with torch.enable_grad():
        phi, log_scale = features(k, is_query=False)
        w = _weighted_values(v, log_scale, pad, scale)
    return _backprop((phi, w), (w.detach() @ d_kv.transpose(-2, -1), phi.detach() @ d_kv),
                     (k, v, *tensors))


def _query_slice_backward(
    features: FeatureFn,
    q: Tensor,
    g: Tensor,
    kv: Tensor,
    d_kv: Tensor | None,
    tensors: Sequence[Tensor],
) -> list[Tensor | None]:
    """One query slice of :class:`_ReadQueries`'s backward: adds φ(Q)^T G to ``d_kv`` (when
    given) and returns the gradients of q (a leaf) and ``tensors``."""
    with torch.enable_grad():
        phi = features(q, is_query=True)[0]
    if d_kv is not None:
        d_kv += phi.detach().transpose(-2, -1) @ g
    return _backprop((phi,), (g @ kv.transpose(-2, -1) if phi.requires_grad else None,),
                     (q, *tensors))


class _KeyState(torch.autograd.Function):
    """[S, z] = Σ_j φ(k_j) [v_j, 1]^T exp(ls_j - s) (:func:`key_state`), keeping k and v only.

    The stabiliser s (the keys' max log-scale) carries no gradient, so the state's gradient
    dKV (B, H, F, Dv + 1) reaches each key slice directly: with W = [V, 1] exp(ls - s),
    dφ(K) = W dKV^T and dW = φ(K) dKV, then autograd through the recomputed feature map and
    weights gives dk, dv and the feature tensors' gradients.
    """

    @staticmethod
    def forward(ctx: Any, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                features: FeatureFn, step: int, back: int, *tensors: Tensor
                ) -> tuple[Tensor, Tensor]:
        state = _key_state(k, v, features, key_padding_mask, step)
        ctx.features, ctx.back = features, back
        ctx.save_for_backward(k, v, key_padding_mask, state.log_scale, *tensors)
        ctx.mark_non_differentiable(state.log_scale)
        return state.kv, state.log_scale

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_kv: Tensor, _: Tensor | None) -> tuple[Tensor | None, ...]:
        k, v, pad, scale, *tensors = ctx.saved_tensors
        need_k, need_v = ctx.needs_input_grad[:2]
        dk = torch.empty_like(k) if need_k else None
        dv = torch.empty_like(v) if need_v else None
        d_tensors: list[Tensor | None] = [None] * len(tensors)
        for a, b in _spans(k.shape[2], ctx.back):
            grads = _key_slice_backward(
                ctx.features, _leaf(k[:, :, a:b], need_k), _leaf(v[:, :, a:b], need_v),
                None if pad is None else pad[:, None, a:b, None], scale, d_kv, tensors,
            )
            _put(dk, a, b, grads[0])
            _put(dv, a, b, grads[1])
            d_tensors = [_add(t, g) for t, g in zip(d_tensors, grads[2:], strict=True)]
        return dk, dv, None, None, None, None, *d_tensors


class _ReadQueries(torch.autograd.Function):
    """out = num / d with [num, den] = φ(Q) [S, z] (:func:`read_queries`), keeping q, the
    output and the divisors (B, H, N, 1) only.

    With G = [d_out / d, -(d_out·out) / d] the gradient of [num, den] (:func:`_ratio_grad`),
    dφ(Q) = G [S, z]^T and d[S, z] = φ(Q)^T G, then autograd through the recomputed feature map
    gives dq and the feature tensors' gradients.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, kv: Tensor, log_scale: Tensor, features: FeatureFn,
                eps: float, step: int, back: int, *tensors: Tensor) -> Tensor:
        b, h, n = q.shape[:3]
        out = q.new_empty(b, h, n, kv.shape[-1] - 1)
        div, sign = q.new_empty(b, h, n, 1), q.new_empty(b, h, n, 1)
        lost = []
        for a, e in _spans(n, step):
            raw = features(q[:, :, a:e], is_query=True)[0] @ kv
            div[:, :, a:e], sign[:, :, a:e] = _ratio_into(out[:, :, a:e], raw, eps, log_scale)
            lost.append(_lost_rows(raw, eps, log_scale))
        _raise_if_lost(lost, q.dtype)
        ctx.features, ctx.back = features, back
        ctx.save_for_backward(q, kv, out, div, sign, *tensors)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, out, div, sign, *tensors = ctx.saved_tensors
        need_q, need_kv = ctx.needs_input_grad[:2]
        dq = torch.empty_like(q) if need_q else None
        d_kv = torch.zeros_like(kv) if need_kv else None
        d_tensors: list[Tensor | None] = [None] * len(tensors)
        for a, b in _spans(q.shape[2], ctx.back):
            g = _ratio_grad(d_out[:, :, a:b], out[:, :, a:b], div[:, :, a:b], sign[:, :, a:b])
            grads = _query_slice_backward(ctx.features, _leaf(q[:, :, a:b], need_q), g, kv, d_kv,
                                          tensors)
            _put(dq, a, b, grads[0])
            d_tensors = [_add(t, g) for t, g in zip(d_tensors, grads[1:], strict=True)]
        return dq, d_kv, None, None, None, None, None, *d_tensors


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
    chunk_size: int = 32,
    eps: float = 1e-6,
    slice_elements: int = SLICE_ELEMENTS,
    feature_tensors: Sequence[Tensor] | None = None,
    lag: int = 0,
) -> tuple[Tensor, RecurrentState]:
    """Causal :func:`kernelized_attention` that continues ``state`` and returns the state after.

    This is prefill for decoding: the prompt runs chunkwise, and decoding picks up the state.
    Recording gradients, it keeps q, k, v, the gate, the output and the state entering each
    slice (:class:`effattn.kernelized.cpu._Causal` on the CPU strategy). ``lag`` > 0: query i
    sees keys j <= i - lag (see :func:`lagged`).
    """
    out, state, _ = _causal(q, k, v, features, state, feature_dim, key_padding_mask, gate,
                            chunk_size, eps, slice_elements, feature_tensors, False, lag)
    return out, state


def kernelized_causal_normalised(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    state: RecurrentState | None = None,
    *,
    feature_dim: int,
    key_padding_mask: Tensor | None = None,
    gate: Tensor | None = None,
    chunk_size: int = 32,
    eps: float = 1e-6,
    slice_elements: int = SLICE_ELEMENTS,
    feature_tensors: Sequence[Tensor] | None = None,
    lag: int = 0,
) -> tuple[Tensor, RecurrentState, Normaliser]:
    """:func:`kernelized_causal` that also returns each query's normaliser (:class:`Normaliser`),
    differentiable: what a sum with other attention terms over other keys needs (the window
    hybrid, ``effattn.kernelized.hybrid``, whose keys outside the window are those of
    ``lag`` = window)."""
    out, state, norm = _causal(q, k, v, features, state, feature_dim, key_padding_mask, gate,
                               chunk_size, eps, slice_elements, feature_tensors, True, lag)
    assert norm is not None
    return out, state, norm


@dataclass
class Normaliser:
    """Σ_j w_ij φ(q_i)·φ(k_j) at the true scale (the query's log-scale included: see
    kernelized.features) as ``sign · exp(log_abs)``, each (B, H, N). log_abs carries the
    gradient; sign is -1, 0 (no key, or all terms 0: log_abs = -inf) or 1. Where the core's
    eps floor replaced the denominator (signed features that cancel), it is the floor: then
    out · normaliser is what the output was divided by, not the exact numerator."""

    log_abs: Tensor
    sign: Tensor


def _causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    state: RecurrentState | None,
    feature_dim: int,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk_size: int,
    eps: float,
    slice_elements: int,
    feature_tensors: Sequence[Tensor] | None,
    normaliser: bool,
    lag: int = 0,
) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    b, h, n = q.shape[:3]
    if k.shape[2] != n:
        raise ValueError(f"causal needs N == M, got {n} and {k.shape[2]}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if gate is not None and gate.shape != (b, h, n):
        raise ValueError(f"gate must be (B, H, N) = {(b, h, n)}, got {tuple(gate.shape)}")
    _check_chunk(chunk_size)
    check_lag(lag)
    if lag:
        def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                gate: Tensor | None) -> tuple[Tensor, RecurrentState, Normaliser | None]:
            return _causal(q, k, v, features, None, feature_dim, mask, gate, chunk_size, eps,
                           slice_elements, feature_tensors, normaliser)

        def empty() -> RecurrentState:
            phi = features(k[:, :, :1], is_query=False)[0]
            return RecurrentState.empty(b, h, phi.shape[-1], v.shape[-1], phi)

        return lagged(run, q, k, v, key_padding_mask, gate, state, lag, normaliser, empty)
    return _strategy_module(q).causal(q, k, v, features, state, feature_dim=feature_dim,
                                      key_padding_mask=key_padding_mask, gate=gate,
                                      chunk_size=chunk_size, eps=eps,
                                      slice_elements=slice_elements,
                                      feature_tensors=feature_tensors, normaliser=normaliser)


CausalFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", "Tensor | None"],
                    tuple[Tensor, RecurrentState, "Normaliser | None"]]


def lagged(run: CausalFn, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
           gate: Tensor | None, state: RecurrentState | None, lag: int, normaliser: bool,
           empty: Callable[[], RecurrentState]) -> tuple[Tensor, RecurrentState,
                                                          Normaliser | None]:
    """A causal form with query i seeing keys j <= i - ``lag`` (lag >= 1), from ``run`` (q, k,
    v, mask, gate) -> (out, state, normaliser) of an ordinary causal pass::

        out_i = Σ_{j <= i - lag} w_ij φ(q_i)·φ(k_j) v_j / Σ_{j <= i - lag} w_ij φ(q_i)·φ(k_j)

    with the gate's w_ij = (1 - g_j) Π_{j<l<=i-lag} g_l (the state the query reads is the one
    after key i - lag). The scan runs over keys 0..N-1-lag with the queries' positions offset
    by ``lag``: query i takes the place of query i - lag of an ordinary causal pass. q, k, v,
    the mask and the gate enter as views (no lagged copies); queries i < lag see no key (output
    0, normaliser -inf with sign 0). The state after holds the keys the last query saw,
    j <= N - 1 - lag (position N - lag), or is ``empty()`` when no query sees a key; a lagged
    pass starts from no state, since its first queries would read one that no causal pass of
    theirs makes. Shared by the row core and the per-feature one."""
    b, h, n = q.shape[:3]
    if state is not None:
        raise ValueError("lag > 0 needs state=None: a lagged pass starts at the sequence's start")
    seen = n - lag  # keys that some query sees
    if seen <= 0:
        norm = None
        if normaliser:
            norm = Normaliser(q.new_full((b, h, n), -math.inf), q.new_zeros(b, h, n))
        return q.new_zeros(b, h, n, v.shape[-1]), empty(), norm
    out, after, norm = run(q[:, :, lag:], k[:, :, :seen], v[:, :, :seen],
                           None if key_padding_mask is None else key_padding_mask[:, :seen],
                           None if gate is None else gate[:, :, :seen])
    if norm is not None:
        norm = Normaliser(F.pad(norm.log_abs, (lag, 0), value=-math.inf),
                          F.pad(norm.sign, (lag, 0)))
    return F.pad(out, (0, 0, lag, 0)), after, norm


def _normaliser(den: Tensor, eps: float, log_scale: Tensor,
                query_log_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """(log |d|, sign d) (B, H, n) of the divisor d = :func:`_divisor` of ``den`` (B, H, n, 1) at
    ``log_scale``, moved to the true scale by ``log_scale`` and the queries' log-scales
    (B, H, n, 1); -inf and 0 where den is 0 (no key: nothing to add). The gradient reaches den
    where d is den (see :func:`_ratio_into`) and the queries' log-scales."""
    div = _divisor(den, eps, log_scale)
    if query_log_scale is not None:
        log_scale = log_scale + query_log_scale
    log_abs = torch.where(den == 0, -math.inf, torch.log(div.abs()) + log_scale)
    return log_abs[..., 0], torch.where(den == 0, 0.0, torch.sign(div)).detach()[..., 0]


def _unique(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple({id(t): t for t in tensors}.values())


@dataclass(frozen=True)
class CoreConfig:
    """The settings every call of one module's core shares, built once per call by
    :meth:`effattn.kernelized.base.KernelizedAttention.core` and passed whole by every caller
    (the module, the window hybrid, sequence parallelism), rather than restated at each call
    site: ``features`` (φ, see kernelized.features) and its width ``feature_dim``, the causal
    form's ``chunk_size``, the divisor's ``eps``, the slice budget ``slice_elements`` (the GPU
    strategy scales it up: ``gpu.SLICE_SCALE``) and the ``feature_tensors`` the recomputing
    backward saves (the redraw guard, see
    :func:`_feature_inputs`). The strategy is not a setting: :mod:`effattn.strategy` picks it
    by device, in one place.

    ``exponents`` (maps whose features are exp of per-feature exponents, see
    :mod:`effattn.kernelized.exponents`): when set, every call runs that module's per-feature
    stabilised core instead, and states carry per-feature log-scales; ``features`` is then
    unused here. It takes no gate.
    """

    features: FeatureFn
    feature_dim: int
    chunk_size: int = 32
    eps: float = 1e-6
    slice_elements: int = SLICE_ELEMENTS
    feature_tensors: tuple[Tensor, ...] | None = None
    exponents: Callable[[Tensor], Tensor] | None = None

    def _no_gate(self, gate: Tensor | None) -> None:
        if gate is not None and self.exponents is not None:
            raise ValueError("gate: a map of per-feature exponents takes no gate")

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                  key_padding_mask: Tensor | None = None, gate: Tensor | None = None) -> Tensor:
        """:func:`kernelized_attention` with these settings."""
        if self.exponents is not None:
            from effattn.kernelized import exponents

            self._no_gate(gate)
            return exponents.attention(q, k, v, self.exponents, self.feature_dim,
                                       is_causal=causal, key_padding_mask=key_padding_mask,
                                       chunk_size=self.chunk_size,
                                       slice_elements=self.slice_elements,
                                       feature_tensors=self.feature_tensors)
        return kernelized_attention(
            q, k, v, self.features, feature_dim=self.feature_dim, causal=causal,
            key_padding_mask=key_padding_mask, gate=gate, chunk_size=self.chunk_size,
            eps=self.eps, slice_elements=self.slice_elements,
            feature_tensors=self.feature_tensors,
        )

    def key_state(self, k: Tensor, v: Tensor, *,
                  key_padding_mask: Tensor | None = None) -> RecurrentState:
        """:func:`key_state` with these settings."""
        if self.exponents is not None:
            from effattn.kernelized import exponents

            return exponents.key_state(k, v, self.exponents, self.feature_dim,
                                       key_padding_mask=key_padding_mask,
                                       slice_elements=self.slice_elements,
                                       feature_tensors=self.feature_tensors)
        return key_state(k, v, self.features, feature_dim=self.feature_dim,
                         key_padding_mask=key_padding_mask, slice_elements=self.slice_elements,
                         feature_tensors=self.feature_tensors)

    def read_queries(self, q: Tensor, state: RecurrentState) -> Tensor:
        """:func:`read_queries` with these settings."""
        if self.exponents is not None:
            from effattn.kernelized import exponents

            return exponents.read_queries(q, state, self.exponents,
                                          slice_elements=self.slice_elements,
                                          feature_tensors=self.feature_tensors)
        return read_queries(q, state, self.features, feature_dim=self.feature_dim, eps=self.eps,
                            slice_elements=self.slice_elements,
                            feature_tensors=self.feature_tensors)

    def causal(self, q: Tensor, k: Tensor, v: Tensor, state: RecurrentState | None = None, *,
               key_padding_mask: Tensor | None = None, gate: Tensor | None = None,
               lag: int = 0) -> tuple[Tensor, RecurrentState]:
        """:func:`kernelized_causal` with these settings; ``lag``: query i sees keys
        j <= i - lag."""
        out, state, _ = self._causal(q, k, v, state, key_padding_mask, gate, False, lag)
        return out, state

    def causal_normalised(
        self, q: Tensor, k: Tensor, v: Tensor, state: RecurrentState | None = None, *,
        key_padding_mask: Tensor | None = None, gate: Tensor | None = None, lag: int = 0,
    ) -> tuple[Tensor, RecurrentState, Normaliser]:
        """:func:`kernelized_causal_normalised` with these settings; ``lag``: query i sees keys
        j <= i - lag."""
        out, state, norm = self._causal(q, k, v, state, key_padding_mask, gate, True, lag)
        assert norm is not None
        return out, state, norm

    def _causal(self, q: Tensor, k: Tensor, v: Tensor, state: RecurrentState | None,
                key_padding_mask: Tensor | None, gate: Tensor | None, normaliser: bool,
                lag: int) -> tuple[Tensor, RecurrentState, Normaliser | None]:
        if self.exponents is not None:
            from effattn.kernelized import exponents

            self._no_gate(gate)
            _check_chunk(self.chunk_size)
            check_lag(lag)
            return exponents.causal(q, k, v, self.exponents, self.feature_dim, state,
                                    key_padding_mask=key_padding_mask,
                                    chunk_size=self.chunk_size,
                                    slice_elements=self.slice_elements, normaliser=normaliser,
                                    lag=lag, feature_tensors=self.feature_tensors)
        return _causal(q, k, v, self.features, state, self.feature_dim, key_padding_mask, gate,
                       self.chunk_size, self.eps, self.slice_elements, self.feature_tensors,
                       normaliser, lag)

    def step(self, q: Tensor, k: Tensor, v: Tensor, state: RecurrentState | None, *,
             gate: Tensor | None = None) -> tuple[Tensor, RecurrentState]:
        """One decoding token: q, k (B, H, 1, D), v (B, H, 1, Dv) -> (B, H, 1, Dv) and the
        state after it (:func:`linear_attention_step` of the features)."""
        if self.exponents is not None:
            from effattn.kernelized import exponents

            self._no_gate(gate)
            return exponents.step(q, k, v, state, self.exponents)
        phi_q, _ = self.features(q, is_query=True)
        phi_k, log_scale = self.features(k, is_query=False)
        return linear_attention_step(phi_q, phi_k, v, state, key_log_scale=log_scale, gate=gate,
                                     eps=self.eps)

    def step_keys(self, state: RecurrentState | None, k: Tensor, v: Tensor, *,
                  gate: Tensor | None = None, recording: bool = False) -> RecurrentState:
        """:func:`step_state` of one key k (B, H, 1, D), v (B, H, 1, Dv)."""
        if self.exponents is not None:
            from effattn.kernelized import exponents

            self._no_gate(gate)
            return exponents.step_state(state, self.exponents(k), v)
        phi_k, log_scale = self.features(k, is_query=False)
        return step_state(state, phi_k, v, key_log_scale=log_scale, gate=gate,
                          recording=recording)

    def read_normalised(self, state: RecurrentState, q: Tensor) -> tuple[Tensor, Normaliser]:
        """:func:`read_normalised` of queries q (B, H, N, D) out of ``state``."""
        if self.exponents is not None:
            from effattn.kernelized import exponents

            out, norm = exponents.read_normalised(state, self.exponents(q))
            assert norm is not None
            return out, norm
        return read_normalised(state, *self.features(q, is_query=True), self.eps)


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
    state = step_state(state, phi_k, v, key_log_scale=key_log_scale, gate=gate,
                       recording=_needs_grad(phi_q))
    return _ratio(phi_q @ state.kv, eps, state.log_scale), state


def read_normalised(state: RecurrentState, phi_q: Tensor, query_log_scale: Tensor | None,
                    eps: float) -> tuple[Tensor, Normaliser]:
    """φ(Q) (B, H, N, F) read out of ``state``: the output (B, H, N, Dv) and its
    :class:`Normaliser`, with the queries' log-scales (B, H, N, 1) (None: 0)."""
    return read_checked(state, phi_q, query_log_scale, eps)[:2]


def read_checked(state: RecurrentState, phi_q: Tensor, query_log_scale: Tensor | None,
                 eps: float) -> tuple[Tensor, Normaliser, Tensor | None]:
    """:func:`read_normalised`, and whether a query that sees a key lost its denominator (0-d,
    see :func:`_lost_rows`; None: not checked), unread (no host sync)."""
    raw = phi_q @ state.kv
    log_abs, sign = _normaliser(raw[..., -1:], eps, state.log_scale, query_log_scale)
    with torch.no_grad():
        lost = _lost_rows(raw, eps, state.log_scale)
    return _ratio(raw, eps, state.log_scale), Normaliser(log_abs, sign), lost


def step_state(
    state: RecurrentState | None,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Tensor | None = None,
    gate: Tensor | None = None,
    recording: bool = False,
) -> RecurrentState:
    """The state update of :func:`linear_attention_step`: φ(k_t) (B, H, 1, F), v_t (B, H, 1, Dv)
    (and log-scale, gate (B, H, 1)) into ``state``, in place unless autograd records (a tensor
    involved requires grad, or ``recording``: the caller's read-out does)."""
    _check_shapes(phi_k, phi_k, v, key_log_scale)
    state = _state_for(state, phi_k, v)
    v1 = with_ones(v)
    scale = state.log_scale
    if gate is not None:
        if gate.shape != phi_k.shape[:3]:
            raise ValueError(
                f"gate must be (B, H, 1) = {tuple(phi_k.shape[:3])}, got {tuple(gate.shape)}"
            )
        g = gate[..., None]
        # The decay g S_{t-1} is a shift of the state's scale, not a pass over the state.
        scale = scale + log_gates(g)
        v1 = v1 * (1.0 - g)
    key_scale = torch.zeros_like(scale) if key_log_scale is None else key_log_scale
    kv = state.kv
    recording = torch.is_grad_enabled() and (recording or _needs_grad(
        phi_k, v, key_log_scale, gate, kv, state.log_scale
    ))
    # Without autograd the step reuses the state's memory: a fresh multi-MiB state per step
    # would be page-faulted in by the allocator, which costs more than the update itself.
    # Compiled, it stays functional (torch.compile cannot trace the inference-mode queries, and
    # plans the graph's buffers itself).
    compiling = torch.compiler.is_compiling()
    in_place = not compiling and not recording and (
        torch.is_inference_mode_enabled() or not kv.is_inference()
    )
    exceeds = (key_scale - scale > RESCALE_MARGIN).any()
    # Branch-free, no host sync, when compiling and on the GPU strategies (whose device would
    # stall on reading the flag every token): a rescale by exp(0) = 1 unless a key exceeds the
    # margin (a compiler fuses it with the update below into one pass over the state).
    branch_free = compiling or _strategy(kv) != "cpu"
    if branch_free or bool(exceeds):
        new_scale = torch.maximum(scale, key_scale)
        if branch_free:
            new_scale = torch.where(exceeds, new_scale, scale)
        decay = torch.exp(scale - new_scale)
        kv = kv.mul_(decay) if in_place else kv * decay
        scale = new_scale
    # S += φ(k) [v, 1]^T as one elementwise pass over the state (an outer product, no GEMM).
    update = (phi_k.transpose(-2, -1), v1 * torch.exp(key_scale - scale))
    kv = kv.addcmul_(*update) if in_place else torch.addcmul(kv, *update)
    return RecurrentState(kv, scale, state.position + 1)
