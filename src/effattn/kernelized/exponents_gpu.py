"""The GPU strategy of the per-feature core (:mod:`effattn.kernelized.exponents`): the same sums
under the same conventions, chunk-parallel, with a fixed number of launches per device-sized
slice and no host sync.

The per-feature core's causal form walks the chunks of a slice in a Python loop, each chunk
reading the state and decaying it per feature by exp(R_{c-1} - R_c): on a GPU, thousands of
tiny launches. Here every chunk of a slice at once (R_c the running max of feature f at the end
of chunk c, R_{-1} the entering state's scale, C = ``chunk_size``, nc chunks, E = Dv + 1):

    ΔS_c = exp(u_k(chunk c) - R_c)^T [v, 1]          all chunks by one batched GEMM, (F, E) each
    S_c  = Σ_{c' < c} diag(exp(R_{c'} - R_{c-1})) ΔS_{c'} + diag(exp(R_{-1} - R_{c-1})) S_in
    o_i  = exp(u_q(i) + R_{c-1} - c_i) S_c                      the read-out, one batched GEMM
         + Σ_{j <= i in chunk c} (exp(u_q(i) + R_c - c_i) · exp(u_k(j) - R_c)) [v_j, 1]

with c_i = max_f (u_qf(i) + M_f(i)) the log of query i's largest term (M_f(i) the running max of
feature f up to key i), which cancels in the ratio. The entering states S_c are the unrolled
recurrence S_{c+1} = diag(exp(R_{c-1} - R_c)) S_c + ΔS_c, a diagonal decay as gated linear
attention's: each feature row is a recurrence of its own with a scalar decay, so the per-feature
form is the GPU strategy's decayed prefix (:func:`effattn.kernelized.gpu.decayed_prefix`: two
levels of GEMMs over the chunk axis, blocks of ⌈√nc⌉ chunks) with (B, H, F) as its batch and one
state row (1, E) per batch entry. Every weight it forms is exp of a difference R_{c'} - R_{c-1}
or R_s - R_c of running maxima, <= 0: no reference scale is factored out, so nothing overflows
and a weight underflows only where it is below e^-87 (fp32) of the row's largest term, which is
1 (the key that set R_{c-1}). Growth across chunks is therefore exact at any size: a feature
whose exponent jumps by thousands between chunks only zeroes the weights of the keys it
outgrew, which are below rounding anyway.

Inside a chunk the query factor exp(u_q + R_c - c_i) exceeds 1 by the growth of the running max
between query i and the chunk's end, which no single per-chunk reference bounds: the C x C
products run in float64 (on a GPU, fp64 tensor cores; 2 n C F flops per (B, H), a fraction of
the slice's time), exactly as the CPU form's ``wide`` products, the query's exponent clamped at
:data:`~effattn.kernelized.exponents.GROWTH_LIMIT` (700; float64 holds e^709). In-chunk growth
beyond that limit (a feature that rises by 700 inside C tokens) would lose the products of the
queries before the rise; the growth across chunks has no limit. The CPU form instead checks the
growth with a host sync and runs fp32 when it is small; here no flag is read back. Cost: the
float64 products are 2 n C F flops per (B, H) and slice (4.3 GFLOP at B·H = 8, N = 65536,
C = 32, F = 128), which an H100's fp64 tensor cores (67 TFLOP/s by NVIDIA's sheet, the rate of
its fp32 GEMMs without TF32) run in well under a millisecond; the float64 factors double the
memory of u for the slice. On a GPU with slow fp64 (1/64 of fp32 on consumer parts) they would
weigh more. None of this is measured yet.

Training: :class:`_ChunkParallel` keeps q, k, v, the mask, the state entering every span of
1 / ``BACKWARD_SHARE`` of a slice (read off the chunk states the forward forms anyway) and the
tensors the exponents function reads, not u, the chunk states or the in-chunk products; its
backward recomputes one span at a time under autograd, so between forward and backward nothing
of size N x F stays alive, and the backward's one span graph is what training adds to the
forward's peak (accounted on the CPU at N = 16384, B = 1, H = 8, fp32: 0.86 GiB against the
inference forward's 0.61, where spans of a whole slice held 1.33). Under ``torch.compile`` the
forward is traced as it is.

Non-causal (:func:`~effattn.kernelized.exponents.key_state`,
:func:`~effattn.kernelized.exponents.read_queries`): already a GEMM pair per slice; the GPU
strategy only makes the slices device-sized (:func:`slice_budget`).

Shapes: B batch, H heads, N tokens, F features (the width of u), Dv value dim, E = Dv + 1,
C chunk, nc chunks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn import strategy
from effattn.kernelized import core, gpu
from effattn.kernelized import exponents as ex
from effattn.kernelized.core import LOG_FLOOR, Normaliser, RecurrentState, with_ones


def slice_budget(slice_elements: int, x: Tensor) -> int:
    """The slice budget of the per-feature core for tensors like x: ``gpu.SLICE_SCALE`` times
    ``slice_elements`` on the GPU strategy (few, large slices), as given on the CPU one."""
    if strategy.choose("kernelized", x.device) != "cpu":
        return slice_elements * gpu.SLICE_SCALE
    return slice_elements


# A slice of this form holds slice_elements / SLICE_SHARE feature values: its backward
# recomputes the slice under autograd, which holds several slice-sized tensors (u, shifted
# copies, the float64 in-chunk factors). The CPU form's hand-written backward has its own share
# (exponents.SLICE_SHARE).
SLICE_SHARE = 2
# Its backward recomputes spans of 1 / BACKWARD_SHARE of a slice, from the states entering them,
# read off the forward's chunk states: one span's graph is what a training call adds to the
# forward's peak.
BACKWARD_SHARE = 2


def slice_tokens(batch_heads: int, feature_dim: int, value_dim: int, chunk_size: int,
                 slice_elements: int) -> int:
    """Tokens per causal slice, a multiple of the chunk: the GPU strategy's causal slice
    (:func:`effattn.kernelized.gpu.slice_tokens`) of ``slice_elements / SLICE_SHARE``."""
    return gpu.slice_tokens(batch_heads, feature_dim, value_dim, chunk_size,
                            slice_elements // SLICE_SHARE)


def causal(q: Tensor, k: Tensor, v: Tensor, exponents: ex.ExponentFn, feature_dim: int,
           state: RecurrentState | None = None, *, key_padding_mask: Tensor | None = None,
           chunk_size: int = 32, slice_elements: int = 1 << 20,
           normaliser: bool = False) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """:func:`effattn.kernelized.exponents.causal` (same arguments, outputs and state; its
    shape check and ``lag`` are handled there, before it hands over) in the chunk-parallel form
    of the module docstring: q, k (B, H, N, D), v (B, H, N, Dv) -> the output (B, H, N, Dv),
    the state after (per-feature log-scales (B, H, F, 1)) and, with ``normaliser``, the
    queries' normalisers (B, H, N); slices of :func:`slice_tokens` tokens."""
    b, h, n = q.shape[:3]
    state = ex._state(state, b, h, feature_dim, v.shape[-1], v)
    step = slice_tokens(b * h, feature_dim, v.shape[-1], chunk_size, slice_elements)
    args = (q, k, v, key_padding_mask, state.kv, state.log_scale, exponents, chunk_size, step,
            normaliser)
    # Eager training runs the recomputing function; under torch.compile the forward is traced
    # as it is (dynamo does not trace a backward that calls autograd itself).
    tensors = _exponent_inputs(exponents, q) if core._recording() else ()
    if core._recording() and core._needs_grad(q, k, v, state.kv, *tensors):
        out, kv, scale, log_abs, sign = _ChunkParallel.apply(*args, *tensors)
    else:
        out, kv, scale, log_abs, sign = _sliced(*args, None)
    norm = Normaliser(log_abs, sign) if normaliser else None
    return out, RecurrentState(kv, scale, state.position + n), norm


def _exponent_inputs(exponents: ex.ExponentFn, x: Tensor) -> tuple[Tensor, ...]:
    """The tensors requiring grad that ``exponents`` reads (hedgehog's projection): the leaves
    of the graph of u of one token, found as the row core finds a feature map's."""

    def as_features(x: Tensor, *, is_query: bool) -> tuple[Tensor, None]:
        return exponents(x), None

    return core._feature_inputs(as_features, x, True, None)


def _sliced(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
            exponents: ex.ExponentFn, chunk: int, step: int, normaliser: bool,
            entering: list[Tensor] | None,
            back: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_slice` one slice of ``step`` tokens after the other, each handing its state to
    the next: the output, the state after (kv, log-scale) and the normaliser's log and sign
    (empty tensors without ``normaliser``). ``entering`` (a list), when given, receives the
    state (kv, log-scale) entering every ``back`` tokens (a multiple of the chunk; None:
    ``step``) of each slice (:func:`backward_spans` lists their spans)."""
    outs, logs, signs = [], [], []
    every = None if entering is None else (back or step) // chunk
    for a, e in core._spans(q.shape[2], step):
        if entering is not None:
            entering += [kv, scale]
        out, log_abs, sign, kv, scale, marks = _slice(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None if pad is None else pad[:, a:e], kv,
            scale, exponents, chunk, normaliser, every)
        if entering is not None:
            entering += marks
        outs.append(out)
        logs.append(log_abs)
        signs.append(sign)
    if not normaliser:
        return torch.cat(outs, 2), kv, scale, q.new_empty(0), q.new_empty(0)
    return torch.cat(outs, 2), kv, scale, torch.cat(logs, 2), torch.cat(signs, 2)


def _slice(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
           exponents: ex.ExponentFn, chunk: int, normaliser: bool, every: int | None = None,
           ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor, list[Tensor]]:
    """One slice of n tokens, chunk-parallel (module docstring), from the state (kv (B, H, F, E),
    scale (B, H, F, 1)) before it: the output (B, H, n, Dv), the normaliser's log and sign
    (B, H, n) (None without ``normaliser``), the state after it, and the states (kv, scale)
    entering chunks ``every``, 2 ``every``, ... (copies; none when ``every`` is None)."""
    b, h, n = q.shape[:3]
    u_q = exponents(q)
    u_k = ex._padded(exponents(k), pad)
    v1 = with_ones(v)
    tail = -n % chunk
    if tail:  # keys that are not there: exp(-inf) = 0, and the running max stays
        u_q = torch.cat([u_q, u_q.new_zeros(b, h, tail, u_q.shape[-1])], 2)
        u_k = torch.cat([u_k, u_k.new_full((b, h, tail, u_k.shape[-1]), float("-inf"))], 2)
        v1 = torch.cat([v1, v1.new_zeros(b, h, tail, v1.shape[-1])], 2)
    uq_c, uk_c, v_c = (x.unflatten(2, (-1, chunk)) for x in (u_q, u_k, v1))  # (B, H, nc, C, ·)
    with torch.no_grad():
        first = scale.transpose(-2, -1)  # R_{-1} (B, H, 1, F)
        end = torch.maximum(torch.cummax(uk_c.amax(-2), 2).values,
                            first).clamp_min(LOG_FLOOR)  # R_c (B, H, nc, F)
        running = torch.cat([first, end], 2)  # R_{-1}, R_0, .., R_{nc-1}
        before = running[:, :, :-1, None]  # R_{c-1} (B, H, nc, 1, F)
        top = (uq_c + torch.maximum(before, ex._prefix_max(uk_c))).amax(-1, keepdim=True)
    end = end[..., None, :]
    delta = torch.sub(uk_c, end).exp_().transpose(-2, -1) @ v_c  # ΔS_c (B, H, nc, F, E)
    states, kv = _entering(kv, delta, running)
    shifted = uq_c - top
    inter = torch.add(shifted, before).exp_() @ states
    wide_end = end.double()
    q_f = (shifted.double() + wide_end).clamp_max_(ex.GROWTH_LIMIT).exp_()
    k_f = (uk_c.double() - wide_end).exp_()
    causal_mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril_()
    scores = torch.where(causal_mask, q_f @ k_f.transpose(-2, -1), 0.0).to(v_c.dtype)
    raw = (inter + scores @ v_c).flatten(2, 3)[:, :, :n]
    marks = []
    for c in range(every or states.shape[2], states.shape[2], every or 1):
        # Copies: views would keep all nc states alive until the backward.
        marks += [states[:, :, c].clone(), running[:, :, c, :, None].clone()]
    return (*ex._finish(raw, top.flatten(2, 3)[:, :, :n], normaliser), kv,
            end[:, :, -1].transpose(-2, -1), marks)


def _entering(kv: Tensor, delta: Tensor, running: Tensor) -> tuple[Tensor, Tensor]:
    """The states entering each chunk (B, H, nc, F, E) and the state after the last
    (B, H, F, E), from the entering state kv at R_{-1}, the chunks' ΔS_c each at its R_c, and
    ``running`` = R_{-1}, R_0, .., R_{nc-1} (B, H, nc + 1, F): the decayed prefix of
    :func:`effattn.kernelized.gpu.decayed_prefix` with (B·H, F) as its batch, each feature's
    row (1, E) a state of its own with scalar weights exp(R_{c'} - R_{c-1}) <= 1."""
    b, h, nc, f, e = delta.shape
    rows = delta.permute(2, 0, 1, 3, 4).reshape(nc, b * h, f, 1, e)  # a view: (B, H) merge
    scales = running.permute(2, 0, 1, 3).reshape(nc + 1, b * h, f)
    before, after = gpu.decayed_prefix(kv.reshape(b * h, f, 1, e), rows, scales, scales[1:],
                                       None)
    return before.reshape(nc, b, h, f, e).permute(1, 2, 0, 3, 4), after.reshape(b, h, f, e)


class _ChunkParallel(torch.autograd.Function):
    """:func:`causal` keeping q, k, v, the mask, the state entering each span of the backward
    (1 / ``BACKWARD_SHARE`` of a slice of S tokens) and the tensors the exponents function reads:
    O(N (D + Dv) + (N / S) F E) between forward and backward. Backward, span by span from the
    last: :func:`_slice` again under autograd from its saved inputs and entering state, then its
    vector-Jacobian product for the output, the state after (the gradient from the next span)
    and the normaliser's log; the entering state's gradient goes on to the span before. Memory:
    one span's graph at a time; cost: one more forward."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor,
                scale: Tensor, exponents: ex.ExponentFn, chunk: int, step: int,
                normaliser: bool, *tensors: Tensor) -> tuple[Tensor, ...]:
        entering: list[Tensor] = []
        back = max(chunk, step // BACKWARD_SHARE // chunk * chunk)
        out, kv, scale, log_abs, sign = _sliced(q, k, v, pad, kv, scale, exponents, chunk, step,
                                                normaliser, entering, back)
        ctx.exponents, ctx.chunk, ctx.normaliser = exponents, chunk, normaliser
        ctx.spans = gpu.backward_spans(q.shape[2], step, back)
        ctx.save_for_backward(q, k, v, pad, *entering, *tensors)
        ctx.mark_non_differentiable(scale, sign)
        return out, kv, scale, log_abs, sign

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_kv: Tensor | None, _: Tensor | None,
                 d_log_abs: Tensor | None, __: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, pad, *rest = ctx.saved_tensors
        spans = ctx.spans
        states, tensors = rest[:2 * len(spans)], rest[2 * len(spans):]
        needs = ctx.needs_input_grad

        def span(i: int, leaves: list[Tensor | None],
                 d_kv: Tensor | None) -> tuple[Tensor | None, list[Tensor | None]]:
            a, e = spans[i]
            # The entering state needs its gradient for the span before, or for the caller.
            kv = core._leaf(states[2 * i], i > 0 or needs[4])
            with torch.enable_grad():
                out, log_abs, _, after, _, _ = _slice(
                    *leaves, None if pad is None else pad[:, a:e], kv, states[2 * i + 1],
                    ctx.exponents, ctx.chunk, ctx.normaliser)
            got = core._backprop(
                (out, after, log_abs),
                (d_out[:, :, a:e], d_kv, None if d_log_abs is None or log_abs is None
                 else d_log_abs[:, :, a:e]),
                [*leaves, kv, *tensors])
            return got[3], [*got[:3], *got[4:]]

        grads, d_kv, d_tensors = core._backward_in_spans(
            (q, k, v), needs[:3], spans, len(tensors), d_kv, span)
        return (*grads, None, d_kv if needs[4] else None, None, None, None, None, None,
                *d_tensors)
