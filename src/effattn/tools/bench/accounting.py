"""Device-independent accounting of one call: the peak of its live tensor bytes, and the number
of ATen operations it dispatches.

Both count what the code asks of ATen, not what a device does with it, so a strategy written
for a GPU can be accounted for on a CPU (forced there, as CI runs it):

- :func:`live_peak_bytes`: the allocator's events (``torch.profiler`` with
  ``profile_memory=True``: every allocation and free of a tensor's storage), summed in time
  order; the peak of the running sum is the most memory the call's own tensors held at once,
  above what existed before it. On CUDA the caching allocator's ``max_memory_allocated`` counts
  the same storages (rounded up to its blocks), so the two agree to the rounding; the resident
  set (:mod:`effattn.tools.bench.memory`) also counts the CPU allocator's own slack.
- :func:`count_ops`: operations that compute or allocate (views, reshapes, ``detach``,
  ``set_``, empty allocations and a copy of a tensor onto itself are left out: they launch
  nothing; the last three are what Triton's interpreter does around every kernel it runs on
  the CPU). On a GPU each is at least one kernel launch, and in eager mode a few microseconds
  of host work, which bounds a call's time from below however small its tensors. Triton
  kernels are not ATen operations: their launches are counted by whoever launches them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

# ATen operations that only describe memory (no kernel, no allocation).
VIEWS = frozenset({
    "_reshape_alias", "_unsafe_view", "alias", "as_strided", "chunk", "detach", "diagonal",
    "expand", "flatten", "lift_fresh", "narrow", "permute", "reshape", "select", "slice",
    "set_", "split", "squeeze", "t", "transpose", "unbind", "unflatten", "unsqueeze", "view",
})
ALLOCATIONS = frozenset({"empty", "new_empty"})


def live_peak_bytes(fn: Callable[[], Any]) -> int:
    """The peak of the bytes held by the storages ``fn()`` allocates, above those alive before
    the call (a CPU call: the profiler's memory events are the CPU allocator's)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _launches_nothing(func.__name__.split(".")[0], args, out):
            self.count += 1
        return out


def _launches_nothing(name: str, args: Any, out: Any) -> bool:
    if name in VIEWS:
        return True
    if name in ALLOCATIONS:
        return out.numel() == 0
    if name == "copy_":
        return args[0].data_ptr() == args[1].data_ptr()
    return False


def count_ops(fn: Callable[[], Any]) -> int:
    """The ATen operations ``fn()`` dispatches that are not views (module docstring)."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.count
