"""Checkpoints and data caches as data, never code: the one writer and the one reader of every
``.pt`` file effattn keeps (a run's ``checkpoint.pt``, a task's cached data sets).

What a checkpoint holds. A dict of tensors and plain Python data, nothing else::

    format: "effattn-checkpoint"   version: 2
    config: the run's TrainConfig as a dict (str, int, float, bool, None, tuples, dicts)
    model: the model's state_dict (tensors; the modules' random draws as tensors and ints)
    step, train_time, peak_bytes, losses, init: counters and the run's history
    optimizer: AdamW's state_dict (tensors and numbers)       [runs of effattn train]
    torch_rng (uint8 tensor), python_rng (tuple of ints), cuda_rng (tensor or None)

How it is read. ``torch.load(weights_only=True)``: torch's restricted unpickler, which builds
tensors, storages and the containers and scalars above, and refuses every other global. A crafted
file that names ``os.system`` or any class is refused before anything is built, so nothing it
names runs. Everything effattn writes is already of those types, so no allowlist of our own is
needed and RNG and optimizer states come back bit for bit. Safetensors with the rest in JSON was
the alternative: it would need the optimizer's nested state and the RNG tuples split into tensors
and a JSON skeleton and glued back, for the same guarantee and a new dependency.

The opt-in. A file that holds other objects (effattn's own older checkpoints could, e.g. a
``pathlib.Path`` in a config) is refused with a :class:`CheckpointError` that says so.
``trust=True`` (``--trust-checkpoint`` at the command line) then loads it with the full
unpickler, which runs whatever the file names: only for files from a source you trust. It is the
one place in effattn that unpickles arbitrary objects (tests/test_checkpoints.py holds it so).

Every failure is a :class:`CheckpointError` (a ``ValueError``: one line and exit 2 at the
command line) naming the file and what to do: missing, empty, corrupt or truncated (not a zip
archive of ``torch.save``), refused (objects other than data), foreign (not a run's checkpoint,
e.g. a plain ``state_dict``) or newer than this effattn.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "VERSION", "CheckpointError", "load_checkpoint", "load_data", "save"]

FORMAT = "effattn-checkpoint"
VERSION = 2  # 1: the same dict without the format keys (loads as is when it holds only data)
TRUST_HINT = ("if it is an effattn checkpoint from a source you trust, load it with "
              "--trust-checkpoint (trust_checkpoint=True), which runs any code the file holds")


class CheckpointError(ValueError):
    """A file that is not a checkpoint effattn can load safely; the message names the file."""


def save(path: str | Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` with ``torch.save`` atomically: the file is either the old one
    or the whole new one, even if the process is killed (per-process temporary name, so that the
    ranks of a torchrun launch may write the same file at once)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _refused_global(err: Exception) -> str | None:
    """The global that torch's restricted unpickler refused, if that is why it failed."""
    text = str(err)
    match = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"safe_globals\(\[([\w.]+)\]", text)
    return match.group(1) if match else None


def _read(path: Path, what: str, trust: bool) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file ({what} expected)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file, not a {what}; delete it (or the run folder) "
                              "and run again")
    corrupt = (f"{path}: not a readable {what} (corrupt or truncated, or not written by "
               "torch.save); delete it, or restore it from a copy")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(corrupt)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = _refused_global(err)
        if refused is None:
            raise CheckpointError(corrupt) from None
        if not trust:
            raise CheckpointError(f"{path}: holds Python objects other than tensors and data "
                                  f"({refused}), which loading would run or build; "
                                  f"{TRUST_HINT}") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{corrupt} ({type(err).__name__})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # the file's own code may raise anything
        raise CheckpointError(f"{corrupt} ({type(err).__name__}: {err})") from None
    warnings.warn(f"{path}: loaded with the full unpickler (trust_checkpoint), which may have "
                  "run code it holds; save it again with this effattn to drop the need",
                  stacklevel=3)
    return obj


def load_checkpoint(path: str | Path, *, trust: bool = False) -> dict[str, Any]:
    """The run checkpoint at ``path`` (a ``checkpoint.pt`` of ``effattn train`` or ``convert``).

    Read as data (see the module docstring); ``trust=True`` also loads a checkpoint that holds
    other objects, with the full unpickler. Checks that it is a run's checkpoint: a dict with
    ``config`` (a dict), ``model`` (a state_dict) and ``step``, of this format version or the
    one before it. :class:`CheckpointError` otherwise.
    """
    path = Path(path)
    saved = _read(path, "checkpoint", trust)
    keys = sorted(saved) if isinstance(saved, dict) else []
    if not (isinstance(saved, dict) and isinstance(saved.get("config"), dict)
            and isinstance(saved.get("model"), dict) and "step" in saved):
        held = (f"a dict of {len(keys)} entries ({', '.join(map(str, keys[:4]))}"
                f"{', ...' if len(keys) > 4 else ''})" if isinstance(saved, dict)
                else f"a {type(saved).__name__}")
        raise CheckpointError(f"{path}: not an effattn run checkpoint: it holds {held}, not the "
                              "config, model and step that effattn train writes (a plain "
                              "state_dict of another tool is loaded with load_state_dict, not "
                              "as a run folder)")
    fmt, version = saved.get("format", FORMAT), saved.get("version", 1)
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: format {fmt!r}, not an effattn checkpoint")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{path}: checkpoint version {version!r} of a newer effattn (this "
                              f"one reads up to {VERSION}); upgrade effattn")
    return saved


def load_data(path: str | Path, check: Callable[[Any], bool], expected: str) -> Any:
    """A cached data file (never trusted: caches are regenerated, never shipped as code).

    ``check(obj)`` says whether the loaded object has the cache's shape; ``expected`` describes
    it for the error. :class:`CheckpointError` when the file is unreadable, refused or of
    another shape, saying to delete it (it is regenerated on the next run).
    """
    path = Path(path)
    try:
        obj = _read(path, "data cache", trust=False)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; a data cache is regenerated when deleted") from None
    if not check(obj):
        raise CheckpointError(f"{path}: not a data cache of effattn ({expected} expected, got a "
                              f"{type(obj).__name__}); delete it and it is regenerated")
    return obj
