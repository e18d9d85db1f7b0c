"""One core configuration per module (kernelized.core.CoreConfig), passed whole by every caller:
sequence parallelism now hands the core the module's feature tensors, so that a redraw between
its forward and backward raises there as it does on the module path (before, the core found
the tensors by walking the autograd graph, which misses buffers: the gradient was silently
computed with the redrawn features)."""

import pytest
import torch
from conftest import qkv

import effattn
from effattn import strategy
from effattn.kernelized.parallel import StateExchange
from effattn.parallel import SequenceGroup


class OneRank(SequenceGroup):
    """A group of one rank: the collectives are identities."""

    def __init__(self, n: int) -> None:
        super().__init__(0, (n,))

    def all_gather(self, x):
        return x[None]

    def all_reduce_sum(self, x):
        return x

    def all_reduce_max(self, x):
        return x


def test_module_core_carries_its_settings():
    module = effattn.build("performer", head_dim=8, heads=2, seed=0, num_features=12,
                           chunk_size=5)
    core = module.core()
    assert (core.feature_dim, core.chunk_size, core.eps) == (12, 5, module.eps)
    assert core.slice_elements == module.slice_elements
    assert core.feature_tensors == module.feature_tensors()
    with pytest.raises(AttributeError):
        core.eps = 1.0


@pytest.mark.parametrize("kernelized", ["cpu", "gpu"])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_parallel_keeps_the_redraw_guard(causal, kernelized):
    module = effattn.build("performer", head_dim=8, heads=2, seed=0, num_features=12,
                           redraw_interval=1).double().train()
    q, k, v = (t.requires_grad_(True) for t in qkv(h=2, n=20, d=8))
    with strategy.force(kernelized=kernelized):
        out = StateExchange().attend(module, OneRank(20), q, k, v, causal=causal,
                                     key_padding_mask=None)
        torch.testing.assert_close(out, module(q, k, v, causal=causal), rtol=1e-10,
                                   atol=1e-10)
        module.redraw()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
