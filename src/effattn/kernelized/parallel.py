"""Sequence parallelism of kernelized attention: the ranks exchange fixed-size key states.

Rank r of P holds the contiguous slice r of the sequence, starting at offset o_r (see
:mod:`effattn.parallel`).

- Non-causal: the key state [S, z] = φ(K)^T [V, 1] is a sum over keys, so each rank forms its
  slice's (F, Dv + 1) state and one all-reduce sums them. The stabiliser scale is made common
  first: every rank rescales its state to m = max_r s_r (an all-reduce MAX of (B, H) scalars,
  without gradient: it cancels).
- Causal (and gated): rank r needs the state of everything before o_r. Each rank forms its
  slice's state S_r at scale s_r and its slice's total log gate G_r (0 ungated); one all-gather
  of the P states (LASP-2, Sun et al. 2025) gives every rank
  S_in,r = Σ_{r' < r} exp(s_r' + Σ_{r' < l < r} G_l) S_r', and the chunkwise causal core
  continues from it over the rank's slice.

Communication is one or P states per call, independent of N.

- The window hybrid (``window=W``, :mod:`effattn.kernelized.hybrid`): each rank all-gathers the
  W keys, values, padding and gates before its slice (after it too, non-causal: W // 2 + 1
  each way), a halo as the banded methods' (:mod:`effattn.sparse.parallel`), and computes the
  window's softmax over [halo, own slice, halo]. The kernelized part runs on the lagged keys
  (positions o_r - lag ..), whose slices tile the lagged sequence across the ranks: the state
  exchange above on them gives each rank the state of every key before its lagged slice.
  Non-causal, the keys after the window are the same exchange over the reversed sequence (the
  ranks after r, from the leading keys o_r + lag ..).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.base import compute_dtype
from effattn.kernelized.base import KernelizedAttention
from effattn.kernelized.core import (
    LOG_FLOOR,
    RecurrentState,
    accumulate_keys,
    log_gates,
)
from effattn.kernelized.hybrid import Partial, linear_part, merge, window_log_gate, window_part
from effattn.parallel import SequenceGroup, SequenceStrategy
from effattn.sparse.parallel import halos


class StateExchange(SequenceStrategy):
    """The strategy of every :class:`KernelizedAttention` (see the module docstring); takes the
    call input ``gate`` (B, H, n_r) of gated methods."""


    def attend(
        self,
        attn: KernelizedAttention,
        group: SequenceGroup,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        gate: Tensor | None = None,
    ) -> Tensor:
        dt = compute_dtype(q.dtype)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        gate = None if gate is None else gate.to(dt)
        if attn.window is not None:
            return _hybrid(attn, group, q, k, v, causal, key_padding_mask, gate)
        core = attn.core()
        if not causal:
            local = core.key_state(k, v, key_padding_mask=key_padding_mask)
            scale = group.all_reduce_max(local.log_scale)
            kv = group.all_reduce_sum(local.kv * torch.exp(local.log_scale - scale))
            state = RecurrentState(kv, scale, group.total)
            return core.read_queries(q, state)
        incoming = _entering(attn, group, k, v, key_padding_mask, gate, reverse=False)
        return core.causal(q, k, v, incoming, key_padding_mask=key_padding_mask, gate=gate)[0]


def _slice_state(
    attn: KernelizedAttention,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
) -> tuple[RecurrentState, Tensor]:
    """The causal state after this slice alone and its total log gate G (B, H) (0 ungated).

    Ungated, that state is the non-causal key state of the slice. Gated, key j enters it with
    weight (1 - g_j) Π_{j < l} g_l over the slice's later tokens l: the product goes into the
    key's log-scale (the core's stabiliser then keeps it finite), 1 - g_j multiplies φ(k_j),
    so that it reaches both [v_j, 1] columns. Padded tokens neither enter nor decay the state.
    """
    if gate is None:
        state = attn.core().key_state(k, v, key_padding_mask=key_padding_mask)
        return state, k.new_zeros(k.shape[:2])
    log_gate = log_gates(gate)  # as the core floors it
    if key_padding_mask is not None:
        log_gate = log_gate.masked_fill(key_padding_mask[:, None, :], 0.0)
    # Σ_{l > j} log g_l as a reversed cumsum shifted by one: no subtraction of long sums.
    later = F.pad(log_gate[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))
    phi_k, log_scale = attn.features(k, is_query=False)
    log_scale = later[..., None] if log_scale is None else log_scale + later[..., None]
    state = accumulate_keys(None, phi_k * (1.0 - gate)[..., None], v, key_log_scale=log_scale,
                            key_padding_mask=key_padding_mask)
    return state, log_gate.sum(-1)


def _entering(attn: KernelizedAttention, group: SequenceGroup, k: Tensor, v: Tensor,
              key_padding_mask: Tensor | None, gate: Tensor | None,
              reverse: bool) -> RecurrentState:
    """The causal state entering this rank's slice of k, v: every rank's slice state and total
    log gate in one all-gather, combined by :func:`_incoming`."""
    local, decay = _slice_state(attn, k, v, key_padding_mask, gate)
    b, h, f, dv1 = local.kv.shape
    widths = (f * dv1, local.log_scale.shape[-2])  # one log-scale per state, or per feature
    packed = torch.cat([local.kv.reshape(b, h, widths[0]), local.log_scale.reshape(b, h, -1),
                        decay.reshape(b, h, 1)], -1)
    return _incoming(group.all_gather(packed), f, widths, group, reverse)


def _incoming(states: Tensor, f: int, widths: tuple[int, int], group: SequenceGroup,
              reverse: bool) -> RecurrentState:
    """The state entering this rank r from the gathered states of all P ranks.

    S_in = Σ_{r' < r} exp(s_r' + Σ_{r' < l < r} G_l) S_r', held at the largest of those
    exponents (every weight <= 1). Ranks r' >= r get weight 0 rather than being left out, so
    that every rank's output depends on the gather and every rank runs its backward (rank 0
    gets an empty state). ``reverse``: the ranks in reverse order (r' > r enter), for a pass
    over the reversed sequence. ``widths``: of the packed state F (Dv + 1) and of its
    log-scales, 1 or F (a per-feature state, see kernelized.exponents).
    """
    rank = group.rank
    if reverse:
        states, rank = states.flip(0), group.size - 1 - group.rank
    size, scales = widths
    kv = states[..., :size].unflatten(-1, (f, -1))  # (P, B, H, F, Dv + 1)
    scale = states[..., size:size + scales].detach()  # (P, B, H, 1 or F)
    decay = states[..., -1]  # (P, B, H)
    earlier = (torch.arange(group.size, device=states.device) < rank)[:, None, None]
    decay = decay.masked_fill(~earlier, 0.0)
    # Σ_{l > r'} G_l as a reversed cumsum shifted by one: no subtraction of long sums.
    later = torch.cat([decay[1:].flip(0).cumsum(0).flip(0), torch.zeros_like(decay[:1])])
    exponent = (scale + later[..., None]).masked_fill(~earlier[..., None], float("-inf"))
    top = exponent.detach().amax(0).clamp_min(LOG_FLOOR)
    weight = torch.exp(exponent - top)[..., None]
    return RecurrentState((weight * kv).sum(0), top[..., None], group.offset)


def _hybrid(
    attn: KernelizedAttention,
    group: SequenceGroup,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
) -> Tensor:
    """The window hybrid over this rank's slice (see the module docstring)."""
    window = attn.window
    assert window is not None
    b, h, n, d = k.shape
    dv = v.shape[-1]
    lag = window if causal else window // 2 + 1
    pad = (torch.zeros(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None
           else key_padding_mask)
    # One gather for keys, values, padding (1 = padded) and gates; halos filled to ``lag``
    # rows with padding where the sequence ends.
    rows = torch.cat([k, v, pad[:, None, :, None].to(k.dtype).expand(b, h, n, 1),
                      (k.new_ones(b, h, n) if gate is None else gate)[..., None]], -1)
    before, after = halos(rows, group, lag, 0 if causal else lag)
    filler = torch.cat([rows.new_zeros(d + dv), rows.new_ones(2)])
    before = torch.cat([filler.expand(b, h, lag - before.shape[2], -1), before], 2)
    after = torch.cat([after, filler.expand(b, h, (0 if causal else lag) - after.shape[2], -1)],
                      2)
    ext = torch.cat([before, rows, after], 2)
    k_e, v_e = ext[..., :d], ext[..., d:d + dv]
    pad_e, gate_e = ext[:, 0, :, d + dv] > 0.5, ext[..., -1]
    q_e = F.pad(q, (0, 0, lag, after.shape[2]))
    seen = window_part(attn, q_e, k_e, v_e, causal, pad_e)
    parts = [Partial(seen.out[:, :, lag:lag + n], seen.log_abs[:, :, lag:lag + n])]
    lagged = _exchanged_part(attn, group, q, k_e[:, :, :n], v_e[:, :, :n], pad_e[:, :n],
                             None if gate is None else gate_e[:, :, :n], reverse=False)
    if gate is not None:
        earlier = log_gates(gate_e[:, :, :lag]).masked_fill(
            pad_e[:, None, :lag], 0.0)
        lagged = Partial(lagged.out, lagged.log_abs
                         + window_log_gate(gate, key_padding_mask, lag, earlier), lagged.sign)
    parts.append(lagged)
    if not causal:
        lead = slice(2 * lag, 2 * lag + n)
        later = _exchanged_part(attn, group, q.flip(2), k_e[:, :, lead].flip(2),
                                v_e[:, :, lead].flip(2), pad_e[:, lead].flip(1), None,
                                reverse=True)
        parts.append(Partial(later.out.flip(2), later.log_abs.flip(2),
                             None if later.sign is None else later.sign.flip(2)))
    return merge(parts, attn.eps)


def _exchanged_part(
    attn: KernelizedAttention,
    group: SequenceGroup,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pad: Tensor,
    gate: Tensor | None,
    reverse: bool,
) -> Partial:
    """The kernelized part of the hybrid from this rank's lagged (or, ``reverse``, leading) keys:
    their slice states exchanged, then the causal pass from the state entering the slice."""
    incoming = _entering(attn, group, k, v, pad, gate, reverse)
    out, _, norm = attn.core().causal_normalised(q, k, v, incoming, key_padding_mask=pad,
                                                 gate=gate)
    return linear_part(attn, out, norm)

