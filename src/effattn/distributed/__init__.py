"""Sequence parallelism on torch.distributed (gloo, NCCL): rank r holds slice r of the sequence.

>>> attn = effattn.build("performer", head_dim=64, heads=8, seed=0)   # the same seed everywhere
>>> sp = effattn.distributed.SequenceParallel(attn)
>>> out = sp(q, k, v, causal=True)   # this rank's slices in, this rank's slice out

See :mod:`effattn.distributed.sequence` and docs/distributed.md. Not imported by ``import effattn``.
"""

from effattn.distributed.sequence import SequenceParallel

__all__ = ["SequenceParallel"]
