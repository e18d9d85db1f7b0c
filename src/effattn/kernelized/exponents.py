"""The kernelized core for feature maps given by per-feature exponents, with a per-feature
stabiliser.

A map of this kind returns u (B, H, L, F) with φ(x) = exp(u) elementwise (Hedgehog's
[exp(x W + b), exp(-(x W + b))], Zhang et al. 2024). The row convention of
:mod:`effattn.kernelized.core` holds each key at one scale for all its features (φ over its row
max, times a log-scale), so a pair (q, k) whose peaks sit on different features has every
product exp(u_qf + u_kf - max_f u_qf - max_f u_kf) far below 1: with exponents around 70 in
fp32 that product underflows and the normaliser of a query can be lost. Here each feature has
its own scale, the running max of that feature over the keys a query can see::

    M_f(i) = max_{j <= i} u_kf(j)           (non-causal: over every key)
    c_i    = max_f (u_qf(i) + M_f(i))        (the log of the query's largest term)
    out_i  = Σ_{j<=i} Σ_f exp(u_qf(i) + u_kf(j) - c_i) [v_j, 1]   (numerator and denominator)

Every term is <= 1 and the largest is exactly 1, so the denominator of a query that sees a key
is at least 1 whatever the exponents: no underflow, no eps. The shift c_i cancels in the ratio.
No future key sets a scale: M_f(i) looks at keys j <= i only.

Causal, chunkwise (C tokens per chunk, R_c the running max at the end of chunk c, R_{-1} the
incoming state's):

- the state entering chunk c is held at R_{c-1}: S_c = Σ_{j < chunk c} exp(u_k(j) - R_{c-1})
  [v_j, 1]^T per feature row, every factor <= 1; moving on, its rows decay by
  exp(R_{c-1} - R_c) <= 1 (a per-feature, diagonal decay, as gated linear attention's);
- a query of chunk c reads it with exp(u_q + R_{c-1} - c_i) <= 1;
- inside the chunk, the pair products exp(u_q + R_c - c_i) exp(u_k - R_c) form a C x C GEMM;
  the query factor can exceed 1 by the growth of the running max inside the chunk (it is the
  chunk's later keys that raise R_c). Where no feature grows by more than
  :data:`FP32_GROWTH` inside its chunk (checked on the CPU, one host sync per slice), the GEMM
  runs in the input's dtype with c_i taken over the state and the query's own key (the keys in
  between can only raise it by that growth); otherwise in float64, whose range (e^±709) holds
  any growth up to :data:`GROWTH_LIMIT`, with the exact c_i. A compiled graph always takes
  float64 rather than the host sync. On the GPU strategy the causal form is
  :mod:`effattn.kernelized.exponents_gpu`'s (chunk-parallel, no host sync), and the non-causal
  slices are device-sized.

The state is a :class:`~effattn.kernelized.core.RecurrentState` whose ``log_scale`` is per
feature, (B, H, F, 1); decoding (:func:`step_state`, :func:`read_normalised`) keeps it so, and
equals the forward up to rounding. Gradients flow through autograd: the shifts (M, R, c) are
constants that cancel (no gradient), and long inputs run in slices of about
``slice_elements / SLICE_SHARE`` feature values (half the row core's slice), each
recomputed in the backward (activation checkpointing), so training memory grows with the
slice, not the sequence.

Shapes: B batch, H heads, N queries, M keys, F features (the width of u), Dv value dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from effattn import strategy
from effattn.kernelized.core import (
    LOG_FLOOR,
    RESCALE_MARGIN,
    Normaliser,
    RecurrentState,
    lagged,
    with_ones,
)

# exponents(x (B, H, L, D)) -> u (B, H, L, F): the map is φ(x) = exp(u).
ExponentFn = Callable[[Tensor], Tensor]

# Largest exponent of the in-chunk query factor exp(u_q + R_c - c_i), i.e. of the growth of a
# feature's running max inside one chunk: float64 holds e^709. Larger growth would be clamped
# (and the products through it too small); exponents that grow by 700 inside 32 tokens are not
# a model anyone trains.
GROWTH_LIMIT = 700.0
# Below this largest in-chunk query exponent, the CPU computes the chunk in the input's dtype
# (fp32: products up to e^60 times F·C terms stay far from e^88); above it, in float64.
FP32_GROWTH = 60.0
# A slice of this core holds slice_elements / SLICE_SHARE feature values: its backward
# recomputes the slice with autograd, which keeps several slice-sized tensors (exponents,
# factors, shifted copies) where the row core's hand-written backward keeps one or two.
SLICE_SHARE = 2


def _padded(u_k: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    if key_padding_mask is None:
        return u_k
    return u_k.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))


def _state(state: RecurrentState | None, b: int, h: int, f: int, dv: int,
           like: Tensor) -> RecurrentState:
    """``state`` checked to be a per-feature state (B, H, F, Dv + 1) with log-scales
    (B, H, F, 1), or an empty one like ``like``."""
    if state is None:
        return RecurrentState(like.new_zeros(b, h, f, dv + 1),
                              like.new_full((b, h, f, 1), LOG_FLOOR), 0)
    if not isinstance(state, RecurrentState):
        raise ValueError(f"state must be a RecurrentState or None, got {type(state).__name__}")
    if state.kv.shape != (b, h, f, dv + 1) or state.log_scale.shape != (b, h, f, 1):
        raise ValueError(
            f"state has kv {tuple(state.kv.shape)} and log_scale "
            f"{tuple(state.log_scale.shape)}, expected {(b, h, f, dv + 1)} and {(b, h, f, 1)} "
            "(a per-feature state of the same method)"
        )
    return state


def _finish(raw: Tensor, top: Tensor,
            normaliser: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """[num, den] (..., Dv + 1) held at exp(top) (..., 1) -> num / den (0 where no key is
    seen), and (when asked) the normaliser den · exp(top) as its log (-inf where no key) and
    sign, (...)."""
    den = raw[..., -1:]
    div = torch.where(den == 0, 1.0, den)  # 0 / 1, and a gradient of 0, where no key is seen
    if not normaliser:
        return raw[..., :-1] / div, None, None
    log_abs = torch.where(den == 0, float("-inf"), torch.log(div) + top)[..., 0]
    return raw[..., :-1] / div, log_abs, (den > 0).to(den.dtype).detach()[..., 0]


def _key_state(k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
               exponents: ExponentFn) -> tuple[Tensor, Tensor]:
    u_k = _padded(exponents(k), pad)
    with torch.no_grad():
        top = torch.maximum(u_k.amax(2, keepdim=True).clamp_min(LOG_FLOOR),
                            scale.transpose(-2, -1)).transpose(-2, -1)  # (B, H, F, 1)
    kv = (kv * torch.exp(scale - top)
          + torch.sub(u_k, top.transpose(-2, -1)).exp_().transpose(-2, -1) @ with_ones(v))
    return kv, top


def _slice_tokens(b: int, h: int, f: int, slice_elements: int, multiple: int = 1) -> int:
    """Tokens per slice: about ``slice_elements / SLICE_SHARE`` feature values (B·H·S·F), a
    multiple of ``multiple`` (the chunk)."""
    tokens = slice_elements // SLICE_SHARE // max(1, b * h * f)
    return max(multiple, tokens // multiple * multiple)


def key_state(k: Tensor, v: Tensor, exponents: ExponentFn, feature_dim: int, *,
              key_padding_mask: Tensor | None = None, state: RecurrentState | None = None,
              slice_elements: int = 1 << 20) -> RecurrentState:
    """Non-causal: [S, z] = Σ_j exp(u_k(j) - o) [v_j, 1]^T with o_f the max of feature f over
    the keys (and the incoming state's scale): k (B, H, M, D), v (B, H, M, Dv) -> a state with
    per-feature log-scales o (B, H, F, 1). Slice by slice of the keys, the state rescaled per
    feature between them, each slice recomputed in the backward: the forward saves no M x F
    tensor."""
    from effattn.kernelized import exponents_gpu

    slice_elements = exponents_gpu.slice_budget(slice_elements, k)
    b, h, m = k.shape[:3]
    state = _state(state, b, h, feature_dim, v.shape[-1], v)
    kv, scale = state.kv, state.log_scale
    step = _slice_tokens(b, h, feature_dim, slice_elements)
    for a in range(0, m, step):
        z = min(m, a + step)
        args = (k[:, :, a:z], v[:, :, a:z],
                None if key_padding_mask is None else key_padding_mask[:, a:z], kv, scale,
                exponents)
        if torch.is_grad_enabled():
            kv, scale = checkpoint(_key_state, *args, use_reentrant=False)
        else:
            kv, scale = _key_state(*args)
    return RecurrentState(kv, scale, state.position + m)


def _read(u_q: Tensor, kv: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    shifted = u_q + scale.transpose(-2, -1)
    top = shifted.detach().amax(-1, keepdim=True)
    return shifted.sub_(top).exp_() @ kv, top


def read_normalised(state: RecurrentState, u_q: Tensor,
                    normaliser: bool = True) -> tuple[Tensor, Normaliser | None]:
    """Queries' exponents u_q (B, H, N, F) read out of a per-feature ``state``: the output
    (B, H, N, Dv) and (when asked) its normaliser Σ_j φ(q_i)·φ(k_j) at the true scale."""
    out, log_abs, sign = _finish(*_read(u_q, state.kv, state.log_scale), normaliser)
    return out, None if log_abs is None or sign is None else Normaliser(log_abs, sign)


def _read_queries(q: Tensor, kv: Tensor, scale: Tensor, exponents: ExponentFn) -> Tensor:
    return _finish(*_read(exponents(q), kv, scale), False)[0]


def against(u: Tensor, scale: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor | None]:
    """Exponents u (B, H, L, F) as features in the row core's convention, against the
    per-feature scale o (B, H, F, 1) of a state that holds the keys: keys exp(u - o) (<= 1 for
    every key the state holds; clamped at 1 for others, e.g. padding rows), queries
    exp(u + o - c) with their log-scale c = max_f (u + o). Then φ̃(q)·φ̃(k) e^c = φ(q)·φ(k),
    and φ̃(q) times the state's kv reads it at scale e^c (the window hybrid's band uses both)."""
    offset = scale.transpose(-2, -1)  # (B, H, 1, F)
    if not is_query:
        return torch.sub(u, offset).clamp_max_(0.0).exp_(), None
    shifted = u + offset
    top = shifted.detach().amax(-1, keepdim=True)
    return shifted.sub_(top).exp_(), top


def read_queries(q: Tensor, state: RecurrentState, exponents: ExponentFn, *,
                 slice_elements: int = 1 << 20) -> Tensor:
    """Non-causal read-out: q (B, H, N, D) -> (B, H, N, Dv), slice by slice of the queries,
    each recomputed in the backward (no N x F tensor saved)."""
    from effattn.kernelized import exponents_gpu

    slice_elements = exponents_gpu.slice_budget(slice_elements, q)
    b, h, n = q.shape[:3]
    step = _slice_tokens(b, h, state.kv.shape[2], slice_elements)
    outs = []
    for a in range(0, n, step):
        args = (q[:, :, a:a + step], state.kv, state.log_scale, exponents)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_read_queries, *args, use_reentrant=False))
        else:
            outs.append(_read_queries(*args))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def step_state(state: RecurrentState | None, u_k: Tensor, v: Tensor) -> RecurrentState:
    """One decoding step: u_k (B, H, 1, F), v (B, H, 1, Dv) into ``state``, in place unless
    autograd records.

    As the row core's step, the scale is updated lazily: the key enters at
    exp(u_k - scale) <= e^RESCALE_MARGIN, and the state's rows are rescaled (a pass over the
    state) only when a key would exceed that: the read-out shifts each query by its own largest
    term, so a state held up to e^20 below its running max is as exact. On the CPU the check is
    a branch; on a GPU, or compiled, a rescale by exp(0) = 1 where no key exceeds it (no host
    sync per token)."""
    b, h, _, f = u_k.shape
    state = _state(state, b, h, f, v.shape[-1], u_k)
    kv, scale = state.kv, state.log_scale
    key = u_k.transpose(-2, -1)  # (B, H, F, 1)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (u_k, v, kv))
    compiling = torch.compiler.is_compiling()
    in_place = not (recording or compiling or (
        kv.is_inference() and not torch.is_inference_mode_enabled()))
    with torch.no_grad():
        exceeds = key - scale > RESCALE_MARGIN
    branch_free = compiling or strategy.choose("kernelized", kv.device) != "cpu"
    if branch_free or bool(exceeds.any()):
        with torch.no_grad():
            new = torch.where(exceeds, torch.maximum(scale, key), scale)
        decay = torch.exp(scale - new)
        kv, scale = (kv.mul_(decay) if in_place else kv * decay), new
    update = (torch.exp(key - scale), with_ones(v))
    kv = kv.addcmul_(*update) if in_place else torch.addcmul(kv, *update)
    return RecurrentState(kv, scale, state.position + 1)


def step(q: Tensor, k: Tensor, v: Tensor, state: RecurrentState | None,
         exponents: ExponentFn) -> tuple[Tensor, RecurrentState]:
    """q, k (B, H, 1, D), v (B, H, 1, Dv): the decoded output (B, H, 1, Dv) and the state."""
    state = step_state(state, exponents(k), v)
    return read_normalised(state, exponents(q), normaliser=False)[0], state


def _prefix_max(x: Tensor) -> Tensor:
    """Running max along the chunk's tokens of x (B, H, nc, C, F), by log2(C) doubling steps
    (ATen's cummax along a strided dim is several times slower)."""
    shift = 1
    while shift < x.shape[-2]:
        x = torch.maximum(x, F.pad(x[..., :-shift, :], (0, 0, shift, 0), value=float("-inf")))
        shift *= 2
    return x


def _causal_slice(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor,
                  scale: Tensor, exponents: ExponentFn, chunk: int,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One slice of n tokens of the causal form, from the state (kv, scale) before it: the
    output (B, H, n, Dv), its normaliser's log and sign (B, H, n), and the state after it."""
    b, h, n = q.shape[:3]
    u_q = exponents(q)
    u_k = _padded(exponents(k), pad)
    v1 = with_ones(v)
    tail = -n % chunk
    if tail:  # keys that are not there: exp(-inf) = 0, and the running max stays
        u_q = torch.cat([u_q, u_q.new_zeros(b, h, tail, u_q.shape[-1])], 2)
        u_k = torch.cat([u_k, u_k.new_full((b, h, tail, u_k.shape[-1]), float("-inf"))], 2)
        v1 = torch.cat([v1, v1.new_zeros(b, h, tail, v1.shape[-1])], 2)
    # (B, H, nc, C, ·): the (B, H, nc) batch of every GEMM below is one contiguous stride.
    uq_c, uk_c, v_c = (x.unflatten(2, (-1, chunk)) for x in (u_q, u_k, v1))
    with torch.no_grad():
        ends = torch.cummax(uk_c.amax(-2), 2).values  # (B, H, nc, F)
        first = scale.transpose(-2, -1)  # (B, H, 1, F)
        end = torch.maximum(ends, first).clamp_min(LOG_FLOOR)  # R_c
        before = torch.cat([first, end[:, :, :-1]], 2)[..., None, :]  # R_{c-1} (B, H, nc, 1, F)
        end = end[..., None, :]
        # The shift of query i: the log of its largest term, here over the state and its own
        # key. The keys between the chunk's start and i can raise the true one, by at most
        # R_c - max(R_{c-1}, the chunk's smallest key), per feature: below FP32_GROWTH the
        # chunk's products fit fp32; above, the exact shift and float64.
        top = (uq_c + torch.maximum(before, uk_c)).amax(-1, keepdim=True)
        # A compiled graph takes the float64 products rather than a host sync.
        wide = (torch.compiler.is_compiling()
                or bool((end - torch.maximum(before, uk_c.amin(-2, keepdim=True))).amax()
                        > FP32_GROWTH))
        if wide:  # the running max of each feature up to i
            top = (uq_c + torch.maximum(before, _prefix_max(uk_c))).amax(-1, keepdim=True)
    # Each chunk's keys at the chunk's end scale: (B, H, nc, F, Dv + 1), every factor <= 1.
    keys = torch.sub(uk_c, end).exp_()
    delta = keys.transpose(-2, -1) @ v_c
    decay = torch.exp(before - end).transpose(-2, -1)  # (B, H, nc, F, 1), <= 1
    shifted = uq_c - top
    queries = torch.add(shifted, before).exp_()
    # Each chunk reads the state entering it, then updates it: the per-chunk states are never
    # stacked (F / C times the size of the outputs).
    reads = []
    for q_c, delta_c, decay_c in zip(queries.unbind(2), delta.unbind(2), decay.unbind(2),
                                     strict=True):
        reads.append(q_c @ kv)
        kv = torch.addcmul(delta_c, kv, decay_c)
    inter = torch.stack(reads, 2)
    # Inside the chunk (see the module's docstring): exp(u_q + R_c - top) can exceed 1.
    if wide:
        wide_end = end.double()
        q_f = (shifted.double() + wide_end).clamp_max_(GROWTH_LIMIT).exp_()
        k_f = (uk_c.double() - wide_end).exp_()
    else:
        q_f = torch.add(shifted, end).exp_()
        k_f = keys
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril_()
    scores = torch.where(causal, q_f @ k_f.transpose(-2, -1), 0.0).to(v_c.dtype)
    raw = (inter + scores @ v_c).flatten(2, 3)[:, :, :n]
    return (*_finish(raw, top.flatten(2, 3)[:, :, :n]), kv, end[:, :, -1].transpose(-2, -1))


def causal(q: Tensor, k: Tensor, v: Tensor, exponents: ExponentFn, feature_dim: int,
           state: RecurrentState | None = None, *, key_padding_mask: Tensor | None = None,
           chunk_size: int = 32, slice_elements: int = 1 << 20, normaliser: bool = False,
           lag: int = 0) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """Causal linear attention of φ = exp(u) with the per-feature stabiliser (module
    docstring): q, k (B, H, N, D), v (B, H, N, Dv), from ``state`` (or empty) -> the output
    (B, H, N, Dv), the state after the last token and, with ``normaliser``, the queries'
    normalisers. Slices of about ``slice_elements`` feature values run one after the other,
    each recomputed in the backward when autograd records. ``lag`` > 0: query i sees keys
    j <= i - lag, as the row core's lagged form (queries lag.. against keys ..N-1-lag, as
    views; the first ``lag`` queries see no key; no entering state)."""
    if strategy.choose("kernelized", q.device) == "gpu":
        from effattn.kernelized import exponents_gpu

        return exponents_gpu.causal(q, k, v, exponents, feature_dim, state,
                                    key_padding_mask=key_padding_mask, chunk_size=chunk_size,
                                    slice_elements=slice_elements, normaliser=normaliser,
                                    lag=lag)
    b, h, n = q.shape[:3]
    if k.shape[2] != n:
        raise ValueError(f"causal needs N == M, got {n} and {k.shape[2]}")
    if lag:
        def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                _: Tensor | None) -> tuple[Tensor, RecurrentState, Normaliser | None]:
            return causal(q, k, v, exponents, feature_dim, key_padding_mask=mask,
                          chunk_size=chunk_size, slice_elements=slice_elements,
                          normaliser=normaliser)

        return lagged(run, q, k, v, key_padding_mask, None, state, lag, normaliser,
                      lambda: _state(None, b, h, feature_dim, v.shape[-1], v))
    f = feature_dim
    state = _state(state, b, h, f, v.shape[-1], v)
    kv, scale = state.kv, state.log_scale
    step = _slice_tokens(b, h, f, slice_elements, chunk_size)
    recording = torch.is_grad_enabled()
    parts = []
    for a in range(0, n, step):
        z = min(n, a + step)
        pad = None if key_padding_mask is None else key_padding_mask[:, a:z]
        args = (q[:, :, a:z], k[:, :, a:z], v[:, :, a:z], pad, kv, scale, exponents,
                chunk_size)
        if recording:
            *part, kv, scale = checkpoint(_causal_slice, *args, use_reentrant=False)
        else:
            *part, kv, scale = _causal_slice(*args)
        parts.append(part)
    out, log_abs, sign = parts[0] if len(parts) == 1 else (torch.cat(p, 2)
                                                           for p in zip(*parts, strict=True))
    norm = Normaliser(log_abs, sign) if normaliser else None
    return out, RecurrentState(kv, scale, state.position + n), norm


def attention(q: Tensor, k: Tensor, v: Tensor, exponents: ExponentFn, feature_dim: int, *,
              is_causal: bool,
              key_padding_mask: Tensor | None = None, chunk_size: int = 32,
              slice_elements: int = 1 << 20) -> Tensor:
    """Causal or non-causal attention (the core's ``attention`` for exponent maps)."""
    if is_causal:
        return causal(q, k, v, exponents, feature_dim, key_padding_mask=key_padding_mask,
                      chunk_size=chunk_size, slice_elements=slice_elements)[0]
    state = key_state(k, v, exponents, feature_dim, key_padding_mask=key_padding_mask,
                      slice_elements=slice_elements)
    return read_queries(q, state, exponents, slice_elements=slice_elements)
