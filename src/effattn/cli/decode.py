"""``effattn decode``: tokens/s, per-token time and state memory of greedy decoding against
output length and batch size, for every decoding-capable method against softmax with a KV cache."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import effattn
from effattn.cli.common import (
    UsageError,
    check_method,
    device,
    int_list,
    options_per_method,
    parse_entry,
    positive_float,
    positive_int,
    prepare_out,
    user_input,
)
from effattn.registry import DEFAULT_METHOD
from effattn.tools.bench.machine import machine_info

if TYPE_CHECKING:
    from effattn.tools.decode import DecodeConfig

DEFAULT_LENGTHS = "128,256,512,1024,2048,4096,8192"


def decoding_entries() -> list[tuple[str, dict[str, Any]]]:
    """``default`` / ``all``: every registered method that can decode, plus the variants whose
    decoding step differs from their method's (``Variant.decoding``: gated RFA's decay)."""
    names = [m for m in effattn.methods() if effattn.spec(m).decoding]
    return [(m, {}) for m in names] + [
        (m, dict(v.options)) for m in names for v in effattn.spec(m).variants if v.decoding]


def parse_methods(items: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Method entries -> [(name, options)], deduplicated, each checked to be able to decode.

    Entries are ``name`` or ``name:key=value,key=value`` (as in ``effattn compare``), separated by
    spaces or commas; a comma piece with ``=`` and no ``:`` is one more option of the entry before
    it (``rfa:gated=True,num_features=64,softmax`` is two entries). ``default`` and ``all`` expand
    to :func:`decoding_entries`. Option values are typed by the method's defaults
    (:func:`~effattn.cli.common.parse_entry`). Raises ``ValueError`` (or ``KeyError`` for an
    unknown name) with a message for the user.
    """
    texts: list[str] = []
    for piece in (p.strip() for item in items for p in item.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece:
            if not texts or texts[-1] in ("default", "all"):
                raise ValueError(f"option {piece!r} does not follow a method name:key=value entry")
            texts[-1] += "," + piece
        else:
            texts.append(piece)
    if not texts:
        raise ValueError("no methods given")
    entries: list[tuple[str, dict[str, Any]]] = []
    for text in texts:
        if text in ("default", "all"):
            entries += decoding_entries()
            continue
        name, options = parse_entry(text)
        method_spec = effattn.spec(name)
        if not method_spec.decoding:
            valid = ", ".join(m for m in effattn.methods() if effattn.spec(m).decoding)
            raise ValueError(f"{name} cannot decode token by token: "
                             f"{method_spec.refusals.get('decoding', 'no decoding state')}; "
                             f"methods that can: {valid}")
        entries.append((name, options))
    unique: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, options in entries:
        unique.setdefault(f"{name}:{sorted(options.items())}", (name, options))
    return list(unique.values())


def make_configs(entries: Sequence[tuple[str, dict[str, Any]]], extra: Sequence[str],
                 batches: Sequence[int], **settings: Any) -> list[DecodeConfig]:
    """One run per entry and batch size. ``extra`` (``--option KEY=VALUE`` items) goes to the
    methods that have each option, under the entry's own options; ``settings`` are the other
    :class:`~effattn.tools.decode.DecodeConfig` fields. ``ValueError`` for an option no entry
    has, or for options a method cannot be built with (checked now, before any run)."""
    from effattn.tools.decode import DecodeConfig

    per_method = options_per_method(extra, list(dict.fromkeys(m for m, _ in entries)))
    configs = []
    for name, options in entries:
        merged = per_method[name] | options
        runs = [DecodeConfig(method=name, options=tuple(sorted(merged.items())), batch=b,
                             **settings) for b in batches]
        check_method(name, merged, head_dim=runs[0].d_model // runs[0].heads,
                     heads=runs[0].heads)
        configs += runs
    return configs


def _fmt(x: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{unit}"


def _verdict(flag: bool | None, defined: bool, where: str) -> str:
    if not defined:
        return f"defined {where}, not measured"
    return {True: "met", False: "NOT met", None: "not measured"}[flag]


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The goals of the summary rows, one line per (batch, method) besides softmax; a goal is
    judged only where it is defined (see :func:`effattn.tools.decode.summarize`)."""
    from effattn.tools.decode import (
        FLAT_GOAL,
        FLAT_GOAL_SPAN,
        GOAL_LENGTH,
        STATE_GOAL_PCT,
        flat_goal_applies,
    )

    lines = []
    for r in rows:
        if r["method"] == DEFAULT_METHOD:
            continue
        lengths = r["flatness_lengths"]
        span = f" ({lengths[0]} -> {lengths[1]})" if lengths else ""
        flat = _verdict(r["flat_goal_met"], lengths is None or flat_goal_applies(lengths),
                        f"from {FLAT_GOAL_SPAN[0]} to {FLAT_GOAL_SPAN[1]} tokens")
        state = _verdict(r["state_goal_met"], r["state_length"] == GOAL_LENGTH,
                         f"at {GOAL_LENGTH} tokens")
        lines.append(
            f"  B={r['batch']} {r['method']}: flatness {_fmt(r['flatness'], '.2f', 'x')}{span} "
            f"[<= {FLAT_GOAL:g}x: {flat}]; state at {r['state_length']} "
            f"{_fmt(r['state_pct_of_softmax'], '.2f', '%')} of the KV cache "
            f"[< {STATE_GOAL_PCT:g}%: {state}]; speed-up at "
            f"{r['state_length']} {_fmt(r['speedup_at_goal_length'], '.2f', 'x')}")
    return lines


def _run_decode(args: argparse.Namespace) -> int:
    from effattn.tools import decode
    from effattn.tools.bench import plots
    from effattn.tools.bench.results import record_key, table, write_json

    if args.d_model % args.heads:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    with user_input():
        configs = make_configs(
            parse_methods(args.methods), args.option, args.batch, lengths=tuple(args.lengths),
            d_model=args.d_model, heads=args.heads, layers=args.layers, vocab=args.vocab,
            prompt_len=args.prompt_len, device=args.device)
    out = prepare_out(args.out)
    with user_input():
        store = decode.open_store(out)
    stats = decode.run_all(configs, store, max_seconds=args.max_seconds, timeout=args.timeout)
    keys = {record_key(c.fields(n), decode.KEY_FIELDS) for c in configs for n in c.lengths}
    records = decode.with_speedup(
        [r for r in store.records() if record_key(r, decode.KEY_FIELDS) in keys])
    print(f"{stats.measured} runs measured, {stats.resumed} already in {store.json_path} "
          f"(d_model={args.d_model}, heads={args.heads}, layers={args.layers}, "
          f"vocab={args.vocab}, prompt {args.prompt_len} tokens, {args.device})")
    for batch in args.batch:
        rows = [r for r in records if r["batch"] == batch]
        print(f"\n== batch {batch} ==")
        for title, value, fmt in (
                ("per-token time near position L (ms)", "ms_per_token", ".3g"),
                ("tokens/s over the first L tokens", "tokens_per_s", ".4g"),
                ("decoding state after L tokens (MiB in use, all layers)", "state_mib", ".3g"),
                ("speed-up over softmax with KV cache (tokens/s ratio)", "speedup", ".2f")):
            print(f"\n{title}:\n{table(rows, None, value, fmt)}")
    length = decode.GOAL_LENGTH if decode.GOAL_LENGTH in args.lengths else max(args.lengths)
    rows = decode.summarize(records, length)
    print("\ngoals (flatness = per-token time at the largest length / at the smallest):")
    print("\n".join(goal_lines(rows)) or "  (no method besides softmax)")
    print(f"for comparison: {decode.RFA_CLAIMS}")
    summary = {
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("func", "on_interrupt", "option", "out", "methods")}
        | {"methods": list(dict.fromkeys(c.label for c in configs)), "options": args.option,
           "out": str(out)},
        "machine": machine_info(),
        "goals": {"flatness_max": decode.FLAT_GOAL, "flatness_span": decode.FLAT_GOAL_SPAN,
                  "state_pct_below": decode.STATE_GOAL_PCT, "state_length": decode.GOAL_LENGTH,
                  "length": length},
        "rfa_claims": decode.RFA_CLAIMS,
        "rows": rows,
    }
    write_json(out / "summary.json", summary)
    figures = (("time_per_token.png", "ms_per_token", "ms per token (median of the last "
                f"{decode.TAIL_STEPS} steps)", "per-token time", False),
               ("state_memory.png", "state_mib", "decoding state, MiB in use (all layers)",
                "state memory", True),
               ("tokens_per_s.png", "tokens_per_s", "tokens/s over the first L tokens",
                "throughput", False))
    for name, value, ylabel, title, logy in figures:
        plots.plot_decode(records, out / name, value=value, ylabel=ylabel, title=title,
                          batches=args.batch, logy=logy)
    written = ["results.json", "results.csv", "summary.json", *(f[0] for f in figures)]
    print(f"\nwrote {', '.join(str(out / w) for w in written)}")
    return 0


EPILOG = """\
Each (method, batch) pair runs in a fresh worker process that prefills a random prompt and
decodes greedily to the largest length, recording at every length. Results are saved after each
run; rerunning the same command with the same --out skips the runs already there. The default
run (7 entries x batch 1, 16, to 8192 tokens) takes a while on a CPU; see docs/benchmarks.md.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode", help="decoding speed and state memory against output length and batch",
        description="Greedy decoding with every decoding-capable method against softmax with a "
        "KV cache, same model: tokens/s, per-token time and state memory against output length, "
        "per batch size; table, JSON/CSV, summary and PNG plots.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["default"], metavar="METHOD",
                   help="method entries, name or name:key=value,key=value (space or comma "
                   "separated); 'default' or 'all': every method that can decode plus "
                   "rfa:gated=True")
    p.add_argument("--lengths", type=int_list, default=DEFAULT_LENGTHS,
                   help=f"comma list of output lengths to report (default {DEFAULT_LENGTHS}); "
                   "one decode runs to the largest")
    p.add_argument("--batch", type=int_list, default="1,16",
                   help="comma list of batch sizes (default 1,16)")
    p.add_argument("--d-model", type=positive_int, default=256, help="model width (default 256)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default 2)")
    p.add_argument("--vocab", type=positive_int, default=256, help="vocabulary (default 256)")
    p.add_argument("--prompt-len", type=positive_int, default=16,
                   help="random prompt tokens, prefilled in parallel (default 16)")
    p.add_argument("--device", type=device, default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--max-seconds", type=positive_float, default=600.0,
                   help="a decode that runs longer stops; the lengths not reached are recorded "
                   "as too slow (default 600)")
    p.add_argument("--timeout", type=positive_float, default=1200.0,
                   help="seconds before a run's worker is killed and all its lengths are "
                   "recorded as timeout (default 1200)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, repeatable, given to the methods that have it and typed "
                   "by its default (a method entry's own options win)")
    p.add_argument("--out", type=Path, default=Path("effattn-decode"),
                   help="output folder (default ./effattn-decode); reused to resume")
    p.set_defaults(func=_run_decode, on_interrupt=(
        "Every run finished so far is saved in {out}; run the same command again to resume."))
