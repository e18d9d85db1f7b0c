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
Non-causal, the rest is one non-causal key state over every key, read by every query, minus the
window's band of the kernel (Σ_{|i-j|<=window//2} κ_ij [v_j, 1], in blocks: O(N·window·F)), a
third part with a negative normaliser. A subtraction can cancel: where a row's estimate over
every key is mostly its window's, and the window's exact softmax does not outweigh it (peaked
logits with an estimate far from e^s, or a large per-head factor), the difference would keep
only its rounding (:func:`cancels`, one host sync per call); the call then computes the rest
as two lagged causal passes, the keys before the window and (over the reversed sequence) those
after it, which subtract nothing. A compiled graph always takes those two passes (no
data-dependent branch). The engines keep only their inputs, outputs and normalisers for the
backward, the band's slices are recomputed, and the merge keeps the merged output, not the
kernelized parts' (:class:`_Merge`): no N x window or N x F tensor.

Gated (RFA's gate): key j outside the window carries (1 - g_j) Π_{j<l<=i} g_l, the lagged
state's weight times the gates of the window, Π_{i-window<l<=i} g_l, added to its log.

Decoding: :class:`WindowState` holds a ring buffer of the last ``window`` keys and values (and
gates) and the fixed-size state of every key before them: memory independent of the position.
A key leaving the window enters the state.

Shapes: B batch, H heads, N tokens, D head dim, Dv value dim, W window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from effattn.kernelized import exponents
from effattn.kernelized.core import (
    LOG_FLOOR,
    CoreConfig,
    Normaliser,
    RecurrentState,
    log_gates,
    read_checked,
    slice_tokens,
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
    """Σ_p a_p out_p: outs (B, H, N, Dv), shares (B, H, N). Accumulated in place into one new
    tensor: each further (B, H, N, Dv) temporary would cost a fresh allocation, whose page
    faults on a CPU take longer than the arithmetic."""
    merged = outs[0] * shares[0][..., None]
    for out, share in zip(outs[1:], shares[1:], strict=True):
        merged.addcmul_(out, share[..., None])
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
    log_gate = log_gates(gate)
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
    if lag >= n:  # every key is in every window: exact softmax
        return merge(parts, attn.eps)
    if causal:
        return merge(parts + [_lagged_part(attn, q, k, v, lag, key_padding_mask, gate)],
                     attn.eps)
    if not torch.compiler.is_compiling():
        outside, lost = outside_window_parts(
            attn, q, k, v, key_padding_mask,
            attn.core().key_state(k, v, key_padding_mask=key_padding_mask), window // 2,
        )
        if not cancels(parts[0], *outside, lost):
            return merge(parts + outside, attn.eps)
    return merge(parts + _lagged_both_ways(attn, q, k, v, lag, key_padding_mask), attn.eps)


def cancels(window: Partial, total: Partial, band: Partial, lost: Tensor) -> bool:
    """Whether the non-causal form's subtraction (every key's estimate minus the window's band)
    is unsafe: ``lost`` (0-d), a query's read-out of every key underflowed (as the core's
    lost-row check finds it), or the subtraction loses more than a third of the digits of some
    row's merged normaliser::

        max(|n_total|, |n_band|) > ε^(-1/3) |n_window + n_total - n_band|

    (ε of the parts' dtype): a query whose estimate over the window is most of its estimate over
    every key, and is not outweighed by the window's exact softmax. Peaked logits with estimates
    far from e^s do it (in fp32, rows that should carry weight would read their difference's
    rounding, or 0). The caller then takes the two lagged passes, which subtract nothing. One
    host sync per call."""
    with torch.no_grad():
        logs = torch.stack([window.log_abs, total.log_abs, band.log_abs])
        top = logs.amax(0)
        top = torch.where(torch.isfinite(top), top, 0.0)
        sizes = torch.exp(logs - top)
        signed = [size if part.sign is None else size * part.sign
                  for size, part in zip(sizes, (window, total, band), strict=True)]
        merged = (signed[0] + signed[1] + signed[2]).abs()
        limit = torch.finfo(logs.dtype).eps ** (-1 / 3)
        return bool((torch.maximum(sizes[1], sizes[2]) > limit * merged).any() | lost)


def _lagged_both_ways(attn: KernelizedAttention, q: Tensor, k: Tensor, v: Tensor, lag: int,
                      key_padding_mask: Tensor | None) -> list[Partial]:
    """Non-causal, without a subtraction: the keys before i - lag + 1 by one lagged causal pass,
    those after i + lag - 1 by the same pass over the reversed sequence."""
    flip = None if key_padding_mask is None else key_padding_mask.flip(1)
    later = _lagged_part(attn, q.flip(2), k.flip(2), v.flip(2), lag, flip, None)
    return [_lagged_part(attn, q, k, v, lag, key_padding_mask, None),
            Partial(later.out.flip(2), later.log_abs.flip(2),
                    None if later.sign is None else later.sign.flip(2))]


def outside_window_parts(attn: KernelizedAttention, q: Tensor, k: Tensor, v: Tensor,
                         key_padding_mask: Tensor | None, state: RecurrentState,
                         half: int) -> tuple[list[Partial], Tensor]:
    """Non-causal: the kernelized estimate over the keys outside each query's window,
    |i - j| > half, as every key's estimate minus the window's::

        Σ_{|i-j|>half} κ_ij [v_j, 1] = φ(q_i)·Σ_j φ(k_j) [v_j, 1] - Σ_{|i-j|<=half} κ_ij [v_j, 1]

    two parts for :func:`merge`, the second with its sign turned: ``state``, the non-causal key
    state of every key (``CoreConfig.key_state``), read by every query, and the window's band
    of the kernel; and whether a query's read-out of the state underflowed (0-d, see
    :func:`cancels`). q, k (B, H, N, D), v (B, H, N, Dv), key_padding_mask (B, N).

    Slice by slice of the queries (:func:`_band_slice`); recording gradients, each slice is
    recomputed in the backward (a checkpoint), so that only the inputs are kept, not the
    slices' features or band scores.
    """
    config = attn.core()
    b, h, n = q.shape[:3]
    chunk = max(half, BAND_CHUNK)
    step = slice_tokens(b * h, config.feature_dim + 2 * chunk, chunk, config.slice_elements)
    recording = (torch.is_grad_enabled() and not torch.compiler.is_compiling()
                 and any(t.requires_grad for t in (q, k, v, state.kv)))
    pieces = []
    for a in range(0, n, step):
        e = min(n, a + step)
        # The keys from half before the slice's first query to half after its last, as views;
        # those outside the sequence are padded in the slice only.
        lo, hi = max(0, a - half), min(n, e + half)
        args = (q[:, :, a:e], k[:, :, lo:hi], v[:, :, lo:hi],
                None if key_padding_mask is None else key_padding_mask[:, lo:hi],
                state.kv, state.log_scale)
        if recording:
            pieces.append(checkpoint(_band_slice, config, half, chunk, lo - (a - half), *args,
                                     use_reentrant=False))
        else:
            pieces.append(_band_slice(config, half, chunk, lo - (a - half), *args))
    lost = torch.stack([piece[-1] for piece in pieces]).any()
    total, total_log, total_sign, band, band_log, band_sign = (
        x[0] if len(pieces) == 1 else torch.cat(x, 2)
        for x in zip(*(piece[:-1] for piece in pieces), strict=True))
    return [linear_part(attn, total, Normaliser(total_log, total_sign)),
            linear_part(attn, band, Normaliser(band_log, -band_sign))], lost


# Queries per block of the band (at least the half window): the block's C queries meet its
# C + 2 half keys in one GEMM, 2 half + 1 of each row's C + 2 half products in the window.
BAND_CHUNK = 16


def _band_slice(config: CoreConfig, half: int, chunk: int, left: int, q: Tensor,
                k: Tensor, v: Tensor, mask: Tensor | None, kv: Tensor,
                log_scale: Tensor) -> tuple[Tensor, ...]:
    """One slice of :func:`outside_window_parts`: S queries q (B, H, S, D), the keys from
    ``half`` before the first to ``half`` after the last that are in the sequence, k, v, with
    their padding mask (B, ·) or None, and how many of the ``half`` before fall outside it
    (``left``); the key state (kv, log_scale) of every key.

    Returns the state's read-out (B, H, S, Dv), its log-normaliser and sign (B, H, S), and the
    window's kernelized part, Σ_{|i-j|<=half} κ_ij [v_j, 1] (the core's convention: the keys at
    exp(ls_j - M), M the slice's largest key log-scale, the queries' log-scale added to the
    normaliser): its output, log-normaliser (-inf where no key) and sign.

    The band in blocks of C queries: each block's keys are a window of width C + 2 half of the
    keys, its products masked to the band |i - j| <= half. The (B, H) rows are padded to R rows
    (a multiple of C, ``extra`` blocks more than the queries': R >= S + 2 half), laid one after
    another, and the windows of every block of every row taken from that flat sequence by one
    ``unfold`` (a view: no copy of φ(K)), so that one batched GEMM forms all the blocks (the
    padding's rows are masked keys and unused queries)."""
    b, h, s = q.shape[:3]
    width = chunk + 2 * half
    blocks, extra = -(-s // chunk), -(-2 * half // chunk)
    rows = (blocks + extra) * chunk
    tail = rows - left - k.shape[2]  # the rows after the keys: outside the sequence, or none
    q = F.pad(q, (0, 0, 0, rows - s))
    k = F.pad(k, (0, 0, left, tail))
    values = F.pad(F.pad(v, (0, 0, left, tail)), (0, 1), value=1.0)  # [v, 1]
    # Each key's weight: 0 for padding and the rows outside the sequence; with key log-scales,
    # exp(ls_j - M) (M their largest).
    inside = torch.zeros(b, k.shape[2] - left - tail, dtype=torch.bool, device=q.device)
    masked = F.pad(inside if mask is None else mask, (left, tail), value=True)[:, None, :]
    scale = v.new_zeros(b, h, 1)
    # The per-feature read-out's largest term is 1 (exponents module): nothing to lose.
    lost = torch.zeros((), dtype=torch.bool, device=q.device)
    if config.exponents is not None:
        # Both the state's read-out and the band at the state's per-feature scale o: keys
        # exp(u_k - o), queries exp(u_q + o - c) with c their log-scale (exponents.against).
        u_q = config.exponents(q)
        total, total_norm = exponents.read_normalised(RecurrentState(kv, log_scale),
                                                      u_q[:, :, :s])
        phi_q, query_log_scale = exponents.against(u_q, log_scale, is_query=True)
        phi_k, _ = exponents.against(config.exponents(k), log_scale, is_query=False)
        key_weight = (~masked).to(phi_k.dtype).expand(b, h, rows)
    else:
        phi_q, query_log_scale = config.features(q, is_query=True)
        total, total_norm, check = read_checked(
            RecurrentState(kv, log_scale), phi_q[:, :, :s],
            None if query_log_scale is None else query_log_scale[:, :, :s], config.eps)
        if check is not None:
            lost = check
        phi_k, key_log_scale = config.features(k, is_query=False)
        if key_log_scale is None:
            key_weight = (~masked).to(phi_k.dtype).expand(b, h, rows)
        else:
            key_log_scale = key_log_scale[..., 0].masked_fill(masked, -math.inf)
            scale = key_log_scale.detach().amax(2, keepdim=True).clamp_min(LOG_FLOOR)
            key_weight = torch.exp(key_log_scale - scale)
    assert total_norm is not None
    # Query u of a block and its key r (at u - half .. u + half): |r - half - u| <= half.
    offsets = torch.arange(chunk, device=q.device)[:, None] + half
    band = (torch.arange(width, device=q.device) - offsets).abs_() <= half
    # The flat sequence's windows stop short of the last row's ``extra`` blocks (no queries).
    count = b * h * (blocks + extra) - extra
    keys = phi_k.reshape(-1, phi_k.shape[-1]).unfold(0, width, chunk)  # (count, F, C + 2 half)
    queries = phi_q.reshape(-1, chunk, phi_q.shape[-1])[:count]
    weights = key_weight.reshape(-1).unfold(0, width, chunk)[:, None]  # (count, 1, C + 2 half)
    scores = torch.bmm(queries, keys) * (weights * band)  # (count, C, C + 2 half)
    # Each row at its largest term: its sum is then >= 1 for positive maps, so the division
    # below (and its gradient, -raw / den^2) stays in range however small the band's terms
    # are at the keys' scale.
    top = scores.detach().abs().amax(-1, keepdim=True)
    top = torch.where(top > 0, top, 1.0)
    raw = torch.bmm(scores / top, values.reshape(-1, values.shape[-1]).unfold(0, width, chunk)
                    .transpose(1, 2))  # (count, C, Dv + 1)
    raw = F.pad(raw, (0, 0, 0, 0, 0, extra)).view(b, h, rows, -1)[:, :, :s]
    top = F.pad(top, (0, 0, 0, 0, 0, extra)).view(b, h, rows)[:, :, :s]
    den = raw[..., -1]
    empty = den == 0  # no key in the window (padding): nothing to subtract
    div = torch.where(empty, 1.0, den)
    log_abs = torch.log(div.abs()) + torch.log(top) + scale
    if query_log_scale is not None:
        log_abs = log_abs + query_log_scale[:, :, :s, 0]
    return (total, total_norm.log_abs, total_norm.sign, raw[..., :-1] / div[..., None],
            log_abs.masked_fill(empty, -math.inf), torch.sign(den).detach(), lost)


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
    log_gate = log_gates(gate)
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
        # Made on the device: a host tensor copied over would wait for the device's queue.
        at = torch.arange(window, device=k.device) == slot
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
