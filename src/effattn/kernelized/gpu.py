"""The GPU strategy of the kernelized engine: chunk-parallel, a few large batched GEMMs per call.

The CPU strategy (:mod:`effattn.kernelized.cpu`) walks long sequences in cache-sized slices and
the chunks of a slice in a Python loop: right for a few cores with a cache, thousands of tiny
kernel launches on a GPU. This strategy computes the same sums under the same conventions
(:class:`~effattn.kernelized.core.RecurrentState` with z the last column of [V, 1], the key
log-scales' stabiliser, the eps floor of the divisor, the lost-row check) with a fixed number
of launches per device-sized slice (a few slices at N = 65536, one up to tens of thousands of
tokens), not per chunk:

- non-causal (and a decoder's cross-attention memory): the keys in one GEMM, φ(K)^T [V, 1],
  and the queries in one, φ(Q) [S, z], per device-sized slice (the whole sequence up to tens
  of thousands of tokens): the core's recomputing functions (:func:`key_state`,
  :func:`read_queries`);
- causal (the chunk-parallel form of linear attention; Yang et al. 2024, "Gated Linear Attention
  Transformers with Hardware-Efficient Training", section 3): each slice of n tokens in
  nc = ceil(n / C) chunks of C = ``chunk_size`` tokens, chunk-major (nc, B, H, C, ·) as in the
  CPU strategy, and

      ΔS_c   = φ(K_c)^T U_c                       all chunks by one batched GEMM, (nc, B, H, F, E)
      S_c    = Σ_{c' < c} T_{c,c'} ΔS_{c'} + t_c S_in  an exclusive decayed prefix sum over chunks
      o_c    = (φ(Q_c) S_c) ⊙ ω_c + ((φ(Q_c) φ(K_c)^T) ⊙ W_c) V'_c

  with E = Dv + 1 and the per-token factors (U, ω, W, V') of the CPU strategy's
  :func:`~effattn.kernelized.chunkwise._factors` (the stabiliser and the gate folded into one log
  weight a with every exp(a_i - a_j) <= 1). The decays between chunks come from the same
  running max R_c of the chunks' key log-scales r_c and the chunks' total log-gates d_c:

      T_{c,c'} = exp(r_{c'} - R_c + Σ_{c' < l < c} d_l)  (c' < c),
      t_c      = exp(R_0 - R_c + Σ_{l < c} d_l)

  every exponent <= 0: nothing overflows, no future key sets a scale, and no partial sums are
  subtracted. The sums of log-gates are formed in float64 (nc values per (B, H)): as
  differences of prefix sums over up to N log-gates, they would lose ~ε N of their precision
  in fp32. Without log-scales, padding or a gate (elu + 1, relu, Taylor maps), every T and t
  is 1 and the prefix sum is a plain cumulative sum over the chunk axis.

Cost per (B, H) of a slice of n tokens, nc = n / C chunks: 2 n C (F + E) flops inside the
chunks, 2 n F E for the chunk states and as much for their read-out, plus, with a decay,
about 4 nc^1.5 F E for the prefix (:func:`decayed_prefix`, two levels of GEMMs over the chunk
axis; a plain cumsum, O(nc F E), without one). The states (nc, F, E) are held in the compute
dtype (fp32 for half-precision inputs): (n / C) F E values, as large as φ(K) when E ~ C.

``chunk_size`` means the same C on both strategies (the results agree to rounding): the length
of the blocks whose masked C x C product is formed exactly, and the spacing of the states. On
the GPU strategy a larger C trades intra-chunk flops (linear in C) for state memory (~ 1 / C)
and, with a decay, the prefix (~ C^-1.5); which C is fastest on which GPU is not yet measured
(docs/gpu.md).

Memory: the causal form runs in slices of S tokens (:func:`slice_tokens`, ``SLICE_SCALE``
times the CPU strategy's: thousands of chunks each), each chunk-parallel, each handing its
state to the next, so that φ of S tokens and the S / C chunk states of one slice are alive at
a time, at any N. Training: :class:`_ChunkParallel` keeps q, k, v, the gate, the mask, the
state entering each slice (and the feature map's tensors, whose in-place redraw between
forward and backward then raises), not φ(Q), φ(K) or the chunk states: its backward
recomputes one slice at a time under autograd and backpropagates (the trade of
FlashAttention, Dao et al. 2022), so that between a layer's forward and backward only its
inputs, output and (N / S) states stay alive, and the backward holds one slice's graph.

Decoding (``step_state``) is shared with the CPU strategy; on this strategy it takes its
branch-free form (a rescale by exp(0) = 1 unless a key exceeds the margin), which reads no
flag back to the host on every token.

Shapes: B batch, H heads, N tokens, D head dim, F features, Dv value dim, E = Dv + 1,
C chunk, nc chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn.kernelized import chunkwise, core
from effattn.kernelized.core import (
    FeatureFn,
    Normaliser,
    RecurrentState,
)

# A slice of the GPU strategy holds about SLICE_SCALE times the CPU strategy's values (64 Mi,
# 256 MiB in fp32, at the default slice_elements): the whole sequence up to tens of thousands
# of tokens, thousands of chunks per causal slice, so a few launches more per call at most,
# while the memory of the forward and of each slice's recomputed backward stays bounded at any
# N.
SLICE_SCALE = 64


def key_state(k: Tensor, v: Tensor, features: FeatureFn, *, feature_dim: int,
              key_padding_mask: Tensor | None, slice_elements: int,
              feature_tensors: Sequence[Tensor] | None) -> RecurrentState:
    """[S, z] = φ(K)^T [V, 1] of all keys k (B, H, M, D), v (B, H, M, Dv), a GEMM per
    device-sized slice (:func:`effattn.kernelized.core.key_state`'s contract)."""
    step = core.slice_tokens(k.shape[0] * k.shape[1], feature_dim, 1,
                             slice_elements * SLICE_SCALE)
    return core.key_state_in_slices(k, v, features, key_padding_mask, feature_tensors, step,
                                    step)


def read_queries(q: Tensor, state: RecurrentState, features: FeatureFn, *, feature_dim: int,
                 eps: float, slice_elements: int,
                 feature_tensors: Sequence[Tensor] | None) -> Tensor:
    """Queries q (B, H, N, D) against a finished key state, a GEMM per device-sized slice:
    (B, H, N, Dv) (:func:`effattn.kernelized.core.read_queries`'s contract)."""
    step = core.slice_tokens(q.shape[0] * q.shape[1], feature_dim, 1,
                             slice_elements * SLICE_SCALE)
    return core.read_queries_in_slices(q, state, features, eps, feature_tensors, step, step)


def causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: FeatureFn,
    state: RecurrentState | None,
    *,
    feature_dim: int,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk_size: int,
    eps: float,
    slice_elements: int,
    feature_tensors: Sequence[Tensor] | None,
    normaliser: bool,
) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """Causal kernelized attention of q, k (B, H, N, D), v (B, H, N, Dv) after ``state``:
    the output (B, H, N, Dv), the state after and, with ``normaliser``, each query's
    :class:`~effattn.kernelized.core.Normaliser` (the contract of
    :func:`effattn.kernelized.core.kernelized_causal` and its ``_normalised`` form), in
    slices of :func:`slice_tokens` tokens, each chunk-parallel.

    Raises :class:`~effattn.kernelized.core.DenominatorUnderflowError` (eager, one host sync
    per call) where a query that sees keys gets a zero or subnormal denominator.
    """
    b, h, n = q.shape[:3]
    step = slice_tokens(b * h, feature_dim, v.shape[-1], chunk_size, slice_elements)
    position = 0 if state is None else state.position
    if core._recording():
        tensors = core._feature_inputs(features, q, True, feature_tensors)
        if feature_tensors is None:
            tensors = core._unique(tensors + core._feature_inputs(features, k, False, None))
        if core._needs_grad(q, k, v, gate, None if state is None else state.kv, *tensors):
            kv, scale = (None, None) if state is None else (state.kv, state.log_scale)
            out, kv, scale, log_abs, sign = _ChunkParallel.apply(
                q, k, v, gate, key_padding_mask, kv, scale, features, chunk_size, eps, step,
                normaliser, *tensors,
            )
            return (out, RecurrentState(kv, scale, position + n),
                    Normaliser(log_abs, sign) if normaliser else None)
    out, state, norm = _sliced(q, k, v, gate, key_padding_mask, state, features, chunk_size, eps,
                               step, normaliser, None)
    return out, state, norm


def slice_tokens(batch_heads: int, feature_dim: int, value_dim: int, chunk_size: int,
                 slice_elements: int) -> int:
    """Tokens per causal slice of the GPU strategy, a multiple of the chunk: ``SLICE_SCALE``
    times the CPU strategy's budget (:func:`effattn.kernelized.core.causal_slice_tokens`)."""
    return core.causal_slice_tokens(batch_heads, feature_dim, value_dim, chunk_size,
                                    slice_elements * SLICE_SCALE)


def _sliced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor | None,
    key_padding_mask: Tensor | None,
    state: RecurrentState | None,
    features: FeatureFn,
    chunk: int,
    eps: float,
    step: int,
    normaliser: bool,
    entering: list[RecurrentState | None] | None,
) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """:func:`_forward` slice after slice of ``step`` tokens, each handing its state to the
    next; ``entering`` (a list), when given, receives the state entering each slice. Raises
    on lost rows after the last slice (one host sync)."""
    outs, norms, lost = [], [], []
    for a, e in core._spans(q.shape[2], step):
        if entering is not None:
            entering.append(state)
        out, state, norm, flag = _forward(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None if gate is None else gate[:, :, a:e],
            None if key_padding_mask is None else key_padding_mask[:, a:e], state, features,
            chunk, eps, normaliser,
        )
        outs.append(out)
        norms.append(norm)
        lost.append(flag)
    core._raise_if_lost(lost, q.dtype)
    norm = None
    if normaliser:
        norm = Normaliser(torch.cat([x.log_abs for x in norms], 2),
                          torch.cat([x.sign for x in norms], 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2), state, norm


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor | None,
    key_padding_mask: Tensor | None,
    state: RecurrentState | None,
    features: FeatureFn,
    chunk: int,
    eps: float,
    normaliser: bool,
) -> tuple[Tensor, RecurrentState, Normaliser | None, Tensor | None]:
    """The causal forward, differentiable where autograd records: output (B, H, N, Dv), the
    state after, the normaliser (``normaliser``: else None) and the lost-row flag (a 0-d bool
    tensor, read by the caller; None: not checked)."""
    b, h, n = q.shape[:3]
    phi_q, query_log_scale = chunkwise._chunk_features(features, q, chunk, True)
    phi_k, key_log_scale = chunkwise._chunk_features(features, k, chunk, False)
    core._check_shapes(phi_q, phi_k, None, key_log_scale)
    state = core._state_of(state, b, h, phi_k.shape[-1], v.shape[-1], phi_k)
    raw, out_scale, state = chunk_parallel(phi_q, phi_k, key_log_scale, v, state,
                                           key_padding_mask, gate, chunk)
    raw, out_scale = chunkwise._from_chunks(raw, n), chunkwise._from_chunks(out_scale, n)
    norm = None
    if normaliser:
        norm = Normaliser(*core._normaliser(
            raw[..., -1:], eps, out_scale,
            None if query_log_scale is None else chunkwise._from_chunks(query_log_scale, n),
        ))
    # A gate can decay what a query sees to a legitimate 0: only ungated rows are checked.
    lost = None if gate is not None else core._lost_rows(raw, eps, out_scale)
    return core._ratio(raw, eps, out_scale), state, norm, lost


def chunk_parallel(
    phi_q: Tensor,
    phi_k: Tensor,
    key_log_scale: Tensor | None,
    v: Tensor,
    state: RecurrentState,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk: int,
) -> tuple[Tensor, Tensor, RecurrentState]:
    """Causal attention of n tokens after ``state`` in the chunk-parallel form (module
    docstring), from chunk-major φ(Q), φ(K) (nc, B, H, C, F), key log-scales (nc, B, H, C, 1)
    or None, v (B, H, n, Dv), the padding mask (B, n) and the gate (B, H, n).

    Returns [num, den] (nc, B, H, C, Dv + 1) at log-scale m (nc, B, H, C, 1), chunk-major,
    and the state after: what the CPU strategy's ``_causal_group`` returns, without its loop.
    """
    fac = chunkwise._factors(v, key_log_scale, key_padding_mask, gate, chunk)
    chunk_max = fac.prefix[..., -1, 0]
    chunk_decay = None if fac.cum is None else fac.cum[..., -1]
    running, _, _ = chunkwise._scan_factors(state.log_scale, chunk_max, chunk_decay)
    inter, _, common = chunkwise._out_weights(fac, running)
    scores = phi_q @ phi_k.transpose(-1, -2)  # (nc, B, H, C, C)
    k_t = phi_k.transpose(-1, -2)
    if fac.log_weight is None:
        # Every key at scale 0, the entering state at 0 or empty (see cpu._causal_group):
        # T = t = 1, and ω multiplies zeros where it is not 1.
        states = torch.cat([state.kv[None].to(phi_k.dtype), k_t @ fac.v]).cumsum(0)
        before, after = states[:-1], states[-1]
        out = phi_q @ before + scores.tril() @ fac.v
    else:
        weight = chunkwise._intra_weights(fac.log_weight, (fac.prefix - common)[..., 0])
        deltas = k_t @ (fac.v * chunkwise._to_end(fac.log_weight))
        before, after = decayed_prefix(state.kv.to(phi_k.dtype), deltas, running, chunk_max,
                                       chunk_decay)
        out = (phi_q @ before) * inter + (scores * weight) @ fac.v
    position = state.position + v.shape[2]
    return out, common, RecurrentState(after, running[-1, ..., None, None], position)


def decayed_prefix(kv: Tensor, deltas: Tensor, running: Tensor, chunk_max: Tensor,
                   chunk_decay: Tensor | None) -> tuple[Tensor, Tensor]:
    """The states S_c before each chunk (nc, B, H, F, E) and the state after the last
    (B, H, F, E), from the entering state kv (B, H, F, E) at scale R_0, the chunks' deltas ΔS_c
    (nc, B, H, F, E) each at its chunk's scale r_c (``chunk_max`` (nc, B, H)), the running
    scales R_0..R_nc (``running`` (nc + 1, B, H)) and the chunks' total log-gates d_c
    (nc, B, H) or None:

        S_c = Σ_{c' < c} exp(w(c, c')) ΔS_{c'} + exp(w_in(c)) S_in,
        w(c, c') = r_{c'} - R_c + Σ_{c' < l < c} d_l,   w_in(c) = R_0 - R_c + Σ_{l < c} d_l,

    the unrolled recurrence S_{c+1} = keep_c S_c + enter_c ΔS_c of the CPU strategy's
    ``_scan_factors``. In two levels, so that the work is 2 nc^1.5 F E rather than one
    (nc + 1) x nc GEMM's nc² F E: the chunks in blocks of m = ⌈√nc⌉, the states at the blocks'
    starts (and after the last chunk) by one (nc / m + 1) x nc GEMM over the chunk axis, and
    each chunk's state as its block's starting state moved to it, exp(w_in(c) - w_in(bm)),
    plus the deltas of the earlier chunks of its block, by an m x m GEMM per block. Every
    weight is <= 1.
    """
    nc = deltas.shape[0]
    m = math.ceil(math.sqrt(nc))
    nb = -(-nc // m)
    cum = None
    if chunk_decay is not None:
        # G_c = Σ_{l < c} d_l in float64 (module docstring); the gate's gradient flows through.
        cum = torch.cat([chunk_decay.new_zeros(1, *chunk_decay.shape[1:], dtype=torch.float64),
                         chunk_decay.to(torch.float64).cumsum(0)])

    def log_weight(rows: Tensor, cols: Tensor) -> Tensor:
        """w(c, c') for rows c and columns c' of any broadcastable index shapes (clamped into
        range where padded: such rows are dropped, such columns carry zero deltas), -inf where
        c' >= c: (*shape, B, H)."""
        c, c_ = rows.clamp_max(nc), cols.clamp_max(nc - 1)
        w = chunk_max[c_] - running[c]
        if cum is not None:
            w = w + (cum[c] - cum[c_ + 1]).to(w.dtype)
        return w.masked_fill((cols >= rows)[..., None, None], float("-inf"))

    def log_move(rows: Tensor, starts: Tensor) -> Tensor:
        """w_in(c) - w_in(s) = R_s - R_c + Σ_{s <= l < c} d_l for rows c and starts s (clamped
        into range), formed without R_0 (LOG_FLOOR for an empty state, whose difference would
        cancel): (*shape, B, H)."""
        c, s = rows.clamp_max(nc), starts.clamp_max(nc)
        w = running[s] - running[c]
        return w if cum is None else w + (cum[c] - cum[s]).to(w.dtype)

    index = torch.arange(nb * m, device=deltas.device)
    starts = torch.cat([index[::m], index.new_full((1,), nc)])  # bm for each block, and nc
    at_starts = torch.einsum("idbh,dbhfe->ibhfe", torch.exp(log_weight(starts[:, None],
                                                                         index[None, :nc])),
                             deltas) + torch.exp(log_move(starts, starts[:1]))[..., None, None] * kv
    blocks = index.view(nb, m)
    padded = torch.cat([deltas, deltas.new_zeros(nb * m - nc, *deltas.shape[1:])])
    inner = torch.einsum("kijbh,kjbhfe->kibhfe",
                         torch.exp(log_weight(blocks[:, :, None], blocks[:, None, :])),
                         padded.view(nb, m, *deltas.shape[1:]))
    moved = torch.exp(log_move(blocks, blocks[:, :1]))[..., None, None]
    before = (inner + moved * at_starts[:-1, None]).flatten(0, 1)[:nc]
    return before, at_starts[-1]


class _ChunkParallel(torch.autograd.Function):
    """:func:`causal` keeping q, k, v, the gate, the mask, the state entering each slice
    ((N / S) F (Dv + 1)) and the feature map's tensors: O(N (D + Dv)) between forward and
    backward, not the features' O(N F) or the chunk states' O((N / C) F (Dv + 1)).

    Backward, slice by slice from the last: :func:`_forward` of the slice again under autograd,
    from its saved inputs and entering state, then its vector-Jacobian product for the output,
    the state after (the gradient coming from the next slice) and (hybrid) the normaliser's
    log |d|; the entering state's gradient goes on to the previous slice. Memory: one slice's
    autograd graph at a time. Cost: one more forward.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None,
                key_padding_mask: Tensor | None, kv: Tensor | None, log_scale: Tensor | None,
                features: FeatureFn, chunk: int, eps: float, step: int, normaliser: bool,
                *tensors: Tensor) -> tuple[Tensor, ...]:
        entering: list[RecurrentState | None] = []
        out, state, norm = _sliced(
            q, k, v, gate, key_padding_mask, None if kv is None else RecurrentState(kv, log_scale),
            features, chunk, eps, step, normaliser, entering,
        )
        ctx.features, ctx.chunk, ctx.eps, ctx.step = features, chunk, eps, step
        ctx.normaliser, ctx.slices = normaliser, len(entering)
        states = [t for s in entering for t in ((None, None) if s is None else (s.kv, s.log_scale))]
        ctx.save_for_backward(q, k, v, gate, key_padding_mask, *states, *tensors)
        if norm is None:
            norm = Normaliser(out.new_empty(0), out.new_empty(0))
        ctx.mark_non_differentiable(state.log_scale, norm.sign)
        return out, state.kv, state.log_scale, norm.log_abs, norm.sign

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_kv: Tensor | None, _: Tensor | None,
                 d_log_abs: Tensor | None, __: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, gate, pad, *rest = ctx.saved_tensors
        states, tensors = rest[:2 * ctx.slices], rest[2 * ctx.slices:]
        needs = ctx.needs_input_grad
        full = (q, k, v, gate)
        grads = [torch.empty_like(t) if t is not None and need else None
                 for t, need in zip(full, needs[:4], strict=True)]
        d_tensors: list[Tensor | None] = [None] * len(tensors)
        spans = core._spans(q.shape[2], ctx.step)
        for i in range(len(spans) - 1, -1, -1):
            a, e = spans[i]
            parts = [core._leaf(None if t is None else t[:, :, a:e], need)
                     for t, need in zip(full, needs[:4], strict=True)]
            kv, log_scale = states[2 * i], states[2 * i + 1]
            # The entering state needs its gradient for the slice before, or for the caller.
            kv = core._leaf(kv, i > 0 or needs[5])
            with torch.enable_grad():
                out, state, norm, _ = _forward(
                    *parts, None if pad is None else pad[:, a:e],
                    None if kv is None else RecurrentState(kv, log_scale), ctx.features,
                    ctx.chunk, ctx.eps, ctx.normaliser,
                )
            leaves = [*parts, kv]
            got = iter(core._backprop(
                (out, state.kv, None if norm is None else norm.log_abs),
                (d_out[:, :, a:e], d_kv,
                 None if d_log_abs is None or norm is None else d_log_abs[:, :, a:e]),
                [t for t in (*leaves, *tensors) if t is not None],
            ))
            part_grads = [None if t is None else next(got) for t in leaves]
            for total, part in zip(grads, part_grads[:4], strict=True):
                core._put(total, a, e, part)
            d_kv = part_grads[4]
            d_tensors = [core._add(t, g) for t, g in zip(d_tensors, got, strict=True)]
        return (*grads, None, d_kv if needs[5] else None, None, None, None, None, None, None,
                *d_tensors)
