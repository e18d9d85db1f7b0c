"""``effattn methods``: the registered mechanisms and what each can do."""

from __future__ import annotations

import argparse

from effattn.cli.common import user_input
from effattn.registry import methods, spec


def capability_table() -> str:
    """A Markdown table of every method's capabilities and options (the README shows it)."""
    head = "| method | causal | padding mask | cross | decoding | complexity | options |"
    rows = [head, "|" + "---|" * 7]
    for name in methods():
        s = spec(name)
        opts = ", ".join(f"`{k}={v!r}`" for k, v in s.options.items()) or "-"
        marks = ["yes" if getattr(s, c) else "no" for c in
                 ("causal", "padding_mask", "cross", "decoding")]
        rows.append(f"| `{name}` | " + " | ".join(marks) + f" | {s.complexity} | {opts} |")
    return "\n".join(rows)


def _run(args: argparse.Namespace) -> int:
    if args.name:
        with user_input():
            s = spec(args.name)
        print(f"{s.name}: {s.summary}\n  paper: {s.paper}\n  complexity: {s.complexity}")
        for cap in ("causal", "padding_mask", "cross", "decoding"):
            ok = getattr(s, cap)
            print(f"  {cap}: {'yes' if ok else 'no (' + s.refusals[cap] + ')'}")
        for key, value in s.options.items():
            print(f"  option {key} = {value!r}")
    else:
        print(capability_table())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", help="list registered methods and their capabilities")
    p.add_argument("name", nargs="?", help="show one method in detail")
    p.set_defaults(func=_run, on_interrupt="")
