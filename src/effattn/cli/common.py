"""What every ``effattn`` command shares: argument types, method and task options given as
``KEY=VALUE``, the output-folder check, and how mistakes end a command.

A mistake on the command line raises :class:`UsageError` (or happens inside
:func:`user_input`); :func:`effattn.cli.main` prints it as one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import ast
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from effattn.registry import COMMON_OPTIONS, build, spec

TRUST_HELP = ("also load a checkpoint that holds Python objects other than tensors and data "
              "(an older effattn's), with the full unpickler: it runs any code the file holds, "
              "so only for files from a source you trust")


class UsageError(Exception):
    """A mistake on the command line; its message is shown as ``effattn CMD: error: ...``."""


@contextmanager
def user_input() -> Iterator[None]:
    """Treat ``ValueError``, ``KeyError`` and ``TypeError`` raised inside as mistakes in the
    command line: they become :class:`UsageError` with the same message."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as err:
        raise UsageError(err.args[0] if err.args else str(err)) from err


# argparse types: each raises ArgumentTypeError, which argparse turns into one line and exit 2.

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def float_list(text: str) -> list[float]:
    return [positive_float(t) for t in text.split(",") if t.strip()]


def int_list(text: str) -> list[int]:
    values = sorted({positive_int(t.strip()) for t in text.split(",") if t.strip()})
    if not values:
        raise argparse.ArgumentTypeError("expected a comma list of positive integers")
    return values


def passes(text: str) -> list[str]:
    """A comma list of benchmark passes (fwd, fwdbwd), in their canonical order."""
    from effattn.tools.bench.speed import PASSES

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in PASSES for n in names):
        raise argparse.ArgumentTypeError(f"passes must be a comma list of {', '.join(PASSES)}")
    return [p for p in PASSES if p in names]


def device(text: str) -> str:
    """``cpu`` or ``cuda[:i]`` (CUDA must be available)."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"bad device {text!r}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda[:i], got {text!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device {text!r}: CUDA is not available")
    return str(parsed)


def device_or_auto(text: str) -> str:
    """:func:`device`, or ``auto``: CUDA when available, else the CPU."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device(text)


def key_value(text: str) -> str:
    """A ``KEY=VALUE`` item, checked for its shape only: its value is typed by
    :func:`parse_options` once the option's default is known."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return text


# Option values. A value's type is its default's type, so that `orthogonal=false` is False (not
# the truthy string "false") and `num_features=abc` is an error before any work starts.

TRUE_WORDS = ("true", "yes", "1")
FALSE_WORDS = ("false", "no", "0")


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_value(key: str, text: str, default: Any) -> Any:
    """The value of option ``key`` from the text ``text``, typed by its default ``default``.

    - bool: ``true``/``false``, ``yes``/``no``, ``1``/``0``, in any case;
    - int, float: a number, or ``none`` (for options that take None, such as
      ``redraw_interval``; the method rejects None where it does not);
    - str: the text itself (quotes around it are dropped), so ``share=none`` stays a string;
    - tuple: a Python literal, ``(0, 1)`` or ``[0, 1]``; a single number gives a 1-tuple;
    - None (no type to go by): ``none``, else a Python literal, else the text.

    Raises ``ValueError`` naming the option when the text does not fit the type.
    """
    text = text.strip()
    word = text.lower()
    if isinstance(default, bool):
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError(f"option {key} takes a bool ({'/'.join(TRUE_WORDS)} or "
                         f"{'/'.join(FALSE_WORDS)}), got {text!r}")
    if isinstance(default, str):
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        return text[1:-1] if quoted else text
    if word == "none":
        return None
    if isinstance(default, (int, float)):
        number_type = type(default)
        try:
            return number_type(text)
        except ValueError:
            if number_type is int:
                raise ValueError(f"option {key} takes an integer, got {text!r}") from None
            raise ValueError(f"option {key} takes a number, got {text!r}") from None
    if isinstance(default, tuple):
        value = _literal(text)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (value,)
        if isinstance(value, (tuple, list)):
            return tuple(value)
        raise ValueError(f"option {key} takes a tuple such as (0, 1), got {text!r}")
    return _literal(text)


def split_items(items: str | Iterable[str]) -> list[str]:
    """``"k=v,k=v"`` or ``["k=v", ...]`` -> ``["k=v", ...]`` (a string is split on commas)."""
    if isinstance(items, str):
        return [part for part in items.split(",") if part.strip()]
    return list(items)


def parse_options(items: str | Iterable[str], defaults: Mapping[str, Any],
                  what: str = "option") -> dict[str, Any]:
    """``KEY=VALUE`` items -> {key: value}, each value typed by :func:`parse_value` against
    ``defaults[key]``. ``what`` names the items in messages (``--option``, ``options of 'rfa'``).

    Raises ``ValueError`` for an item without ``=``, a key not in ``defaults`` (listing the valid
    ones) or a value of the wrong type.
    """
    options: dict[str, Any] = {}
    for item in split_items(items):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{what} must look like key=value, got {item!r}")
        if key not in defaults:
            raise ValueError(f"{what}: no option {key!r}; valid options: "
                             f"{', '.join(defaults) or 'none'}")
        options[key] = parse_value(key, text, defaults[key])
    return options


def method_defaults(name: str) -> dict[str, Any]:
    """The options method ``name`` accepts with their defaults (``scale``: None, a number)."""
    return {**spec(name).options, **dict.fromkeys(COMMON_OPTIONS)}


def parse_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """``"rfa:gated=true,num_features=64"`` -> ("rfa", {"gated": True, "num_features": 64}).

    ``KeyError`` for an unregistered name; ``ValueError`` for an option the method does not have
    or a value of the wrong type.
    """
    name, _, text = entry.partition(":")
    defaults = method_defaults(name)
    items = split_items(text)
    unknown = [key for key in (i.partition("=")[0].strip() for i in items) if key not in defaults]
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(defaults)}")
    return name, parse_options(items, defaults, f"options of {name!r}")


def options_per_method(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--option KEY=VALUE`` items given to every method of ``names`` that has KEY, typed by
    that method's default -> {name: options}. ``ValueError`` for a key none of them has."""
    per_method: dict[str, dict[str, Any]] = {name: {} for name in names}
    for item in items:
        key, sep, _ = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--option must look like key=value, got {item!r}")
        having = [n for n in names if key in spec(n).options]
        if not having:
            valid = sorted({k for n in names for k in spec(n).options})
            raise ValueError(f"option {key!r} is not an option of any of {', '.join(names)}; "
                             f"their options: {', '.join(valid) or 'none'}")
        for name in having:
            per_method[name] |= parse_options([item], spec(name).options, "--option")
    return per_method


def check_method(name: str, options: Mapping[str, Any], *, head_dim: int, heads: int,
                 max_len: int | None = None) -> None:
    """Build ``name`` once with ``options``, so that a bad value (``num_features=-3``) is an
    error before any measurement instead of a result cell; ``ValueError`` naming the method."""
    try:
        build(name, head_dim=head_dim, heads=heads, max_len=max_len, seed=0, **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: {err}") from err


def prepare_out(path: Path, flag: str = "--out") -> Path:
    """Create the output folder ``path`` and check that files can be written in it, before any
    work; :class:`UsageError` naming ``flag`` otherwise (a file in the way, no permission, a
    read-only or virtual file system)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        reason = err.strerror or str(err)
        raise UsageError(f"{flag} {path}: cannot write there ({reason})") from None
    return path
