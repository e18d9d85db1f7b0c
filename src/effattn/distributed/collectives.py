"""The collectives of sequence parallelism, differentiable where a gradient crosses ranks.

Every rank's loss is a function of what it received, so the gradient of a rank's contribution is
the sum, over all ranks, of the gradients of what they received from it:

- :func:`all_reduce_sum`: y = Σ_r x_r on every rank; backward, grad x_r = Σ_r' grad y_r'.
- :func:`all_gather`: y = (x_0, ..., x_{P-1}) on every rank; backward, grad x_r = Σ_r' grad y_r'[r],
  one all-reduce of the (P, ...) gradient (gloo has no reduce-scatter; the payload is a fixed-size
  state or halo, never the sequence, for every method but the softmax baseline).

``torch.distributed.nn.functional`` has the same two operations, deprecated, and its all_gather
backward runs P scatters on gloo. The backward collectives run when every rank calls backward:
a rank that skips it leaves the others waiting until the group's timeout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Group = Any  # a torch.distributed ProcessGroup, or None for the default group


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        out = x.contiguous().clone()  # all_reduce works in place
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return gather_values(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_reduce_sum(x: Tensor, group: Group) -> Tensor:
    """Σ_r x_r, the same on every rank; differentiable (see the module docstring)."""
    return _AllReduceSum.apply(x, group)


def all_gather(x: Tensor, group: Group) -> Tensor:
    """(P, *x.shape): rank r's x at index r, on every rank; differentiable."""
    return _AllGather.apply(x, group)


def all_reduce_max(x: Tensor, group: Group) -> Tensor:
    """max_r x_r elementwise, without gradient (used for stabiliser scales, which cancel)."""
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def gather_values(x: Tensor, group: Group) -> Tensor:
    """(P, *x.shape) of every rank's x, without gradient. Bool tensors travel as uint8."""
    flag = x.dtype == torch.bool
    x = (x.to(torch.uint8) if flag else x).detach().contiguous()
    out = x.new_empty(dist.get_world_size(group), *x.shape)
    dist.all_gather(list(out.unbind(0)), x, group=group)
    return out.bool() if flag else out
