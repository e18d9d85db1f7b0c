"""Where each engine's strategy is chosen: one place, by device, with one override.

An *engine* is the code every mechanism of a family meets (the kernelized core, the banded
engine); a *strategy* is one way of running it, shaped for one kind of device. Strategies of an
engine compute the same thing under the same conventions and live in modules of their own; this
module only picks one:

============  ==========================================  =====================================
engine        strategies                                  default
============  ==========================================  =====================================
kernelized    ``cpu``: cache-sized slices, a chunk loop   ``gpu`` on CUDA, ``cpu`` elsewhere
              ``gpu``: chunk-parallel, batched
              ``triton``: the causal scan fused in
              Triton kernels, Hedgehog's per-feature
              core's too (only when forced: on an
              H200 it holds 4-7x less than ``gpu``
              in causal training, but is slower)
banded        ``cpu``: the banded engine                  ``flex`` on CUDA, ``cpu`` elsewhere
              ``flex``: torch's FlexAttention
============  ==========================================  =====================================

The default can be overridden, so that CI runs a GPU strategy on the CPU:

- the environment, read once at import: ``EFFATTN_STRATEGY="kernelized=gpu,banded=flex"``;
- in code, for a block: ``with effattn.strategy.force(kernelized="gpu"): ...``.

An override names a strategy for an engine and applies on every device. A default that this
torch cannot run (``flex`` before torch 2.5, which has no FlexAttention) gives way to ``cpu``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

ENGINES: dict[str, tuple[str, ...]] = {
    "kernelized": ("cpu", "gpu", "triton"),
    "banded": ("cpu", "flex"),
}

_ON_CUDA = {"kernelized": "gpu", "banded": "flex"}

ENV = "EFFATTN_STRATEGY"


def _check(engine: str, strategy: str | None = None) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; engines: {sorted(ENGINES)}")
    if strategy is not None and strategy not in ENGINES[engine]:
        raise ValueError(
            f"unknown strategy {strategy!r} for engine {engine!r}; choose from {ENGINES[engine]}"
        )


def parse(text: str) -> dict[str, str]:
    """``"kernelized=gpu,banded=flex"`` as ``{"kernelized": "gpu", "banded": "flex"}``.

    Raises ValueError naming the variable on an unknown engine or strategy, or a malformed item.
    """
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        engine, sep, strategy = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}: {item!r} is not engine=strategy (e.g. kernelized=gpu)")
        engine, strategy = engine.strip(), strategy.strip()
        try:
            _check(engine, strategy)
        except ValueError as err:
            raise ValueError(f"{ENV}: {err}") from None
        out[engine] = strategy
    return out


_forced: dict[str, str] = parse(os.environ.get(ENV, ""))


@cache
def _runs_here(strategy: str) -> bool:
    """Whether this torch has what ``strategy`` needs (found without importing it)."""
    if strategy == "flex":
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    return True


def choose(engine: str, device: torch.device) -> str:
    """The strategy that runs ``engine`` for tensors on ``device``."""
    _check(engine)
    forced = _forced.get(engine)
    if forced is not None:
        return forced
    default = _ON_CUDA[engine] if device.type == "cuda" else "cpu"
    return default if _runs_here(default) else "cpu"


@contextmanager
def force(**strategies: str) -> Iterator[None]:
    """Run the block with the named strategies, e.g. ``force(kernelized="gpu")``, on any device."""
    for engine, strategy in strategies.items():
        _check(engine, strategy)
    before = dict(_forced)
    _forced.update(strategies)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(before)


def forced() -> dict[str, str]:
    """The overrides in force (environment and :func:`force`), engine -> strategy."""
    return dict(_forced)
