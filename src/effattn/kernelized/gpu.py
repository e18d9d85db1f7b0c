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
  nc >= ceil(n / C) chunks of C = ``chunk_size`` tokens (rounded up to whole blocks of the
  prefix below; the chunks after n are empty), indexed chunk-major (nc, B, H, C, ·) as in the
  CPU strategy but stored head-major (B, H, nc, C, ·): φ is the map of the (B, H, n, D) input
  itself, unflattened, and every GEMM batches over (B, H, nc) in storage order (:func:`_matmul`),
  so that neither φ nor the chunk states are ever copied into another layout, and

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
a time, at any N: at the peak of a slice, φ(Q), φ(K), the deltas and the states, nothing
copied. Training: :class:`_ChunkParallel` keeps q, k, v, the gate, the mask, a checkpoint
state every S_b tokens (and the feature map's tensors, whose in-place redraw between forward
and backward then raises), not φ(Q), φ(K) or the chunk states (the trade of FlashAttention,
Dao et al. 2022): between a layer's forward and backward only its inputs, output and
(N / S_b) states stay alive. The checkpoints are chunk states the forward forms anyway, so the
backward's spans S_b (:func:`backward_slice_tokens`, ``BACKWARD_SLICE_SCALE``) can be shorter
than the forward's slices at no cost to the forward. The backward of a span is written out
(:func:`_span_backward`): φ and the per-token factors recomputed under autograd, the
chunk-parallel part and its adjoint recurrence (:func:`decayed_suffix`) without it, so that it
holds at most two state tensors of the span at once (three with a gate), not an autograd
graph of the span. Accounted on the CPU (``benchmarks/strategy_memory.py``: live tensor bytes,
the storages a GPU would allocate), half-slice spans make a training call's peak that of an
inference forward; spans as long as the slices cost ~1.6x that and ~30% fewer launches in the
backward. Which side of that trade is faster on a GPU is not yet measured.

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
# Its callers promote half-precision inputs (core.promotes_inside).
PROMOTES_INSIDE = False
# The backward recomputes spans of BACKWARD_SLICE_SCALE times the CPU strategy's causal budget,
# half a forward slice: a training call then holds no more than an inference forward
# (module docstring, Memory).
BACKWARD_SLICE_SCALE = 32


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
            back = backward_slice_tokens(b * h, feature_dim, v.shape[-1], chunk_size,
                                         slice_elements, step)
            out, kv, scale, log_abs, sign = _ChunkParallel.apply(
                q, k, v, gate, key_padding_mask, kv, scale, features, chunk_size, eps,
                (step, back), normaliser, *tensors,
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


def backward_slice_tokens(batch_heads: int, feature_dim: int, value_dim: int, chunk_size: int,
                          slice_elements: int, step: int) -> int:
    """Tokens per span of :class:`_ChunkParallel`'s backward, a multiple of the chunk and at most
    ``step`` (the forward's slice): the CPU strategy's causal budget times
    ``BACKWARD_SLICE_SCALE``, so that what the backward holds of one span stays within an
    inference forward's peak (module docstring, Memory)."""
    return min(step, core.causal_slice_tokens(batch_heads, feature_dim, value_dim, chunk_size,
                                              slice_elements * BACKWARD_SLICE_SCALE))


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
    back: int | None = None,
) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """:func:`_forward` slice after slice of ``step`` tokens, each handing its state to the
    next; ``entering`` (a list), when given, receives the state entering every ``back`` tokens
    (a multiple of the chunk; None: ``step``) of each slice, read off the chunk states the
    slice forms anyway (:func:`backward_spans` lists their spans). Raises on lost rows after
    the last slice (one host sync)."""
    outs, norms, lost = [], [], []
    every = None if entering is None else (back or step) // chunk
    for a, e in core._spans(q.shape[2], step):
        out, after, norm, flag, marks = _forward(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None if gate is None else gate[:, :, a:e],
            None if key_padding_mask is None else key_padding_mask[:, a:e], state, features,
            chunk, eps, normaliser, every,
        )
        if entering is not None:
            entering += [state, *marks]
        state = after
        outs.append(out)
        norms.append(norm)
        lost.append(flag)
    core._raise_if_lost(lost, q.dtype)
    norm = None
    if normaliser:
        norm = Normaliser(torch.cat([x.log_abs for x in norms], 2),
                          torch.cat([x.sign for x in norms], 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2), state, norm


def backward_spans(n: int, step: int, back: int) -> list[tuple[int, int]]:
    """The spans of ``back`` tokens inside each forward slice of ``step`` (the last of each
    shorter): the spans whose entering states :func:`_sliced` records."""
    return [(a, min(e, a + back)) for s, e in core._spans(n, step) for a in range(s, e, back)]


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
    every: int | None = None,
) -> tuple[Tensor, RecurrentState, Normaliser | None, Tensor | None, list[RecurrentState]]:
    """The causal forward, differentiable where autograd records: output (B, H, N, Dv), the
    state after, the normaliser (``normaliser``: else None), the lost-row flag (a 0-d bool
    tensor, read by the caller; None: not checked) and the states before chunks ``every``,
    2 ``every``, ... (None: no states)."""
    b, h, n = q.shape[:3]
    # nc rounded up to the two-level prefix's blocks: the chunks after n are empty (their keys
    # carry no value, weight or scale), and the states come out block-padded, uncopied.
    chunks = prefix_rows(-(-n // chunk))
    phi_q, query_log_scale = _chunk_features(features, q, chunk, chunks, True)
    phi_k, key_log_scale = _chunk_features(features, k, chunk, chunks, False)
    core._check_shapes(phi_q, phi_k, None, key_log_scale)
    state = core._state_of(state, b, h, phi_k.shape[-1], v.shape[-1], phi_k)
    raw, out_scale, state, marks = chunk_parallel(phi_q, phi_k, key_log_scale, v, state,
                                                  key_padding_mask, gate, chunk, every)
    raw, out_scale = chunkwise._from_chunks(raw, n), chunkwise._from_chunks(out_scale, n)
    norm = None
    if normaliser:
        norm = Normaliser(*core._normaliser(
            raw[..., -1:], eps, out_scale,
            None if query_log_scale is None else chunkwise._from_chunks(query_log_scale, n),
        ))
    # A gate can decay what a query sees to a legitimate 0: only ungated rows are checked.
    lost = None if gate is not None else core._lost_rows(raw, eps, out_scale)
    return core._ratio(raw, eps, out_scale), state, norm, lost, marks


def _chunk_features(features: FeatureFn, x: Tensor, chunk: int, chunks: int,
                    is_query: bool) -> tuple[Tensor, Tensor | None]:
    """φ of x (B, H, n, D) as chunk-major views (nc, B, H, C, F) of head-major storage
    (B, H, nc C, F), nc = ``chunks``, and the log-scales (nc, B, H, C, 1) or None. The map runs
    on x itself, its tail padded with copies of the last token (finite; no gradient returns
    through them), so that no chunk-major copy of x or φ is made: the GEMMs of
    :func:`_matmul` batch over (B, H, nc) in storage order."""
    b, h, n = x.shape[:3]
    tail = chunks * chunk - n
    if tail:
        x = torch.cat([x, x[:, :, -1:].expand(b, h, tail, x.shape[-1])], 2)
    phi, log_scale = features(x, is_query=is_query)

    def chunked(t: Tensor) -> Tensor:
        return t.unflatten(2, (chunks, chunk)).movedim(2, 0)

    return chunked(phi), None if log_scale is None else chunked(log_scale)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of chunk-major (nc, B, H, ·, ·) operands, batched in head-major order: no copy of
    an operand stored head-major (:func:`_chunk_features`), whose chunk-major batch would not
    fold into one GEMM batch; the product is stored head-major too."""
    return (a.movedim(0, 2) @ b.movedim(0, 2)).movedim(2, 0)


def chunk_parallel(
    phi_q: Tensor,
    phi_k: Tensor,
    key_log_scale: Tensor | None,
    v: Tensor,
    state: RecurrentState,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk: int,
    every: int | None = None,
) -> tuple[Tensor, Tensor, RecurrentState, list[RecurrentState]]:
    """Causal attention of n tokens after ``state`` in the chunk-parallel form (module
    docstring), from chunk-major φ(Q), φ(K) (nc, B, H, C, F) (nc >= ceil(n / C): the chunks
    after n are empty), key log-scales (nc, B, H, C, 1) or None, v (B, H, n, Dv), the padding
    mask (B, n) and the gate (B, H, n).

    Returns [num, den] (nc, B, H, C, Dv + 1) at log-scale m (nc, B, H, C, 1), chunk-major,
    the state after (what the CPU strategy's ``_causal_group`` returns, without its loop), and
    the states S_c before chunks c = ``every``, 2 ``every``, ... < nc at their scales R_c,
    copied out of the chunk states (none when ``every`` is None): the checkpoints from which
    :class:`_ChunkParallel`'s backward recomputes spans shorter than the slice.
    """
    fac = chunkwise._factors(v, key_log_scale, key_padding_mask, gate, chunk, phi_k.shape[0])
    chunk_max = fac.prefix[..., -1, 0]
    chunk_decay = None if fac.cum is None else fac.cum[..., -1]
    running, _, _ = chunkwise._scan_factors(state.log_scale, chunk_max, chunk_decay)
    inter, _, common = chunkwise._out_weights(fac, running)
    scores = _matmul(phi_q, phi_k.transpose(-1, -2))  # (nc, B, H, C, C)
    k_t = phi_k.transpose(-1, -2)
    kv = state.kv.to(phi_k.dtype)
    # In place only in eager without autograd. Recorded, mul_ would overwrite what the weight's
    # gradient reads. Compiled, functionalization turns the mutation back into a copy (the
    # compiler plans the buffers), and tril_ on this chunk-major view of a head-major GEMM
    # output does not trace: the view regenerated after it takes the copy's chunk-major strides,
    # and the next GEMM's view of it fails (torch 2.13, aot_eager and inductor alike).
    in_place = not (torch.is_grad_enabled() or torch.compiler.is_compiling())
    if fac.log_weight is None:
        # Every key at scale 0, the entering state at 0 or empty (see cpu._causal_group):
        # T = t = 1, and ω multiplies zeros where it is not 1.
        states = torch.cat([kv[:, :, None], _matmul(k_t, fac.v).movedim(0, 2)], 2).cumsum(2)
        before, after = states[:, :, :-1].movedim(2, 0), states[:, :, -1]
        masked = scores.tril_() if in_place else scores.tril()
        out = _matmul(phi_q, before) + _matmul(masked, fac.v)
    else:
        weight = chunkwise._intra_weights(fac.log_weight, (fac.prefix - common)[..., 0])
        before, after = decayed_prefix(
            kv, _matmul(k_t, fac.v * chunkwise._to_end(fac.log_weight)), running, chunk_max,
            chunk_decay,
        )
        weighted = scores.mul_(weight) if in_place else scores * weight
        out = _matmul(phi_q, before) * inter + _matmul(weighted, fac.v)
    position = state.position + v.shape[2]
    marks = []
    used = -(-v.shape[2] // chunk)  # the chunks holding tokens; those after are empty
    if every is not None and every < used:
        # Copies: a view would keep all nc states alive until the backward.
        chosen = before[every:used:every].clone()
        marks = [RecurrentState(s, running[c, ..., None, None], state.position + c * chunk)
                 for c, s in zip(range(every, used, every), chosen.unbind(0), strict=True)]
    return out, common, RecurrentState(after, running[-1, ..., None, None], position), marks


def decayed_prefix(kv: Tensor, deltas: Tensor, running: Tensor, chunk_max: Tensor,
                   chunk_decay: Tensor | None) -> tuple[Tensor, Tensor]:
    """The states S_c before each chunk (nc, *batch, F, E) and the state after the last
    (*batch, F, E), from the entering state kv (*batch, F, E) at scale R_0, the chunks' deltas
    ΔS_c (nc, *batch, F, E) each at its chunk's scale r_c (``chunk_max`` (nc, *batch)), the
    running scales R_0..R_nc (``running`` (nc + 1, *batch)) and the chunks' total log-gates
    d_c (nc, *batch) or None (batch: (B, H) for the GPU strategy):

        S_c = Σ_{c' < c} exp(w(c, c')) ΔS_{c'} + exp(w_in(c)) S_in,
        w(c, c') = r_{c'} - R_c + Σ_{c' < l < c} d_l,   w_in(c) = R_0 - R_c + Σ_{l < c} d_l,

    the unrolled recurrence S_{c+1} = keep_c S_c + enter_c ΔS_c of the CPU strategy's
    ``_scan_factors``. In two levels, so that the work is 2 nc^1.5 F E rather than one
    (nc + 1) x nc GEMM's nc² F E: the chunks in blocks of m = ⌈√nc⌉ (:func:`prefix_rows`),
    the states at the blocks' starts (and after the last chunk) by one (nc / m + 1) x nc GEMM
    over the chunk axis, and each chunk's state as its block's starting state moved to it,
    exp(w_in(c) - w_in(bm)), plus the deltas of the earlier chunks of its block, by an m x m
    GEMM per block. Every weight is <= 1.

    The GEMMs batch over ``*batch`` in front of the chunk axis, which is where the storage
    of deltas stored head-major (:func:`_matmul`) already has it: then no operand is copied,
    and when nc is a multiple of m (:func:`prefix_rows` chunks) neither is the result. The
    states returned are chunk-major views of head-major storage.
    """
    nc = deltas.shape[0]
    m, nb = _blocks(nc)
    nd = deltas.dim() - 3
    decays = _Decays(running, chunk_max, chunk_decay, nb * m)
    rows = deltas.movedim(0, nd).flatten(-2)  # (*batch, nc, F E), in place for head-major storage
    index = torch.arange(nb * m, device=deltas.device)
    starts = torch.cat([index[::m], index.new_full((1,), nc)])  # bm for each block, and nc
    at_starts = torch.exp(decays.between(starts[:, None], index[None, :nc])) @ rows
    at_starts = at_starts.unflatten(-1, deltas.shape[-2:])
    at_starts += torch.exp(decays.move(starts, starts[:1]))[..., None, None] * kv.unsqueeze(nd)
    if nb * m > nc:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, nb * m - nc))
    blocks = index.view(nb, m)
    inner = torch.exp(decays.between(blocks[:, :, None], blocks[:, None, :])) @ rows.unflatten(
        -2, (nb, m))
    del rows
    # In place on the GEMM's fresh output (autograd keeps a GEMM's inputs, not its output).
    moved = torch.exp(decays.move(blocks, blocks[:, :1]))[..., None]
    before = inner.addcmul_(moved, at_starts[..., :-1, None, :, :].flatten(-2)).flatten(nd, nd + 1)
    before = before[..., :nc, :].unflatten(-1, deltas.shape[-2:]).movedim(nd, 0)
    return before, at_starts[..., -1, :, :]


def decayed_suffix(reads: Tensor, d_after: Tensor | None, running: Tensor, chunk_max: Tensor,
                   chunk_decay: Tensor | None) -> Tensor:
    """The adjoint of :func:`decayed_prefix`'s recurrence: with Y_c = ``reads`` (nc, *batch, F,
    E) the gradient reaching the state S_c directly (through the queries of chunk c) and
    U_nc = ``d_after`` (*batch, F, E) (None: 0) that reaching the state after the last chunk,
    the whole gradient of each state, U_c = ∂L/∂S_c = Y_c + keep_c U_{c+1}, unrolled:

        U_c = Σ_{c <= c'' < nc} exp(w_in(c'') - w_in(c)) Y_{c''} + exp(w_in(nc) - w_in(c)) U_nc,

    every weight a product of keeps, <= 1 (the exponent R_c - R_{c''} + Σ_{c <= l < c''} d_l).
    Returns U_0..U_{nc-1} (nc, *batch, F, E): U_0 is the entering state's gradient, and chunk
    c's delta gets enter_c U_{c+1}. In the two levels of :func:`decayed_prefix`, mirrored: the
    sums from each block's end on by one GEMM over the chunk axis (U_nc a rank-one term), then
    each block's own by an m x m GEMM per block. For :func:`prefix_rows` chunks stored
    head-major no operand is copied.
    """
    nc = reads.shape[0]
    nd = reads.dim() - 3
    shape = reads.shape[-2:]
    m, nb = _blocks(nc)
    decays = _Decays(running, chunk_max, chunk_decay, nb * m)
    rows = reads.movedim(0, nd).flatten(-2)  # (*batch, nc, F E)
    if nb * m > nc:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, nb * m - nc))
    index = torch.arange(nb * m, device=reads.device)
    ends = (index[m - 1::m] + 1).clamp_max(nc)  # each block's end (the last: nc)
    beyond = torch.exp(decays.move(index[None, :nc], ends[:, None])) @ rows[..., :nc, :]
    if d_after is not None:
        last = index.new_full((1,), nc)
        beyond += torch.exp(decays.move(last, ends))[..., None] * d_after.to(
            reads.dtype).flatten(-2).unsqueeze(nd)
    blocks = index.view(nb, m)
    inner = torch.exp(decays.move(blocks[:, None, :], blocks[:, :, None])) @ rows.unflatten(
        -2, (nb, m))
    del rows
    moved = torch.exp(decays.move(ends[:, None], blocks))[..., None]
    adjoint = inner.addcmul_(moved, beyond[..., None, :]).flatten(nd, nd + 1)
    return adjoint[..., :nc, :].unflatten(-1, shape).movedim(nd, 0)


class _Decays:
    """The log weights of :func:`decayed_prefix` and :func:`decayed_suffix` over nc chunks,
    from the running scales R_0..R_nc (nc + 1, *batch), the chunks' scales r_c (nc, *batch)
    and their total log-gates d_c (nc, *batch) or None, for index tensors of any broadcastable
    shapes with values below ``length`` (those past the chunks read the last chunk's terms:
    padded rows are dropped, padded columns carry zero deltas), batch first: (*batch, *shape).

    Both are differences of two per-chunk terms, formed once: with G_c = Σ_{l < c} d_l,
    A_c = G_c - R_c and B_c = r_c - G_{c+1}, w(c, c') = A_c + B_{c'} and
    w_in(c) - w_in(s) = A_c - A_s, so that each weight matrix is one gather of each and one
    sum. G (and so A and B) is formed in float64 (module docstring); the gate's gradient flows
    through.
    """

    def __init__(self, running: Tensor, chunk_max: Tensor, chunk_decay: Tensor | None,
                 length: int) -> None:
        nc, self.dtype = chunk_max.shape[0], running.dtype
        if chunk_decay is None:
            a, b = -running, chunk_max
        else:
            cum = torch.cat([
                chunk_decay.new_zeros(1, *chunk_decay.shape[1:], dtype=torch.float64),
                chunk_decay.to(torch.float64).cumsum(0),
            ])
            a, b = cum - running.to(torch.float64), chunk_max.to(torch.float64) - cum[1:]
        # (*batch, length + 1), (*batch, length): edge-padded, so that no index is clamped.
        self.a = torch.cat([a, a[-1:].expand(max(0, length - nc), *a.shape[1:])]).movedim(0, -1)
        self.b = torch.cat([b, b[-1:].expand(length - nc, *b.shape[1:])]).movedim(0, -1)

    def between(self, rows: Tensor, cols: Tensor) -> Tensor:
        """w(c, c') = r_{c'} - R_c + Σ_{c' < l < c} d_l for rows c and columns c' (padded
        columns carry zero deltas), -inf where c' >= c."""
        w = self.a[..., rows] + self.b[..., cols]
        return w.masked_fill(cols >= rows, float("-inf")).to(self.dtype)

    def move(self, rows: Tensor, starts: Tensor) -> Tensor:
        """w_in(c) - w_in(s) = R_s - R_c + Σ_{s <= l < c} d_l for rows c and starts s, -inf
        where c < s (an empty state's R_0 = LOG_FLOOR makes its weights 0)."""
        w = self.a[..., rows] - self.a[..., starts]
        return w.masked_fill(rows < starts, float("-inf")).to(self.dtype)


def _blocks(nc: int) -> tuple[int, int]:
    """The two levels of :func:`decayed_prefix` over nc chunks: m = ⌈√nc⌉ chunks a block, nb
    blocks."""
    m = math.ceil(math.sqrt(nc))
    return m, -(-nc // m)


def prefix_rows(nc: int) -> int:
    """nc rounded up to a whole number of :func:`decayed_prefix`'s blocks."""
    m, nb = _blocks(nc)
    return m * nb


class _ChunkParallel(torch.autograd.Function):
    """:func:`causal` keeping q, k, v, the gate, the mask, a checkpoint state every S_b tokens
    ((N / S_b) F (Dv + 1), S_b = :func:`backward_slice_tokens`) and the feature map's tensors:
    O(N (D + Dv)) between forward and backward, not the features' O(N F) or the chunk states'
    O((N / C) F (Dv + 1)). The checkpoints are the chunk states the forward forms anyway, so
    the backward's spans can be shorter than the forward's slices at no cost to the forward.

    Backward, span by span of S_b tokens from the last: :func:`_span_backward`, written out,
    from the span's saved inputs and checkpoint, for the output, the state after (the gradient
    coming from the next span) and (hybrid) the normaliser's log |d|; the checkpoint's gradient
    goes on to the previous span. Memory: one span's φ and two of its state tensors at a time.
    Cost: one more forward.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None,
                key_padding_mask: Tensor | None, kv: Tensor | None, log_scale: Tensor | None,
                features: FeatureFn, chunk: int, eps: float, steps: tuple[int, int],
                normaliser: bool, *tensors: Tensor) -> tuple[Tensor, ...]:
        entering: list[RecurrentState | None] = []
        step, back = steps
        out, state, norm = _sliced(
            q, k, v, gate, key_padding_mask, None if kv is None else RecurrentState(kv, log_scale),
            features, chunk, eps, step, normaliser, entering, back,
        )
        ctx.features, ctx.chunk, ctx.eps, ctx.spans = features, chunk, eps, backward_spans(
            q.shape[2], step, back)
        ctx.normaliser = normaliser
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
        spans = ctx.spans
        states, tensors = rest[:2 * len(spans)], rest[2 * len(spans):]

        def span(i: int, leaves: list[Tensor | None],
                 d_kv: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
            a, e = spans[i]
            kv, log_scale = states[2 * i], states[2 * i + 1]
            return _span_backward(
                ctx.features, *leaves, None if pad is None else pad[:, a:e],
                None if kv is None else RecurrentState(kv, log_scale), ctx.chunk, ctx.eps,
                d_out[:, :, a:e], d_kv,
                d_log_abs[:, :, a:e] if ctx.normaliser and d_log_abs is not None else None,
                tensors,
            )

        needs = ctx.needs_input_grad
        grads, d_kv, d_tensors = core._backward_in_spans(
            (q, k, v, gate), needs[:4], spans, len(tensors), d_kv, span)
        return (*grads, None, d_kv if needs[5] else None, None, None, None, None, None, None,
                *d_tensors)


def _span_backward(
    features: FeatureFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor | None,
    pad: Tensor | None,
    state: RecurrentState | None,
    chunk: int,
    eps: float,
    d_out: Tensor,
    d_after: Tensor | None,
    d_log_abs: Tensor | None,
    tensors: Sequence[Tensor],
) -> tuple[Tensor, list[Tensor | None]]:
    """One span of :class:`_ChunkParallel`'s backward, written out: q, k, v, gate (leaves;
    (B, H, n, ·)), the state entering the span, ∂L/∂out (B, H, n, Dv), ∂L/∂(state after),
    ∂L/∂(log |d|) (B, H, n) of the hybrid's normaliser (None: not used). Returns ∂L/∂(entering
    kv) and the gradients of q, k, v, gate and ``tensors``.

    φ(Q), φ(K) and the per-token and per-chunk factors are recomputed under autograd (their
    graphs are O(n F) and smaller); the chunk-parallel part runs again without autograd and
    its vector-Jacobian product is written out. With X = φ(Q_c) φ(K_c)^T, A = X ⊙ W, U = V' ⊙ t,
    ΔS_c = φ(K_c)^T U_c, the states S_c of :func:`decayed_prefix`, r = φ(Q_c) S_c and
    [num, den] = r ⊙ ω + A V', from G = ∂L/∂[num, den] (the ratio's and the normaliser's
    gradient), G1 = G ⊙ ω, dA = G V'^T, dX = dA ⊙ W:

        dφ(Q) = G1 S_c^T + dX φ(K),                 Y_c = φ(Q_c)^T G1_c = ∂L/∂S_c (direct),
        U_{c+1} = :func:`decayed_suffix` of Y,       ∂ΔS_c = enter_c U_{c+1},
        dφ(K) = U ∂ΔS_c^T + dX^T φ(Q),               dU = φ(K) ∂ΔS_c,
        dV' = A^T G + dU ⊙ t,   dW = dA ⊙ X,   dt = rowsum(dU ⊙ V'),   dω = rowsum(G ⊙ r),
        dkeep_c = <U_{c+1}, S_c>,

    the last four only where the gate (or a learned map) makes them carry a gradient; the
    entering state's gradient is U_0. Autograd then takes the factors' and features' gradients
    to q, k, v, the gate and the feature tensors. Without log weights (no log-scale, padding or
    gate) W is the causal mask, ω = t = enter = 1, and the states are plain sums. What is alive
    at once: φ(Q), φ(K) and their graphs, at most two (nc, F, Dv + 1) state tensors (three with
    a gate, whose dkeep reads S), C x C and (C, Dv + 1) blocks.
    """
    b, h, n = q.shape[:3]
    chunks = prefix_rows(-(-n // chunk))
    with torch.enable_grad():
        phi_q, query_log_scale = _chunk_features(features, q, chunk, chunks, True)
        phi_k, key_log_scale = _chunk_features(features, k, chunk, chunks, False)
        state = core._state_of(state, b, h, phi_k.shape[-1], v.shape[-1], phi_k)
        fac = chunkwise._factors(v, key_log_scale, pad, gate, chunk, chunks)
        chunk_max = fac.prefix[..., -1, 0]
        chunk_decay = None if fac.cum is None else fac.cum[..., -1]
        running, keep, enter = chunkwise._scan_factors(state.log_scale, chunk_max, chunk_decay)
        inter, _, common = chunkwise._out_weights(fac, running)
        scaled = fac.log_weight is not None
        weight = to_end = None
        if scaled:
            weight = chunkwise._intra_weights(fac.log_weight, (fac.prefix - common)[..., 0])
            to_end = chunkwise._to_end(fac.log_weight)

    def chunked(t: Tensor) -> Tensor:
        """(B, H, n, ·) -> chunk-major views (nc, B, H, C, ·) of head-major storage, 0 after
        n."""
        return torch.nn.functional.pad(t, (0, 0, 0, chunks * chunk - n)).unflatten(
            2, (chunks, chunk)).movedim(2, 0)

    pq, pk, vv = phi_q.detach(), phi_k.detach(), fac.v.detach()
    kv = state.kv.detach().to(pk.dtype)
    decay = None if chunk_decay is None else chunk_decay.detach()
    scores = _matmul(pq, pk.transpose(-1, -2))
    if scaled:
        wt, te, it = weight.detach(), to_end.detach(), inter.detach()
        a, u = scores * wt, vv * te
        before, _ = decayed_prefix(kv, _matmul(pk.transpose(-1, -2), u), running, chunk_max,
                                   decay)
        read = _matmul(pq, before)
        raw = read * it + _matmul(a, vv)
    else:
        a, u = scores.tril(), vv
        states = torch.cat([kv[:, :, None], _matmul(pk.transpose(-1, -2), vv).movedim(0, 2)],
                           2).cumsum(2)
        before = states[:, :, :-1].movedim(2, 0)
        del states
        read = _matmul(pq, before)
        raw = read + _matmul(a, vv)
        # Unit weights: the suffix of plain sums (every exponent 0).
        running = torch.zeros_like(running)
    out = d_out.new_empty(b, h, n, v.shape[-1])
    div, back = core._ratio_into(out, chunkwise._from_chunks(raw, n), eps,
                                 chunkwise._from_chunks(common.detach(), n))
    del raw
    g = core._ratio_grad(d_out, out, div, back)
    d_query_scale = None
    if d_log_abs is not None:
        # log |d| + the scales: d receives d_log_abs / d where it is the denominator.
        d_query_scale = d_log_abs[..., None]
        g[..., -1:].sub_(d_query_scale * back)
    del out, div, back
    g = chunked(g)
    g1 = g * it if scaled else g
    d_a = _matmul(g, vv.transpose(-1, -2))
    d_weight = None
    if scaled:
        d_x = d_a * wt
        if weight.requires_grad:
            d_weight = d_a.mul_(scores)
    else:
        d_x = d_a.tril_()
    del d_a, scores
    d_v = _matmul(a.transpose(-1, -2), g)
    del a
    d_inter = (g * read).sum(-1, keepdim=True) if scaled and inter.requires_grad else None
    del read
    d_q = _matmul(g1, before.transpose(-1, -2)).add_(_matmul(d_x, pk))
    gated = scaled and keep.requires_grad
    if not gated:
        del before
    adjoint = decayed_suffix(_matmul(pq.transpose(-1, -2), g1), d_after, running, chunk_max,
                             decay)
    del g, g1
    # ∂L/∂S_{c+1} of each chunk c: the adjoints shifted by one, the last the state after's.
    d_deltas = adjoint.new_empty(adjoint.movedim(0, 2).shape).movedim(2, 0)
    d_deltas[:-1] = adjoint[1:]
    if d_after is None:
        d_deltas[-1] = 0.0
    else:
        d_deltas[-1] = d_after
    d_kv = adjoint[0].clone()  # not a view keeping the adjoints alive
    del adjoint
    d_keep = None
    if gated:
        d_keep = _matmul(d_deltas.flatten(-2)[..., None, :], before.flatten(-2)[..., :, None])
        del before
    if scaled:
        d_deltas.mul_(enter.detach())
    d_k = _matmul(u, d_deltas.transpose(-1, -2)).add_(_matmul(d_x.transpose(-1, -2), pq))
    d_u = _matmul(pk, d_deltas)
    del d_deltas, d_x
    d_to_end = None
    if scaled:
        if to_end.requires_grad:
            d_to_end = (d_u * vv).sum(-1, keepdim=True)
        d_v += d_u.mul_(te)
    else:
        d_v += d_u
    del d_u
    inputs = [t for t in (q, k, v, gate, *tensors) if t is not None]
    got = iter(core._backprop(
        (phi_q, phi_k, fac.v, weight, to_end, inter if scaled else None,
         keep if scaled else None, query_log_scale),
        (d_q, d_k, d_v, d_weight, d_to_end, d_inter, d_keep,
         None if d_query_scale is None or query_log_scale is None else chunked(d_query_scale)),
        inputs,
    ))
    grads = [None if t is None else next(got) for t in (q, k, v, gate)]
    return d_kv.to(state.kv.dtype), [*grads, *got]
