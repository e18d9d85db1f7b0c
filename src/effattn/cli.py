"""The ``effattn`` command. Each subcommand lives in its own module, which provides
``add_parser(subparsers)`` and sets ``func`` on its parser; this file only wires them up."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that contribute subcommands, in the order `effattn --help` lists them.
_SUBCOMMANDS = ("effattn.cli_methods", "effattn.cli_bench", "effattn.cli_decode",
                "effattn.cli_train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="effattn",
        description="Efficient attention: list, benchmark, study and train every mechanism.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
