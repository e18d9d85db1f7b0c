"""Sequence-parallel attention: rank r of P holds the contiguous slice r of one sequence.

q, k, v (B, H, n_r, D) and the key padding mask (B, n_r) of every rank are slices of the whole
(B, H, N, D) and (B, N); slice r starts at offset o_r = n_0 + ... + n_{r-1}. Each rank gets its
slice of the output, equal (up to rounding) to the module on the whole sequence, and gradients
flow back through the collectives to every rank's inputs. The method's spec says how
(``MethodSpec.sequence_parallel``):

- "state", kernelized (performer, favor, rfa, linear), non-causal: the key state
  [S, z] = φ(K)^T [V, 1] is a sum over keys, so each rank forms its slice's (F, Dv + 1) state and
  one all-reduce sums them. The stabiliser scale is made common first: every rank rescales its
  state to m = max_r s_r (an all-reduce MAX of (B, H) scalars, without gradient: it cancels).
- "state", causal (and gated): rank r needs the state of everything before o_r. Each rank forms
  its slice's state S_r at scale s_r and its slice's total log gate G_r (0 ungated); one all-gather
  of the P states (LASP-2, Sun et al. 2025) gives every rank
  S_in,r = Σ_{r' < r} exp(s_r' + Σ_{r' < l < r} G_l) S_r', and the chunkwise causal core continues
  from it over the rank's slice. Communication is P states, independent of N.
- "gather", softmax (the exact baseline): all-gather K and V, O(N) per rank.
- "halo", local (sliding window): query i needs keys i - left .. i + right (left = window - 1,
  right = 0 causal; window // 2 each way otherwise). Every rank all-gathers the first ``right``
  and last ``left`` tokens of every slice (a halo, O(P window) per rank, independent of N) and
  attends over [halo before, own slice, halo after]; slices shorter than the window take their
  context from several earlier ranks.

Methods whose spec says None (landmarks, projections along the sequence, hashing, global tokens,
random blocks, an FFT) are refused when wrapped, with the reason in their spec's
``refusals["sequence_parallel"]``.

Slicing: without ``total_length`` every rank must hold the same n (N = P n); with it, rank r holds
``torch.tensor_split``'s slice r of N positions (the first N mod P ranks one more). Before moving
any data the ranks exchange a small header: each rank's slice length, the shapes and flags of the
call, and a fingerprint of the module (parameters, buffers, random state). A bad input on any
rank, a disagreement, uneven slices or random features that differ raise the same ValueError on
every rank instead of a collective that never completes.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from effattn.base import AttentionMethod, check_bool, compute_dtype
from effattn.distributed.collectives import (
    Group,
    all_gather,
    all_reduce_max,
    all_reduce_sum,
    gather_values,
)
from effattn.kernelized.base import KernelizedAttention
from effattn.kernelized.core import (
    LOG_FLOOR,
    LOG_GATE_FLOOR,
    RecurrentState,
    accumulate_keys,
    kernelized_causal,
    key_state,
    read_queries,
)
from effattn.mechanisms.local import LocalAttention, local_attention
from effattn.mechanisms.softmax import SoftmaxAttention
from effattn.random import RandomizedAttention
from effattn.registry import methods, spec

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Header fields that every rank must report identically.
_AGREE = ("batch", "heads", "head_dim", "value_dim", "dtype", "causal", "key_padding_mask",
          "call_inputs", "total_length", "training", "requires_grad", "module")
_FIELDS = ("rejected", "length", *_AGREE, "fingerprint", "fingerprint_ramp")


@dataclass(frozen=True)
class Layout:
    """Where the slices lie: this rank's index and every rank's slice length."""

    rank: int
    lengths: tuple[int, ...]

    @property
    def offset(self) -> int:
        """Position of this rank's first token in the whole sequence."""
        return sum(self.lengths[: self.rank])

    @property
    def total(self) -> int:
        return sum(self.lengths)


Strategy = Callable[..., Tensor]


class SequenceParallel(nn.Module):
    """Attention of a built module over a sequence split across the ranks of ``group``.

    ``attn`` is the module of ``effattn.build(...)``, built identically (same seed) on every rank;
    ``group`` a torch.distributed process group (None: the default group), initialised before the
    first call. forward takes this rank's slices q (B, H, n_r, D), k (B, H, n_r, D),
    v (B, H, n_r, Dv), key_padding_mask (B, n_r) and, for gated rfa, gate (B, H, n_r), and returns
    this rank's slice of the output (B, H, n_r, Dv). Every rank of the group must make the same
    calls (forward and, when training, backward): the collectives pair them up.

    Raises ValueError when wrapping a method that cannot be split along the sequence.
    """

    def __init__(self, attn: AttentionMethod, group: Group = None) -> None:
        super().__init__()
        if not isinstance(attn, AttentionMethod):
            raise ValueError(
                f"attn must be a module of effattn.build(...), got {type(attn).__name__}"
            )
        self._strategy = _strategy(attn)
        self.attn = attn
        self.group = group

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        *,
        total_length: int | None = None,
        **call: Tensor | None,
    ) -> Tensor:
        """This rank's slice of attention over the whole sequence; see the class docstring.

        ``total_length``: N, needed when the slices are uneven (N not a multiple of P).
        ``call``: this rank's slices of the module's call inputs (``spec.call_inputs``).
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "effattn.distributed needs an initialised process group: call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        layout = self._agree(q, k, v, causal, key_padding_mask, call, total_length)
        attn = self.attn
        # The same redraw on every rank: the generators agree (the header checked them).
        attn.prepare_call()
        call = {name: value for name, value in call.items() if value is not None}
        out = self._strategy(attn, self.group, layout, q, k, v, causal, key_padding_mask,
                             call.get("gate"))
        return out.to(q.dtype)

    def _check_local(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        key_padding_mask: Tensor | None,
        call: dict[str, Tensor | None],
        total_length: int | None,
    ) -> None:
        check_bool("causal", causal)
        self.attn.validate(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **call)
        if not (q.shape[2] == k.shape[2] == v.shape[2]):
            raise ValueError(
                "sequence parallel attention is self-attention over one sequence: q, k, v must "
                f"hold the same slice, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        world = dist.get_world_size(self.group)
        if total_length is not None and (
            isinstance(total_length, bool) or not isinstance(total_length, int)
            or total_length < world
        ):
            raise ValueError(
                f"total_length must be an int >= the number of ranks {world}, got {total_length!r}"
            )

    def _agree(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        key_padding_mask: Tensor | None,
        call: dict[str, Tensor | None],
        total_length: int | None,
    ) -> Layout:
        """Exchange the header; the same error on every rank if anything is off."""
        try:
            self._check_local(q, k, v, causal, key_padding_mask, call, total_length)
            rejected = None
        except (ValueError, TypeError) as err:
            rejected = err
        device = q.device if isinstance(q, Tensor) else torch.device("cpu")
        if rejected is None:
            values = [0, q.shape[2], q.shape[0], q.shape[1], q.shape[3], v.shape[3],
                      _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, int(causal),
                      int(key_padding_mask is not None), _given(call),
                      -1 if total_length is None else total_length, int(self.attn.training),
                      int(_records_grad(self.attn, q, k, v, *call.values())),
                      zlib.crc32(repr(self.attn).encode())]
        else:
            values = [1] + [-1] * (1 + len(_AGREE))
        header = torch.cat([torch.tensor(values, dtype=torch.float64, device=device),
                            _fingerprint(self.attn, device)])
        rows = gather_values(header, self.group).tolist()
        table = [dict(zip(_FIELDS, row, strict=True)) for row in rows]
        rank = dist.get_rank(self.group)

        bad = [r for r, row in enumerate(table) if row["rejected"]]
        if bad:
            if rejected is not None:
                raise rejected
            raise ValueError(f"sequence parallel: rank(s) {bad} rejected their input "
                             "(their error says why); no rank ran the attention")
        for name in _AGREE:
            if len({row[name] for row in table}) > 1:
                got = [_describe(name, row[name]) for row in table]
                raise ValueError(f"sequence parallel: the ranks disagree on {name}: {got} "
                                 "(rank 0 first); every rank must make the same call")
        differ = [r for r, row in enumerate(table)
                  if (row["fingerprint"], row["fingerprint_ramp"])
                  != (table[0]["fingerprint"], table[0]["fingerprint_ramp"])]
        if differ:
            raise ValueError(
                f"sequence parallel: the module's parameters, buffers or random state on rank(s) "
                f"{differ} differ from rank 0's; the random features must be identical on every "
                "rank: build the module with the same seed= everywhere and keep its parameters "
                "in sync"
            )
        lengths = tuple(int(row["length"]) for row in table)
        total = int(table[0]["total_length"])
        if total < 0 and len(set(lengths)) > 1:
            raise ValueError(
                f"sequence parallel: the ranks hold slices of lengths {list(lengths)}: uneven "
                "slices need total_length=N, with rank r holding torch.tensor_split's slice r"
            )
        if total >= 0:
            base, longer = divmod(total, len(lengths))  # torch.tensor_split's sizes
            expected = tuple(base + (r < longer) for r in range(len(lengths)))
            if lengths != expected:
                raise ValueError(
                    f"sequence parallel: total_length={total} over {len(lengths)} ranks means "
                    f"slices of lengths {list(expected)} (torch.tensor_split), the ranks hold "
                    f"{list(lengths)}"
                )
        layout = Layout(rank, lengths)
        if self.attn.max_len is not None and layout.total > self.attn.max_len:
            raise ValueError(
                f"sequence length {layout.total} exceeds max_len={self.attn.max_len}"
            )
        return layout


def _records_grad(attn: AttentionMethod, *tensors: Tensor | None) -> bool:
    """Will autograd record the call? Then every rank must, or a backward collective waits."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*tensors, *attn.parameters())
    )


def _given(call: dict[str, Tensor | None]) -> int:
    """A number for the set of call inputs given, equal on ranks given the same names."""
    return zlib.crc32(",".join(sorted(n for n, t in call.items() if t is not None)).encode())


def _describe(name: str, value: float) -> str | int:
    if name == "dtype":
        return str(_DTYPES[int(value)]) if value >= 0 else "other"
    return int(value)


def _fingerprint(attn: AttentionMethod, device: torch.device) -> Tensor:
    """(2,) float64: sums of every parameter, buffer and the random state, plain and weighted
    by position. Equal on ranks that hold the same module; a different seed changes both."""
    tensors = [t.detach() for t in (*attn.parameters(), *attn.buffers())]
    if isinstance(attn, RandomizedAttention):
        extra = attn.get_extra_state()
        tensors.append(extra["generator"])
        tensors.append(torch.tensor([extra["seed"] % (1 << 52), extra["calls"]]))
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for t in tensors:
        flat = t.to(device=device, dtype=torch.float64).flatten()
        ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=device)
        total += torch.stack([flat.sum(), flat @ ramp])
    return total


def _strategy(attn: AttentionMethod) -> Strategy:
    """How ``attn`` is split, as its spec's ``sequence_parallel`` says; ValueError naming the
    method, with the spec's reason, when it cannot be."""
    method = attn.spec
    if method.sequence_parallel is None:
        supported = [name for name in methods() if spec(name).sequence_parallel is not None]
        raise ValueError(
            f"{method.name} cannot be split along the sequence: "
            f"{method.refusals['sequence_parallel']}; sequence parallel supports "
            f"{', '.join(supported)}"
        )
    return _STRATEGIES[method.sequence_parallel]


def _kernelized(
    attn: KernelizedAttention,
    group: Group,
    layout: Layout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
) -> Tensor:
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    gate = None if gate is None else gate.to(dt)
    common = {"feature_dim": attn.feature_dim, "slice_elements": attn.slice_elements}
    if not causal:
        local = key_state(k, v, attn.features, key_padding_mask=key_padding_mask, **common)
        scale = all_reduce_max(local.log_scale, group)
        kv = all_reduce_sum(local.kv * torch.exp(local.log_scale - scale), group)
        state = RecurrentState(kv, scale, layout.total)
        return read_queries(q, state, attn.features, eps=attn.eps, **common)
    local, decay = _slice_state(attn, k, v, key_padding_mask, gate)
    b, h, f, dv1 = local.kv.shape
    packed = torch.cat([local.kv.reshape(b, h, f * dv1), local.log_scale.reshape(b, h, 1),
                        decay.reshape(b, h, 1)], -1)
    incoming = _incoming(all_gather(packed, group), f, dv1, layout)
    return kernelized_causal(
        q, k, v, attn.features, incoming, key_padding_mask=key_padding_mask, gate=gate,
        chunk_size=attn.chunk_size, eps=attn.eps, **common,
    )[0]


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
        state = key_state(k, v, attn.features, feature_dim=attn.feature_dim,
                          key_padding_mask=key_padding_mask, slice_elements=attn.slice_elements)
        return state, k.new_zeros(k.shape[:2])
    log_gate = torch.log(gate).clamp_min(LOG_GATE_FLOOR)  # as the core clamps it
    if key_padding_mask is not None:
        log_gate = log_gate.masked_fill(key_padding_mask[:, None, :], 0.0)
    # Σ_{l > j} log g_l as a reversed cumsum shifted by one: no subtraction of long sums.
    later = F.pad(log_gate[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))
    phi_k, log_scale = attn.features(k, is_query=False)
    log_scale = later[..., None] if log_scale is None else log_scale + later[..., None]
    state = accumulate_keys(None, phi_k * (1.0 - gate)[..., None], v, key_log_scale=log_scale,
                            key_padding_mask=key_padding_mask)
    return state, log_gate.sum(-1)


def _incoming(states: Tensor, f: int, dv1: int, layout: Layout) -> RecurrentState:
    """The state entering this rank r from the gathered states of all P ranks.

    S_in = Σ_{r' < r} exp(s_r' + Σ_{r' < l < r} G_l) S_r', held at the largest of those
    exponents (every weight <= 1). Ranks r' >= r get weight 0 rather than being left out, so
    that every rank's output depends on the gather and every rank runs its backward (rank 0
    gets an empty state).
    """
    kv = states[..., :-2].unflatten(-1, (f, dv1))  # (P, B, H, F, Dv + 1)
    scale, decay = states[..., -2].detach(), states[..., -1]  # (P, B, H)
    earlier = (torch.arange(len(layout.lengths), device=states.device) < layout.rank)[:, None, None]
    decay = decay.masked_fill(~earlier, 0.0)
    # Σ_{l > r'} G_l as a reversed cumsum shifted by one: no subtraction of long sums.
    later = torch.cat([decay[1:].flip(0).cumsum(0).flip(0), torch.zeros_like(decay[:1])])
    exponent = (scale + later).masked_fill(~earlier, float("-inf"))
    top = exponent.detach().amax(0).clamp_min(LOG_FLOOR)
    weight = torch.exp(exponent - top)[..., None, None]
    return RecurrentState((weight * kv).sum(0), top[..., None, None], layout.offset)


def _softmax(
    attn: SoftmaxAttention,
    group: Group,
    layout: Layout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
) -> Tensor:
    """Exact attention of this rank's queries over the all-gathered keys and values."""
    d = k.shape[-1]
    longest = max(layout.lengths)
    kv = _gather_slices(torch.cat([k, v], -1), group, layout, longest)
    keys, values = kv[..., :d], kv[..., d:]
    keep = None
    if key_padding_mask is not None:
        mask = _gather_slices(key_padding_mask[:, None, :, None], group, layout, longest)
        keep = ~mask[:, :, None, :, 0]  # (B, 1, 1, N)
    if causal:
        i = torch.arange(layout.offset, layout.offset + q.shape[2], device=q.device)[:, None]
        seen = torch.arange(layout.total, device=q.device)[None, :] <= i
        keep = seen if keep is None else keep & seen
    if keep is None:
        return F.scaled_dot_product_attention(q, keys, values, scale=attn.scale)
    # A query without a visible key outputs 0: its mask row is opened so that the softmax stays
    # finite (no NaN in the gradients), then its output is cleared.
    visible = keep.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep | ~visible,
                                         scale=attn.scale)
    return out.masked_fill(~visible, 0.0)


def _gather_slices(x: Tensor, group: Group, layout: Layout, longest: int) -> Tensor:
    """Every rank's x (B, H, n_r, X), padded to ``longest`` for the all-gather, joined along
    the sequence: (B, H, N, X). Differentiable when x is floating point."""
    padded = F.pad(x, (0, 0, 0, longest - x.shape[2]))
    gathered = all_gather(padded, group) if x.is_floating_point() else gather_values(padded, group)
    return torch.cat([g[:, :, :n] for g, n in zip(gathered, layout.lengths, strict=True)], 2)


def _local(
    attn: LocalAttention,
    group: Group,
    layout: Layout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    key_padding_mask: Tensor | None,
    gate: Tensor | None,
) -> Tensor:
    """Sliding window over [halo before, own slice, halo after].

    The halo queries are zeros whose outputs are dropped: the banded kernel needs aligned
    queries and keys, and they cost (left + right) / n_r of the work.
    """
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    left, right = (attn.window - 1, 0) if causal else (attn.window // 2, attn.window // 2)
    n, d = q.shape[2], k.shape[-1]
    kv = torch.cat([k, v], -1)
    mask = key_padding_mask
    before = after = kv[:, :, :0]
    mask_before = mask_after = None if mask is None else mask[:, :0]
    if left + right:
        before, after = _halos(kv, group, layout, left, right)
        if mask is not None:
            mask_before, mask_after = _halos(mask[:, None, :, None], group, layout, left, right)
            mask_before, mask_after = mask_before[:, 0, :, 0], mask_after[:, 0, :, 0]
    k_ext = torch.cat([before, kv, after], 2)
    q_ext = F.pad(q, (0, 0, before.shape[2], after.shape[2]))
    mask_ext = None if mask is None else torch.cat([mask_before, mask, mask_after], 1)
    out = local_attention(
        q_ext, k_ext[..., :d], k_ext[..., d:], window=attn.window, dilation=attn.dilation,
        causal=causal, key_padding_mask=mask_ext, scale=attn.scale,
    )
    return out[:, :, before.shape[2] : before.shape[2] + n]


def _halos(
    x: Tensor, group: Group, layout: Layout, left: int, right: int
) -> tuple[Tensor, Tensor]:
    """The ``left`` tokens before this rank's slice and the ``right`` after it (fewer at the
    ends of the sequence), from one all-gather of every slice's last ``left`` and first
    ``right`` tokens. x: (B, H, n_r, X); returns (B, H, <= left, X), (B, H, <= right, X)."""
    n = x.shape[2]
    tail = F.pad(x[:, :, n - min(left, n):], (0, 0, left - min(left, n), 0))
    head = F.pad(x[:, :, : min(right, n)], (0, 0, 0, right - min(right, n)))
    send = torch.cat([tail, head], 2)
    gathered = all_gather(send, group) if x.is_floating_point() else gather_values(send, group)
    r, lengths = layout.rank, layout.lengths
    # Slices shorter than the halo contribute all their tokens; the context is the end of the
    # concatenated tails before r and the start of the heads after r.
    tails = [g[:, :, left - min(left, m) : left]
             for g, m in zip(gathered[:r], lengths[:r], strict=True)]
    heads = [g[:, :, left : left + min(right, m)]
             for g, m in zip(gathered[r + 1 :], lengths[r + 1 :], strict=True)]
    before = torch.cat([x[:, :, :0], *tails], 2)
    after = torch.cat([x[:, :, :0], *heads], 2)
    return before[:, :, before.shape[2] - min(left, before.shape[2]):], after[:, :, :right]


# The strategy of each value of MethodSpec.sequence_parallel (registry.SEQUENCE_PARALLEL).
_STRATEGIES: dict[str, Strategy] = {"state": _kernelized, "gather": _softmax, "halo": _local}
