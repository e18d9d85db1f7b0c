"""The chunkwise causal form's layout and per-token factors, shared by the kernelized engine's
strategies (:mod:`effattn.kernelized.cpu`, :mod:`effattn.kernelized.gpu`).

Causal kernelized attention of n tokens runs in nc = ceil(n / C) chunks of C tokens: inside a
chunk a masked C x C product, across chunks a state (F, Dv + 1). Both strategies cut the
sequence the same way, chunk-major (nc, B, H, C, ·) (:func:`_chunk_major`), and weigh the
tokens by the same factors (:func:`_factors`: the keys' log-scales and the gate folded into one
log weight a, every exp(a_i - a_j) <= 1; :func:`_scan_factors`: the scales of the states
between chunks), so that their results agree to rounding whichever runs; they differ in how
the chunks are walked (a loop on the CPU, chunk-parallel on the GPU).

Layering: this module builds on :mod:`effattn.kernelized.core` (the state, the floors, the
conventions) and is imported by the strategies alone; the core never imports it.

Shapes: B batch, H heads, n tokens, F features, Dv value dim, C chunk, nc chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.kernelized import core
from effattn.kernelized.core import LOG_FLOOR, FeatureFn, with_ones
from effattn.kernelized.features import LOG2E


def _chunk_major(x: Tensor, chunk: int, fill: float | None = 0.0,
                 chunks: int | None = None) -> Tensor:
    """(B, H, n, ...) -> (nc, B, H, C, ...): the sequence cut into nc = ceil(n / C) chunks (or
    ``chunks`` >= that many), chunk first, so that each chunk's (B·H, C, ...) block is
    contiguous (a GEMM from or into a strided one runs one small GEMM per matrix, and the
    per-chunk loops feed them one chunk at a time). The tail is filled with ``fill``, or with
    copies of the last row (None: inputs of a feature map, which must stay finite there; no
    gradient comes back through them)."""
    b, h, n = x.shape[:3]
    rest = x.shape[3:]
    tail = (chunks * chunk if chunks else -(-n // chunk) * chunk) - n
    if tail:
        if fill is None:
            x = torch.cat([x, x[:, :, -1:].expand(b, h, tail, *rest)], 2)
        else:
            x = F.pad(x, (0, 0) * len(rest) + (0, tail), value=fill)
    return x.reshape(b, h, -1, chunk, *rest).movedim(2, 0).contiguous()


def _from_chunks(x: Tensor, n: int) -> Tensor:
    """(nc, B, H, C, ...) -> (B, H, n, ...), the inverse of :func:`_chunk_major`."""
    return x.movedim(0, 2).flatten(2, 3)[:, :, :n]


def _chunk_features(
    features: FeatureFn, x: Tensor, chunk: int, is_query: bool
) -> tuple[Tensor, Tensor | None]:
    """φ of x (B, H, n, D), chunk-major (nc, B, H, C, F), and the log-scales (nc, B, H, C, 1) or
    None: the map runs on the chunk-major input as a batch of nc·B sequences of C tokens."""
    x_c = _chunk_major(x, chunk, fill=None)
    phi, log_scale = features(x_c.flatten(0, 1), is_query=is_query)
    nc, b = x_c.shape[:2]
    return phi.unflatten(0, (nc, b)), None if log_scale is None else log_scale.unflatten(0, (nc, b))


@dataclass
class _Factors:
    """The per-token weights of a causal group of n tokens, chunk-major over nc chunks of C.

    With P_j the prefix max of the key log-scales inside j's chunk, g the gate and Λ_j the
    inclusive cumulative log-gate inside the chunk:

    - v (nc, B, H, C, Dv + 1): [v_j, 1] (1 - g_j) exp(ls_j - P_j), 0 at padded and tail keys;
    - prefix: P (nc, B, H, C, 1), no gradient;
    - log_weight: a_j = Λ_j + P_last - P_j (nc, B, H, C), None when every a_j is 0;
    - cum: Λ (nc, B, H, C), None ungated.
    """

    v: Tensor
    prefix: Tensor
    log_weight: Tensor | None
    cum: Tensor | None


def _factors(v: Tensor, key_log_scale: Tensor | None, key_padding_mask: Tensor | None,
             gate: Tensor | None, chunk: int, chunks: int | None = None) -> _Factors:
    """Per-token weights from v (B, H, n, Dv), the keys' chunk-major log-scales
    (nc, B, H, C, 1) or None, the padding mask (B, n) and the gate (B, H, n); nc = ceil(n / C),
    or ``chunks`` (>= that: the chunks after n are empty)."""
    b, h, n = v.shape[:3]
    log_gate = None
    if gate is None and key_padding_mask is None:
        v_c = _values_chunk_major(v, chunk, chunks)
    else:
        v1 = with_ones(v)
        if gate is not None:
            v1 = v1 * (1.0 - gate)[..., None]
            log_gate = core.log_gates(gate)
        if key_padding_mask is not None:
            pad = key_padding_mask[:, None, :]
            v1 = v1.masked_fill(pad[..., None], 0.0)
            if log_gate is not None:
                log_gate = log_gate.masked_fill(pad, 0.0)  # a padded token leaves the state alone
        v_c = _chunk_major(v1, chunk, chunks=chunks)  # zero rows after n
    nc = v_c.shape[0]
    if key_padding_mask is not None and key_log_scale is None:
        # Scale 0 from the first unpadded key on, the floor before it: queries that see no
        # key keep the floor (see core._lost_rows).
        key_log_scale = v.new_zeros(nc, b, h, chunk, 1)
    if key_log_scale is not None and (key_padding_mask is not None or nc * chunk != n):
        # Padded keys and the tail after n carry no scale.
        dropped = torch.ones(key_padding_mask.shape[0] if key_padding_mask is not None else 1,
                             nc * chunk, dtype=torch.bool, device=v.device)
        dropped[:, :n] = False if key_padding_mask is None else key_padding_mask
        dropped = dropped.view(-1, nc, chunk).movedim(1, 0)[:, :, None, :, None]
        key_log_scale = key_log_scale.masked_fill(dropped, float("-inf"))
    # Query i of a chunk sums its keys j <= i at the prefix-max scale P_i = max_{j<=i} ls_j: a
    # key later in the chunk cannot set the scale of earlier queries (their keys would underflow
    # against it). Key j enters at exp(ls_j - P_j) <= 1 and moves to scale P_i through
    # exp(P_j - P_i) <= 1, a C x C factor of the same form as the gate's decay exp(Λ_i - Λ_j):
    # both are exp(a_i - a_j) with a = Λ - P. The last prefix max is the chunk's max, the
    # scale of its delta for later chunks, which only see it complete.
    # Only differences of a enter, so its stabiliser part is taken from the chunk's max,
    # P_last - P_j >= 0: the log-scales themselves can be large (|x̃|²/2 ~ 56 for trigonometric
    # keys of norm 30 at D = 64), and -P_j * log2(e) rounded at that size put ~ε|P| of error into
    # every weight exp2(a_i - a_j) (5e-6 at 56, 1e-4 at 1024), which decoding, subtracting
    # log-scales first, does not have.
    log_weight = None
    if key_log_scale is None:
        prefix = v_c.new_zeros(nc, b, h, chunk, 1)
    else:
        with torch.no_grad():
            prefix = torch.cummax(key_log_scale, -2).values.clamp_min_(LOG_FLOOR)
        entry = torch.exp(key_log_scale - prefix)
        # v_c is this function's own: scaled in place unless autograd records the product.
        recorded = torch.is_grad_enabled() and core._needs_grad(v_c, entry)
        v_c = v_c * entry if recorded else v_c.mul_(entry)
        log_weight = prefix[..., -1:, 0] - prefix[..., 0]
    cum = None
    if log_gate is not None:
        cum = _chunk_major(log_gate, chunk, chunks=chunks).cumsum(-1)
        log_weight = cum if log_weight is None else cum + log_weight
    return _Factors(v_c, prefix, log_weight, cum)


def _values_chunk_major(v: Tensor, chunk: int, chunks: int | None = None) -> Tensor:
    """[v, 1] of v (B, H, n, Dv), chunk-major (nc, B, H, C, Dv + 1) (nc = ceil(n / C), or
    ``chunks``), 0 after n: one pass over v (the ones column is written by the same pad, not by
    a concatenation copied again)."""
    b, h, n, dv = v.shape
    tail = (chunks * chunk if chunks else -(-n // chunk) * chunk) - n
    if tail:
        v = F.pad(v, (0, 0, 0, tail))
    v_c = F.pad(v.unflatten(2, (-1, chunk)).movedim(2, 0), (0, 1), value=1.0)
    if tail:
        v_c[n // chunk, :, :, n % chunk:, dv] = 0.0
        v_c[n // chunk + 1:, :, :, :, dv] = 0.0
    return v_c


def _intra_weights(log_weight: Tensor, row: Tensor | None = None) -> Tensor:
    """exp(a_i - a_j) for j <= i, 0 above the diagonal: (nc, B, H, C) -> (nc, B, H, C, C); times
    exp(row_i) when a row factor's log (nc, B, H, C) is given (folded into the C x C weights,
    C wide, rather than applied to their (C, Dv + 1) product)."""
    chunk = log_weight.shape[-1]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=log_weight.device).triu_(1)
    log2_weight = log_weight * LOG2E  # exp2 on the C x C weights (see features.LOG2E)
    log2_row = log2_weight if row is None else (log_weight + row) * LOG2E
    return (log2_row[..., :, None] - log2_weight[..., None, :]).masked_fill_(
        upper, float("-inf")
    ).exp2_()


def _to_end(log_weight: Tensor) -> Tensor:
    """exp(a_last - a_j), key j's weight in its chunk's state delta: (nc, B, H, C, 1)."""
    return torch.exp(log_weight[..., -1:] - log_weight)[..., None]


def _scan_factors(
    state_scale: Tensor, chunk_max: Tensor, chunk_log_decay: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Scales and factors of the recurrence over the chunks (see
    :func:`effattn.kernelized.cpu._chunk_scan`).

    With ΔS_c at log-scale r_c (``chunk_max`` (nc, B, H)), a_c the total gate of chunk c
    (``chunk_log_decay``) and the incoming state at scale R_0 = s (``state_scale`` (B, H, 1, 1)),
    the state before chunk c + 1 is kept at R_{c+1} = max(R_c, r_c):

        S_{c+1} = keep_c S_c + enter_c ΔS_c,
        keep_c = exp(R_c - R_{c+1} + log a_c),  enter_c = exp(r_c - R_{c+1}).

    Every exponent is <= 0: nothing overflows. Returns R_0..R_nc (nc + 1, B, H) and keep, enter
    (nc, B, H, 1, 1); only keep carries a gradient (the gate's).
    """
    scales = torch.cat([state_scale.reshape(1, *chunk_max.shape[1:]), chunk_max])
    running = torch.cummax(scales, 0).values
    log_keep = running[:-1] - running[1:]
    if chunk_log_decay is not None:
        log_keep = log_keep + chunk_log_decay
    keep = torch.exp(log_keep)[..., None, None]
    enter = torch.exp(chunk_max - running[1:])[..., None, None]
    return running, keep, enter


def _out_weights(fac: _Factors, running: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Query i of chunk c reads the state at scale R_c and its chunk at P_i; its output is held
    at the larger, m_i = max(P_i, R_c). Returns the state's weight exp(R_c - m_i + Λ_i), the
    chunk's exp(P_i - m_i) and m_i, each (nc, B, H, C, 1)."""
    state_scale = running[:-1, ..., None, None]
    common = torch.maximum(fac.prefix, state_scale)
    inter = torch.exp(state_scale - common)
    if fac.cum is not None:
        inter = inter * fac.cum.exp()[..., None]  # decay of the entering state to i
    return inter, torch.exp(fac.prefix - common), common
