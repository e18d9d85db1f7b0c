"""The window hybrid of a kernelized method: exact softmax over each query's window of keys, the
method's feature-map estimate over every other key, in one normaliser.

With s_ij the method's exact logits (``scale q_i·k_j``; RFA: the log of its Gaussian kernel),
κ(q, k) = φ(q)·φ(k) its kernel at the true scale (the query's log-scale included, see
kernelized.features), w_ij the weights of the pure method (causality, padding, gate) and α_h an
optional per-head factor (LoLCATs, Zhang et al. 2024; Based, Arora et al. 2024 for the
window + linear split)::

    out_i = (Σ_{j ∈ W(i)} e^{s_ij} v_j + α_h Σ_{j ∉ W(i)} w_ij κ(q_i, k_j) v_j)
            / (Σ_{j ∈ W(i)} e^{s_ij}   + α_h Σ_{j ∉ W(i)} w_ij κ(q_i, k_j))

W(i) is the window of ``local``: causal, the last ``window`` keys 0 <= i - j < window (the
query's own included); non-causal, |i - j| <= window // 2. For random features (performer,
favor, rfa) κ estimates e^{s}, so the window is exact where attention is peaked and the
estimate fills in the rest; for maps that do not estimate e^{s} (linear, hedgehog, taylor) the
factor lets training set the balance. A window that covers every key is exact softmax.

Computed as two (non-causal: three) normalised partial attentions merged by their normalisers,
as FlashAttention merges blocks: the banded engine (``effattn.sparse``) gives the window's
output and log-sum-exp; the causal kernelized core gives the rest's output and normaliser
(:meth:`effattn.kernelized.core.CoreConfig.causal_normalised`) with its ``lag`` = window:
query i sees keys up to i - window, exactly those causal attention leaves outside the window.
Non-causal, the keys before i - window // 2 are one lagged causal pass and those after
i + window // 2 the same pass over the reversed sequence. Both engines keep only
their inputs, outputs and normalisers for the backward (no N x window or N x F tensor).

Gated (RFA's gate): key j outside the window carries (1 - g_j) Π_{j<l<=i} g_l, the lagged
state's weight times the gates of the window, Π_{i-window<l<=i} g_l, added to its log.

Decoding: :class:`WindowState` holds a ring buffer of the last ``window`` keys and values (and
gates) and the fixed-size state of every key before them: memory independent of the position.
A key leaving the window enters the state.

Shapes: B batch, H heads, N tokens, D head dim, Dv value dim, W window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn.kernelized.core import (
    LOG_GATE_FLOOR,
    Normaliser,
    RecurrentState,
)
from effattn.sparse import banded_attention

if TYPE_CHECKING:
    from effattn.kernelized.base import KernelizedAttention


@dataclass
class Partial:
    """Attention over a subset of the keys: its normalised output (B, H, N, Dv) and normaliser
    Σ_j (weight of j) as ``sign · exp(log_abs)`` (B, H, N); sign None: positive."""

    out: Tensor
    log_abs: Tensor
    sign: Tensor | None = None


def merge(parts: list[Partial], eps: float) -> Tensor:
    """Σ_p n_p out_p / Σ_p n_p for the parts' normalisers n_p: attention over the union of their
    (disjoint) key sets. Held at the largest log |n_p| of each row (no overflow); a row that no
    part reaches gives 0. ``eps`` floors |Σ_p n_p| at ``eps`` times the largest |n_p|, keeping
    its sign (0: no floor): only signed features' estimates can cancel the sum, and relative to
    its parts, since the window's exact softmax can be legitimately tiny at the true scale
    (logits of -400), where the core's absolute floor would replace it.

    Recording gradients (eager), by :class:`_Merge`, which keeps the merged output, the
    parts' shares and the outputs of all parts but the last (causal: only the window's, which
    its engine keeps anyway), not the last part's output or the weighted sums."""
    outs = [p.out for p in parts]
    logs = [p.log_abs for p in parts]
    signs = [p.sign for p in parts]
    if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t.requires_grad for t in outs + logs)):
        return _Merge.apply(eps, len(parts), *outs, *logs, *signs)
    shares, _ = _shares(logs, signs, eps)
    return _weighted_sum(outs, shares)


def _shares(logs: list[Tensor], signs: list[Tensor | None],
            eps: float) -> tuple[list[Tensor], Tensor]:
    """Each part's share a_p = n_p / D of the merged output (B, H, N), D the floored sum of the
    n_p (see :func:`merge`), and where D is that sum (1.0, else 0.0: the floor or the 0 -> 1
    rule replaced it, and no gradient reaches the n_p through D)."""
    top = torch.stack(logs).amax(0).detach()
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = []
    for log_abs, sign in zip(logs, signs, strict=True):
        weight = torch.exp(log_abs - top)
        weights.append(weight if sign is None else weight * sign)
    den = weights[0]
    for weight in weights[1:]:
        den = den + weight
    div = den
    if eps > 0:
        div = torch.where(div >= 0, div.clamp_min(eps), div.clamp_max(-eps))
    div = torch.where(div == 0, 1.0, div)
    return [weight / div for weight in weights], (div == den).to(den.dtype)


def _weighted_sum(outs: list[Tensor], shares: list[Tensor]) -> Tensor:
    """Σ_p a_p out_p: outs (B, H, N, Dv), shares (B, H, N)."""
    merged = outs[0] * shares[0][..., None]
    for out, share in zip(outs[1:], shares[1:], strict=True):
        merged = merged + out * share[..., None]
    return merged


class _Merge(torch.autograd.Function):
    """o = Σ_p a_p out_p, a_p = n_p / D (:func:`merge`), differentiable in the parts' outputs
    out_p (B, H, N, Dv) and log-normalisers l_p = log |n_p| (B, H, N). With G = ∂L/∂o::

        ∂L/∂out_p = a_p G,   ∂L/∂l_p = a_p (G·out_p) - c a_p (G·o)

    (c = 1 where D is Σ_p n_p, 0 where a floor replaced it). Since o = Σ_p a_p out_p exactly,
    the last part's a_P (G·out_P) = G·o - Σ_{p<P} a_p (G·out_p): its output is not needed, and
    the backward keeps o, the shares and the other parts' outputs only. The stabiliser (the
    rows' largest l_p) carries no gradient, as in the forward's autograd form.
    """

    @staticmethod
    def forward(ctx: Any, eps: float, count: int, *tensors: Tensor | None) -> Tensor:
        outs = list(tensors[:count])
        logs = list(tensors[count:2 * count])
        signs = list(tensors[2 * count:])
        shares, reaches = _shares(logs, signs, eps)
        merged = _weighted_sum(outs, shares)
        ctx.count = count
        ctx.save_for_backward(merged, reaches, *shares, *outs[:-1])
        return merged

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        merged, reaches, *rest = ctx.saved_tensors
        count = ctx.count
        shares, outs = rest[:count], rest[count:]
        total = (grad * merged).sum(-1)
        weighted = [share * (grad * out).sum(-1)
                    for share, out in zip(shares[:-1], outs, strict=True)]
        last = total
        for term in weighted:
            last = last - term
        weighted.append(torch.where(shares[-1] == 0, 0.0, last))
        d_outs = [grad * share[..., None] if ctx.needs_input_grad[2 + p] else None
                  for p, share in enumerate(shares)]
        d_logs = [term - reaches * share * total if ctx.needs_input_grad[2 + count + p] else None
                  for p, (term, share) in enumerate(zip(weighted, shares, strict=True))]
        return None, None, *d_outs, *d_logs, *([None] * count)


def window_part(attn: KernelizedAttention, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                 key_padding_mask: Tensor | None) -> Partial:
    """Exact softmax over each query's window, by the banded engine."""
    wq, wk, scale, shift = attn.window_logits(q, k)
    window = attn.window
    assert window is not None
    left, right = (window - 1, 0) if causal else (window // 2, window // 2)
    out, lse = banded_attention(wq, wk, v, left=left, right=right, scale=scale,
                                key_mask=key_padding_mask)
    return Partial(out, lse if shift is None else lse + shift[:, None])


def _lagged_part(attn: KernelizedAttention, q: Tensor, k: Tensor, v: Tensor, lag: int,
                 key_padding_mask: Tensor | None, gate: Tensor | None) -> Partial:
    """The kernelized estimate over keys j <= i - lag, causal: the core's ``lag``."""
    out, _, norm = attn.core().causal_normalised(q, k, v, key_padding_mask=key_padding_mask,
                                                 gate=gate, lag=lag)
    log_abs = norm.log_abs
    if gate is not None:
        log_abs = log_abs + window_log_gate(gate, key_padding_mask, lag, None)
    return linear_part(attn, out, Normaliser(log_abs, norm.sign))


def window_log_gate(gate: Tensor, key_padding_mask: Tensor | None, window: int,
                     earlier: Tensor | None) -> Tensor:
    """Σ_{i-window<l<=i} log g_l (B, H, N): the decay of the lagged state over the window, padded
    tokens leaving it alone as in the core. ``earlier`` (B, H, window): the log-gates of the
    ``window`` tokens before these (a decoder's ring buffer), None: none. Summed in float64 as
    a difference of cumulative sums (a window of any length costs one pass)."""
    log_gate = torch.log(gate).clamp_min(LOG_GATE_FLOOR)
    if key_padding_mask is not None:
        log_gate = log_gate.masked_fill(key_padding_mask[:, None, :], 0.0)
    if earlier is None:
        earlier = log_gate.new_zeros(*log_gate.shape[:2], window)
    total = torch.cat([earlier, log_gate], -1).double().cumsum(-1)
    return (total[..., window:] - total[..., :-window]).to(gate.dtype)


def linear_part(attn: KernelizedAttention, out: Tensor, norm: Normaliser) -> Partial:
    """The kernelized part as a :class:`Partial`, times the per-head factor when there is one."""
    log_abs = norm.log_abs
    factor = attn.window_log_factor
    if factor is not None:
        log_abs = log_abs + factor.to(log_abs.dtype)[:, None]
    return Partial(out, log_abs, norm.sign)


def hybrid_attention(
    attn: KernelizedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    gate: Tensor | None = None,
) -> Tensor:
    """The window hybrid of ``attn`` (see the module docstring): q, k (B, H, N, D), v (B, H, N,
    Dv), key_padding_mask (B, N), gate (B, H, N) (causal) -> (B, H, N, Dv)."""
    window = attn.window
    assert window is not None
    n = q.shape[2]
    parts = [window_part(attn, q, k, v, causal, key_padding_mask)]
    lag = window if causal else window // 2 + 1
    if lag < n:  # else every key is in every window: exact softmax
        parts.append(_lagged_part(attn, q, k, v, lag, key_padding_mask, gate))
        if not causal:
            flip = None if key_padding_mask is None else key_padding_mask.flip(1)
            later = _lagged_part(attn, q.flip(2), k.flip(2), v.flip(2), lag, flip, None)
            parts.append(Partial(later.out.flip(2), later.log_abs.flip(2),
                                 None if later.sign is None else later.sign.flip(2)))
    return merge(parts, attn.eps)


@torch.no_grad()
def calibrate_factor(attn: KernelizedAttention, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None) -> None:
    """Set the per-head factor α_h (``window_log_factor``) so that the estimate's normaliser over
    the keys outside each window equals exact softmax's, at the median over the queries::

        log α_h = median_i [log Σ_{j ∉ W(i)} e^{s_ij} - log Σ_{j ∉ W(i)} κ(q_i, k_j)]

    Then the estimate starts with the share of attention softmax gives the keys outside the
    window. α_h = 1 is right for the maps that estimate e^{s} (random features); a map whose
    kernel has its own scale (hedgehog's, linear's) can otherwise drown the window, and training
    moves log α by about the step size per step. Dense N x N logits, ungated: for converting a
    trained model, once on a batch of its own q, k (q, k (B, H, N, D), key_padding_mask (B, N)).
    Queries whose estimate is signed or empty are left out; heads without any keep their factor.
    """
    window, factor = attn.window, attn.window_log_factor
    if window is None or factor is None:
        raise ValueError(f"{attn.spec.name}: calibrate_factor needs window= and "
                         "window_factor=True")
    n = q.shape[2]
    wq, wk, scale, shift = attn.window_logits(q, k)
    logits = scale * wq @ wk.transpose(-2, -1)
    if shift is not None:
        logits = logits + shift[:, None, None]
    offset = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)
    outside = (offset >= window) if causal else offset.abs() > window // 2
    if key_padding_mask is not None:
        outside = outside & ~key_padding_mask[:, None, None, :]
    exact = torch.logsumexp(logits.masked_fill(~outside, -torch.inf), -1)
    lag = window if causal else window // 2 + 1
    if lag >= n:
        return
    zeros = q.new_zeros(*q.shape[:3], 1)
    parts = [_lagged_part(attn, q, k, zeros, lag, key_padding_mask, None)]
    if not causal:
        flip = None if key_padding_mask is None else key_padding_mask.flip(1)
        later = _lagged_part(attn, q.flip(2), k.flip(2), zeros, lag, flip, None)
        parts.append(Partial(later.out, later.log_abs.flip(2),
                             None if later.sign is None else later.sign.flip(2)))
    estimate = torch.logsumexp(torch.stack([p.log_abs for p in parts]), 0)
    estimate = estimate - factor.to(estimate.dtype)[:, None]
    keep = torch.isfinite(exact) & torch.isfinite(estimate)
    for p in parts:
        if p.sign is not None:
            keep &= (p.sign > 0) | ~torch.isfinite(p.log_abs)
    diff = (exact - estimate).masked_fill(~keep, torch.nan)
    median = diff.transpose(0, 1).flatten(1).nanmedian(-1).values  # (H,)
    factor.copy_(torch.where(torch.isnan(median), factor, median.to(factor.dtype)))


@dataclass
class WindowState:
    """Decoding state of a window hybrid: the last W keys, values (and gates) in a ring buffer
    (position p in slot p % W) and the kernelized state of every key before them.

    k: (B, H, W, D), v: (B, H, W, Dv), gate: (B, H, W) or None; linear: the
    :class:`RecurrentState` of the keys before the window (None until one leaves it);
    length: tokens seen. Its size does not depend on the position.
    """

    k: Tensor
    v: Tensor
    gate: Tensor | None
    linear: RecurrentState | None
    length: int

    def nbytes(self) -> int:
        tensors = [self.k, self.v] + [t for t in (self.gate,) if t is not None]
        ring = sum(t.numel() * t.element_size() for t in tensors)
        return ring + (0 if self.linear is None else self.linear.nbytes())

    def nbytes_in_use(self) -> int:
        return self.nbytes()


def _ordered(x: Tensor, length: int) -> Tensor:
    """A ring buffer's (B, H, W, ...) slots in position order, oldest first."""
    return torch.roll(x, -(length % x.shape[2]), 2)


def _slots(x: Tensor, length: int) -> Tensor:
    """The inverse of :func:`_ordered`: the last W positions (oldest first) -> ring slots."""
    return torch.roll(x, length % x.shape[2], 2)


def hybrid_prefill(
    attn: KernelizedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: WindowState | None,
    gate: Tensor | None = None,
) -> tuple[Tensor, WindowState]:
    """Causal window hybrid over a block of L tokens after ``state`` (None: the start): q, k
    (B, H, L, D), v (B, H, L, Dv), gate (B, H, L) -> (B, H, L, Dv) and the state after.

    The W keys before the block (the ring, in order) go in front of it: the window part runs on
    those W + L positions (their queries unused), the kernelized part on the first L of them,
    the lagged keys, after the state of everything older."""
    window = attn.window
    assert window is not None
    b, h, n = q.shape[:3]
    state = _check_state(attn, state, k, v, gate)
    front = torch.arange(state.length - window, state.length, device=q.device) < 0
    k_ext = torch.cat([_ordered(state.k, state.length), k], 2)
    v_ext = torch.cat([_ordered(state.v, state.length), v], 2)
    pad = torch.cat([front, front.new_zeros(n)])[None].expand(b, -1)
    g_ext = None
    if gate is not None:
        assert state.gate is not None
        g_ext = torch.cat([_ordered(state.gate, state.length), gate], 2)
    q_ext = torch.cat([q.new_zeros(b, h, window, q.shape[3]), q], 2)
    seen = window_part(attn, q_ext, k_ext, v_ext, True, pad)
    parts = [Partial(seen.out[:, :, window:], seen.log_abs[:, :, window:])]
    out, linear, norm = attn.core().causal_normalised(
        q, k_ext[:, :, :n], v_ext[:, :, :n], state.linear, key_padding_mask=pad[:, :n],
        gate=None if g_ext is None else g_ext[:, :, :n],
    )
    if g_ext is not None:
        norm = Normaliser(norm.log_abs + window_log_gate(g_ext[:, :, window:], None, window,
                                                          _masked_log(g_ext[:, :, :window],
                                                                      front)), norm.sign)
    parts.append(linear_part(attn, out, norm))
    length = state.length + n
    return merge(parts, attn.eps), WindowState(
        _slots(k_ext[:, :, -window:], length), _slots(v_ext[:, :, -window:], length),
        None if g_ext is None else _slots(g_ext[:, :, -window:], length), linear, length,
    )


def _masked_log(gate: Tensor, empty: Tensor | None) -> Tensor:
    """log g (clamped as the core clamps it), 0 at the ring's empty slots (``empty`` (W,), None:
    none)."""
    log_gate = torch.log(gate).clamp_min(LOG_GATE_FLOOR)
    return log_gate if empty is None else log_gate.masked_fill(empty, 0.0)


def _check_state(attn: KernelizedAttention, state: WindowState | None, k: Tensor, v: Tensor,
                 gate: Tensor | None) -> WindowState:
    """``state``, checked against the module and the block, or an empty one."""
    window = attn.window
    assert window is not None
    b, h = k.shape[:2]
    if state is None:
        return WindowState(
            k.new_zeros(b, h, window, k.shape[3]), v.new_zeros(b, h, window, v.shape[3]),
            None if gate is None else gate.new_ones(b, h, window), None, 0,
        )
    if not isinstance(state, WindowState) or state.k.shape != (b, h, window, k.shape[3]):
        got = (f"a WindowState of keys {tuple(state.k.shape)}" if isinstance(state, WindowState)
               else type(state).__name__)
        raise ValueError(
            f"{attn.spec.name} with window={window}: state must be the WindowState of its "
            f"step/prefill, keys (B={b}, H={h}, W={window}, D={k.shape[3]}), got {got}"
        )
    if (state.gate is None) != (gate is None):
        made = "with" if gate is None else "without"
        raise ValueError(f"{attn.spec.name}: the state was made {made} a gate; every step and "
                         "prefill of a sequence must agree")
    return WindowState(state.k.to(k.dtype), state.v.to(v.dtype),
                       None if state.gate is None else state.gate.to(k.dtype), state.linear,
                       state.length)


def hybrid_step(
    attn: KernelizedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: WindowState | None,
    gate: Tensor | None = None,
) -> tuple[Tensor, WindowState]:
    """One decoding token (B, H, 1, ·) of the causal window hybrid: the key leaving the window
    enters the kernelized state, the new one takes its slot, then softmax over the ring and the
    state's read-out are merged. Updates the ring in place unless autograd records."""
    window = attn.window
    assert window is not None
    state = _check_state(attn, state, k, v, gate)
    t, slot = state.length, state.length % window
    linear = state.linear
    core = attn.core()
    if t >= window:
        linear = core.step_keys(
            linear, state.k[:, :, slot:slot + 1], state.v[:, :, slot:slot + 1],
            gate=None if state.gate is None else state.gate[:, :, slot:slot + 1],
            recording=q.requires_grad)
    in_place = not torch.compiler.is_compiling() and not (
        torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, state.k, state.v)))
    ring_k, ring_v, ring_g = state.k, state.v, state.gate
    if in_place:
        ring_k[:, :, slot] = k[:, :, 0]
        ring_v[:, :, slot] = v[:, :, 0]
        if ring_g is not None and gate is not None:
            ring_g[:, :, slot] = gate[:, :, 0]
    else:
        at = F.one_hot(torch.tensor(slot), window).to(device=k.device, dtype=torch.bool)
        ring_k = torch.where(at[:, None], k, ring_k)
        ring_v = torch.where(at[:, None], v, ring_v)
        if ring_g is not None and gate is not None:
            ring_g = torch.where(at, gate, ring_g)
    # Slots not written yet, masked out of the softmax: none from the window's end on.
    empty = torch.arange(window, device=q.device) > t if t < window - 1 else None
    wq, wk, scale, shift = attn.window_logits(q, ring_k)
    scores = wq @ wk.transpose(-2, -1) * scale
    if empty is not None:
        scores = scores.masked_fill(empty, float("-inf"))
    # One pass of the softmax's sums (logsumexp and softmax would each take the max and exp).
    top = scores.amax(-1, keepdim=True)  # finite: the token's own key is in the ring
    weights = torch.exp(scores - top)
    num, total = weights @ ring_v, weights.sum(-1)
    if linear is None:
        return num / total[..., None], WindowState(ring_k, ring_v, ring_g, linear, t + 1)
    lse = top[..., 0] + torch.log(total)
    if shift is not None:
        lse = lse + shift[:, None]
    out, norm = core.read_normalised(linear, q)
    if ring_g is not None:
        norm = Normaliser(norm.log_abs + _masked_log(ring_g, empty).sum(-1, keepdim=True),
                          norm.sign)
    merged = _merge_window(num, total, lse, linear_part(attn, out, norm), attn.eps)
    return merged, WindowState(ring_k, ring_v, ring_g, linear, t + 1)


def _merge_window(num: Tensor, total: Tensor, lse: Tensor, part: Partial, eps: float) -> Tensor:
    """:func:`merge` of a window's softmax, given by its sums num = Σ_j e^{s_j - m} v_j (B, H, N,
    Dv), total = Σ_j e^{s_j - m} (B, H, N) and lse = log Σ_j e^{s_j} (finite: every query
    sees a key of its window), with one other part: the decoding step's merge in fewer passes
    than the general one (the window's output is never normalised on its own, and its finite
    lse sets the rows' scale without a check). With n_w = e^{lse - top}, n_p = ±e^{l_p - top}::

        out = (num n_w / total + out_p n_p) / (n_w + n_p)

    the sum floored as :func:`merge` floors it; it is not 0 unless signed features cancel the
    window's positive part exactly, where the floor (eps > 0 for those maps) holds it."""
    top = torch.maximum(lse, part.log_abs)
    own = torch.exp(lse - top)
    other = torch.exp(part.log_abs - top)
    if part.sign is not None:
        other = other * part.sign
    den = own + other
    if eps > 0:
        den = torch.where(den >= 0, den.clamp_min(eps), den.clamp_max(-eps))
    return (num * (own / total)[..., None] + part.out * other[..., None]) / den[..., None]
