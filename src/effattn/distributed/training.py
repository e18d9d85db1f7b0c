"""Training on the P processes of a ``torchrun`` launch: data parallel or sequence parallel.

``torchrun --nproc-per-node P`` starts P processes with RANK, WORLD_SIZE and LOCAL_RANK (and the
rendezvous address) in their environment; :func:`launched` reads them, initialises the process
group (NCCL on CUDA, gloo on the CPU) and destroys it on exit.

Both modes compute the gradient of one process on the whole batch, up to rounding. Every rank
draws the whole batch of B sequences, so the number T of scored targets of the batch is known
without communication; with ℓ_r the summed loss of rank r's part, one process minimises
L = Σ_r ℓ_r / T.

- data parallel: rank r takes examples [r B/P, (r + 1) B/P) (P must divide B) and backpropagates
  P ℓ_r / T; DDP averages the gradients over the ranks, which gives ∇L.
- sequence parallel: rank r takes slice r of every sequence (``torch.tensor_split``: the first
  N mod P ranks hold one token more), at positions o_r .. o_r + n_r - 1, and its attention layers
  run through :class:`~effattn.distributed.SequenceParallel`. It backpropagates ℓ_r / T: the
  collectives' backward brings the other ranks' losses into its slice, so its gradient is ∇L
  restricted to the computations on its slice, and their sum over ranks (one all-reduce after
  backward, :meth:`World.sum_gradients`) is ∇L.

Not imported by ``import effattn``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from effattn.distributed.collectives import Group
from effattn.distributed.sequence import SequenceParallel
from effattn.nn.attention import MultiheadAttention

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class World:
    """This process's place in a launch: rank ``rank`` of ``size``, and how work is split.

    ``World()`` is one process on its own (no process group): every method is then the
    identity. ``distributed``: a process group is initialised (even with size 1).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    sequence_parallel: bool = False
    distributed: bool = False
    group: Group = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes files."""
        return self.rank == 0

    @property
    def mode(self) -> str:
        """``"single"``, ``"data"`` or ``"sequence"`` (parallel)."""
        if not self.distributed:
            return "single"
        return "sequence" if self.sequence_parallel else "data"

    @property
    def loss_scale(self) -> float:
        """What rank r multiplies ℓ_r / T by before backward: P under DDP, which averages."""
        return float(self.size) if self.mode == "data" else 1.0

    def sequence_slice(self, length: int) -> slice:
        """This rank's positions of a sequence of ``length`` tokens (torch.tensor_split's)."""
        base, longer = divmod(length, self.size)
        start = self.rank * base + min(self.rank, longer)
        return slice(start, start + base + (self.rank < longer))

    def batch_part(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        """This rank's part of a training batch (B, ...): (inputs, targets, position offset).

        Data parallel: examples [r B/P, (r + 1) B/P). Sequence parallel: :meth:`sequence_part`.
        """
        if self.mode == "data":
            per_rank = len(inputs) // self.size
            part = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
            return inputs[part], targets[part], 0
        return self.sequence_part(inputs, targets)

    def sequence_part(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        """Sequence parallel: this rank's slice of every sequence of inputs and targets (B, N)
        and its offset o_r; otherwise the whole of both and 0."""
        if self.mode != "sequence":
            return inputs, targets, 0
        part = self.sequence_slice(inputs.shape[1])
        return inputs[:, part], targets[:, part], part.start

    def sum(self, x: Tensor) -> Tensor:
        """Σ_r x_r on every rank, without gradient (losses and counts to report)."""
        if not self.distributed:
            return x
        out = x.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def max(self, value: int) -> int:
        """max_r value_r on every rank (peak memory)."""
        if not self.distributed:
            return value
        out = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return int(out)

    def sum_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Sequence parallel: replace every gradient by its sum over the ranks, in one
        all-reduce (a missing gradient counts as zeros, so that every rank sends the same
        layout). Otherwise nothing: a single process has the whole gradient, DDP reduced it."""
        if self.mode != "sequence":
            return
        params = [p for p in parameters if p.requires_grad]
        flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten()
                          for p in params])
        dist.all_reduce(flat, group=self.group)
        for p, grad in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad = grad.view_as(p)

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank when any rank failed, instead of leaving the others waiting in
        a collective that the failed rank never joins: a failed rank raises its own error, the
        others a ValueError with the first failed rank's message. Without a process group,
        raise ``error`` if there is one."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        messages: list[Any] = [None] * self.size
        text = None if error is None else str(error) or type(error).__name__
        dist.all_gather_object(messages, text, group=self.group)
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            rank, message = failed[0]
            raise ValueError(f"rank {rank} failed: {message}")

    def wrap(self, model: nn.Module, total_length: int) -> nn.Module:
        """The module to run a training step with. Data parallel: ``model`` in
        DistributedDataParallel (a collective: every rank must call it). Sequence parallel:
        ``model`` itself, its attention layers split (:func:`split_sequences`) over sequences
        of ``total_length`` tokens. Single: ``model``."""
        if self.mode == "data":
            ids = [self.local_rank] if self._device().type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                       process_group=self.group)
        if self.mode == "sequence":
            split_sequences(model, total_length, self.group)
        return model

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == dist.Backend.NCCL:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def torchrun_rank() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) from the environment torchrun sets, or None when this
    process was not started by it. ValueError when they are set but malformed."""
    values = [os.environ.get(name) for name in TORCHRUN_VARIABLES]
    if all(v is None for v in values):
        return None
    try:
        rank, size, local = (int(v) for v in values)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        got = ", ".join(f"{n}={v!r}" for n, v in zip(TORCHRUN_VARIABLES, values, strict=True))
        raise ValueError(f"the launch environment is incomplete or malformed ({got}); start "
                         "the processes with torchrun, which sets all three") from None
    if not 0 <= rank < size or local < 0:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={size}), LOCAL_RANK={local} "
                         ">= 0")
    return rank, size, local


@contextmanager
def launched(device: str = "cpu", sequence_parallel: bool = False) -> Iterator[World]:
    """The :class:`World` of this process: under torchrun, with its process group initialised
    (NCCL when ``device`` is CUDA, on GPU LOCAL_RANK; gloo otherwise) and destroyed on exit;
    otherwise ``World()``.

    ValueError for ``sequence_parallel`` outside torchrun: there is nothing to split over.
    """
    found = torchrun_rank()
    if found is None:
        if sequence_parallel:
            raise ValueError("sequence parallel splits each sequence across processes: start "
                             "them with torchrun --nproc-per-node P")
        yield World()
        return
    rank, size, local = found
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield World(rank, size, local, sequence_parallel, distributed=True)
    finally:
        dist.destroy_process_group()


def split_sequences(model: nn.Module, total_length: int, group: Group = None) -> None:
    """Run every :class:`effattn.nn.MultiheadAttention` of ``model`` sequence parallel over
    ``group``: the model's inputs are then this rank's ``torch.tensor_split`` slice of
    sequences of ``total_length`` tokens (for :class:`effattn.nn.DecoderLM`, called with the
    slice's position offset). Parameters and ``state_dict`` are unchanged.

    ValueError naming the method, before any layer is changed, when one cannot be split.
    """
    layers = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    wrapped = [SequenceParallel(layer.attn, group) for layer in layers]
    for layer, parallel in zip(layers, wrapped, strict=True):
        # A partial is a plain callable: assigning it registers no submodule.
        layer.sequence_parallel = partial(parallel, total_length=total_length)
