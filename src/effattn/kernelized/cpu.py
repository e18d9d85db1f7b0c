"""The CPU strategy of the kernelized engine: cache-sized slices, a loop over the chunks, a
hand-written backward.

It computes the sums of :mod:`effattn.kernelized.core` (its module docstring gives them and
their conventions) shaped for a few cores with a cache:

- non-causal (and a decoder's cross-attention memory): the core's recomputing key state and
  read-out (:func:`effattn.kernelized.core.key_state_in_slices`,
  :func:`effattn.kernelized.core.read_queries_in_slices`) in slices of about ``slice_elements``
  feature values (4 MiB in fp32 by default: cache-sized), the backward's a
  ``BACKWARD_SLICE_SHARE``-th of the forward's;
- causal: slices of :func:`effattn.kernelized.core.causal_slice_tokens` tokens, each handing
  its state to the next; inside a slice the chunks of the shared chunkwise form
  (:mod:`effattn.kernelized.chunkwise`: chunk-major layout, per-token factors) walked by a Python
  loop (:func:`_chunk_scan`), which keeps one running state (F, Dv + 1) in cache between the
  chunks' GEMMs rather than forming the (nc, F, Dv + 1) chunk states. Recording gradients,
  :class:`_Causal` keeps q, k, v, the gate, the output, its divisors and the state entering each
  slice; its backward (:func:`_causal_group_backward`) is written by hand, chunk by chunk, from
  the recomputed features, so that no chunk state and no slice's autograd graph of the chunk
  products is ever held.

:func:`key_state`, :func:`read_queries` and :func:`causal` have the signatures of
:mod:`effattn.kernelized.gpu`'s: :func:`effattn.kernelized.core._strategy_module` picks one of
the two modules (:mod:`effattn.strategy` decides) and calls them alike.

Shapes: B batch, H heads, N tokens, D head dim, F features, Dv value dim, C chunk, nc chunks,
S slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn.kernelized import chunkwise, core
from effattn.kernelized.core import FeatureFn, Normaliser, RecurrentState

# Its callers promote half-precision inputs (core.promotes_inside).
PROMOTES_INSIDE = False


def key_state(k: Tensor, v: Tensor, features: FeatureFn, *, feature_dim: int,
              key_padding_mask: Tensor | None, slice_elements: int,
              feature_tensors: Sequence[Tensor] | None) -> RecurrentState:
    """[S, z] = φ(K)^T [V, 1] of all keys k (B, H, M, D), v (B, H, M, Dv), in cache-sized
    slices (:func:`effattn.kernelized.core.key_state`'s contract)."""
    bh = k.shape[0] * k.shape[1]
    step = core.slice_tokens(bh, feature_dim, 1, slice_elements)
    back = core.slice_tokens(bh, feature_dim, 1, slice_elements // core.BACKWARD_SLICE_SHARE)
    return core.key_state_in_slices(k, v, features, key_padding_mask, feature_tensors, step,
                                    back)


def read_queries(q: Tensor, state: RecurrentState, features: FeatureFn, *, feature_dim: int,
                 eps: float, slice_elements: int,
                 feature_tensors: Sequence[Tensor] | None) -> Tensor:
    """Queries q (B, H, N, D) against a finished key state, in cache-sized slices:
    (B, H, N, Dv) (:func:`effattn.kernelized.core.read_queries`'s contract)."""
    bh = q.shape[0] * q.shape[1]
    step = core.slice_tokens(bh, feature_dim, 1, slice_elements)
    back = core.slice_tokens(bh, feature_dim, 1, slice_elements // core.BACKWARD_SLICE_SHARE)
    return core.read_queries_in_slices(q, state, features, eps, feature_tensors, step, back)


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
    :func:`effattn.kernelized.core.kernelized_causal` and its ``_normalised`` form), in slices
    of :func:`~effattn.kernelized.core.causal_slice_tokens` tokens, the chunks of each in a loop.
    """
    b, h, n = q.shape[:3]
    step = core.causal_slice_tokens(b * h, feature_dim, v.shape[-1], chunk_size, slice_elements)
    if core._recording():
        tensors = core._feature_inputs(features, q, True, feature_tensors)
        if feature_tensors is None:
            tensors = core._unique(tensors + core._feature_inputs(features, k, False, None))
        if core._needs_grad(q, k, v, gate, None if state is None else state.kv, *tensors):
            kv, scale = (None, None) if state is None else (state.kv, state.log_scale)
            out, kv, scale, log_abs, sign = _Causal.apply(
                q, k, v, gate, key_padding_mask, kv, scale, features, chunk_size, eps, step,
                normaliser, *tensors,
            )
            return (out, RecurrentState(kv, scale, n + (0 if state is None else state.position)),
                    Normaliser(log_abs, sign) if normaliser else None)
    out, state, _, _, norm = _causal_forward(q, k, v, gate, key_padding_mask, state, features,
                                             chunk_size, eps, step, None, normaliser)
    return out, state, norm


def _causal_group(
    q_c: Tensor,
    k_c: Tensor,
    key_log_scale: Tensor | None,
    v: Tensor,
    state: RecurrentState,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk: int,
) -> tuple[Tensor, Tensor, RecurrentState]:
    """Causal attention of n tokens after ``state``, chunkwise (see
    :func:`core.kernelized_causal`), from chunk-major φ(Q), φ(K) (nc, B, H, C, F) and key
    log-scales (nc, B, H, C, 1) (see :func:`chunkwise._chunk_major`), v (B, H, n, Dv), the
    padding mask (B, n) and the gate (B, H, n).

    Returns [num, den] (nc, B, H, C, Dv + 1) at log-scale m (nc, B, H, C, 1), chunk-major, and
    the state after.
    """
    fac = chunkwise._factors(v, key_log_scale, key_padding_mask, gate, chunk)
    running, keep, enter = chunkwise._scan_factors(
        state.log_scale, fac.prefix[..., -1, 0], None if fac.cum is None else fac.cum[..., -1]
    )
    inter, _, common = chunkwise._out_weights(fac, running)
    # (nc·B·H, C, ·) batches: a bmm of 3-d views, not matmul's broadcasting of 5-d ones.
    scores = torch.bmm(q_c.flatten(0, 2), k_c.flatten(0, 2).transpose(1, 2))  # (nc·B·H, C, C)
    v_flat = fac.v.flatten(0, 2)
    if fac.log_weight is None:
        # No log-scale, padding or gate: every key enters at scale 0, and the state entering
        # is at 0 or, empty (zeros), at LOG_FLOOR (maps without log-scales make no other), so
        # keep, enter and the output weights are 1 (or multiply zeros): the read-outs add onto
        # the chunks' own parts, no pass over the state or the output is spent on them.
        intra = torch.bmm(scores.tril_(), v_flat).view_as(fac.v)
        out, kv = _chunk_scan(state.kv, q_c, k_c, fac.v, None, intra)
    else:
        # The chunk's own part reaches m_i through exp(P_i - m_i), folded into the weights' rows.
        weight = chunkwise._intra_weights(fac.log_weight, (fac.prefix - common)[..., 0])
        weight = weight.flatten(0, 2)
        u = fac.v * (chunkwise._to_end(fac.log_weight) * enter)
        read, kv = _chunk_scan(state.kv, q_c, k_c, u, keep, None)
        # In place on fresh GEMM outputs (bmm keeps its inputs, not its output, for backward)
        # unless autograd records the product (a gate's weights and ω carry gradients): the
        # read-outs scaled to m_i, and the chunks' own parts accumulated onto them by the GEMM.
        if torch.is_grad_enabled() and core._needs_grad(weight, inter, read, v_flat):
            out = (read * inter).flatten(0, 2).baddbmm(scores * weight, v_flat).view_as(read)
        else:
            out = read.mul_(inter)
            out.flatten(0, 2).baddbmm_(scores.mul_(weight), v_flat)
    return out, common, RecurrentState(kv, running[-1, ..., None, None],
                                       state.position + v.shape[2])


def _chunk_scan(
    kv: Tensor, q_c: Tensor, k_c: Tensor, u: Tensor, keep: Tensor | None, acc: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The chunks' read-outs φ(Q_c) S_c (nc, B, H, C, E) of the states before them, added to
    ``acc`` when given, and the state after the last (B, H, F, E), by the recurrence of
    :func:`chunkwise._scan_factors`, S_{c+1} = keep_c S_c + φ(K_c)^T U_c, from the state kv
    (B, H, F, E), chunk-major φ(Q), φ(K) (nc, B, H, C, F) and rows U (nc, B, H, C, E) (enter_c
    folded in); keep (nc, B, H, 1, 1), None: 1.

    A loop over the chunks: the same states as one (nc + 1) x nc GEMM over the chunk axis, whose
    inner dimension (nc) is too short for a GEMM to run anywhere near its rate, and no
    subtraction of large partial sums can cancel (unlike an exclusive cumsum formed as
    cumsum - ΔS). Each chunk reads the running state, then scales it and adds its delta GEMM
    onto it: the (nc, F, E) states (as large as φ(K)) are never formed, and the state stays in
    cache between its GEMMs. Without autograd in place; recorded (autograd, torch.compile) as
    the same operations on fresh tensors, so that both agree to the last bit.
    """
    recorded = torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and core._needs_grad(kv, q_c, k_c, u, keep, acc)
    )
    nc, b, h = q_c.shape[:3]
    s3 = kv.to(q_c.dtype, copy=not recorded).flatten(0, 1)  # (B·H, F, E)
    keeps = [None] * nc if keep is None else _per_chunk(keep)
    accs = [None] * nc if acc is None else _per_chunk(acc)
    if recorded:
        reads = []
        for q_i, k_i, u_i, acc_i, keep_i in zip(_per_chunk(q_c), _per_chunk(k_c.transpose(-1, -2)),
                                                _per_chunk(u), accs, keeps, strict=True):
            reads.append(torch.bmm(q_i, s3) if acc_i is None else torch.baddbmm(acc_i, q_i, s3))
            s3 = torch.baddbmm(s3 if keep_i is None else s3 * keep_i, k_i, u_i)
        return torch.stack(reads).unflatten(1, (b, h)), s3.unflatten(0, (b, h))
    out = q_c.new_empty(*q_c.shape[:-1], u.shape[-1]) if acc is None else acc
    for q_i, k_i, u_i, out_i, keep_i in zip(_per_chunk(q_c), _per_chunk(k_c.transpose(-1, -2)),
                                            _per_chunk(u), _per_chunk(out), keeps, strict=True):
        if acc is None:
            torch.bmm(q_i, s3, out=out_i)
        else:
            out_i.baddbmm_(q_i, s3)
        if keep_i is not None:
            s3.mul_(keep_i)
        s3.baddbmm_(k_i, u_i)
    return out, s3.unflatten(0, (b, h))


def _per_chunk(x: Tensor) -> tuple[Tensor, ...]:
    """(nc, B, H, ...) -> nc (B·H, ...) views, in one call (per-chunk indexing and reshaping
    cost more than the small GEMMs they feed); contiguous for a chunk-major x."""
    return x.flatten(1, 2).unbind(0)


def _causal_group_backward(
    q_c: Tensor,
    k_c: Tensor,
    fac_v: Tensor,
    weight: Tensor | None,
    to_end: Tensor | None,
    keep: Tensor,
    enter: Tensor,
    inter: Tensor,
    intra_weight: Tensor,
    kv: Tensor,
    g: Tensor,
    d_final: Tensor | None,
    needs: tuple[bool, bool, bool, bool],
    query_backward: Callable[[Tensor], None],
) -> tuple[Tensor | None, ...]:
    """Gradients of one causal group, from recomputed values (no autograd).

    The forward of :func:`_causal_group`, per chunk: A = (φ(Q) φ(K)^T) ⊙ W (W: the weights
    exp(a_i - a_j), or the causal mask), intra = A V', U = V' ⊙ t (t = enter exp(a_last - a)),
    the scan S_{c+1} = keep S_c + φ(K)^T U, and o = (φ(Q) S_c) ⊙ ω + intra ⊙ ν. From
    G = ∂L/∂o (nc, B, H, C, E), with G1 = G ⊙ ω, G2 = G ⊙ ν, dA = G2 V'^T and
    dX = dA ⊙ W:

        dφ(Q) = G1 S_c^T + dX φ(K),   dφ(K) = dX^T φ(Q) + U ∂S_{c+1}^T,
        dV' = A^T G2 + (φ(K) ∂S_{c+1}) ⊙ t,   ∂S_c = keep_c ∂S_{c+1} + φ(Q_c)^T G1_c,

    with ∂S_c = ∂L/∂S_c. Two loops over the chunks, one chunk's GEMMs at a time: forwards,
    the states S_c are recomputed from kv (B, H, F, E), the state entering the group, and read
    into dφ(Q); backwards, ∂S runs from ∂S_nc = ``d_final`` (None: 0) into dφ(K) and dV'. No
    per-chunk tensor of states is kept but for the gate's dkeep. For the factors that carry the
    gate's gradient (``needs``: W, exp(a_last - a), keep, ω): dW = dA ⊙ X,
    d exp(a_last - a) = enter rowsum((φ(K) ∂S_{c+1}) ⊙ V'), dkeep_c = <∂S_{c+1}, S_c>,
    dω = rowsum(G ⊙ φ(Q) S_c). Without W (no log-scale, padding or gate: see
    :func:`_causal_group`) every factor is 1 but keep_0 (0 after an empty state).
    dφ(Q) goes to ``query_backward`` as soon as it is complete (so that it and the queries'
    recomputed graph are freed before the keys' part). Returns dφ(K), dV', dW,
    d exp(a_last - a), dkeep, dω (None where not needed) and ∂L/∂kv. Inputs are chunk-major
    values (nc, B, H, C, ·).
    """
    need_weight, need_to_end, need_keep, need_inter = needs
    nc, b, h, c, f = q_c.shape
    e = g.shape[-1]
    scaled = weight is not None
    scores = q_c @ k_c.transpose(-1, -2)  # X
    # X and dA are this function's own: masked or weighted in place unless dW needs them both
    # (every fresh (C, C) or (C, Dv + 1) tensor per group is memory the allocator faults in).
    if scaled:
        a = scores * weight if need_weight else scores.mul_(weight)
        t = to_end * enter
        u, g1, g2 = fac_v * t, g * inter, g * intra_weight
    else:
        a, u, g1, g2 = scores.tril_(), fac_v, g, g
    # A bmm of 3-d views: matmul would copy the transposed 5-d V' before its GEMM.
    d_a = torch.bmm(g2.flatten(0, 2), fac_v.flatten(0, 2).transpose(1, 2)).view_as(scores)
    d_scores = (d_a * weight if need_weight else d_a.mul_(weight)) if scaled else d_a.tril_()
    d_weight = d_a.mul_(scores) if need_weight else None
    del scores, d_a
    d_v = a.transpose(-1, -2) @ g2
    del a
    d_q = torch.empty_like(q_c)
    d_inter = inter.new_empty(inter.shape) if need_inter else None
    states = q_c.new_empty(nc, b, h, f, e) if need_keep else None
    state = kv.to(q_c.dtype, copy=True)
    s3 = state.flatten(0, 1)
    keeps = _per_chunk(keep) if scaled else [None] * nc
    k_t = _per_chunk(k_c.transpose(-1, -2))
    chunks = zip(_per_chunk(q_c), k_t, _per_chunk(u), _per_chunk(g1), _per_chunk(d_q), keeps,
                 strict=True)
    for i, (q_i, k_i, u_i, g1_i, d_q_i, keep_i) in enumerate(chunks):
        if states is not None:
            states[i] = state
        torch.bmm(g1_i, s3.transpose(1, 2), out=d_q_i)
        if d_inter is not None:
            d_inter[i] = (g[i] * torch.bmm(q_i, s3).view(b, h, c, e)).sum(-1, keepdim=True)
        if keep_i is not None:
            s3.mul_(keep_i)
        s3.baddbmm_(k_i, u_i)
    del state, s3
    d_q.flatten(0, 2).baddbmm_(d_scores.flatten(0, 2), k_c.flatten(0, 2))
    query_backward(d_q)
    del d_q
    d_k = d_scores.transpose(-1, -2) @ q_c
    del d_scores
    d_u = torch.empty_like(fac_v)
    d_keep = keep.new_empty(keep.shape) if need_keep else None
    # ∂S_{i+1}, this function's own: updated in place (no state-sized tensor per chunk).
    d = (torch.zeros_like(kv) if d_final is None else d_final.clone()).flatten(0, 1)
    chunks = zip(_per_chunk(q_c), _per_chunk(k_c), _per_chunk(u), _per_chunk(g1),
                 _per_chunk(d_k), _per_chunk(d_u), keeps, strict=True)
    for i, (q_i, k_i, u_i, g1_i, d_k_i, d_u_i, keep_i) in reversed(list(enumerate(chunks))):
        d_k_i.baddbmm_(u_i, d.transpose(1, 2))
        torch.bmm(k_i, d, out=d_u_i)
        if d_keep is not None:
            d_keep[i] = (d.view(b, h, f, e) * states[i]).sum((-2, -1), keepdim=True)
        if keep_i is not None:
            d.mul_(keep_i)
        d.baddbmm_(q_i.transpose(1, 2), g1_i)
    d = d.view(b, h, f, e)
    if not scaled:
        # keep_0 = ω = 0 for the first chunk after an empty state (at LOG_FLOOR), 1 otherwise.
        return d_k, d_v.add_(d_u), None, None, None, None, d * keep[0]
    d_to_end = (d_u * fac_v).sum(-1, keepdim=True).mul_(enter) if need_to_end else None
    d_v += d_u.mul_(t)
    return d_k, d_v, d_weight, d_to_end, d_keep, d_inter, d


def _causal_forward(
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
    entering: list[Tensor] | None,
    normaliser: bool,
) -> tuple[Tensor, RecurrentState, Tensor | None, Tensor | None, Normaliser | None]:
    """The slices of :func:`core.kernelized_causal`: output (B, H, N, Dv) and state after.
    Without autograd the output is written in place, with the divisors and gradient factors of
    :func:`core._ratio_into` (B, H, N, 1) when ``entering`` (a list) is given, which then
    receives the state (kv, log_scale) entering each slice; recorded, as autograd needs (None,
    None). With ``normaliser``, also each query's :class:`core.Normaliser` (recorded:
    differentiable)."""
    b, h, n = q.shape[:3]
    recorded = torch.is_grad_enabled() or torch.compiler.is_compiling()
    outs, lost = [], []
    out = None if recorded else q.new_empty(b, h, n, v.shape[-1])
    div = sign = None
    if entering is not None:
        div, sign = q.new_empty(b, h, n, 1), q.new_empty(b, h, n, 1)
    norms = []
    for a, e in core._spans(n, step):
        phi_q, query_log_scale = chunkwise._chunk_features(features, q[:, :, a:e], chunk, True)
        phi_k, key_log_scale = chunkwise._chunk_features(features, k[:, :, a:e], chunk, False)
        core._check_shapes(phi_q, phi_k, None, key_log_scale)
        state = core._state_of(state, b, h, phi_k.shape[-1], v.shape[-1], phi_k)
        if entering is not None:
            entering += [state.kv, state.log_scale]
        raw, out_scale, state = _causal_group(
            phi_q, phi_k, key_log_scale, v[:, :, a:e], state,
            None if key_padding_mask is None else key_padding_mask[:, a:e],
            None if gate is None else gate[:, :, a:e], chunk,
        )
        raw = chunkwise._from_chunks(raw, e - a)
        out_scale = chunkwise._from_chunks(out_scale, e - a)
        if out is None:
            outs.append(core._ratio(raw, eps, out_scale))
        else:
            d, s = core._ratio_into(out[:, :, a:e], raw, eps, out_scale)
            if div is not None and sign is not None:
                div[:, :, a:e], sign[:, :, a:e] = d, s
        if normaliser:
            norms.append(core._normaliser(
                raw[..., -1:], eps, out_scale,
                None if query_log_scale is None else chunkwise._from_chunks(query_log_scale, e - a),
            ))
        # A gate can decay what a query sees to a legitimate 0: only ungated rows are checked.
        lost.append(None if gate is not None else core._lost_rows(raw, eps, out_scale))
    core._raise_if_lost(lost, q.dtype)
    if out is None:
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    norm = None
    if normaliser:
        log_abs, signs = zip(*norms, strict=True)
        norm = Normaliser(torch.cat(log_abs, 2), torch.cat(signs, 2))
    return out, state, div, sign, norm


class _Causal(torch.autograd.Function):
    """Causal attention of q, k, v after the state (kv, log_scale)
    (:func:`core.kernelized_causal`), slice by slice, keeping q, k, v, the gate, the output, its
    divisors and the state entering each slice (S tokens): O(N·(D + Dv) + (N / S)·F·(Dv + 1)).

    Backward, slice by slice from the last: recompute φ(Q), φ(K) and the per-token factors
    under autograd, then :func:`_causal_group_backward` recomputes the slice's chunk states from
    the state entering it and gives the gradients of the features, of the factors and of the
    entering state, which goes on to the previous slice; autograd through the recomputed
    features and factors gives dq, dk, dv, the gate's and the feature tensors'. The per-chunk
    states (N/C of F x (Dv + 1): as large as φ(K)) are never kept: recomputing a slice's costs
    one chunk GEMM per chunk.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None,
                key_padding_mask: Tensor | None, kv: Tensor | None, log_scale: Tensor | None,
                features: FeatureFn, chunk: int, eps: float, step: int, normaliser: bool,
                *tensors: Tensor) -> tuple[Tensor, ...]:
        entering: list[Tensor] = []
        out, state, div, sign, norm = _causal_forward(
            q, k, v, gate, key_padding_mask, None if kv is None else RecurrentState(kv, log_scale),
            features, chunk, eps, step, entering, normaliser,
        )
        ctx.features, ctx.chunk, ctx.step, ctx.slices = features, chunk, step, len(entering) // 2
        ctx.normaliser = normaliser
        ctx.save_for_backward(q, k, v, gate, key_padding_mask, out, div, sign, *entering,
                              *tensors)
        if norm is None:
            norm = Normaliser(out.new_empty(0), out.new_empty(0))
        ctx.mark_non_differentiable(state.log_scale, norm.sign)
        return out, state.kv, state.log_scale, norm.log_abs, norm.sign

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_kv: Tensor | None, _: Tensor | None,
                 d_log_abs: Tensor | None, __: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, gate, pad, out, div, sign, *rest = ctx.saved_tensors
        entering, tensors = rest[:2 * ctx.slices], rest[2 * ctx.slices:]

        def span(i: int, leaves: list[Tensor | None],
                 d_kv: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
            a, e = spans[i]
            g = core._ratio_grad(d_out[:, :, a:e], out[:, :, a:e], div[:, :, a:e], sign[:, :, a:e])
            d_query_scale = None
            if ctx.normaliser and d_log_abs is not None:
                # log |d| + scale: d receives d_log_abs / d where it is the denominator (-back).
                d_query_scale = d_log_abs[:, :, a:e, None]
                g[..., -1:].sub_(d_query_scale * sign[:, :, a:e])
            return _causal_slice_backward(
                ctx.features, *leaves, None if pad is None else pad[:, a:e],
                entering[2 * i], entering[2 * i + 1], ctx.chunk, g, d_kv, tensors,
                d_query_scale,
            )

        spans = core._spans(q.shape[2], ctx.step)
        grads, d_kv, d_tensors = core._backward_in_spans(
            (q, k, v, gate), ctx.needs_input_grad[:4], spans, len(tensors), d_kv, span)
        d_kv = d_kv if ctx.needs_input_grad[5] else None
        return (*grads, None, d_kv, None, None, None, None, None, None, *d_tensors)


def _causal_slice_backward(
    features: FeatureFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor | None,
    pad: Tensor | None,
    kv: Tensor,
    log_scale: Tensor,
    chunk: int,
    g: Tensor,
    d_final: Tensor | None,
    tensors: Sequence[Tensor],
    d_query_scale: Tensor | None,
) -> tuple[Tensor, list[Tensor | None]]:
    """One slice of :class:`_Causal`'s backward: q, k, v, gate (leaves), the state (kv,
    log_scale) entering the slice, g = ∂L/∂[num, den] (B, H, n, Dv + 1), ∂L/∂(state after)
    and ∂L/∂(the queries' log-scales) (B, H, n, 1) (None: not used).
    Returns ∂L/∂kv and the gradients of q, k, v, gate and ``tensors``. The tail after n is
    padded with copies of the last token (see :func:`chunkwise._chunk_major`): no gradient
    reaches them (their keys are masked and their queries' g is 0)."""
    with torch.enable_grad():
        phi_q, query_log_scale = chunkwise._chunk_features(features, q, chunk, True)
        phi_k, key_log_scale = chunkwise._chunk_features(features, k, chunk, False)
        fac = chunkwise._factors(v, key_log_scale, pad, gate, chunk)
        weight = to_end = None
        if fac.log_weight is not None:
            weight = chunkwise._intra_weights(fac.log_weight)
            to_end = chunkwise._to_end(fac.log_weight)
        running, keep, enter = chunkwise._scan_factors(
            log_scale, fac.prefix[..., -1, 0], None if fac.cum is None else fac.cum[..., -1]
        )
        inter, intra_weight, _ = chunkwise._out_weights(fac, running)
    values = [None if t is None else t.detach() for t in (weight, to_end, keep, inter)]
    needs = tuple(t is not None and t.requires_grad for t in (weight, to_end, keep, inter))
    inputs = (q, k, v, *(() if gate is None else (gate,)), *tensors)
    grads: list[Tensor | None] = [None] * len(inputs)

    def query_backward(d_q: Tensor) -> None:
        d_scale = None if d_query_scale is None else chunkwise._chunk_major(d_query_scale, chunk)
        grads[:] = core._backprop((phi_q, query_log_scale), (d_q, d_scale), inputs)

    d_k, *d_rest, d_kv = _causal_group_backward(
        phi_q.detach(), phi_k.detach(), fac.v.detach(), values[0], values[1], values[2], enter,
        values[3], intra_weight, kv.detach(), chunkwise._chunk_major(g, chunk), d_final, needs,
        query_backward,
    )
    keys = core._backprop((phi_k, fac.v, weight, to_end, keep, inter), (d_k, *d_rest), inputs)
    grads = [core._add(a, b) for a, b in zip(grads, keys, strict=True)]
    if gate is None:
        grads.insert(3, None)
    return d_kv, grads
