"""The random state of the modules that keep drawing: a generator held as a tensor, and the
``effattn::draw`` operator that torch.compile traces.

:class:`RandomizedAttention` is the base of every mechanism that draws after construction (random
features redrawn in training, random blocks, rotations, subsets): it owns the generator state,
saves it with the ``state_dict`` and counts training calls for redraw schedules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from effattn.base import AttentionMethod


def resolve_seed(seed: int | None) -> int:
    """``seed``, or a seed drawn from the global RNG when None.

    Drawing from the global RNG keeps ``torch.manual_seed`` in control of unseeded modules.
    """
    return seed if seed is not None else int(torch.randint(0, 2**62, ()).item())


@torch.library.custom_op("effattn::draw", mutates_args=("state",))
def _draw(
    state: Tensor, shape: list[int], normal: bool, dtype: torch.dtype, when: Tensor | None
) -> Tensor:
    """Standard normal (``normal``) or uniform [0, 1) values of ``shape`` from the CPU generator
    whose state is ``state``, advanced in place; zeros, and the state left alone, where ``when``
    (0-d bool) is False.

    An operator rather than a ``torch.Generator`` call because torch.compile cannot trace a
    generator: it traces this as one opaque node, so modules that draw compile fullgraph.
    """
    if when is not None and not bool(when):
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator()
    g.set_state(state)
    out = (torch.randn if normal else torch.rand)(shape, generator=g, dtype=dtype)
    state.copy_(g.get_state())
    return out


@_draw.register_fake
def _(state: Tensor, shape: list[int], normal: bool, dtype: torch.dtype,
      when: Tensor | None) -> Tensor:
    return torch.empty(shape, dtype=dtype)


class TensorGenerator:
    """A CPU random generator held as its state tensor (uint8, as ``torch.Generator.get_state``).

    Draws the same numbers as a ``torch.Generator`` with that state, through the ``effattn::draw``
    operator, which torch.compile traces (it cannot trace a ``torch.Generator``). ``when`` (0-d
    bool tensor, optional) makes every draw conditional: False gives zeros and leaves the state
    alone, a branch that needs no host sync under compile.
    """

    def __init__(self, state: Tensor, when: Tensor | None = None) -> None:
        self.state = state
        self.when = when

    @staticmethod
    def seeded(seed: int) -> Tensor:
        """The state of a CPU generator seeded with ``seed``."""
        return torch.Generator().manual_seed(seed).get_state()

    def normal(self, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """N(0, 1) draws of ``shape``, as ``torch.randn(*shape, generator=g, dtype=dtype)``."""
        return _draw(self.state, list(shape), True, dtype, self.when)

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """U[0, 1) draws of ``shape``, as ``torch.rand(*shape, generator=g, dtype=dtype)``."""
        return _draw(self.state, list(shape), False, dtype, self.when)


# Where random draws come from: a torch.Generator, the global RNG (None), or a TensorGenerator
# (what modules use, so that they compile).
RandomSource = torch.Generator | TensorGenerator | None


def normal(generator: RandomSource, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """N(0, 1) draws of ``shape`` from ``generator`` (see :data:`RandomSource`)."""
    if isinstance(generator, TensorGenerator):
        return generator.normal(*shape, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype)


def uniform(generator: RandomSource, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """U[0, 1) draws of ``shape`` from ``generator`` (see :data:`RandomSource`)."""
    if isinstance(generator, TensorGenerator):
        return generator.uniform(*shape, dtype=dtype)
    return torch.rand(shape, generator=generator, dtype=dtype)


class RandomizedAttention(AttentionMethod):
    """Base of the methods that keep drawing random numbers after construction.

    It owns the module's random state and saves it with the ``state_dict`` (as extra state), so
    that a checkpoint loaded into a fresh build, whatever that build's ``seed``, continues
    exactly as the saved module would have:

    - ``_rng``: the state of a CPU generator seeded with the seed; training-mode draws (fresh
      random blocks, rotations or subsets on every call, redrawn random features) advance it;
    - ``_seed``: eval-mode draws restart from its generator state on every call, so eval calls
      repeat them;
    - ``_calls``: training-mode forward calls so far (redraw schedules count them).

    The generator state and the counter are CPU tensors, updated in place, not a
    ``torch.Generator`` and a Python int: torch.compile traces draws from a state tensor
    (:class:`TensorGenerator`) and in-place updates of a tensor, where a generator would break
    the graph and an int would be baked into it (one recompilation per call). They are plain
    attributes, not buffers: ``.to(device)`` leaves them on the CPU, where the draws are made.
    ``seed=None`` draws the seed from the global RNG (see :func:`resolve_seed`).
    """

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale)
        self._seed = resolve_seed(seed)
        self._seed_state = TensorGenerator.seeded(self._seed)
        self._rng = self._seed_state.clone()
        self._calls = torch.zeros((), dtype=torch.int64)

    def prepare_call(self) -> None:
        """:meth:`AttentionMethod.prepare_call`, counting training-mode calls in ``_calls``."""
        super().prepare_call()
        if self.training:
            self._calls.add_(1)

    def _train_generator(self, when: Tensor | None = None) -> TensorGenerator:
        """The module's generator: its draws advance the module's random state."""
        return TensorGenerator(self._rng, when)

    def _eval_generator(self) -> TensorGenerator:
        """A generator restarted at the module's seed: the same draws on every call."""
        return TensorGenerator(self._seed_state.clone())

    def _call_generator(self) -> TensorGenerator:
        """The generator for this call's draws: fresh ones in training mode, fixed in eval."""
        return self._train_generator() if self.training else self._eval_generator()

    def get_extra_state(self) -> dict[str, Any]:
        """Generator state (uint8 tensor), seed and call count: plain data, so a state_dict
        holding it loads with ``torch.load(weights_only=True)``."""
        return {"generator": self._rng.clone(), "seed": self._seed, "calls": int(self._calls)}

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved."""
        keys = {"generator", "seed", "calls"}
        if (not isinstance(state, dict) or set(state) != keys
                or not isinstance(state["generator"], Tensor)):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{self.spec.name}: extra state must be the dict of get_extra_state() with keys "
                f"{sorted(keys)} (generator a uint8 tensor), got {got}"
            )
        # Through a generator: it validates the state as torch.Generator.set_state does.
        self._rng.copy_(torch.Generator().set_state(state["generator"].cpu()).get_state())
        self._seed = int(state["seed"])
        self._seed_state = TensorGenerator.seeded(self._seed)
        self._calls.fill_(int(state["calls"]))
