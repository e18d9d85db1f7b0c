"""Triton kernels of the kernelized engine's ``triton`` strategy: the causal scan fused, one
program walking the chunks of one (batch, head, feature block) with its state in registers.

The sums are those of the chunk-parallel form (:mod:`effattn.kernelized.gpu`), walked in order
rather than unrolled: per chunk c of C tokens, with S_c, z_c the state before it at scale
exp(R_c), the keys' log-weights ls (log-scale, plus log(1 - g) with a gate; -inf at padded keys
and after the sequence), the inclusive cumulative log-gates Λ_i inside the chunk (0 ungated),
a_j = ls_j - Λ_j, the prefix max P_i = max_{j <= i, j in c} a_j and the output scale
m_i = max(LOG_FLOOR, P_i + Λ_i, R_c + Λ_i):

    num_i = ω_i φ(q_i) S_c + Σ_{j in c, j <= i} (φ(q_i)·φ(k_j)) exp(a_j + Λ_i - m_i) v_j,
    den_i = ω_i φ(q_i)·z_c + Σ_{j in c, j <= i} (φ(q_i)·φ(k_j)) exp(a_j + Λ_i - m_i),
    ω_i   = exp(R_c + Λ_i - m_i),
    R_{c+1} = Λ_last + max(R_c, max_{j in c} a_j),
    S_{c+1} = exp(R_c + Λ_last - R_{c+1}) S_c
              + Σ_{j in c} exp(a_j + Λ_last - R_{c+1}) φ(k_j) v_j^T   (z alike).

Every exponent is <= 0 (those above the diagonal, which are masked, are clamped to 0 so that
none overflows), no key sets the scale of an earlier query, and a gate's decay is part of the
scale, so that a state that has decayed is held at its own size (ungated, these are the other
strategies' scales: :func:`effattn.kernelized.chunkwise._out_weights`, ``_scan_factors``). No
chunk state is written to memory: per call the kernel writes the outputs, the row scales m
(B, H, N) and the running scales R_0..R_nc (B, H, nc + 1), which the backward reads, and on
request the states entering every S_b tokens (checkpoints, from which the backward recomputes
spans shorter than the forward's slice).

Backward (:func:`backward`), from G = ∂L/∂num, g = ∂L/∂den, dA_ij = G_i·v_j + g_i and
dX = dA ⊙ exp(a_j + Λ_i - m_i) (j <= i in the chunk). Of out = num / d, G = d_out / d is formed
by both kernels from the output's gradient, read in place, and the divisors; g = -(d_out·out) / d
(0 where the eps floor set d) by ``_divisor_grad_kernel`` (:func:`divisor_grad`) first.

- ``_backward_queries_kernel``, chunks in order, the state recomputed as in the forward:
  dφ(q_i) = ω_i (S_c G_i + z_c g_i) + Σ_j dX_ij φ(k_j);
- ``_backward_keys_kernel``, chunks in reverse, with the adjoint of the states
  U_c = Σ_{i in c} ω_i φ(q_i) [G_i, g_i]^T + exp(R_c + Λ_last - R_{c+1}) U_{c+1} (U_nc =
  ∂L/∂ state after; U_0 is the entering state's gradient): with
  e_j = exp(a_j + Λ_last - R_{c+1}), dφ(k_j) = e_j U_{c+1} [v_j, 1] + Σ_i dX_ij φ(q_i) and
  dv_j = e_j U_{c+1}^T φ(k_j) + Σ_i A_ij G_i (A_ij = (φ(q_i)·φ(k_j)) exp(a_j + Λ_i - m_i)).

The log-weights' and log-gates' gradients follow from dφ (the caller's:
:func:`effattn.kernelized.fused._log_gate_grad`).

With a map formed inside (``MAP``: any but ``READ``), φ is not read but
formed from x̃ (N x D) and the projection's block of rows w (BK x D), u = x̃ w^T:

- ``EXP`` (performer's positive and hyperbolic maps): φ = exp(u - m) with the row maxima m over
  all F features (``_row_max_kernel``, launched first: they span every feature block);
- ``SINE`` (performer's trig, FAVOR's random-phase cosine, RFA's sin/cos): φ = sin(u + b) with
  per-feature phases b (π/2 for a cosine);
- ``RELU`` (performer's relu, RFA's arc-cosine): φ = relu(u) + b with per-feature floors b
  (performer's 1e-3, 0 for the arc-cosine);
- ``ELU`` (the linear transformer's): φ = elu(x̃) + 1 of x̃ itself (F = D, no projection: u is
  the block's columns of x̃), read in its own dtype (bf16 q, k need no fp32 copy).

The backward kernels then write, in place of dφ, this block's part of ∂L/∂x̃ =
(dφ ⊙ ∂φ/∂u) w (∂φ/∂u = φ for ``EXP``, m held constant: it cancels; cos(u + b) for ``SINE``;
1 above 0 and 0 below for ``RELU``; for ``ELU`` the block's columns, dφ ⊙ ∂φ/∂u itself) and of
Σ_f dφ ⊙ φ (``_store_inputs_grad``).

A program holds one block of BK features and all Dv values, so that the sums over features
(num, den, dv, the gradient of x̃ and the products φ·dφ) come out per feature block: with
several blocks, each adds its part atomically into one zeroed buffer (``ATOMIC``), or, with
``torch.use_deterministic_algorithms`` on, stores it in its own, added by the caller
(:func:`atomic`); the rest needs no reduction across programs. Grid: (F / BK, B H, P). The
chunk C is a power of two >= 16 (tl.dot's smallest tile; :func:`tile`), with 8 warps a program
(:func:`meta`).

Segments (the grid's P; :func:`segments` chooses it by device, 1 off a GPU). At B = 1, H = 8
the (F / BK, B H) programs are 8 to 32, and each walks N / C chunks one after the other: a
chain of dependent steps on a few of a GPU's multiprocessors. The chunks are then split into
P segments of consecutive chunks, walked side by side. The state is linear in what enters it,
so what each segment needs from the ones before is one state:

- forward: a first launch (``STATES``) walks each segment's keys alone, from an empty state,
  to its own state L_p at its running scale r_p; the state entering segment p is
  e^{G_p + R_in} S_in + Σ_{q<p} e^{G_p - G_{q+1} + r_q} L_q (G the cumulative log-gate at the
  segments' starts), one (P x P) by (P x F (Dv + 1)) product per (batch, head) in ATen
  (:func:`_entering`), held at the largest of those exponents, the running max one walk keeps;
  the second launch walks every segment from its own;
- backward: the queries' kernel needs those states again (at the forward's running scales,
  which it reads); the keys' kernel needs the gradient of the state leaving each segment,
  which every later query holds to account: a first launch (``ADJOINT``) walks each segment's
  queries alone in reverse from 0, and the mirror product (:func:`_adjoints`) sums the later
  segments' with d_after.

A split costs one more walk over the keys (forward) or the queries (backward) and P states of
(B, H, F, Dv + 1) each way; the results are one walk's to rounding (tested in float64).

v may be in a narrower dtype than φ (bf16 values beside fp32 features): the kernels read it
as it is and convert each tile after loading, so that no promoted copy of v is made.

On the CPU these run under Triton's interpreter (``TRITON_INTERPRET=1`` before this module is
imported), which is how CI tests them.

Shapes: B batch, H heads, N tokens, F features, Dv value dim, nc = ceil(N / C) chunks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from effattn.base import compute_dtype
from effattn.kernelized.core import LOG_FLOOR

# How the kernels get φ (their MAP): read from memory (φ(Q), φ(K) given), or formed from x̃
# and the projection's rows, as exp(x̃ w^T - m) (the positive maps), sin(x̃ w^T + b) (the
# trigonometric ones), relu(x̃ w^T) + b (the rectified ones) or the product of two affine maps
# (x̃ w^T + b)(x̃ w'^T + b') (Taylor's), or from x itself as elu(x) + 1 (the linear
# transformer's, F = D).
READ, EXP, SINE, ELU, RELU, PRODUCT = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2),
                                       tl.constexpr(3), tl.constexpr(4), tl.constexpr(5))


@triton.jit
def _put(ptr, values, mask, ATOMIC: tl.constexpr):
    """Write a feature block's part of a sum over the blocks: added atomically into the one
    buffer that every block adds to (``ATOMIC``), or stored in the block's own, which the
    caller adds."""
    if ATOMIC:
        tl.atomic_add(ptr, values, mask=mask)
    else:
        tl.store(ptr, values, mask=mask)


@triton.jit
def _part(kb, bh, BH, N, ATOMIC: tl.constexpr):
    """Where a feature block's parts of the sums over blocks start, in rows of N: the (batch,
    head) pair's rows of the one buffer (``ATOMIC``), or of the block's own."""
    if ATOMIC:
        return bh * N
    return (kb * BH + bh) * N


@triton.jit
def _decays(lg_ptrs, ok, GATED: tl.constexpr, BT: tl.constexpr, ACC: tl.constexpr):
    """A chunk's inclusive cumulative log-gates Λ (BT) and their total (0 ungated)."""
    gc = tl.zeros([BT], dtype=ACC)
    total = tl.sum(gc, 0)
    if GATED:
        lg = tl.load(lg_ptrs, mask=ok, other=0.0).to(ACC)
        gc = tl.cumsum(lg, 0)
        total = tl.sum(lg, 0)
    return gc, total


@triton.jit
def _projection(w_ptr, f, f_ok, D, BD: tl.constexpr):
    """The rows f of the projection w (F, D): (BK, BD), 0 past F and D."""
    e = tl.arange(0, BD)
    return tl.load(w_ptr + f[:, None] * D + e[None, :], mask=f_ok[:, None] & (e < D)[None, :],
                   other=0.0)


@triton.jit
def _features(x_ptr, w, rows_ptr, b, w2, b2, t, t_ok, f, f_ok, D, BD: tl.constexpr,
              ACC: tl.constexpr, PRECISION: tl.constexpr, MAP: tl.constexpr):
    """φ of a chunk's tokens t (BT, BK), in ACC, and its derivatives in u and u', from x̃ (at
    x_ptr, N x D): with u = x̃ w^T (w the projection's rows), exp(u - m) with the row maxima m
    (at rows_ptr) for ``EXP`` (its own derivative), sin(u + b) with the phases b (BK) for
    ``SINE`` (cos(u + b)), relu(u) + b with the floors b for ``RELU`` (1 above 0, else 0) and
    (u + b)(u' + b') with u' = x̃ w2^T for ``PRODUCT`` (u' + b' in u, u + b in u'); with
    u = x̃'s columns f, elu(u) + 1 for ``ELU`` (1 above 0, e^u below; x̃ read in its own
    dtype). The derivative in u' is the one in u for every map but ``PRODUCT``, which alone
    has a u'. 0 past the sequence and past F."""
    ok = t_ok[:, None] & f_ok[None, :]
    if MAP == ELU:
        u = tl.load(x_ptr + t[:, None] * D + f[None, :], mask=ok, other=0.0).to(ACC)
    else:
        e = tl.arange(0, BD)
        x = tl.load(x_ptr + t[:, None] * D + e[None, :],
                    mask=t_ok[:, None] & (e < D)[None, :], other=0.0)
        u = tl.dot(x, tl.trans(w), input_precision=PRECISION).to(ACC)
    if MAP == PRODUCT:
        u += b[None, :]
        u2 = tl.dot(x, tl.trans(w2), input_precision=PRECISION).to(ACC) + b2[None, :]
        phi = tl.where(ok, u * u2, 0.0)
        slope = tl.where(ok, u2, 0.0)
        slope2 = tl.where(ok, u, 0.0)
        return phi, slope, slope2
    if MAP == EXP:
        m = tl.load(rows_ptr + t, mask=t_ok, other=0.0).to(ACC)
        phi = tl.where(ok, tl.exp(u - m[:, None]), 0.0)
        slope = phi
    elif MAP == SINE:
        u += b[None, :]
        phi = tl.where(ok, tl.sin(u), 0.0)
        slope = tl.where(ok, tl.cos(u), 0.0)
    elif MAP == RELU:
        phi = tl.where(ok, tl.maximum(u, 0.0) + b[None, :], 0.0)
        slope = tl.where(ok & (u > 0.0), 1.0, 0.0)
    else:
        below = tl.exp(tl.minimum(u, 0.0))
        phi = tl.where(ok, tl.where(u > 0.0, u + 1.0, below), 0.0)
        slope = tl.where(ok, tl.where(u > 0.0, 1.0, below), 0.0)
    return phi, slope, slope


@triton.jit
def _map_rows(w_ptr, b_ptr, f, f_ok, F, D, BK: tl.constexpr, BD: tl.constexpr,
              ACC: tl.constexpr, MAP: tl.constexpr):
    """The projection's rows f (BK, BD) and the offsets b (BK) of a map formed inside (the
    phases of ``SINE``, the floors of ``RELU``, the first factor's offsets of ``PRODUCT``, else
    0), both placeholders, never read, for ``ELU`` (no projection); and the second factor's
    rows and offsets for ``PRODUCT`` (rows F + f of w (2F, D) and of b (2F)), for the other
    maps the first's again (never read)."""
    w = tl.zeros([BK, BD], dtype=ACC) if MAP == ELU else _projection(w_ptr, f, f_ok, D, BD)
    if (MAP == SINE) | (MAP == RELU) | (MAP == PRODUCT):
        b = tl.load(b_ptr + f, mask=f_ok, other=0.0).to(ACC)
    else:
        b = tl.zeros([BK], dtype=ACC)
    w2, b2 = w, b
    if MAP == PRODUCT:
        w2 = _projection(w_ptr + F * D, f, f_ok, D, BD)
        b2 = tl.load(b_ptr + F + f, mask=f_ok, other=0.0).to(ACC)
    return w, b, w2, b2


@triton.jit
def _store_state(ptr, s, z, f, f_ok, d, d_ok, DV):
    """A feature block's rows f of a state [S, z] (F, DV + 1) at ptr."""
    tl.store(ptr + f[:, None] * (DV + 1) + d[None, :], s, mask=f_ok[:, None] & d_ok[None, :])
    tl.store(ptr + f * (DV + 1) + DV, z, mask=f_ok)


@triton.jit
def _row_max_kernel(x_ptr, w_ptr, m_ptr, N, F, D, BT: tl.constexpr, BK: tl.constexpr,
                    BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """m_t = max_f w_f·x̃_t of BT tokens, over all F features in blocks of BK."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < N
    e = tl.arange(0, BD)
    x = tl.load(x_ptr + bh * N * D + t[:, None] * D + e[None, :],
                mask=t_ok[:, None] & (e < D)[None, :], other=0.0)
    best = tl.full([BT], float("-inf"), ACC)
    for f0 in range(0, F, BK):
        f = f0 + tl.arange(0, BK)
        f_ok = f < F
        u = tl.dot(x, tl.trans(_projection(w_ptr, f, f_ok, D, BD)),
                   input_precision=PRECISION).to(ACC)
        best = tl.maximum(best, tl.max(tl.where(f_ok[None, :], u, float("-inf")), 1))
    tl.store(m_ptr + bh * N + t, best, mask=t_ok)


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, ls_ptr, lg_ptr, v_ptr, kv_in_ptr, r_in_ptr, w_ptr, b_ptr, mq_ptr, mk_ptr,
    num_ptr, den_ptr, m_ptr, kv_out_ptr, r_ptr, marks_ptr,
    N, F, D, DV, NC, BH, EVERY, NMARKS, SEG, LOG_FLOOR_: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, GATED: tl.constexpr, MAP: tl.constexpr, ATOMIC: tl.constexpr,
    STATES: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    # Segment p walks chunks [p SEG, (p + 1) SEG) from its entering state (row bh P + p of
    # kv_in and r_in); with STATES, from an empty one (0 at LOG_FLOOR), the keys' side only,
    # writing the state and running scale it ends with (row bh P + p of kv_out and r).
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
    if STATES:
        s = tl.zeros([BK, BV], dtype=ACC)
        z = tl.zeros([BK], dtype=ACC)
        r = tl.full([], LOG_FLOOR_, ACC)
    else:
        state = kv_in_ptr + seg * F * (DV + 1) + f[:, None] * (DV + 1)
        s = tl.load(state + d[None, :], mask=f_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        z = tl.load(kv_in_ptr + seg * F * (DV + 1) + f * (DV + 1) + DV, mask=f_ok,
                    other=0.0).to(ACC)
        r = tl.load(r_in_ptr + seg).to(ACC)
    if MAP != READ:
        w, b, w2, b2 = _map_rows(w_ptr, b_ptr, f, f_ok, F, D, BK, BD, ACC, MAP)
    part = _part(kb, bh, BH, N, ATOMIC)
    for c in range(c_start, c_end):
        if (c > 0) & (c % EVERY == 0):
            _store_state(marks_ptr + (bh * NMARKS + c // EVERY - 1) * F * (DV + 1), s, z, f,
                         f_ok, d, d_ok, DV)
        t = c * BT + t0
        t_ok = t < N
        ls = tl.load(ls_ptr + bh * N + t, mask=t_ok, other=float("-inf")).to(ACC)
        gc, total = _decays(lg_ptr + bh * N + t, t_ok, GATED, BT, ACC)
        kt = ls - gc
        rows = t[:, None] * F + f[None, :]
        ok = t_ok[:, None] & f_ok[None, :]
        # The queries' side first (the order of one walk's kernel: it compiles to fewer
        # spilled registers than with the keys' tiles loaded first).
        if not STATES:
            prefix = tl.max(tl.where(causal, kt[None, :], float("-inf")), 1)
            m = tl.maximum(tl.maximum(prefix + gc, LOG_FLOOR_), r + gc)
            if MAP != READ:
                qc, _, _ = _features(q_ptr + bh * N * D, w, mq_ptr + bh * N, b, w2, b2, t, t_ok,
                                     f, f_ok, D, BD, ACC, PRECISION, MAP)
                qc = qc.to(w.dtype)
            else:
                qc = tl.load(q_ptr + bh * N * F + rows, mask=ok, other=0.0)
        if MAP != READ:
            kc, _, _ = _features(k_ptr + bh * N * D, w, mk_ptr + bh * N, b, w2, b2, t, t_ok, f,
                                 f_ok, D, BD, ACC, PRECISION, MAP)
            kc = kc.to(w.dtype)
        else:
            kc = tl.load(k_ptr + bh * N * F + rows, mask=ok, other=0.0)
        vc = tl.load(v_ptr + bh * N * DV + t[:, None] * DV + d[None, :],
                     mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(kc.dtype)
        if not STATES:
            x = tl.dot(qc, tl.trans(kc), input_precision=PRECISION).to(ACC)
            a = tl.where(causal,
                         x * tl.exp(tl.minimum(kt[None, :] + gc[:, None] - m[:, None], 0.0)),
                         0.0)
            omega = tl.exp(r + gc - m)
            num = omega[:, None] * tl.dot(qc, s.to(qc.dtype), input_precision=PRECISION).to(ACC)
            num += tl.dot(a.to(vc.dtype), vc, input_precision=PRECISION).to(ACC)
            den = omega * tl.sum(qc.to(ACC) * z[None, :], 1) + tl.sum(a, 1)
            _put(num_ptr + part * DV + t[:, None] * DV + d[None, :], num,
                 t_ok[:, None] & d_ok[None, :], ATOMIC)
            _put(den_ptr + part + t, den, t_ok, ATOMIC)
            if kb == 0:
                tl.store(m_ptr + bh * N + t, m, mask=t_ok)
                tl.store(r_ptr + bh * (NC + 1) + c, r)
        r_next = total + tl.maximum(r, tl.max(kt, 0))
        enter = tl.exp(kt + total - r_next)
        keep = tl.exp(r + total - r_next)
        entering = (vc.to(ACC) * enter[:, None]).to(kc.dtype)
        s = s * keep + tl.dot(tl.trans(kc), entering, input_precision=PRECISION).to(ACC)
        z = z * keep + tl.sum(kc.to(ACC) * enter[:, None], 0)
        r = r_next
    # The state after: each segment's with STATES, else the last segment's.
    if STATES:
        _store_state(kv_out_ptr + seg * F * (DV + 1), s, z, f, f_ok, d, d_ok, DV)
        if kb == 0:
            tl.store(r_ptr + seg, r)
    elif c_end == NC:
        _store_state(kv_out_ptr + bh * F * (DV + 1), s, z, f, f_ok, d, d_ok, DV)
        if kb == 0:
            tl.store(r_ptr + bh * (NC + 1) + NC, r)


@triton.jit
def _store_inputs_grad(dx_ptr, sums_ptr, d_phi, slope, slope2, products, w, w2, t, t_ok, f,
                       f_ok, bh, part, N, D, BD: tl.constexpr, ACC: tl.constexpr,
                       PRECISION: tl.constexpr, MAP: tl.constexpr, ATOMIC: tl.constexpr):
    """From dφ, φ's derivatives in u and u' (:func:`_features`) and dφ ⊙ φ (``products``)
    (BT, BK) of one feature block, stored at the chunk's tokens t: this block's part of
    Σ_f dφ ⊙ φ (the log-scale's gradient), and of ∂L/∂x̃, g w with g = dφ ⊙ ∂φ/∂u (an exp
    map's row maxima held constant: they cancel), plus (dφ ⊙ ∂φ/∂u') w2 for ``PRODUCT``, at
    ``part`` (the block's own (N, D) slot, or the one every block adds to: ``ATOMIC``); for
    ``ELU`` its columns f of ∂L/∂x itself, g, in the one (N, D) slot of the (batch, head)
    ``bh`` that every block writes a part of."""
    g = d_phi * slope
    if MAP == ELU:
        tl.store(dx_ptr + bh * N * D + t[:, None] * D + f[None, :], g,
                 mask=t_ok[:, None] & f_ok[None, :])
    else:
        e = tl.arange(0, BD)
        dx = tl.dot(g.to(w.dtype), w, input_precision=PRECISION).to(ACC)
        if MAP == PRODUCT:
            dx += tl.dot((d_phi * slope2).to(w2.dtype), w2, input_precision=PRECISION).to(ACC)
        _put(dx_ptr + part * D + t[:, None] * D + e[None, :], dx,
             t_ok[:, None] & (e < D)[None, :], ATOMIC)
    _put(sums_ptr + t, tl.sum(products, 1), t_ok, ATOMIC)


@triton.jit
def _ratio_grads(do_ptr, div_ptr, gd_ptr, bh, t, t_ok, d, vd_ok, N, DO_BH, DO_ROW, DO_COL,
                 ACC: tl.constexpr):
    """The gradients of a chunk's num (BT, BV) and den (BT), in ACC: G = dO / d from the
    output's (read in its own dtype at its strides) and the divisors d, and g as given (from
    :func:`divisor_grad`)."""
    do = tl.load(do_ptr + bh * DO_BH + t[:, None] * DO_ROW + d[None, :] * DO_COL, mask=vd_ok,
                 other=0.0).to(ACC)
    div = tl.load(div_ptr + bh * N + t, mask=t_ok, other=1.0).to(ACC)
    gd = tl.load(gd_ptr + bh * N + t, mask=t_ok, other=0.0).to(ACC)
    return do / div[:, None], gd


@triton.jit
def _divisor_grad_kernel(do_ptr, o_ptr, back_ptr, gd_ptr, N, DV, DO_BH, DO_ROW, DO_COL, O_BH,
                         O_ROW, O_COL, BT: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """g_t = b_t Σ_e dO_te O_te of BT tokens, the products in ACC from dO and O read in their
    own dtypes at their strides."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BV)
    t_ok = t < N
    ok = t_ok[:, None] & (d < DV)[None, :]
    do = tl.load(do_ptr + bh * DO_BH + t[:, None] * DO_ROW + d[None, :] * DO_COL, mask=ok,
                 other=0.0).to(ACC)
    o = tl.load(o_ptr + bh * O_BH + t[:, None] * O_ROW + d[None, :] * O_COL, mask=ok,
                other=0.0).to(ACC)
    back = tl.load(back_ptr + bh * N + t, mask=t_ok, other=0.0).to(ACC)
    tl.store(gd_ptr + bh * N + t, tl.sum(do * o, 1) * back, mask=t_ok)


@triton.jit
def _backward_queries_kernel(
    q_ptr, k_ptr, ls_ptr, lg_ptr, v_ptr, kv_in_ptr, m_ptr, r_ptr, do_ptr, div_ptr, gd_ptr,
    w_ptr, b_ptr, mq_ptr, mk_ptr, dq_ptr, sq_ptr,
    N, F, D, DV, NC, BH, DO_BH, DO_ROW, DO_COL, SEG,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, GATED: tl.constexpr, MAP: tl.constexpr, ATOMIC: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    # Segment p: chunks [p SEG, (p + 1) SEG) from the state entering it (row bh P + p of kv_in).
    p = tl.program_id(2)
    seg = bh * tl.num_programs(2) + p
    f = kb * BK + tl.arange(0, BK)
    d = tl.arange(0, BV)
    t0 = tl.arange(0, BT)
    f_ok = f < F
    d_ok = d < DV
    causal = t0[None, :] <= t0[:, None]
    state = kv_in_ptr + seg * F * (DV + 1) + f[:, None] * (DV + 1)
    s = tl.load(state + d[None, :], mask=f_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
    z = tl.load(kv_in_ptr + seg * F * (DV + 1) + f * (DV + 1) + DV, mask=f_ok,
                other=0.0).to(ACC)
    if MAP != READ:
        w, b, w2, b2 = _map_rows(w_ptr, b_ptr, f, f_ok, F, D, BK, BD, ACC, MAP)
    part = _part(kb, bh, BH, N, ATOMIC)
    for c in range(p * SEG, tl.minimum(NC, (p + 1) * SEG)):
        t = c * BT + t0
        t_ok = t < N
        r = tl.load(r_ptr + bh * (NC + 1) + c).to(ACC)
        r_next = tl.load(r_ptr + bh * (NC + 1) + c + 1).to(ACC)
        ls = tl.load(ls_ptr + bh * N + t, mask=t_ok, other=float("-inf")).to(ACC)
        gc, total = _decays(lg_ptr + bh * N + t, t_ok, GATED, BT, ACC)
        kt = ls - gc
        m = tl.load(m_ptr + bh * N + t, mask=t_ok, other=float("inf")).to(ACC)
        if MAP != READ:
            kc, _, _ = _features(k_ptr + bh * N * D, w, mk_ptr + bh * N, b, w2, b2, t, t_ok, f,
                                 f_ok, D, BD, ACC, PRECISION, MAP)
            kc = kc.to(w.dtype)
        else:
            rows = t[:, None] * F + f[None, :]
            ok = t_ok[:, None] & f_ok[None, :]
            kc = tl.load(k_ptr + bh * N * F + rows, mask=ok, other=0.0)
        values = t[:, None] * DV + d[None, :]
        vd_ok = t_ok[:, None] & d_ok[None, :]
        vc = tl.load(v_ptr + bh * N * DV + values, mask=vd_ok, other=0.0).to(kc.dtype)
        gn, gd = _ratio_grads(do_ptr, div_ptr, gd_ptr, bh, t, t_ok, d, vd_ok, N, DO_BH, DO_ROW,
                              DO_COL, ACC)
        gn = gn.to(kc.dtype)
        weight = tl.where(
            causal, tl.exp(tl.minimum(kt[None, :] + gc[:, None] - m[:, None], 0.0)), 0.0)
        d_x = (tl.dot(gn, tl.trans(vc), input_precision=PRECISION).to(ACC) + gd[:, None]) * weight
        omega = tl.exp(r + gc - m)
        read = tl.dot(gn, tl.trans(s.to(gn.dtype)), input_precision=PRECISION).to(ACC)
        dq = omega[:, None] * (read + gd[:, None] * z[None, :])
        dq += tl.dot(d_x.to(kc.dtype), kc, input_precision=PRECISION).to(ACC)
        if MAP != READ:
            phi, slope, slope2 = _features(q_ptr + bh * N * D, w, mq_ptr + bh * N, b, w2, b2, t,
                                           t_ok, f, f_ok, D, BD, ACC, PRECISION, MAP)
            _store_inputs_grad(dq_ptr, sq_ptr + part, dq, slope, slope2, dq * phi, w, w2, t,
                               t_ok, f, f_ok, bh, part, N, D, BD, ACC, PRECISION, MAP, ATOMIC)
        else:
            tl.store(dq_ptr + bh * N * F + rows, dq, mask=ok)
        enter = tl.exp(kt + total - r_next)
        keep = tl.exp(r + total - r_next)
        entering = (vc.to(ACC) * enter[:, None]).to(kc.dtype)
        s = s * keep + tl.dot(tl.trans(kc), entering, input_precision=PRECISION).to(ACC)
        z = z * keep + tl.sum(kc.to(ACC) * enter[:, None], 0)


@triton.jit
def _backward_keys_kernel(
    q_ptr, k_ptr, ls_ptr, lg_ptr, v_ptr, m_ptr, r_ptr, do_ptr, div_ptr, gd_ptr, du_ptr, w_ptr,
    b_ptr, mq_ptr, mk_ptr, dk_ptr, sk_ptr, dv_ptr, dkv_in_ptr,
    N, F, D, DV, NC, BH, DO_BH, DO_ROW, DO_COL, SEG,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, GATED: tl.constexpr, MAP: tl.constexpr, ATOMIC: tl.constexpr,
    ADJOINT: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    # Segment p walks chunks [p SEG, (p + 1) SEG) in reverse from the adjoint of the state after
    # it (row bh P + p of du); with ADJOINT, from 0, the queries' side only, writing the adjoint
    # it ends with (row bh P + p of dkv_in).
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
    if ADJOINT:
        u = tl.zeros([BK, BV], dtype=ACC)
        uz = tl.zeros([BK], dtype=ACC)
    else:
        after = du_ptr + seg * F * (DV + 1) + f[:, None] * (DV + 1)
        u = tl.load(after + d[None, :], mask=f_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        uz = tl.load(du_ptr + seg * F * (DV + 1) + f * (DV + 1) + DV, mask=f_ok,
                     other=0.0).to(ACC)
    if MAP != READ:
        w, b, w2, b2 = _map_rows(w_ptr, b_ptr, f, f_ok, F, D, BK, BD, ACC, MAP)
    part = _part(kb, bh, BH, N, ATOMIC)
    for i in range(0, c_end - c_start):
        c = c_end - 1 - i
        t = c * BT + t0
        t_ok = t < N
        r = tl.load(r_ptr + bh * (NC + 1) + c).to(ACC)
        r_next = tl.load(r_ptr + bh * (NC + 1) + c + 1).to(ACC)
        ls = tl.load(ls_ptr + bh * N + t, mask=t_ok, other=float("-inf")).to(ACC)
        gc, total = _decays(lg_ptr + bh * N + t, t_ok, GATED, BT, ACC)
        kt = ls - gc
        m = tl.load(m_ptr + bh * N + t, mask=t_ok, other=float("inf")).to(ACC)
        if MAP != READ:
            qc, _, _ = _features(q_ptr + bh * N * D, w, mq_ptr + bh * N, b, w2, b2, t, t_ok, f,
                                 f_ok, D, BD, ACC, PRECISION, MAP)
            qc = qc.to(w.dtype)
        else:
            rows = t[:, None] * F + f[None, :]
            ok = t_ok[:, None] & f_ok[None, :]
            qc = tl.load(q_ptr + bh * N * F + rows, mask=ok, other=0.0)
        values = t[:, None] * DV + d[None, :]
        vd_ok = t_ok[:, None] & d_ok[None, :]
        gn, gd = _ratio_grads(do_ptr, div_ptr, gd_ptr, bh, t, t_ok, d, vd_ok, N, DO_BH, DO_ROW,
                              DO_COL, ACC)
        gn = gn.to(qc.dtype)
        if not ADJOINT:
            if MAP != READ:
                kc, k_slope, k_slope2 = _features(k_ptr + bh * N * D, w, mk_ptr + bh * N, b, w2,
                                                  b2, t, t_ok, f, f_ok, D, BD, ACC, PRECISION,
                                                  MAP)
                kc = kc.to(w.dtype)
            else:
                kc = tl.load(k_ptr + bh * N * F + rows, mask=ok, other=0.0)
            vc = tl.load(v_ptr + bh * N * DV + values, mask=vd_ok, other=0.0).to(qc.dtype)
            weight = tl.where(
                causal, tl.exp(tl.minimum(kt[None, :] + gc[:, None] - m[:, None], 0.0)), 0.0)
            a = tl.dot(qc, tl.trans(kc), input_precision=PRECISION).to(ACC) * weight
            d_x = ((tl.dot(gn, tl.trans(vc), input_precision=PRECISION).to(ACC) + gd[:, None])
                   * weight)
            enter = tl.exp(kt + total - r_next)
            later = tl.dot(vc, tl.trans(u.to(vc.dtype)), input_precision=PRECISION).to(ACC)
            dk = enter[:, None] * (later + uz[None, :])
            dk += tl.dot(tl.trans(d_x.to(qc.dtype)), qc, input_precision=PRECISION).to(ACC)
            if MAP != READ:
                _store_inputs_grad(dk_ptr, sk_ptr + part, dk, k_slope, k_slope2,
                                   dk * kc.to(ACC), w, w2, t, t_ok, f, f_ok, bh, part, N, D, BD,
                                   ACC, PRECISION, MAP, ATOMIC)
            else:
                tl.store(dk_ptr + bh * N * F + rows, dk, mask=ok)
            dv = enter[:, None] * tl.dot(kc, u.to(kc.dtype), input_precision=PRECISION).to(ACC)
            dv += tl.dot(tl.trans(a.to(gn.dtype)), gn, input_precision=PRECISION).to(ACC)
            _put(dv_ptr + part * DV + values, dv, vd_ok, ATOMIC)
        omega = tl.exp(r + gc - m)
        read = (qc.to(ACC) * omega[:, None]).to(qc.dtype)
        keep = tl.exp(r + total - r_next)
        u = u * keep + tl.dot(tl.trans(read), gn, input_precision=PRECISION).to(ACC)
        uz = uz * keep + tl.sum(read.to(ACC) * gd[:, None], 0)
    # The adjoint entering the segment: each segment's with ADJOINT, else the first segment's
    # (that of the state entering the call).
    if ADJOINT:
        _store_state(dkv_in_ptr + seg * F * (DV + 1), u, uz, f, f_ok, d, d_ok, DV)
    elif p == 0:
        _store_state(dkv_in_ptr + bh * F * (DV + 1), u, uz, f, f_ok, d, d_ok, DV)


# The kernels, and how their arguments are typed (benchmarks/triton_resources.py compiles them
# ahead of time with these): pointers to inputs of the call's dtype, integers, and the rest
# pointers to accumulator-typed buffers.
KERNELS = (_forward_kernel, _backward_queries_kernel, _backward_keys_kernel, _row_max_kernel,
           _divisor_grad_kernel)
INPUTS = frozenset({"q_ptr", "k_ptr", "v_ptr", "ls_ptr", "lg_ptr", "do_ptr", "o_ptr", "w_ptr",
                    "x_ptr"})
INTEGERS = frozenset({"N", "F", "D", "DV", "NC", "BH", "EVERY", "NMARKS", "SEG", "DO_BH",
                      "DO_ROW", "DO_COL", "O_BH", "O_ROW", "O_COL"})



@dataclass(frozen=True)
class Projection:
    """A map the kernels form themselves from x̃ (B, H, N, D): the rows w (F, D) of u = x̃ w^T,
    and either the row maxima of the queries' and keys' u (B, H, N), for φ = exp(u - m) (the
    positive maps), or the phases b (F,), for φ = sin(u + b) (the trigonometric maps: cos is
    sin at a phase of π/2), or the floors b (F,), for φ = relu(u) + b (the rectified maps), or
    the rows w' (F, D) of a second factor and both factors' offsets (b, b') (2, F), for
    φ = (u + b)(x̃ w'^T + b') (Taylor's map, :meth:`effattn.kernelized.features.TaylorMap.factors`);
    or no projection (w None), for φ = elu(x̃) + 1 of x̃ itself (F = D), which the kernels read
    in its own dtype."""

    w: Tensor | None
    query_maxima: Tensor | None = None
    key_maxima: Tensor | None = None
    phases: Tensor | None = None
    floors: Tensor | None = None
    second: Tensor | None = None
    biases: Tensor | None = None

    @property
    def map(self) -> int:
        """The kernels' MAP: ``ELU`` without a projection, ``SINE`` with phases, ``RELU`` with
        floors, ``PRODUCT`` with a second factor, else ``EXP``."""
        if self.w is None:
            return ELU.value
        if self.phases is not None:
            return SINE.value
        if self.second is not None:
            return PRODUCT.value
        return RELU.value if self.floors is not None else EXP.value

    def rows(self) -> Tensor:
        """The projection's rows as the kernels read them: w (F, D), or [w; w'] (2F, D) for a
        product (joined once per Projection)."""
        return self._rows

    @functools.cached_property
    def _rows(self) -> Tensor:
        return self.w if self.second is None else torch.cat([self.w, self.second])

    def offsets(self) -> Tensor | None:
        """The per-feature b the kernels add (phases or floors (F,), both factors' offsets
        (2F,) for a product; None for the other maps)."""
        if self.biases is not None:
            return self.biases.reshape(-1)
        return self.phases if self.phases is not None else self.floors


def tile(chunk: int, dtype: torch.dtype) -> int:
    """The kernels' chunk C: ``chunk`` rounded up to a power of two, at least 16 (tl.dot's
    smallest tile), at most 32 in half precision and 16 in fp32 and fp64. The caps are what
    compiling the kernels for sm_80 and sm_90 found (benchmarks/triton_resources.py): larger
    tiles spill registers, and the keys' backward in fp64 with C = 32 needs more shared memory
    than an A100 has. The chunk only sets where the exact C x C blocks end, not the result."""
    cap = 32 if dtype in (torch.bfloat16, torch.float16) else 16
    return min(cap, max(16, triton.next_power_of_2(chunk)))


def precision(dtype: torch.dtype) -> str:
    """How ``tl.dot`` multiplies inputs of ``dtype``: fp32 products as torch's own fp32 CUDA
    matmuls are set to (``torch.backends.cuda.matmul.fp32_precision``, which
    ``torch.set_float32_matmul_precision("high")`` sets to "tf32": TF32 tensor cores, 10 bits of
    mantissa; IEEE by default), the rule inductor's Triton matmuls follow; fp64 in IEEE; half
    precision on tensor cores whatever the setting (it only concerns fp32 inputs)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.fp32_precision == "tf32":
        return "tf32"
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def meta(dtype: torch.dtype, chunk: int, feature_dim: int, value_dim: int,
         key_dim: int, fused: bool = False) -> dict[str, Any]:
    """The launch's constexprs and warps for inputs of ``dtype``: the chunk BT (:func:`tile`),
    the feature block BK (at most 64: a (BK, Dv) state tile in registers; 32 in fp64 with the
    map formed inside, ``fused``, whose backward needs 169 KiB of shared memory at 64, more than
    an A100 has), the value width BV and the width BD of x̃ (Dv and D rounded up to a power of
    two, at least 16), the accumulator type (fp32; fp64 for fp64 inputs), the products'
    precision (:func:`precision`) and 8 warps (with 4, a (64, 64) fp32 state and the chunk's
    tiles spill registers in bf16 on sm_90)."""
    widest = 32 if fused and dtype == torch.float64 else 64
    return {"BT": tile(chunk, dtype),
            "BK": min(widest, max(16, triton.next_power_of_2(feature_dim))),
            "BV": max(16, triton.next_power_of_2(value_dim)),
            "BD": max(16, triton.next_power_of_2(key_dim)),
            "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
            "PRECISION": precision(dtype), "num_warps": 8}


def _gates(log_gate: Tensor | None, like: Tensor) -> Tensor:
    """The log-gates as the kernels read them; ungated, any tensor (the kernels read none, but
    an argument must point at memory)."""
    return like if log_gate is None else log_gate.contiguous()


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def atomic(blocks: int) -> bool:
    """Whether the feature blocks of a launch add their parts of the sums over features (the
    numerators and denominators, the gradients of v and x̃, the products φ·dφ) atomically into
    one buffer: where there are several blocks, unless ``torch.use_deterministic_algorithms``
    is on. On a GPU the order of those fp32 additions, hence their last bits, then varies from
    run to run (as in flash attention's backward); the deterministic path writes one buffer
    per block and adds them after, holding ``blocks`` times as much."""
    return blocks > 1 and not torch.are_deterministic_algorithms_enabled()


def _partial(like: Tensor, blocks: int, *shape: int, dtype: torch.dtype) -> Tensor:
    """The buffer that ``blocks`` feature blocks write their parts of a sum of ``shape`` into:
    one, zeroed, that they add to (:func:`atomic`), else one per block (leading dimension)."""
    if atomic(blocks):
        return like.new_zeros(*shape, dtype=dtype)
    return like.new_empty(blocks, *shape, dtype=dtype)


def _total(x: Tensor, blocks: int) -> Tensor:
    """The sum over the feature blocks of a :func:`_partial` buffer."""
    if atomic(blocks):
        return x
    return x.sum(0) if blocks > 1 else x[0]


def row_max(x: Tensor, w: Tensor) -> Tensor:
    """max_f w_f·x̃_t (B, H, N) of x̃ (B, H, N, D) and the projection w (F, D), over all F
    features (the positive map's row maxima, which the kernels subtract), without x̃ w^T in
    memory; in fp32 (fp64 for fp64)."""
    b, h, n, d = x.shape
    f = w.shape[0]
    config = meta(x.dtype, 64, f, 16, d)
    m = x.new_empty(b, h, n, dtype=_accumulator(x.dtype))
    _row_max_kernel[(triton.cdiv(n, config["BT"]), b * h)](
        x, w, m, n, f, d, BT=config["BT"], BK=config["BK"], BD=config["BD"], ACC=config["ACC"],
        PRECISION=config["PRECISION"], num_warps=config["num_warps"])
    return m


def _widths(phi: Tensor, projection: Projection | None,
            ) -> tuple[int, int, tuple[Tensor, Tensor, Tensor, Tensor], int]:
    """F, D, the projection's rows, phases and row maxima as the kernels read them (any tensor
    where there is none: the kernels read none, but an argument must point at memory) and the
    kernels' MAP."""
    if projection is None:
        return phi.shape[-1], phi.shape[-1], (phi, phi, phi, phi), READ.value
    if projection.w is None:
        return phi.shape[-1], phi.shape[-1], (phi, phi, phi, phi), ELU.value
    w = projection.rows().contiguous()
    read = [w if t is None else t.contiguous()
            for t in (projection.offsets(), projection.query_maxima, projection.key_maxima)]
    return projection.w.shape[0], w.shape[1], (w, *read), projection.map


def _strided(x: Tensor) -> tuple[Tensor, int, int, int]:
    """x (B, H, N, L) as the kernels read it in place, at the strides of its (batch, head)
    pairs, rows and columns: x itself where one stride steps over the B H pairs (a span's rows
    of a contiguous tensor, or the expanded gradient of a sum), else a contiguous copy."""
    if x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x, x.stride(1), x.stride(2), x.stride(3)


# Tokens per program and warps of the divisor's gradient (an elementwise pass: one (64, Dv)
# tile each).
RATIO_TOKENS, RATIO_WARPS = 64, 4


def divisor_grad(d_out: Tensor, out: Tensor, back: Tensor) -> Tensor:
    """The gradient of the denominators (B, H, N) from the output's d_out (B, H, N, Dv), of
    out = num / d: back · (d_out·out) with back = -1/d (0 where the eps floor, not the
    denominator, set d), the products in fp32 (fp64 for fp64) from d_out and out read in
    their own dtypes and in place (flash attention's preprocessing of its backward)."""
    b, h, n, dv = out.shape
    (d_out, *read_do), (out, *read_o) = _strided(d_out), _strided(out)
    acc = _accumulator(out.dtype)
    gd = back.new_empty(b, h, n, dtype=acc)
    _divisor_grad_kernel[(triton.cdiv(n, RATIO_TOKENS), b * h)](
        d_out, out, back.to(acc).contiguous(), gd, n, dv, *read_do, *read_o, BT=RATIO_TOKENS,
        BV=max(16, triton.next_power_of_2(dv)),
        ACC=tl.float64 if acc == torch.float64 else tl.float32, num_warps=RATIO_WARPS)
    return gd


def _phi_dtype(phi: Tensor, kind: int) -> torch.dtype:
    """The dtype of the φ tiles, which sets the launch (:func:`meta`): φ's own, or x̃'s, but
    fp32 for half-precision x read by the ``ELU`` map (which forms φ in fp32)."""
    return compute_dtype(phi.dtype) if kind == ELU.value else phi.dtype


# Segments: a launch's chunks are split into P segments walked side by side (a third grid
# dimension) where the (feature block, batch-head) programs alone would leave a GPU's
# multiprocessors idle. SEGMENT_PROGRAMS programs a multiprocessor are aimed at: one, as each
# program holds about 250 registers a thread in 8 warps (benchmarks/triton-resources), the
# whole register file of an sm_80 or sm_90 multiprocessor, so that one wave of programs runs at
# a time. A segment walks at least SEGMENT_CHUNKS chunks: a split costs a first pass and about
# 20 small ATen operations (the states' combination, each one a launch and a host dispatch of
# several microseconds), so it pays only where it shortens the chain by many chunk steps (a
# step is several microseconds too). So the forward's long slices split, and the backward's
# short spans (tens of chunks) mostly do not. Timed on one H200 (benchmarks/gpu_peers.py, suite
# ``segments``; docs/gpu.md): splits made forwards 1.5-5.4x faster, but performer's backward
# spans (about 100 chunks) stayed whole and its forward+backward gained 1.1x; whether a lower
# floor pays for the backward is not yet measured.
SEGMENT_PROGRAMS, SEGMENT_CHUNKS = 1, 64


def multiprocessors(device: torch.device) -> int:
    """The multiprocessors of a CUDA device; 0 elsewhere (Triton's interpreter runs programs
    one after another: segments gain nothing there)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def segments(device: torch.device, programs: int, chunks: int) -> int:
    """How many segments a launch of ``programs`` (feature blocks x batch-heads) walking
    ``chunks`` chunks splits them into: enough for ``SEGMENT_PROGRAMS`` programs a
    multiprocessor of ``device``, each segment at least ``SEGMENT_CHUNKS`` chunks; 1 (no
    split) off a GPU or where the programs already fill it."""
    want = -(-SEGMENT_PROGRAMS * multiprocessors(device) // programs)
    return max(1, min(want, chunks // SEGMENT_CHUNKS))


def _split(chunks: int, count: int) -> tuple[int, int]:
    """Chunks per segment and the segments' number when ``chunks`` are split into about
    ``count`` (no segment empty; one segment when there are no chunks)."""
    per = max(1, triton.cdiv(chunks, max(1, min(count, chunks))))
    return per, max(1, triton.cdiv(chunks, per))


@functools.cache
def _outside(count: int, upper: bool, device: torch.device) -> Tensor:
    """The (source, target) pairs of ``count`` segments that a combination leaves out: later
    segments for the states entering (``upper`` False), earlier ones for the gradients of the
    states leaving (``upper`` True); built once per (count, device)."""
    with torch.inference_mode(False):
        keep = torch.ones(count, count, dtype=torch.bool, device=device)
        return ~(keep.triu() if upper else keep.tril())


def _segment_gates(log_gate: Tensor | None, count: int, tokens: int, like: Tensor) -> Tensor:
    """The exclusive cumulative log-gates at the segments' starts, G_0 = 0, ..., G_P (the
    call's total), (B, H, P + 1) in float64 (their differences are the decays between
    segments: float64 keeps them from cancelling); 0 ungated. ``tokens`` per segment."""
    b, h = like.shape[:2]
    if log_gate is None:
        return like.new_zeros(b, h, count + 1, dtype=torch.float64)
    n = log_gate.shape[-1]
    padded = torch.nn.functional.pad(log_gate.to(torch.float64), (0, count * tokens - n))
    totals = padded.reshape(b, h, count, tokens).sum(-1)
    return torch.nn.functional.pad(totals.cumsum(-1), (1, 0))


def _entering(kv: Tensor, log_scale: Tensor, local: Tensor, ends: Tensor,
              gates: Tensor | None = None, target: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The states entering P segments (B, H, P, F, Dv + 1) and their scales R from the state
    entering the first, kv (B, H, F, Dv + 1) at ``log_scale``, and each segment's own, from
    empty: ``local`` (B, H, P, F, Dv + 1) at the running scales ``ends``, with the exclusive
    cumulative log-gates G (B, H, P + 1, :func:`_segment_gates`; None: ungated). At the true
    scale the state entering segment p is

        e^{G_p + R_in} kv + Σ_{q < p} e^{G_p - G_{q+1} + r_q} local_q,

    held at R_p = the largest of those exponents (each weight <= 1: the running max a walk
    through every chunk keeps; exact, since a max does not round), or at ``target`` where
    given (the forward's running scales, which the backward's kernels read beside it). The
    first segment's is kv itself.

    The scales are one per row of the state (log_scale (B, H), ends and R (B, H, P): the row
    core) or one per feature (log_scale (B, H, F), ends and R (B, H, P, F): the per-feature
    core of :mod:`effattn.kernelized.fused_exponents_kernels`, row f of each state at its own
    scale); the row core's are a feature axis of one here."""
    count = local.shape[2]
    rows = ends.dim() == 3
    first = (log_scale[..., None] if rows else log_scale).to(torch.float64)
    own = (ends[..., None] if rows else ends).to(torch.float64)
    # Sources j: kv (j = 0) and the segments' own states but the last's (j = q + 1), so that
    # x[p, j] = G_p - G_j + (the source's scale).
    source = torch.cat([first[:, :, None], own[:, :, :-1]], 2)
    x = source[:, :, None].expand(-1, -1, count, -1, -1)
    if gates is not None:
        x = x + (gates[..., :count, None] - gates[..., None, :count])[..., None]
    x = x.masked_fill(_outside(count, False, kv.device)[..., None], float("-inf"))
    if target is None:
        scale = x.amax(3)
    else:
        scale = (target[..., None] if rows else target).to(torch.float64)
    weights = torch.exp(x - scale[:, :, :, None]).to(local.dtype)
    states = torch.cat([kv[:, :, None].to(local.dtype), local[:, :, :-1]], 2)
    if rows:
        entering = (weights[..., 0] @ states.flatten(-2)).view_as(local)
        scale = scale[..., 0]
    else:
        entering = torch.einsum("bhpjf,bhjfd->bhpfd", weights, states)
    return entering, scale.to(local.dtype)


def _adjoints(d_after: Tensor, local: Tensor, starts: Tensor,
              gates: Tensor | None = None) -> Tensor:
    """The gradients of the states after P segments (B, H, P, F, Dv + 1), each at the running
    scale of the next segment's start (the last at the call's last, that of ``d_after``, the
    gradient of the state after the call), from each segment's own adjoint from 0, ``local``
    (B, H, P, F, Dv + 1) at the scales of the segments' starts; ``starts`` are the running
    scales at the segments' starts and the call's end ((B, H, P + 1) per row, (B, H, P + 1, F)
    per feature, as :func:`_entering`), G (B, H, P + 1) the exclusive cumulative log-gates
    (None: ungated). At the true scale the state after segment p is held to account by every
    later query: Σ_{q > p} e^{G_q - G_{p+1}} local_q (at the true scale) +
    e^{G_P - G_{p+1}} d_after, mirror of :func:`_entering`."""
    count = local.shape[2]
    rows = starts.dim() == 3
    r = (starts[..., None] if rows else starts).to(torch.float64)
    # Sources j: the segments' own adjoints but the first's (j = q - 1), and d_after (j = P - 1).
    x = r[:, :, 1:, None] - r[:, :, None, 1:]
    if gates is not None:
        x = x + (gates[..., None, 1:] - gates[..., 1:, None])[..., None]
    weights = torch.exp(x.masked_fill(_outside(count, True, local.device)[..., None],
                                      float("-inf"))).to(local.dtype)
    sources = torch.cat([local[:, :, 1:], d_after[:, :, None].to(local.dtype)], 2)
    if rows:
        return (weights[..., 0] @ sources.flatten(-2)).view_as(local)
    return torch.einsum("bhpjf,bhjfd->bhpfd", weights, sources)


def forward(phi_q: Tensor, phi_k: Tensor, key_log_scale: Tensor, v: Tensor, kv: Tensor,
            log_scale: Tensor, chunk: int, every: int | None = None,
            log_gate: Tensor | None = None, projection: Projection | None = None,
            split: int | None = None,
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused causal scan: φ(Q), φ(K) (B, H, N, F), the keys' log-weights (B, H, N) (-inf at
    padded keys), v (B, H, N, Dv), the entering state kv (B, H, F, Dv + 1) at scale
    ``log_scale`` (B, H), and the log-gates (B, H, N) or None: the state decays by g_t at
    token t, a key's weight from j to i by exp(Λ_i - Λ_j) (Λ their cumulative sum). With a
    ``projection``, phi_q and phi_k are x̃ (B, H, N, D) and the kernels form φ themselves
    (:class:`Projection`). Returns num (B, H, N, Dv) and den (B, H, N) at the row
    scales m (B, H, N), the state after (B, H, F, Dv + 1), the running scales R_0..R_nc
    (B, H, nc + 1), whose last is the state after's, and the states entering tokens ``every``,
    2 ``every``, ... < N (a multiple of the chunk; None: none) at their running scales,
    (B, H, n_marks, F, Dv + 1) (one unused slot when there are none); accumulated in fp32
    (fp64 for fp64). v may be in a narrower dtype than φ (converted tile by tile).

    The chunks are walked in ``split`` segments side by side (None: :func:`segments`' count
    for the device): a first launch walks each segment's keys from an empty state, the states
    entering the segments follow from theirs in one small batched product
    (:func:`_entering`), and the second walks every segment from its own. The results are
    those of one walk, to rounding."""
    b, h, n = phi_q.shape[:3]
    f, d, mapped, kind = _widths(phi_q, projection)
    dv = v.shape[-1]
    config = meta(_phi_dtype(phi_q, kind), chunk, f, dv, d, projection is not None)
    bt = config["BT"]
    nk, nc = triton.cdiv(f, config["BK"]), triton.cdiv(n, bt)
    if every is not None and every % bt:
        raise ValueError(f"checkpoints every {every} tokens: not a multiple of the chunk {bt}")
    # In chunks; past the last chunk when there are none (the kernel then writes none).
    every = nc + 1 if every is None else every // bt
    n_marks = (nc - 1) // every
    acc = _accumulator(phi_q.dtype)
    per, count = _split(nc, segments(phi_q.device, nk * b * h, nc) if split is None else split)
    gates = _gates(log_gate, key_log_scale)
    args = (phi_q, phi_k, key_log_scale, gates, v)
    kv, log_scale = kv.to(acc).contiguous(), log_scale.to(acc).contiguous()
    if count > 1:
        local = phi_q.new_empty(b, h, count, f, dv + 1, dtype=acc)
        ends = phi_q.new_empty(b, h, count, dtype=acc)
        # The first launch reads no entering state and writes no outputs and no checkpoints
        # (every chunk count past the last): kv stands in.
        _forward_kernel[(nk, b * h, count)](
            *args, kv, log_scale, *mapped, kv, kv, kv, local, ends, kv, n, f, d, dv, nc, b * h,
            nc + 1, 1, per, LOG_FLOOR, **config, GATED=log_gate is not None, MAP=kind,
            ATOMIC=atomic(nk), STATES=True,
        )
        kv, log_scale = _entering(kv, log_scale, local, ends,
                                  _segment_gates(log_gate, count, per * bt, phi_q))
    num = _partial(phi_q, nk, b, h, n, dv, dtype=acc)
    den = _partial(phi_q, nk, b, h, n, dtype=acc)
    m = phi_q.new_empty(b, h, n, dtype=acc)
    kv_out = phi_q.new_empty(b, h, f, dv + 1, dtype=acc)
    running = phi_q.new_empty(b, h, nc + 1, dtype=acc)
    # A slot even when unused: a kernel argument must point at memory.
    marks = phi_q.new_empty(b, h, max(1, n_marks), f, dv + 1, dtype=acc)
    _forward_kernel[(nk, b * h, count)](
        *args, kv.contiguous(), log_scale.contiguous(), *mapped, num, den, m, kv_out, running,
        marks, n, f, d, dv, nc, b * h, every, max(1, n_marks), per, LOG_FLOOR, **config,
        GATED=log_gate is not None, MAP=kind, ATOMIC=atomic(nk), STATES=False,
    )
    return _total(num, nk), _total(den, nk), m, kv_out, running, marks


def backward(phi_q: Tensor, phi_k: Tensor, key_log_scale: Tensor, v: Tensor, kv: Tensor,
             m: Tensor, running: Tensor, d_out: Tensor, div: Tensor, d_den: Tensor,
             d_after: Tensor | None, chunk: int, log_gate: Tensor | None = None,
             projection: Projection | None = None, split: int | None = None,
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """The gradients of :func:`forward`'s inputs φ(Q), φ(K), v and kv (the entering state)
    from those of num, d_out / div (d_out (B, H, N, Dv), read in its own dtype and in place;
    the divisors div (B, H, N)), of den (B, H, N) and of the state after (None: 0), given the
    forward's row scales m and running scales. The keys' log-weights and the log-gates get
    theirs from the caller: the output depends on φ(k_j) and ls_j only through φ(k_j)
    exp(ls_j), so ∂L/∂ls_j = φ(k_j)·∂L/∂φ(k_j), and the log-gates' follow from the same
    products (:func:`effattn.kernelized.fused._log_gate_grad`).

    With a ``projection`` (phi_q, phi_k are then x̃, as in :func:`forward`), no gradient of φ
    is written: the first two are those of x̃ (B, H, N, D), Σ_f (dφ ⊙ ∂φ/∂u)_f w_f (for
    φ = exp(u - m), with m held constant: it cancels, dφ ⊙ φ; for ``ELU``, dφ ⊙ ∂φ/∂x̃
    itself), and the last is the products
    (φ(q_i)·dφ(q_i), φ(k_j)·dφ(k_j)) (B, H, N) that the caller would otherwise form from φ
    (None without a projection).

    In ``split`` segments as :func:`forward` (None: by device): the states entering them come
    from the forward's first launch and :func:`_entering` again, held at the forward's running
    scales; the gradients of the states leaving them from a first launch of the keys' kernel
    over each segment's queries, in reverse from 0, and :func:`_adjoints`."""
    b, h, n = phi_q.shape[:3]
    f, d, mapped, kind = _widths(phi_q, projection)
    dv = v.shape[-1]
    config = meta(_phi_dtype(phi_q, kind), chunk, f, dv, d, projection is not None)
    nk, nc = triton.cdiv(f, config["BK"]), triton.cdiv(n, config["BT"])
    acc = running.dtype
    d_out, *read_do = _strided(d_out)
    div, d_den = div.to(acc).contiguous(), d_den.to(acc).contiguous()
    if d_after is None:
        d_after = kv.new_zeros(b, h, f, dv + 1, dtype=acc)
    if projection is None:
        d_q = torch.empty_like(phi_q, dtype=acc)
        d_k = torch.empty_like(phi_k, dtype=acc)
        # The kernels write no sums: any tensor (an argument must point at memory).
        q_sums = k_sums = d_q
    else:
        # For ELU each feature block writes its own columns of one; else parts of sums over the
        # blocks, as num and den are.
        d_q, d_k = (phi_q.new_empty(b, h, n, d, dtype=acc) if kind == ELU.value
                    else _partial(phi_q, nk, b, h, n, d, dtype=acc) for _ in range(2))
        q_sums, k_sums = (_partial(phi_q, nk, b, h, n, dtype=acc) for _ in range(2))
    d_v = _partial(v, nk, b, h, n, dv, dtype=acc)
    d_kv = kv.new_empty(b, h, f, dv + 1, dtype=acc)
    per, count = _split(nc, segments(phi_q.device, nk * b * h, nc) if split is None else split)
    grid = (nk, b * h, count)
    gates, gated = _gates(log_gate, key_log_scale), log_gate is not None
    kv, d_after = kv.to(acc).contiguous(), d_after.to(acc).contiguous()
    if count > 1:
        # The states entering the segments, at the forward's running scales there (the
        # forward's first launch and combination again), and the gradients of the states
        # leaving them (the keys' kernel's queries' side, from 0, then combined).
        starts = torch.cat([running[..., 0:nc:per], running[..., nc:]], -1)
        segment_gates = _segment_gates(log_gate, count, per * config["BT"], phi_q)
        local = phi_q.new_empty(b, h, count, f, dv + 1, dtype=acc)
        ends = phi_q.new_empty(b, h, count, dtype=acc)
        _forward_kernel[grid](
            phi_q, phi_k, key_log_scale, gates, v, kv, kv, *mapped, kv, kv, kv, local, ends, kv,
            n, f, d, dv, nc, b * h, nc + 1, 1, per, LOG_FLOOR, **config, GATED=gated, MAP=kind,
            ATOMIC=atomic(nk), STATES=True,
        )
        kv = _entering(kv, running[..., 0], local, ends, segment_gates, starts[..., :-1])[0]
        _backward_keys_kernel[grid](
            phi_q, phi_k, key_log_scale, gates, v, m, running, d_out, div, d_den, kv, *mapped,
            kv, kv, kv, local, n, f, d, dv, nc, b * h, *read_do, per, **config, GATED=gated,
            MAP=kind, ATOMIC=atomic(nk), ADJOINT=True,
        )
        d_after = _adjoints(d_after, local, starts, segment_gates)
    _backward_queries_kernel[grid](
        phi_q, phi_k, key_log_scale, gates, v, kv.contiguous(), m, running, d_out, div, d_den,
        *mapped, d_q, q_sums, n, f, d, dv, nc, b * h, *read_do, per, **config, GATED=gated,
        MAP=kind, ATOMIC=atomic(nk),
    )
    _backward_keys_kernel[grid](
        phi_q, phi_k, key_log_scale, gates, v, m, running, d_out, div, d_den,
        d_after.contiguous(), *mapped, d_k, k_sums, d_v, d_kv, n, f, d, dv, nc, b * h,
        *read_do, per, **config, GATED=gated, MAP=kind, ATOMIC=atomic(nk), ADJOINT=False,
    )
    d_v = _total(d_v, nk)
    if projection is None:
        return d_q, d_k, d_v, d_kv, None
    if kind != ELU.value:
        d_q, d_k = _total(d_q, nk), _total(d_k, nk)
    return d_q, d_k, d_v, d_kv, (_total(q_sums, nk), _total(k_sums, nk))
