"""Sequence parallelism on torch.distributed (gloo, NCCL): rank r holds slice r of the sequence.

>>> attn = effattn.build("performer", head_dim=64, heads=8, seed=0)   # the same seed everywhere
>>> sp = effattn.distributed.SequenceParallel(attn)
>>> out = sp(q, k, v, causal=True)   # this rank's slices in, this rank's slice out

See :mod:`effattn.distributed.sequence` and docs/distributed.md. Not imported by ``import effattn``.
"""

# torch.distributed.nn's functions take group=group.WORLD as a default, evaluated when it is
# imported. torch imports it with torch._dynamo, the first time one of effattn's custom ops runs:
# after init_process_group, so those defaults would hold the default group, destroy_process_group
# could not free it, and gloo's threads would be torn down at interpreter shutdown instead, while
# the other ranks exit, which aborts a process now and then ("terminate called without an active
# exception", exit code -6). Imported here, before any group exists, the defaults are None.
import torch.distributed.nn  # noqa: F401

from effattn.distributed.sequence import SequenceParallel

__all__ = ["SequenceParallel"]
