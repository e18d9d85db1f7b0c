"""``effattn bench-distributed``: per-rank memory, time and bytes communicated of sequence-parallel
attention (:mod:`effattn.distributed`) against N, at P = 1, 2, 4 gloo processes on the CPU."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import effattn
from effattn.cli.common import (
    UsageError,
    check_method,
    int_list,
    key_value,
    nonnegative_int,
    options_per_method,
    passes,
    positive_float,
    positive_int,
    prepare_out,
    user_input,
)


def _methods(text: str) -> list[str]:
    from effattn.tools.bench_distributed import supported_methods

    supported = supported_methods()
    if text == "all":
        return supported
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    registered = effattn.methods()
    unknown = [n for n in names if n not in registered]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(unknown) or '(none given)'}; sequence parallel "
            f"supports {', '.join(supported)}, or 'all'")
    refused = [n for n in names if n not in supported]
    if refused:
        raise argparse.ArgumentTypeError(
            f"{', '.join(refused)} cannot be split along the sequence; sequence parallel "
            f"supports {', '.join(supported)}")
    return names


def _fmt(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _run(args: argparse.Namespace) -> int:
    from effattn.tools import bench_distributed as bd
    from effattn.tools.bench.machine import describe, machine_info
    from effattn.tools.bench.results import record_key, write_json

    uneven = [(n, p) for n in args.lengths for p in args.nproc if n % p]
    if uneven:
        n, p = uneven[0]
        raise UsageError(f"--lengths: N = {n} does not split evenly over P = {p} processes; "
                         "give lengths that every --nproc divides")
    with user_input():
        options = options_per_method(args.option, args.methods)
        for method in args.methods:
            check_method(method, options[method], head_dim=args.head_dim, heads=args.heads,
                         max_len=max(args.lengths))
    out = prepare_out(args.out)
    with user_input():
        store = bd.open_store(out)
    configs = [
        bd.DistConfig(method=m, length=n, nproc=p, passes=tuple(args.passes), batch=args.batch,
                      heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                      causal=args.causal, options=tuple(sorted(options[m].items())),
                      max_memory_mib=args.max_memory)
        for n in args.lengths for p in args.nproc for m in args.methods
    ]
    settings = bd.DistSettings(warmup=args.warmup, repeats=args.repeats,
                               max_seconds=args.max_seconds, timeout=args.timeout)
    stats = bd.sweep(configs, store, settings)
    keys = {record_key(c.fields(p), bd.KEY_FIELDS) for c in configs for p in c.passes}
    records = [r for r in store.records() if record_key(r, bd.KEY_FIELDS) in keys]
    machine = machine_info()
    budget = f"{args.max_memory:g} MiB per process" if args.max_memory else "no memory budget"
    print(f"{stats.measured} configurations measured, {stats.resumed} already in "
          f"{store.json_path} (B={args.batch}, H={args.heads}, D={args.head_dim}, {args.dtype}, "
          f"{'causal' if args.causal else 'non-causal'}, gloo on the CPU, {budget})")
    print(describe(machine))
    print(f"P processes share {machine['cpu_count']} cores: times at P > cores are not "
          "speed-ups.")
    for p in args.passes:
        for title, value, fmt in (("time per layer call, slowest rank (ms)", "median_ms", ".4g"),
                                  ("peak memory per rank, largest (MiB)", "peak_mib", ".4g"),
                                  ("bytes sent per rank and layer", "sent_bytes", ",d")):
            print(f"\n{title}, {p}:\n{bd.grid(records, p, value, fmt)}")
    scaling = bd.memory_scaling(records)
    if scaling:
        print(f"\nmemory per rank x P / memory at P = 1 (∝ N/P means 1; goal <= "
              f"{bd.MEMORY_GOAL:g}):")
        for r in scaling:
            print(f"  {r['method']} {r['pass']} N={r['length']} P={r['nproc']}: "
                  f"{r['ratio']:.2f} ({r['peak_mib']:.4g} MiB vs {r['peak_mib_p1']:.4g} MiB)"
                  f"{'' if r['goal_met'] else '  NOT met'}")
    print("\nbytes sent per layer against N:")
    independence = bd.bytes_by_length(records)
    for r in independence:
        values = sorted(set(r["sent_bytes"].values()))
        verdict = ("the same at every N" if r["independent_of_n"]
                   else "one length only" if len(r["sent_bytes"]) == 1 else "grows with N")
        print(f"  {r['method']} P={r['nproc']} {r['pass']}: {verdict} "
              f"({', '.join(f'{v:,d}' for v in values)})")
    reach = bd.longest(records)
    print(f"\nlongest N completed ({budget}):")
    for r in reach:
        failed = (f"; N={r['failed_at']}: {r['failed_status'].split(':')[0]}"
                  if r["failed_at"] else "")
        print(f"  {r['method']} P={r['nproc']} {r['pass']}: {_fmt(r['longest'], 'd')} "
              f"({_fmt(r['peak_mib'], '.4g')} MiB per rank){failed}")
    summary: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("func", "on_interrupt", "option")}
        | {"options": {m: o for m, o in options.items() if o}, "out": str(out)},
        "machine": machine, "memory_goal": bd.MEMORY_GOAL, "memory_scaling": scaling,
        "bytes_by_length": [r | {"sent_bytes": {str(n): b for n, b in r["sent_bytes"].items()}}
                            for r in independence],
        "longest": reach,
    }
    write_json(out / "summary.json", summary)
    written = ["results.json", "results.csv", "summary.json",
               *bd.write_plots(records, out, args.passes)]
    print(f"\nwrote {', '.join(str(out / w) for w in written)}")
    return 0


EPILOG = """\
Every (method, N, P) runs in P fresh processes (torch.multiprocessing spawn, gloo); results are
saved after each one, and rerunning the same command with the same --out resumes where it
stopped. The longest sequence within a memory budget: a doubling --lengths list with
--max-memory MIB and --passes fwd. See docs/distributed.md.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench-distributed", help="sequence-parallel memory, time and bytes per rank against N",
        description="Sweep methods x lengths x process counts P of sequence-parallel attention "
        "(gloo on the CPU): per-rank peak memory, time per layer call, bytes handed to the "
        "collectives; table, JSON/CSV and PNG plots.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--methods", type=_methods, default="all",
                   help="comma list of methods sequence parallel supports, or 'all' (default)")
    b.add_argument("--lengths", type=int_list, default="4096,8192,16384",
                   help="comma list of whole-sequence lengths N, each divisible by every P "
                   "(default 4096,8192,16384)")
    b.add_argument("--nproc", type=int_list, default="1,2,4",
                   help="comma list of process counts P (default 1,2,4)")
    b.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    b.add_argument("--heads", type=positive_int, default=8, help="H (default 8)")
    b.add_argument("--head-dim", type=positive_int, default=64, help="D = Dv (default 64)")
    b.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                   default="float32")
    b.add_argument("--causal", action="store_true", help="causal attention")
    b.add_argument("--passes", type=passes, default="fwd,fwdbwd",
                   help="comma list of fwd (inference_mode) and fwdbwd (forward + backward of "
                   "out.sum()); default both")
    b.add_argument("--repeats", type=positive_int, default=3,
                   help="timed samples per configuration and pass (default 3)")
    b.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="untimed calls after the first (memory) call (default 1)")
    b.add_argument("--max-seconds", type=positive_float, default=20.0,
                   help="a call of the slowest rank longer than this is not timed (memory and "
                   "bytes are kept) and larger lengths of that method and P are skipped "
                   "(default 20)")
    b.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds before a configuration's processes are killed (default 600)")
    b.add_argument("--max-memory", type=positive_float, default=None, metavar="MIB",
                   help="memory budget of each process: its inputs and everything the call "
                   "allocates; more is recorded as oom (default: no budget)")
    b.add_argument("--option", type=key_value, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="method option, e.g. num_features=128 (repeatable; passed to the "
                   "methods that have it, typed by its default)")
    b.add_argument("--out", type=Path, default=Path("effattn-bench-distributed"),
                   help="output folder (default ./effattn-bench-distributed); reused to resume")
    b.set_defaults(func=_run, on_interrupt=(
        "Every configuration measured so far is saved in {out}; run the same command again to "
        "resume."))
