"""Triton kernels of the per-feature core's ``triton`` strategy: the causal scan of a map
φ(x) = exp(u), u = x̃ w_h^T + b_h (one affine map per head h: Hedgehog's), fused, one program
walking the chunks of one (batch, head, feature block) with its state in registers, the
exponents formed inside from x̃ and the head's rows.

The sums are those of :mod:`effattn.kernelized.exponents` (its docstring gives the scales):
per chunk c of C tokens, R_{c-1} (BK) the running max of each feature over the keys before the
chunk (the state's scale), R_c the one after it (floored at ``LOG_FLOOR``, as the other
strategies do), c_i the query's shift max_f (u_qf(i) + M_f(i)) (M_f(i) the running max up to
key i), Q = exp(u_q + R_{c-1} - c) and K = exp(u_k - R_c), both <= 1:

    num_i = Q_i S_c + Σ_{j <= i in c} A_ij v_j,     den_i = Q_i·z_c + Σ_{j <= i in c} A_ij,
    A_ij  = Σ_f exp(u_qf(i) + u_kf(j) - c_i)        (each term <= 1),
    S_{c+1} = exp(R_{c-1} - R_c) ⊙ S_c + K^T v      (z alike, with 1 for v).

No chunk state is written: per call the kernels write the outputs, the running maxima
R_{-1}..R_{nc-1} per feature (B, H, nc + 1, F, the last the state after's) and, on request,
the states entering every S_b tokens (checkpoints for the backward's spans).

The in-chunk products A: as a GEMM of Q' = exp(u_q + R_c - c) and K where the largest
exponent of Q' (the growth of a feature's running max between a query and its chunk's end)
is at most ``LIMIT`` (:data:`GROWTH`: 60 in fp32, whose products then stay far from e^88 and
lose only terms below e^-27 of the row's largest; 600 in fp64); else, for that chunk,
term by term, exp(min(u_q(i) + u_k(j) - c_i, 0)) summed over the block's features, a loop over
the chunk's keys (C passes over a (C, BK) tile): exact at any growth, where the GPU strategy's
float64 GEMM clamps at 700. Which form a chunk takes is decided in the kernel (no host sync).

c_i spans every feature block: ``_shift_kernel`` forms it first (each block's maximum, the
blocks' combined by an atomic max, or with ``torch.use_deterministic_algorithms`` one row per
block reduced after).

Backward, the shifts and running maxima held constant (the ratio does not depend on them),
G = ∂L/∂num = dO / d, g = ∂L/∂den (from :func:`effattn.kernelized.fused_kernels.divisor_grad`),
dA = (G v^T + g) ⊙ [j <= i] and U_{c+1} the adjoint of S_{c+1}:

- ``_backward_queries_kernel``, chunks in order, the state recomputed:
  ∂L/∂u_q = Q ⊙ (G S_c^T + g z_c^T) + Q' ⊙ (dA K)  (term by term: Σ_j dA_ij exp(u_q + u_kj - c_i));
- ``_backward_keys_kernel``, chunks in reverse:
  ∂L/∂u_k = K ⊙ (v U^T + 1 uz^T + dA^T Q'),  ∂L/∂v = K U + A^T G,
  U_c = exp(R_{c-1} - R_c) ⊙ U_{c+1} + Q^T [G, g].

From ∂L/∂u (never stored) each kernel writes its block's part of ∂L/∂x̃ = ∂L/∂u w (summed over
blocks as :mod:`effattn.kernelized.fused_kernels` sums) and accumulates ∂L/∂w = ∂L/∂u^T x̃ and
∂L/∂b = Σ_t ∂L/∂u in registers (a program owns its rows of them), written once per (batch,
head): (B H, F, D) and (B H, F), summed over the batch by the caller.

Segments (a third grid dimension, as the row kernels'): the chunks split into P segments
walked side by side where the (feature block, batch-head) programs alone would leave a GPU's
multiprocessors idle (:func:`effattn.kernelized.fused_kernels.segments`). A first launch
(``STATES``) walks each segment's keys from an empty state; the state entering segment p has
row f e^{R_in,f - R_p,f} S_in,f + Σ_{q < p} e^{r_q,f - R_p,f} L_q,f, with R_p,f the largest
of those maxima (:func:`effattn.kernelized.fused_kernels._entering`, per feature): a max, so
exactly one walk's running maxima. The shifts follow, segment by segment from those maxima,
then the main launch. The backward takes the same states (at the forward's maxima) and, for
the keys' kernel, the gradients of the states leaving the segments from a first launch over
each segment's queries in reverse (``ADJOINT``,
:func:`effattn.kernelized.fused_kernels._adjoints`); ∂L/∂w and ∂L/∂b come per segment, summed
by the caller.

Launch geometry, chunk, accumulator and precision are the row kernels'
(:func:`effattn.kernelized.fused_kernels.meta` with the map formed inside). On the CPU these run
under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests them.

Shapes: B batch, H heads, N tokens, F features (the width of u), D the width of x̃, Dv value
dim, nc = ceil(N / C) chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from effattn.base import compute_dtype
from effattn.kernelized import fused_kernels as fk
from effattn.kernelized.core import LOG_FLOOR
from effattn.kernelized.exponents import FP32_GROWTH
from effattn.kernelized.fused_kernels import atomic, meta

# The largest exponent of the in-chunk query factor exp(u_q + R_c - c_i) for which a chunk's
# products run as a GEMM, by accumulator: fp32 holds e^88, and with factors up to e^60 the key
# factors that underflow carry terms below e^-27 of the row's largest; fp64 holds e^709.
GROWTH = {torch.float32: FP32_GROWTH, torch.float64: 600.0}


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _head_rows(w_ptr, b_ptr, head, f, f_ok, F, D, BD: tl.constexpr, ACC: tl.constexpr):
    """The rows f (BK, BD) of head ``head``'s projection w (H, F, D) and its offsets b (BK)."""
    w = fk._projection(w_ptr + head * F * D, f, f_ok, D, BD)
    b = tl.load(b_ptr + head * F + f, mask=f_ok, other=0.0).to(ACC)
    return w, b


@triton.jit
def _exponents(x_ptr, w, b, t, t_ok, D, BD: tl.constexpr, ACC: tl.constexpr,
               PRECISION: tl.constexpr):
    """u = x̃ w^T + b of the tokens t (BT, BK), in ACC, and x̃ (BT, BD) in w's dtype (0 past the
    sequence and past D; read in its own dtype: half-precision q, k need no promoted copy)."""
    e = tl.arange(0, BD)
    x = tl.load(x_ptr + t[:, None] * D + e[None, :], mask=t_ok[:, None] & (e < D)[None, :],
                other=0.0).to(w.dtype)
    u = tl.dot(x, tl.trans(w), input_precision=PRECISION).to(ACC) + b[None, :]
    return u, x


@triton.jit
def _key_exponents(x_ptr, ls_ptr, w, b, t, t_ok, f_ok, D, BD: tl.constexpr, ACC: tl.constexpr,
                   PRECISION: tl.constexpr):
    """The keys' u plus their log-weights ls (0, or -inf at padded keys), -inf past the
    sequence and past F (such keys and features have no weight and set no scale), and x̃."""
    u, x = _exponents(x_ptr, w, b, t, t_ok, D, BD, ACC, PRECISION)
    ls = tl.load(ls_ptr + t, mask=t_ok, other=float("-inf")).to(ACC)
    return tl.where(f_ok[None, :], u + ls[:, None], float("-inf")), x


@triton.jit
def _state_rows(ptr, bh, f, f_ok, d, d_ok, F, DV, ACC: tl.constexpr):
    """This block's rows f of a (B H, F, Dv + 1) state [S, z] (or of its adjoint), in ACC: S
    (BK, BV) and z (BK)."""
    rows = ptr + bh * F * (DV + 1) + f * (DV + 1)
    s = tl.load(rows[:, None] + d[None, :], mask=f_ok[:, None] & d_ok[None, :],
                other=0.0).to(ACC)
    return s, tl.load(rows + DV, mask=f_ok, other=0.0).to(ACC)


@triton.jit
def _exact_pairs(u_q, u_k, shift, causal, BT: tl.constexpr, ACC: tl.constexpr):
    """A_ij = Σ_f exp(min(u_qf(i) + u_kf(j) - c_i, 0)) for j <= i (BT, BT), term by term: one
    key j at a time."""
    t0 = tl.arange(0, BT)
    a = tl.zeros([BT, BT], dtype=ACC)
    for j in range(0, BT):
        sel = t0 == j
        ukj = tl.sum(tl.where(sel[:, None], u_k, 0.0), 0)
        col = tl.sum(tl.exp(tl.minimum(u_q + ukj[None, :] - shift[:, None], 0.0)), 1)
        a = tl.where(sel[None, :], col[:, None], a)
    return tl.where(causal, a, 0.0)


@triton.jit
def _exact_query_grad(u_q, u_k, shift, d_a, BT: tl.constexpr, BK: tl.constexpr,
                      ACC: tl.constexpr):
    """Σ_j dA_ij exp(min(u_qf(i) + u_kf(j) - c_i, 0)) (BT, BK), term by term (dA is 0 above
    the diagonal)."""
    t0 = tl.arange(0, BT)
    g = tl.zeros([BT, BK], dtype=ACC)
    for j in range(0, BT):
        sel = t0 == j
        ukj = tl.sum(tl.where(sel[:, None], u_k, 0.0), 0)
        daj = tl.sum(tl.where(sel[None, :], d_a, 0.0), 1)
        g += daj[:, None] * tl.exp(tl.minimum(u_q + ukj[None, :] - shift[:, None], 0.0))
    return g


@triton.jit
def _exact_key_terms(u_q, u_k, shift, d_a, BT: tl.constexpr, BK: tl.constexpr,
                     ACC: tl.constexpr):
    """A (BT, BT) and Σ_i dA_ij exp(min(u_qf(i) + u_kf(j) - c_i, 0)) (BT, BK), term by term:
    one query i at a time, over its keys j <= i."""
    t0 = tl.arange(0, BT)
    a = tl.zeros([BT, BT], dtype=ACC)
    g = tl.zeros([BT, BK], dtype=ACC)
    for i in range(0, BT):
        sel = t0 == i
        uqi = tl.sum(tl.where(sel[:, None], u_q, 0.0), 0)
        ci = tl.sum(tl.where(sel, shift, 0.0), 0)
        dai = tl.sum(tl.where(sel[:, None], d_a, 0.0), 0)
        p = tl.where((t0 <= i)[:, None], tl.exp(tl.minimum(uqi[None, :] + u_k - ci, 0.0)), 0.0)
        g += dai[:, None] * p
        a = tl.where(sel[:, None], tl.sum(p, 1)[None, :], a)
    return a, g


@triton.jit
def _shift_kernel(q_ptr, k_ptr, ls_ptr, r_in_ptr, w_ptr, b_ptr, c_ptr,
                  N, F, D, NC, BH, H, SEG, LOG_FLOOR_: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                  PRECISION: tl.constexpr, ATOMIC: tl.constexpr):
    """c_i = max_f (u_qf(i) + max(R_in, max_{j <= i} u_kf(j))) over this block's features,
    combined over the blocks by an atomic max (``ATOMIC``) or stored in the block's own row;
    segment p walks chunks [p SEG, (p + 1) SEG) from its entering maxima (row bh P + p)."""
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    seg = bh * tl.num_programs(2) + p
    f = kb * BK + tl.arange(0, BK)
    t0 = tl.arange(0, BT)
    f_ok = f < F
    w, b = _head_rows(w_ptr, b_ptr, bh % H, f, f_ok, F, D, BD, ACC)
    r = tl.load(r_in_ptr + seg * F + f, mask=f_ok, other=0.0).to(ACC)
    out = c_ptr + fk._part(kb, bh, BH, N, ATOMIC)
    for c in range(p * SEG, tl.minimum(NC, (p + 1) * SEG)):
        t = c * BT + t0
        t_ok = t < N
        u_q, _ = _exponents(q_ptr + bh * N * D, w, b, t, t_ok, D, BD, ACC, PRECISION)
        u_k, _ = _key_exponents(k_ptr + bh * N * D, ls_ptr + bh * N, w, b, t, t_ok, f_ok, D,
                                BD, ACC, PRECISION)
        seen = tl.maximum(tl.associative_scan(u_k, 0, _max), r[None, :])
        top = tl.max(tl.where(f_ok[None, :], u_q + seen, float("-inf")), 1)
        if ATOMIC:
            tl.atomic_max(out + t, top, mask=t_ok)
        else:
            tl.store(out + t, top, mask=t_ok)
        r = tl.maximum(tl.maximum(r, tl.max(u_k, 0)), LOG_FLOOR_)


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, ls_ptr, v_ptr, kv_in_ptr, r_in_ptr, w_ptr, b_ptr, c_ptr,
    num_ptr, den_ptr, kv_out_ptr, r_ptr, marks_ptr,
    N, F, D, DV, NC, BH, H, EVERY, NMARKS, SEG, LOG_FLOOR_: tl.constexpr,
    LIMIT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
    STATES: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    # Segment p walks chunks [p SEG, (p + 1) SEG) from its entering state and maxima (row
    # bh P + p); with STATES, from an empty state (0 at LOG_FLOOR), the keys' side only,
    # writing the state and maxima it ends with (row bh P + p of kv_out and r).
    p = tl.program_id(2)
    seg = bh * tl.num_programs(2) + p
    c_start = p * SEG
    c_end = tl.minimum(NC, c_start + SEG)
    f = kb * BK + tl.arange(0, BK)
    d = tl.arange(0, BV)
    t0 = tl.arange(0, BT)
    f_ok = f < F
    d_ok = d < DV
    causal = t0[None, :] <= t0[:, None]
    w, b = _head_rows(w_ptr, b_ptr, bh % H, f, f_ok, F, D, BD, ACC)
    if STATES:
        s = tl.zeros([BK, BV], dtype=ACC)
        z = tl.zeros([BK], dtype=ACC)
        r = tl.full([BK], LOG_FLOOR_, ACC)
    else:
        s, z = _state_rows(kv_in_ptr, seg, f, f_ok, d, d_ok, F, DV, ACC)
        r = tl.load(r_in_ptr + seg * F + f, mask=f_ok, other=0.0).to(ACC)
    part = fk._part(kb, bh, BH, N, ATOMIC)
    for c in range(c_start, c_end):
        if (c > 0) & (c % EVERY == 0):
            fk._store_state(marks_ptr + (bh * NMARKS + c // EVERY - 1) * F * (DV + 1), s, z, f,
                            f_ok, d, d_ok, DV)
        t = c * BT + t0
        t_ok = t < N
        ok = t_ok[:, None] & f_ok[None, :]
        u_k, _ = _key_exponents(k_ptr + bh * N * D, ls_ptr + bh * N, w, b, t, t_ok, f_ok, D,
                                BD, ACC, PRECISION)
        r_next = tl.maximum(tl.maximum(r, tl.max(u_k, 0)), LOG_FLOOR_)
        k_f = tl.exp(u_k - r_next[None, :])
        vc = tl.load(v_ptr + bh * N * DV + t[:, None] * DV + d[None, :],
                     mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        if not STATES:
            tl.store(r_ptr + (bh * (NC + 1) + c) * F + f, r, mask=f_ok)
            u_q, _ = _exponents(q_ptr + bh * N * D, w, b, t, t_ok, D, BD, ACC, PRECISION)
            shift = tl.load(c_ptr + bh * N + t, mask=t_ok, other=0.0).to(ACC)
            q_f = tl.exp(tl.where(ok, u_q + r[None, :] - shift[:, None], float("-inf")))
            grow = tl.where(ok, u_q + r_next[None, :] - shift[:, None], float("-inf"))
            if tl.max(grow) <= LIMIT:
                a = tl.where(causal, tl.dot(tl.exp(grow), tl.trans(k_f),
                                            input_precision=PRECISION), 0.0)
            else:
                a = _exact_pairs(u_q, u_k, shift, causal, BT, ACC)
            num = tl.dot(q_f, s, input_precision=PRECISION) + tl.dot(a, vc,
                                                                     input_precision=PRECISION)
            den = tl.sum(q_f * z[None, :], 1) + tl.sum(a, 1)
            fk._put(num_ptr + part * DV + t[:, None] * DV + d[None, :], num,
                    t_ok[:, None] & d_ok[None, :], ATOMIC)
            fk._put(den_ptr + part + t, den, t_ok, ATOMIC)
        keep = tl.exp(r - r_next)
        s = s * keep[:, None] + tl.dot(tl.trans(k_f), vc, input_precision=PRECISION)
        z = z * keep + tl.sum(k_f, 0)
        r = r_next
    # The state after: each segment's with STATES, else the last segment's.
    if STATES:
        fk._store_state(kv_out_ptr + seg * F * (DV + 1), s, z, f, f_ok, d, d_ok, DV)
        tl.store(r_ptr + seg * F + f, r, mask=f_ok)
    elif c_end == NC:
        fk._store_state(kv_out_ptr + bh * F * (DV + 1), s, z, f, f_ok, d, d_ok, DV)
        tl.store(r_ptr + (bh * (NC + 1) + NC) * F + f, r, mask=f_ok)


@triton.jit
def _store_exponent_grads(dx_ptr, du, w, x, part, t, t_ok, D, BD: tl.constexpr,
                          ACC: tl.constexpr, PRECISION: tl.constexpr, ATOMIC: tl.constexpr):
    """This block's part of ∂L/∂x̃ = ∂L/∂u w at the tokens t, and its rows' ∂L/∂w = ∂L/∂u^T x̃
    (BK, BD) of the chunk."""
    e = tl.arange(0, BD)
    dx = tl.dot(du, w.to(ACC), input_precision=PRECISION)
    fk._put(dx_ptr + part * D + t[:, None] * D + e[None, :], dx,
            t_ok[:, None] & (e < D)[None, :], ATOMIC)
    return tl.dot(tl.trans(du), x.to(ACC), input_precision=PRECISION)


@triton.jit
def _recomputed(q_ptr, k_ptr, ls_ptr, r_ptr, c_ptr, w, b, bh, c, t, t_ok, f, f_ok, N, F, D, NC,
                BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """What the backward kernels recompute of chunk c: the running maxima before and after it
    (R_{c-1}, R_c, as the forward stored them), the exponents u_q, u_k with x̃ of each, the
    queries' shifts and the factors Q = exp(u_q + R_{c-1} - c), K = exp(u_k - R_c) (0 past the
    sequence and past F)."""
    r = tl.load(r_ptr + (bh * (NC + 1) + c) * F + f, mask=f_ok, other=0.0).to(ACC)
    r_next = tl.load(r_ptr + (bh * (NC + 1) + c + 1) * F + f, mask=f_ok, other=0.0).to(ACC)
    u_q, xq = _exponents(q_ptr + bh * N * D, w, b, t, t_ok, D, BD, ACC, PRECISION)
    u_k, xk = _key_exponents(k_ptr + bh * N * D, ls_ptr + bh * N, w, b, t, t_ok, f_ok, D, BD,
                             ACC, PRECISION)
    shift = tl.load(c_ptr + bh * N + t, mask=t_ok, other=0.0).to(ACC)
    ok = t_ok[:, None] & f_ok[None, :]
    q_f = tl.exp(tl.where(ok, u_q + r[None, :] - shift[:, None], float("-inf")))
    k_f = tl.exp(u_k - r_next[None, :])
    return r, r_next, u_q, xq, u_k, xk, shift, q_f, k_f


@triton.jit
def _backward_queries_kernel(
    q_ptr, k_ptr, ls_ptr, v_ptr, kv_in_ptr, r_ptr, c_ptr, do_ptr, div_ptr, gd_ptr, w_ptr,
    b_ptr, dq_ptr, dw_ptr, db_ptr,
    N, F, D, DV, NC, BH, H, DO_BH, DO_ROW, DO_COL, SEG, LIMIT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    # Segment p: chunks [p SEG, (p + 1) SEG) from the state entering it; its rows' ∂L/∂w and
    # ∂L/∂b are its own (row bh P + p), summed over the segments by the caller.
    p = tl.program_id(2)
    seg = bh * tl.num_programs(2) + p
    f = kb * BK + tl.arange(0, BK)
    d = tl.arange(0, BV)
    e = tl.arange(0, BD)
    t0 = tl.arange(0, BT)
    f_ok = f < F
    d_ok = d < DV
    causal = t0[None, :] <= t0[:, None]
    w, b = _head_rows(w_ptr, b_ptr, bh % H, f, f_ok, F, D, BD, ACC)
    s, z = _state_rows(kv_in_ptr, seg, f, f_ok, d, d_ok, F, DV, ACC)
    dw = tl.zeros([BK, BD], dtype=ACC)
    db = tl.zeros([BK], dtype=ACC)
    part = fk._part(kb, bh, BH, N, ATOMIC)
    for c in range(p * SEG, tl.minimum(NC, (p + 1) * SEG)):
        t = c * BT + t0
        t_ok = t < N
        ok = t_ok[:, None] & f_ok[None, :]
        r, r_next, u_q, xq, u_k, _, shift, q_f, k_f = _recomputed(
            q_ptr, k_ptr, ls_ptr, r_ptr, c_ptr, w, b, bh, c, t, t_ok, f, f_ok, N, F, D, NC, BD,
            ACC, PRECISION)
        vd_ok = t_ok[:, None] & d_ok[None, :]
        vc = tl.load(v_ptr + bh * N * DV + t[:, None] * DV + d[None, :], mask=vd_ok,
                     other=0.0).to(ACC)
        gn, gd = fk._ratio_grads(do_ptr, div_ptr, gd_ptr, bh, t, t_ok, d, vd_ok, N, DO_BH,
                                 DO_ROW, DO_COL, ACC)
        d_a = tl.where(causal, tl.dot(gn, tl.trans(vc), input_precision=PRECISION)
                       + gd[:, None], 0.0)
        du = q_f * (tl.dot(gn, tl.trans(s), input_precision=PRECISION)
                    + gd[:, None] * z[None, :])
        grow = tl.where(ok, u_q + r_next[None, :] - shift[:, None], float("-inf"))
        if tl.max(grow) <= LIMIT:
            du += tl.exp(grow) * tl.dot(d_a, k_f, input_precision=PRECISION)
        else:
            du += _exact_query_grad(u_q, u_k, shift, d_a, BT, BK, ACC)
        du = tl.where(ok, du, 0.0)
        dw += _store_exponent_grads(dq_ptr, du, w, xq, part, t, t_ok, D, BD, ACC, PRECISION,
                                    ATOMIC)
        db += tl.sum(du, 0)
        keep = tl.exp(r - r_next)
        s = s * keep[:, None] + tl.dot(tl.trans(k_f), vc, input_precision=PRECISION)
        z = z * keep + tl.sum(k_f, 0)
    tl.store(dw_ptr + seg * F * D + f[:, None] * D + e[None, :], dw,
             mask=f_ok[:, None] & (e < D)[None, :])
    tl.store(db_ptr + seg * F + f, db, mask=f_ok)


@triton.jit
def _backward_keys_kernel(
    q_ptr, k_ptr, ls_ptr, v_ptr, r_ptr, c_ptr, do_ptr, div_ptr, gd_ptr, du_ptr, w_ptr, b_ptr,
    dk_ptr, dv_ptr, dkv_in_ptr, dw_ptr, db_ptr,
    N, F, D, DV, NC, BH, H, DO_BH, DO_ROW, DO_COL, SEG, LIMIT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC: tl.constexpr, ADJOINT: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    # Segment p walks chunks [p SEG, (p + 1) SEG) in reverse from the adjoint of the state after
    # it (row bh P + p of du), adding to its rows of ∂L/∂w, ∂L/∂b (row bh P + p); with
    # ADJOINT, from 0, the queries' side only, writing the adjoint it ends with (row bh P + p
    # of dkv_in).
    p = tl.program_id(2)
    seg = bh * tl.num_programs(2) + p
    c_start = p * SEG
    c_end = tl.minimum(NC, c_start + SEG)
    f = kb * BK + tl.arange(0, BK)
    d = tl.arange(0, BV)
    e = tl.arange(0, BD)
    t0 = tl.arange(0, BT)
    f_ok = f < F
    d_ok = d < DV
    causal = t0[None, :] <= t0[:, None]
    w, b = _head_rows(w_ptr, b_ptr, bh % H, f, f_ok, F, D, BD, ACC)
    rows = dw_ptr + seg * F * D + f[:, None] * D + e[None, :]
    rows_ok = f_ok[:, None] & (e < D)[None, :]
    if ADJOINT:
        u = tl.zeros([BK, BV], dtype=ACC)
        uz = tl.zeros([BK], dtype=ACC)
    else:
        u, uz = _state_rows(du_ptr, seg, f, f_ok, d, d_ok, F, DV, ACC)
        dw = tl.load(rows, mask=rows_ok, other=0.0)
        db = tl.load(db_ptr + seg * F + f, mask=f_ok, other=0.0)
    part = fk._part(kb, bh, BH, N, ATOMIC)
    for i in range(0, c_end - c_start):
        c = c_end - 1 - i
        t = c * BT + t0
        t_ok = t < N
        ok = t_ok[:, None] & f_ok[None, :]
        r, r_next, u_q, _, u_k, xk, shift, q_f, k_f = _recomputed(
            q_ptr, k_ptr, ls_ptr, r_ptr, c_ptr, w, b, bh, c, t, t_ok, f, f_ok, N, F, D, NC, BD,
            ACC, PRECISION)
        values = t[:, None] * DV + d[None, :]
        vd_ok = t_ok[:, None] & d_ok[None, :]
        gn, gd = fk._ratio_grads(do_ptr, div_ptr, gd_ptr, bh, t, t_ok, d, vd_ok, N, DO_BH,
                                 DO_ROW, DO_COL, ACC)
        if not ADJOINT:
            vc = tl.load(v_ptr + bh * N * DV + values, mask=vd_ok, other=0.0).to(ACC)
            d_a = tl.where(causal, tl.dot(gn, tl.trans(vc), input_precision=PRECISION)
                           + gd[:, None], 0.0)
            grow = tl.where(ok, u_q + r_next[None, :] - shift[:, None], float("-inf"))
            if tl.max(grow) <= LIMIT:
                q_g = tl.exp(grow)
                a = tl.where(causal, tl.dot(q_g, tl.trans(k_f), input_precision=PRECISION),
                             0.0)
                dk = k_f * tl.dot(tl.trans(d_a), q_g, input_precision=PRECISION)
            else:
                a, dk = _exact_key_terms(u_q, u_k, shift, d_a, BT, BK, ACC)
            dk += k_f * (tl.dot(vc, tl.trans(u), input_precision=PRECISION) + uz[None, :])
            dk = tl.where(ok, dk, 0.0)
            dv = tl.dot(k_f, u, input_precision=PRECISION)
            dv += tl.dot(tl.trans(a), gn, input_precision=PRECISION)
            fk._put(dv_ptr + part * DV + values, dv, vd_ok, ATOMIC)
            dw += _store_exponent_grads(dk_ptr, dk, w, xk, part, t, t_ok, D, BD, ACC,
                                        PRECISION, ATOMIC)
            db += tl.sum(dk, 0)
        keep = tl.exp(r - r_next)
        u = u * keep[:, None] + tl.dot(tl.trans(q_f), gn, input_precision=PRECISION)
        uz = uz * keep + tl.sum(q_f * gd[:, None], 0)
    # The adjoint entering the segment: each segment's with ADJOINT, else the first segment's
    # (that of the state entering the call).
    if ADJOINT:
        fk._store_state(dkv_in_ptr + seg * F * (DV + 1), u, uz, f, f_ok, d, d_ok, DV)
    else:
        if p == 0:
            fk._store_state(dkv_in_ptr + bh * F * (DV + 1), u, uz, f, f_ok, d, d_ok, DV)
        tl.store(rows, dw, mask=rows_ok)
        tl.store(db_ptr + seg * F + f, db, mask=f_ok)


# The kernels, for benchmarks/triton_resources.py's ahead-of-time compiles (arguments typed as
# fused_kernels.INPUTS, INTEGERS say, plus these).
KERNELS = (_shift_kernel, _forward_kernel, _backward_queries_kernel, _backward_keys_kernel)
INTEGERS = frozenset({"H"})


def _config(x: Tensor, chunk: int, f: int, dv: int) -> dict:
    """The launch's constexprs for x̃ like x (:func:`effattn.kernelized.fused_kernels.meta` of
    its compute dtype, the map formed inside) and the growth limit of the in-chunk GEMM."""
    config = meta(compute_dtype(x.dtype), chunk, f, dv, x.shape[-1], True)
    return {**config, "LIMIT": GROWTH[fk._accumulator(x.dtype)]}


def _launch_sizes(x: Tensor, w: Tensor, config: dict) -> tuple[int, int, int, int, int]:
    b, h, n, d = x.shape
    f = w.shape[1]
    return b * h, n, f, triton.cdiv(f, config["BK"]), triton.cdiv(n, config["BT"])


def _shifts(xq: Tensor, xk: Tensor, ls: Tensor, w: Tensor, bias: Tensor, scale: Tensor,
            config: dict, per: int, count: int) -> Tensor:
    """The queries' shifts c (B, H, N): c_i = max_f (u_qf(i) + max(R_f, max_{j <= i} u_kf(j)))
    of x̃ (B, H, N, D) (queries and keys), the keys' log-weights ls (B, H, N) (-inf at padded
    keys), the heads' rows w (H, F, D) and offsets b (H, F), and the maxima R entering each of
    ``count`` segments of ``per`` chunks (B, H, count, F); in fp32 (fp64 for fp64)."""
    b, h = xq.shape[:2]
    bh, n, f, nk, nc = _launch_sizes(xq, w, config)
    acc = fk._accumulator(xq.dtype)
    many = atomic(nk)
    c = (xq.new_full((b, h, n), float("-inf"), dtype=acc) if many
         else xq.new_empty(nk, b, h, n, dtype=acc))
    _shift_kernel[(nk, bh, count)](
        xq, xk, ls, scale.contiguous(), w, bias, c, n, f, xq.shape[-1], nc, bh, h, per,
        LOG_FLOOR, BT=config["BT"], BK=config["BK"], BD=config["BD"], ACC=config["ACC"],
        PRECISION=config["PRECISION"], ATOMIC=many, num_warps=config["num_warps"])
    return c if many else c.amax(0)


def forward(xq: Tensor, xk: Tensor, ls: Tensor, v: Tensor, kv: Tensor, scale: Tensor,
            w: Tensor, bias: Tensor, chunk: int, every: int | None = None,
            split: int | None = None,
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused causal scan of x̃ (B, H, N, D), ls, v (B, H, N, Dv), the entering state kv
    (B, H, F, Dv + 1) at scales R (B, H, F), the rows w (H, F, D) and offsets b (H, F): num
    (B, H, N, Dv) and den (B, H, N) held at exp(c), the state after, the running maxima
    R_{-1}..R_{nc-1} (B, H, nc + 1, F) (the last the state after's), the states entering tokens
    ``every``, 2 ``every``, ... < N (a multiple of the chunk; None: none) (B, H, n_marks, F,
    Dv + 1) (one unused slot when there are none) and the queries' shifts c (B, H, N)
    (``_shift_kernel``, launched first); in fp32 (fp64 for fp64). v may be in a narrower dtype
    (converted tile by tile).

    The chunks are walked in ``split`` segments side by side (None:
    :func:`effattn.kernelized.fused_kernels.segments`' count for the device), as the row
    kernels walk theirs: a first launch walks each segment's keys from an empty state, and the
    states and maxima entering the segments follow per feature
    (:func:`effattn.kernelized.fused_kernels._entering`)."""
    b, h = xq.shape[:2]
    dv = v.shape[-1]
    config = _config(xq, chunk, w.shape[1], dv)
    bh, n, f, nk, nc = _launch_sizes(xq, w, config)
    if every is not None and every % config["BT"]:
        raise ValueError(f"checkpoints every {every} tokens: not a multiple of the chunk "
                         f"{config['BT']}")
    every = nc + 1 if every is None else every // config["BT"]
    n_marks = (nc - 1) // every
    acc = fk._accumulator(xq.dtype)
    per, count = fk._split(nc, fk.segments(xq.device, nk * bh, nc) if split is None else split)
    kv, scale = kv.to(acc).contiguous(), scale.to(acc).contiguous()
    d = xq.shape[-1]
    if count > 1:
        local = xq.new_empty(b, h, count, f, dv + 1, dtype=acc)
        ends = xq.new_empty(b, h, count, f, dtype=acc)
        # The first launch reads no entering state, no shifts, and writes no outputs and no
        # checkpoints: kv stands in.
        _forward_kernel[(nk, bh, count)](
            xq, xk, ls, v, kv, scale, w, bias, kv, kv, kv, local, ends, kv, n, f, d, dv, nc,
            bh, h, nc + 1, 1, per, LOG_FLOOR, **config, ATOMIC=atomic(nk), STATES=True)
        kv, scale = fk._entering(kv, scale, local, ends)
    c = _shifts(xq, xk, ls, w, bias, scale, config, per, count)
    num = fk._partial(xq, nk, b, h, n, dv, dtype=acc)
    den = fk._partial(xq, nk, b, h, n, dtype=acc)
    kv_out = xq.new_empty(b, h, f, dv + 1, dtype=acc)
    running = xq.new_empty(b, h, nc + 1, f, dtype=acc)
    marks = xq.new_empty(b, h, max(1, n_marks), f, dv + 1, dtype=acc)
    _forward_kernel[(nk, bh, count)](
        xq, xk, ls, v, kv.contiguous(), scale.contiguous(), w, bias, c, num, den, kv_out,
        running, marks, n, f, d, dv, nc, bh, h, every, max(1, n_marks), per, LOG_FLOOR,
        **config, ATOMIC=atomic(nk), STATES=False)
    return fk._total(num, nk), fk._total(den, nk), kv_out, running, marks, c


def backward(xq: Tensor, xk: Tensor, ls: Tensor, v: Tensor, kv: Tensor, running: Tensor,
             c: Tensor, d_out: Tensor, div: Tensor, d_den: Tensor, d_after: Tensor | None,
             w: Tensor, bias: Tensor, chunk: int, split: int | None = None,
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`forward`'s x̃ (queries and keys, (B, H, N, D)), v, kv (the
    entering state), w and b (summed over the batch: (H, F, D), (H, F)) from d_out
    (B, H, N, Dv, read in its own dtype and in place), the divisors div (B, H, N), the
    denominators' gradient (B, H, N) and the state after's (None: 0), given the forward's
    running maxima and shifts (held constant: the output does not depend on them); in
    ``split`` segments as :func:`forward` (the states entering them at the forward's maxima,
    the gradients of the states leaving them from a first launch over each segment's queries
    in reverse, :func:`effattn.kernelized.fused_kernels._adjoints`)."""
    b, h = xq.shape[:2]
    dv = v.shape[-1]
    config = _config(xq, chunk, w.shape[1], dv)
    bh, n, f, nk, nc = _launch_sizes(xq, w, config)
    d = xq.shape[-1]
    acc = running.dtype
    d_out, *read_do = fk._strided(d_out)
    div, d_den = div.to(acc).contiguous(), d_den.to(acc).contiguous()
    if d_after is None:
        d_after = kv.new_zeros(b, h, f, dv + 1, dtype=acc)
    d_q, d_k = (fk._partial(xq, nk, b, h, n, d, dtype=acc) for _ in range(2))
    d_v = fk._partial(v, nk, b, h, n, dv, dtype=acc)
    d_kv = kv.new_empty(b, h, f, dv + 1, dtype=acc)
    per, count = fk._split(nc, fk.segments(xq.device, nk * bh, nc) if split is None else split)
    # Each segment's rows of ∂L/∂w and ∂L/∂b, summed over the batch and the segments below.
    d_w = xq.new_empty(b, h, count, f, d, dtype=acc)
    d_b = xq.new_empty(b, h, count, f, dtype=acc)
    grid = (nk, bh, count)
    kv, d_after = kv.to(acc).contiguous(), d_after.to(acc).contiguous()
    if count > 1:
        starts = torch.cat([running[:, :, 0:nc:per], running[:, :, nc:]], 2)
        local = xq.new_empty(b, h, count, f, dv + 1, dtype=acc)
        ends = xq.new_empty(b, h, count, f, dtype=acc)
        _forward_kernel[grid](
            xq, xk, ls, v, kv, kv, w, bias, kv, kv, kv, local, ends, kv, n, f, d, dv, nc, bh, h,
            nc + 1, 1, per, LOG_FLOOR, **config, ATOMIC=atomic(nk), STATES=True)
        kv = fk._entering(kv, running[:, :, 0], local, ends, target=starts[:, :, :-1])[0]
        _backward_keys_kernel[grid](
            xq, xk, ls, v, running, c, d_out, div, d_den, kv, w, bias, kv, kv, local, kv, kv, n,
            f, d, dv, nc, bh, h, *read_do, per, **config, ATOMIC=atomic(nk), ADJOINT=True)
        d_after = fk._adjoints(d_after, local, starts)
    _backward_queries_kernel[grid](
        xq, xk, ls, v, kv.contiguous(), running, c, d_out, div, d_den, w, bias, d_q, d_w, d_b,
        n, f, d, dv, nc, bh, h, *read_do, per, **config, ATOMIC=atomic(nk))
    _backward_keys_kernel[grid](
        xq, xk, ls, v, running, c, d_out, div, d_den, d_after.contiguous(), w, bias, d_k, d_v,
        d_kv, d_w, d_b, n, f, d, dv, nc, bh, h, *read_do, per, **config, ATOMIC=atomic(nk),
        ADJOINT=False)
    return (fk._total(d_q, nk), fk._total(d_k, nk), fk._total(d_v, nk), d_kv,
            d_w.sum((0, 2)), d_b.sum((0, 2)))
