"""Sequence-parallel attention: rank r of P holds the contiguous slice r of one sequence.

q, k, v (B, H, n_r, D), the key padding mask (B, n_r) and the call inputs of every rank are
slices of the whole (B, H, N, D), (B, N) and so on; slice r starts at offset
o_r = n_0 + ... + n_{r-1}. Each rank gets its slice of the output, equal (up to rounding) to the
module on the whole sequence, and gradients flow back through the collectives to every rank's
inputs. How a method computes its slice is its spec's ``sequence_parallel``, a
:class:`~effattn.parallel.SequenceStrategy` its engine provides: the kernelized core exchanges
fixed-size key states (:mod:`effattn.kernelized.parallel`), the banded engine the tokens at the
slice borders (:mod:`effattn.sparse.parallel`), exact softmax all-gathers K and V. This module
runs it on a :class:`~effattn.parallel.SequenceGroup` over a torch.distributed process group,
and names no method or engine.

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

import torch
import torch.distributed as dist
from torch import Tensor, nn

from effattn.base import AttentionMethod, check_bool
from effattn.distributed.collectives import (
    Group,
    all_gather,
    all_reduce_max,
    all_reduce_sum,
    gather_values,
)
from effattn.parallel import SequenceGroup, SequenceStrategy
from effattn.random import RandomizedAttention
from effattn.registry import methods, spec

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Header fields that every rank must report identically.
_AGREE = ("batch", "heads", "head_dim", "value_dim", "dtype", "causal", "key_padding_mask",
          "call_inputs", "total_length", "training", "requires_grad", "module")
_FIELDS = ("rejected", "length", *_AGREE, "fingerprint", "fingerprint_ramp")


class _Ranks(SequenceGroup):
    """The ranks of a torch.distributed process group, as a strategy sees them."""

    def __init__(self, group: Group, rank: int, lengths: tuple[int, ...]) -> None:
        super().__init__(rank, lengths)
        self.group = group

    def all_gather(self, x: Tensor) -> Tensor:
        if x.is_floating_point():
            return all_gather(x, self.group)
        return gather_values(x, self.group)

    def all_reduce_sum(self, x: Tensor) -> Tensor:
        return all_reduce_sum(x, self.group)

    def all_reduce_max(self, x: Tensor) -> Tensor:
        return all_reduce_max(x, self.group)


class SequenceParallel(nn.Module):
    """Attention of a built module over a sequence split across the ranks of ``group``.

    ``attn`` is the module of ``effattn.build(...)``, built identically (same seed) on every rank;
    ``group`` a torch.distributed process group (None: the default group), initialised before the
    first call. forward takes this rank's slices q (B, H, n_r, D), k (B, H, n_r, D),
    v (B, H, n_r, Dv), key_padding_mask (B, n_r) and the module's call inputs (a gate
    (B, H, n_r), say), and returns this rank's slice of the output (B, H, n_r, Dv). Every rank
    of the group must make the same calls (forward and, when training, backward): the
    collectives pair them up.

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
        ranks = self._agree(q, k, v, causal, key_padding_mask, call, total_length)
        attn = self.attn
        # The same redraw on every rank: the generators agree (the header checked them).
        attn.prepare_call()
        call = {name: value for name, value in call.items() if value is not None}
        out = self._strategy.attend(attn, ranks, q, k, v, causal=causal,
                                    key_padding_mask=key_padding_mask, **call)
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
    ) -> _Ranks:
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
        ranks = _Ranks(self.group, rank, lengths)
        if self.attn.max_len is not None and ranks.total > self.attn.max_len:
            raise ValueError(
                f"sequence length {ranks.total} exceeds max_len={self.attn.max_len}"
            )
        return ranks


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


def _strategy(attn: AttentionMethod) -> SequenceStrategy:
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
    return method.sequence_parallel
