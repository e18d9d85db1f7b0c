"""The ``effattn`` command. Each subcommand lives in its own module of this package, which provides
``add_parser(subparsers)`` and sets ``func`` (and ``on_interrupt``) on its parser; this file wires
them up and ends every command the same way (see :func:`main`).

``effattn methods`` needs the library alone; the other commands need the tools
(:mod:`effattn.tools`, the extra ``tools``). Without them those commands are still listed, and
running one prints how to install them instead of a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from effattn import tools
from effattn.cli.common import UsageError

# Modules that contribute subcommands, in the order `effattn --help` lists them: those of the
# library, then those of the tools with the commands each adds.
LIBRARY_COMMANDS = ("effattn.cli.methods",)
TOOL_COMMANDS = {"effattn.cli.bench": ("bench", "approx"),
                 "effattn.cli.bench_distributed": ("bench-distributed",),
                 "effattn.cli.decode": ("decode",), "effattn.cli.train": ("train", "compare"),
                 "effattn.cli.convert": ("convert",)}
INSTALL_TOOLS = "pip install 'effattn[tools]'"

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
    for module in LIBRARY_COMMANDS:
        importlib.import_module(module).add_parser(sub)
    missing = tools.missing()
    for module, commands in TOOL_COMMANDS.items():
        if not missing:
            importlib.import_module(module).add_parser(sub)
            continue
        for command in commands:
            stub = sub.add_parser(command, help=f"(needs the tools: {INSTALL_TOOLS})",
                                  add_help=False)
            stub.set_defaults(func=_needs_tools(command, missing), on_interrupt="",
                              any_arguments=True)
    return parser


def _needs_tools(command: str, missing: Sequence[str]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"effattn {command} needs the tools: {INSTALL_TOOLS} (missing: "
              f"{', '.join(missing)})", file=sys.stderr)
        return EXIT_USAGE
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status.

    0: done; 1: done, but some part failed (``compare``); 2: a mistake on the command line, shown
    as one line on stderr (argparse exits with 2 itself), or a command of the tools run without
    them (one line on what to install); 130: interrupted (Ctrl-C), with a line on how to resume
    instead of a traceback.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # A command that cannot run here takes any arguments: its message is what to install.
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
