"""The ``effattn`` command. Each subcommand lives in its own module of this package, which provides
``add_parser(subparsers)`` and sets ``func`` (and ``on_interrupt``) on its parser; this file wires
them up and ends every command the same way (see :func:`main`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from effattn.cli.common import UsageError

# Modules that contribute subcommands, in the order `effattn --help` lists them.
_SUBCOMMANDS = ("effattn.cli.methods", "effattn.cli.bench", "effattn.cli.decode",
                "effattn.cli.train")

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="effattn",
        description="Efficient attention: list, benchmark, study and train every mechanism.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status.

    0: done; 1: done, but some part failed (``compare``); 2: a mistake on the command line, shown
    as one line on stderr (argparse exits with 2 itself); 130: interrupted (Ctrl-C), with a line
    on how to resume instead of a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"effattn {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        hint = args.on_interrupt.format(out=getattr(args, "out", None))
        print(f"\neffattn {args.command}: interrupted. {hint}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
