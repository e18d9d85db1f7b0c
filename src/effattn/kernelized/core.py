"""The linear-attention core shared by every kernelized method.

Given feature maps φ(Q) (B, H, N, F), φ(K) (B, H, M, F) and V (B, H, M, Dv)::

    out_i = Σ_j w_ij φ(q_i)·φ(k_j) v_j / Σ_j w_ij φ(q_i)·φ(k_j)

where w_ij = 1 (non-causal), [j <= i] (causal) or, for gated attention (Peng et al. 2021, RFA
section 3.1), w_ij = [j <= i] (1 - g_j) Π_{j<l<=i} g_l, the unrolled form of
S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T.

Two conventions make every feature map numerically safe without ever looking at future keys:

- ``key_log_scale`` (B, H, M, 1): the true key features are ``phi_k * exp(key_log_scale)``.
  Exponential feature maps return per-token-normalised features plus that log-scale; the core
  rescales keys by a max that is shared by the keys being summed (per sequence when non-causal,
  per chunk with a running max when causal or recurrent). The shared factor cancels between
  numerator and denominator.
- The normaliser is computed as an extra column of V ([V, 1]), so numerator and denominator come
  out of the same GEMMs.

Shapes: B batch, H heads, N queries, M keys, F features, Dv value dim, C chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Smallest log-scale the core works with: keeps exp(a - b) finite when every key is padding.
LOG_FLOOR = -1.0e4
# log(g) is clamped here so that g = 0 (a full reset) stays finite in log space.
LOG_GATE_FLOOR = -30.0


def safe_denominator(den: Tensor, eps: float) -> Tensor:
    """Push |den| to at least eps, keeping its sign (trigonometric features can go negative).

    For positive features this is ``den.clamp_min(eps)``; a query that sees no key (all padding)
    gets 0 / eps = 0.
    """
    return torch.where(den >= 0, den.clamp_min(eps), den.clamp_max(-eps))


def _shared_max(log_scale: Tensor, dim: int) -> Tensor:
    with torch.no_grad():
        return log_scale.amax(dim=dim, keepdim=True).clamp_min(LOG_FLOOR)


def _with_ones(v: Tensor) -> Tensor:
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _ratio(out: Tensor, eps: float) -> Tensor:
    return out[..., :-1] / safe_denominator(out[..., -1:], eps)


def _check_shapes(phi_q: Tensor, phi_k: Tensor, v: Tensor, key_log_scale: Tensor | None) -> None:
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi_q and phi_k must have the same feature dim F: {tuple(phi_q.shape)} vs "
            f"{tuple(phi_k.shape)}"
        )
    if phi_k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"phi_k {tuple(phi_k.shape)} and v {tuple(v.shape)} disagree on (B, H, M)")
    if key_log_scale is not None and key_log_scale.shape != (*phi_k.shape[:-1], 1):
        raise ValueError(
            f"key_log_scale must be (B, H, M, 1) = {(*phi_k.shape[:-1], 1)}, "
            f"got {tuple(key_log_scale.shape)}"
        )


def linear_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    key_log_scale: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    gate: Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> Tensor:
    """Kernelized attention from features φ(Q) (B, H, N, F), φ(K) (B, H, M, F), V (B, H, M, Dv).

    Returns (B, H, N, Dv).

    Args:
        key_log_scale: optional (B, H, M, 1); true key features are phi_k * exp(key_log_scale).
        key_padding_mask: optional bool (B, M), True marks padded keys; they leave numerator
            and denominator (and, gated, do not decay the state).
        causal: query i sees keys j <= i (N == M); computed chunkwise.
        gate: optional (B, H, N) in [0, 1], causal only (gated RFA).
        chunk_size: C of the chunkwise causal form; any N works (the tail chunk is padded).
        eps: floor of |denominator|.

    Every per-key scalar (stabiliser scale, 1 - g, padding, decay to the chunk end) multiplies
    the rows of [V, 1] (width Dv + 1) instead of φ(K) (width F), and per-query scalars multiply
    output rows, so the only passes over N x F data are the GEMMs.

    Non-causal cost: 2·(N + M)·F·(Dv + 1) flops per (B, H), memory O((N + M)·F + F·Dv).
    Causal adds the C x C intra-chunk products: 2·N·C·(F + Dv + 1), and (N/C)·F·(Dv + 1) states.
    """
    _check_shapes(phi_q, phi_k, v, key_log_scale)
    if gate is not None and not causal:
        raise ValueError("gate needs causal=True: gated attention is a causal recurrence")
    if causal:
        if phi_q.shape[2] != phi_k.shape[2]:
            raise ValueError(f"causal needs N == M, got {phi_q.shape[2]} and {phi_k.shape[2]}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return _causal_chunkwise(
            phi_q, phi_k, v, key_log_scale, key_padding_mask, gate, chunk_size, eps
        )
    v1 = _with_ones(v)
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
    if key_log_scale is not None:
        if pad is not None:
            key_log_scale = key_log_scale.masked_fill(pad, float("-inf"))
        v1 = v1 * torch.exp(key_log_scale - _shared_max(key_log_scale, -2))
    elif pad is not None:
        v1 = v1.masked_fill(pad, 0.0)
    kv = phi_k.transpose(-2, -1) @ v1  # (B, H, F, Dv + 1)
    return _ratio(phi_q @ kv, eps)


def _causal_chunkwise(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_scale: Tensor | None,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
    chunk: int,
    eps: float,
) -> Tensor:
    b, h, n, f = phi_q.shape
    v1 = _with_ones(v)
    dv1 = v1.shape[-1]
    log_gate = None
    if gate is not None:
        if gate.shape != (b, h, n):
            raise ValueError(f"gate must be (B, H, N) = {(b, h, n)}, got {tuple(gate.shape)}")
        v1 = v1 * (1.0 - gate)[..., None]
        log_gate = torch.log(gate).clamp_min(LOG_GATE_FLOOR)
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :]
        v1 = v1.masked_fill(pad[..., None], 0.0)
        if log_gate is not None:
            log_gate = log_gate.masked_fill(pad, 0.0)  # a padded token leaves the state alone
        if log_scale is not None:
            log_scale = log_scale.masked_fill(pad[..., None], float("-inf"))

    tail = (-n) % chunk
    if tail:
        phi_q = F.pad(phi_q, (0, 0, 0, tail))
        phi_k = F.pad(phi_k, (0, 0, 0, tail))
        v1 = F.pad(v1, (0, 0, 0, tail))
        if log_gate is not None:
            log_gate = F.pad(log_gate, (0, tail))
        if log_scale is not None:
            log_scale = F.pad(log_scale, (0, 0, 0, tail), value=float("-inf"))
    nc = (n + tail) // chunk
    q_c = phi_q.reshape(b, h, nc, chunk, f)
    k_c = phi_k.reshape(b, h, nc, chunk, f)
    v_c = v1.reshape(b, h, nc, chunk, dv1)

    chunk_max = None
    if log_scale is not None:
        ls_c = log_scale.reshape(b, h, nc, chunk, 1)
        chunk_max = _shared_max(ls_c, -2)  # (B, H, nc, 1, 1)
        v_c = v_c * torch.exp(ls_c - chunk_max)

    scores = q_c @ k_c.transpose(-1, -2)  # (B, H, nc, C, C)
    if log_gate is None:
        intra = scores.tril_() @ v_c  # (B, H, nc, C, Dv + 1)
        deltas = k_c.transpose(-1, -2) @ v_c  # (B, H, nc, F, Dv + 1), at scale chunk_max
    else:
        cum = log_gate.reshape(b, h, nc, chunk).cumsum(-1)  # inclusive, within the chunk
        upper = torch.ones(chunk, chunk, dtype=torch.bool, device=cum.device).triu(1)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf"))
        intra = (scores * decay.exp()) @ v_c
        deltas = k_c.transpose(-1, -2) @ (v_c * torch.exp(cum[..., -1:] - cum)[..., None])

    if log_gate is None and chunk_max is None:
        # Exclusive scan (state before each chunk). Not cumsum - deltas: that subtraction
        # cancels catastrophically in the backward pass when some rows carry 1/eps gradients.
        states = F.pad(deltas[:, :, :-1].cumsum(2), (0, 0, 0, 0, 1, 0))
        out = intra + q_c @ states
    else:
        chunk_decay = None if log_gate is None else cum[..., -1].exp()  # (B, H, nc)
        states, state_scale = _prefix_states(deltas, chunk_max, chunk_decay)
        inter = q_c @ states
        if log_gate is not None:
            inter = inter * cum.exp()[..., None]  # decay of the entering state up to query i
        if chunk_max is None:
            out = intra + inter
        else:
            common = torch.maximum(chunk_max, state_scale)
            out = intra * torch.exp(chunk_max - common) + inter * torch.exp(state_scale - common)
    return _ratio(out.reshape(b, h, nc * chunk, dv1)[:, :, :n], eps)


def _prefix_states(
    deltas: Tensor, chunk_max: Tensor | None, chunk_decay: Tensor | None
) -> tuple[Tensor, Tensor]:
    """State before each chunk: S_c = a_{c-1} S_{c-1} + ΔS_{c-1}, with running-max rescaling.

    ΔS_c is at log-scale chunk_max[c]; the returned S_c is at log-scale state_scale[c] (the max
    over earlier chunks). A loop over the N/C chunks of (F, Dv + 1) updates: the scan with
    data-dependent factors has no overflow-free closed form.
    """
    b, h, nc = deltas.shape[:3]
    state = torch.zeros_like(deltas[:, :, 0])
    scale = deltas.new_full((b, h, 1, 1), LOG_FLOOR)
    states, scales = [], []
    for c in range(nc):
        states.append(state)
        scales.append(scale)
        factor = 1.0 if chunk_decay is None else chunk_decay[:, :, c, None, None]
        if chunk_max is None:
            state = state * factor + deltas[:, :, c]
        else:
            new_scale = torch.maximum(scale, chunk_max[:, :, c])
            state = state * (factor * torch.exp(scale - new_scale)) + deltas[:, :, c] * torch.exp(
                chunk_max[:, :, c] - new_scale
            )
            scale = new_scale
    return torch.stack(states, 2), torch.stack(scales, 2)


@dataclass
class RecurrentState:
    """Fixed-size decoding state of kernelized attention.

    kv: (B, H, F, Dv + 1), the running [S, z] (S = Σ w_j φ(k_j) v_j^T, z = Σ w_j φ(k_j)),
    stored divided by exp(log_scale); log_scale: (B, H, 1, 1); position: tokens consumed.
    Its size does not depend on the position.
    """

    kv: Tensor
    log_scale: Tensor
    position: int = 0

    @property
    def s(self) -> Tensor:
        """S at the state's scale, (B, H, F, Dv)."""
        return self.kv[..., :-1]

    @property
    def z(self) -> Tensor:
        """z at the state's scale, (B, H, F)."""
        return self.kv[..., -1]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.log_scale.numel() * (
            self.log_scale.element_size()
        )


def linear_attention_step(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: RecurrentState | None,
    *,
    key_log_scale: Tensor | None = None,
    gate: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, RecurrentState]:
    """One recurrent step: φ(q_t), φ(k_t) (B, H, 1, F), v_t (B, H, 1, Dv) -> (B, H, 1, Dv), state.

    S_t = g_t S_{t-1} + (1 - g_t) φ(k_t) v_t^T (g_t = 1, no (1 - g) factor, when ungated),
    o_t = φ(q_t) S_t / φ(q_t) z_t. Matches :func:`linear_attention` with causal=True.
    """
    _check_shapes(phi_q, phi_k, v, key_log_scale)
    if state is None:
        b, h, _, f = phi_k.shape
        kv = phi_k.new_zeros(b, h, f, v.shape[-1] + 1)
        state = RecurrentState(kv, phi_k.new_full((b, h, 1, 1), LOG_FLOOR), 0)
    elif not isinstance(state, RecurrentState):
        raise ValueError(f"state must be a RecurrentState or None, got {type(state).__name__}")
    log_scale = key_log_scale if key_log_scale is not None else torch.zeros_like(state.log_scale)
    new_scale = torch.maximum(state.log_scale, log_scale)
    decay = torch.exp(state.log_scale - new_scale)
    if gate is not None:
        if gate.shape != phi_k.shape[:3]:
            raise ValueError(
                f"gate must be (B, H, 1) = {tuple(phi_k.shape[:3])}, got {tuple(gate.shape)}"
            )
        g = gate[..., None]
        decay = decay * g
        v1 = _with_ones(v) * (1.0 - g)
    else:
        v1 = _with_ones(v)
    update = phi_k.transpose(-2, -1) @ (v1 * torch.exp(log_scale - new_scale))
    kv = state.kv * decay + update
    return _ratio(phi_q @ kv, eps), RecurrentState(kv, new_scale, state.position + 1)
