"""``effattn bench`` (speed and memory sweep) and ``effattn approx`` (approximation study)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

import effattn
from effattn.cli.common import (
    UsageError,
    check_method,
    device,
    float_list,
    int_list,
    key_value,
    nonnegative_int,
    options_per_method,
    parse_value,
    passes,
    positive_float,
    positive_int,
    prepare_out,
    user_input,
)
from effattn.registry import DEFAULT_METHOD

# The default sweep: a representative subset that finishes in a few minutes on 2 CPU cores.
LENGTH_SETS = {
    "quick": (256, 512, 1024, 2048, 4096),
    "short": (128, 256, 512),
    "long": (1024, 2048, 4096, 8192),
    "full": (128, 256, 512, 1024, 2048, 4096, 8192, 16384),
}


def _lengths(text: str) -> list[int]:
    """Comma list of lengths and/or named sets (quick, short, long, full)."""
    out: set[int] = set()
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in LENGTH_SETS:
            out.update(LENGTH_SETS[item])
            continue
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad length {item!r}: give positive integers or one of "
                f"{', '.join(LENGTH_SETS)}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"lengths must be positive, got {value}")
        out.add(value)
    if not out:
        raise argparse.ArgumentTypeError("no lengths given")
    return sorted(out)


def _method_list(text: str, default: tuple[str, ...], allowed: list[str]) -> list[str]:
    if text == "default":
        return [m for m in default if m in allowed]
    if text == "all":
        return list(allowed)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(unknown) or '(none given)'}; valid: "
            f"{', '.join(allowed)}, or 'all'")
    return list(dict.fromkeys(names))


def default_methods() -> tuple[str, ...]:
    """The default sweep, a representative subset that finishes in a few minutes on 2 CPU cores:
    the methods whose spec says ``bench_default``."""
    return tuple(m for m in effattn.methods() if effattn.spec(m).bench_default)


def _bench_methods(text: str) -> list[str]:
    return _method_list(text, default_methods(), effattn.methods())


def _run_bench(args: argparse.Namespace) -> int:
    from effattn.tools.bench import plots
    from effattn.tools.bench.machine import describe
    from effattn.tools.bench.results import (
        ResultStore,
        crossover,
        notes,
        record_key,
        table,
        write_json,
    )
    from effattn.tools.bench.speed import Config, Settings, sweep

    with user_input():
        options = options_per_method(args.option, args.methods)
        # A bad value is an error now, not a "refused" cell in every configuration.
        for method in args.methods:
            check_method(method, options[method], head_dim=args.head_dim, heads=args.heads,
                         max_len=max(args.lengths))
    out = prepare_out(args.out)
    with user_input():
        store = ResultStore(out)
    configs = [
        Config(method=m, length=n, pass_name=p, batch=args.batch, heads=args.heads,
               head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, device=args.device,
               options=tuple(sorted(options[m].items())))
        for n in args.lengths for m in args.methods for p in args.passes
    ]
    settings = Settings(warmup=args.warmup, repeats=args.repeats, max_seconds=args.max_seconds,
                        max_memory_mib=args.max_memory, retries=args.retries)
    stats = sweep(configs, store, settings, timeout=args.timeout)
    keys = {record_key(c.fields()) for c in configs}
    records = [r for r in store.records() if record_key(r) in keys]
    print(f"{stats.measured} configurations measured, {stats.resumed} already in {store.json_path}"
          f" (B={args.batch}, H={args.heads}, D={args.head_dim}, {args.dtype}, "
          f"{'causal' if args.causal else 'non-causal'}, {args.device})")
    print(describe(stats.machine))
    peaks = stats.machine.get("matmul_peak_gflops") or {}
    peak = peaks.get(args.dtype)
    for p in args.passes:
        print(f"\nmedian time per call (ms), {p}:\n{table(records, p, 'median_ms')}")
        print(f"\npeak memory over inputs (MiB), {p}:\n{table(records, p, 'peak_mib')}")
    cross = {p: crossover(records, p) for p in args.passes}
    if DEFAULT_METHOD in args.methods:
        for p, per_method in cross.items():
            print(f"\ncrossover vs {DEFAULT_METHOD} ({p}): smallest measured N from which on "
                  "it is faster")
            for m, n in per_method.items():
                print(f"  {m}: " + (f"N >= {n}" if n else "not within the measured lengths"))
    summary: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("func", "on_interrupt", "option")}
        | {"options": {m: o for m, o in options.items() if o}, "out": str(out)},
        "machine": stats.machine, "crossover": cross,
    }
    plots.plot_vs_length(records, out / "time.png", value="median_ms", ylabel="time per call (ms)",
                         title="time", passes=args.passes)
    plots.plot_vs_length(records, out / "memory.png", value="peak_mib",
                         ylabel="peak memory over inputs (MiB)", title="memory",
                         passes=args.passes)
    written = ["results.json", "results.csv", "time.png", "memory.png"]
    if args.vs_flops:
        summary["matmul_peak_gflops"] = peaks
        for p in args.passes:
            print(f"\neffective GFLOP/s (FLOP model / median time), {p}:\n"
                  f"{table(records, p, 'gflops', '.1f', peak=peak)}")
        hlines = {f"{args.dtype} matmul peak {peak:.0f} GFLOP/s": peak} if peak else {}
        plots.plot_vs_length(records, out / "gflops.png", value="gflops",
                             ylabel="effective GFLOP/s", title="throughput",
                             passes=args.passes, hlines=hlines, guides=False, logy=False)
        written.append("gflops.png")
    for line in notes(records, peak):
        print(f"\n{line}")
    write_json(out / "summary.json", summary)
    written.append("summary.json")
    print(f"\nwrote {', '.join(str(out / w) for w in written)}")
    return 0


def _approx_methods(text: str) -> list[str]:
    from effattn.tools.approx import budgets

    allowed = list(budgets())
    if text not in ("default", "all"):
        names = [t.strip() for t in text.split(",") if t.strip()]
        registered = effattn.methods()
        unknown = [n for n in names if n not in registered]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(allowed)}")
        no_budget = [n for n in names if n not in allowed]
        if no_budget:
            raise argparse.ArgumentTypeError(
                f"{', '.join(no_budget)} has no budget option to sweep; methods with one: "
                f"{', '.join(allowed)}")
    return _method_list(text, tuple(allowed), allowed)


def _budget(text: str) -> tuple[str, list[str]]:
    """``method=v1,v2,...`` -> (method, texts); the values are typed once the method is known."""
    method, sep, raw = text.partition("=")
    values = [t.strip() for t in raw.split(",") if t.strip()]
    if not sep or not method.strip() or not values:
        raise argparse.ArgumentTypeError(f"expected method=v1,v2,..., got {text!r}")
    return method.strip(), values


def _run_approx(args: argparse.Namespace) -> int:
    from effattn.tools import approx
    from effattn.tools.bench import plots
    from effattn.tools.bench.results import write_csv, write_json

    budgets = approx.budgets()
    grids = {m: list(budgets[m].grid) for m in args.methods}
    for method, texts in args.budget:
        if method not in grids:
            raise UsageError(f"--budget {method}=...: {method!r} is not among the methods "
                             f"studied ({', '.join(grids) or 'none'})")
        option = budgets[method].option
        default = effattn.spec(method).options[option]
        with user_input():
            grids[method] = [parse_value(option, t, default) for t in texts]
            # A budget given by hand is checked now rather than recorded as refused.
            for value in grids[method]:
                check_method(method, {option: value}, head_dim=args.head_dim,
                             heads=args.heads, max_len=args.length)
    out = prepare_out(args.out)
    total = sum(len(v) for v in grids.values()) * (len(args.qk_std) + 1)
    with tqdm(total=total, desc="effattn approx", unit="point", file=sys.stderr) as bar:
        records = approx.output_error_study(
            grids, length=args.length, heads=args.heads, head_dim=args.head_dim,
            seeds=args.seeds, qk_stds=args.qk_std, peak_logit=args.peak_logit,
            fit_steps=args.fit_steps, progress=bar)
    kernel = approx.kernel_mse_study(dim=args.kernel_dim, norm=args.kernel_norm,
                                     features=args.kernel_features, draws=args.kernel_draws)
    write_json(out / "approx.json", records)
    write_csv(out / "approx.csv", records, approx.APPROX_FIELDS)
    write_json(out / "kernel_mse.json", kernel)
    write_csv(out / "kernel_mse.csv", kernel, approx.KERNEL_FIELDS)
    plots.plot_approx(records, out / "approx.png")
    plots.plot_kernel_mse(kernel, out / "kernel_mse.png")
    if records:
        print(f"relative output error vs exact attention (N={args.length}, H={args.heads}, "
              f"D={args.head_dim}, float64, mean ± std over {args.seeds} seeds):")
        print(approx.approx_table(records))
    print(f"\nMSE of the softmax-kernel estimate exp(x·y), d={args.kernel_dim}, "
          f"|x|=|y|={args.kernel_norm:g}, {args.kernel_draws} draws:")
    print(approx.kernel_table(kernel))
    names = ("approx.json", "approx.csv", "approx.png", "kernel_mse.json", "kernel_mse.csv",
             "kernel_mse.png")
    print(f"\nwrote {', '.join(str(out / n) for n in names)}")
    return 0


BENCH_EPILOG = """\
The default run (a representative subset of methods, lengths 256..4096, fp32, B=1, H=8, D=64)
takes a few minutes on 2 CPU cores. The full sweep: --methods all --lengths full (128..16384).
Every configuration runs in a fresh worker process; results are saved after each one, and
rerunning the same command with the same --out resumes where it stopped. See docs/benchmarks.md.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    b = sub.add_parser(
        "bench", help="time and memory of every method against sequence length",
        description="Sweep methods x sequence lengths, forward and forward+backward: median "
        "time, peak memory, effective GFLOP/s; table, JSON/CSV and PNG plots.",
        epilog=BENCH_EPILOG, formatter_class=fmt)
    b.add_argument("--methods", type=_bench_methods, default="default",
                   help="comma list of methods, 'all', or 'default' "
                   f"({', '.join(default_methods())})")
    b.add_argument("--lengths", type=_lengths, default="quick",
                   help="comma list of lengths N = M and/or sets: "
                   + "; ".join(f"{k} = {','.join(map(str, v))}" for k, v in LENGTH_SETS.items())
                   + " (default: quick)")
    b.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    b.add_argument("--heads", type=positive_int, default=8, help="H (default 8)")
    b.add_argument("--head-dim", type=positive_int, default=64, help="D = Dv (default 64)")
    b.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                   default="float32")
    b.add_argument("--causal", action="store_true",
                   help="causal attention (methods that cannot are recorded as refused)")
    b.add_argument("--device", type=device, default="cpu", help="cpu or cuda[:i]")
    b.add_argument("--passes", type=passes, default="fwd,fwdbwd",
                   help="comma list of fwd (inference_mode) and fwdbwd (forward + "
                   "backward of out.sum()); default both")
    b.add_argument("--repeats", type=positive_int, default=5,
                   help="timed samples per configuration (default 5)")
    b.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="untimed calls after the first (memory) call (default 1)")
    b.add_argument("--retries", type=nonnegative_int, default=2,
                   help="measurements of a configuration disturbed by other processes made "
                   "again before it is recorded as disturbed (default 2)")
    b.add_argument("--max-seconds", type=positive_float, default=5.0,
                   help="a configuration whose first call takes longer is recorded as too slow "
                   "and larger lengths of that method are skipped (default 5)")
    b.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds before a configuration's worker is killed (default 300)")
    b.add_argument("--max-memory", type=positive_float, default=None, metavar="MIB",
                   help="memory a configuration may allocate beyond its inputs; more is "
                   "recorded as oom (default: no cap)")
    b.add_argument("--option", type=key_value, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="method option, e.g. num_features=256 or orthogonal=false (repeatable; "
                   "passed to the methods that have it, typed by its default)")
    b.add_argument("--out", type=Path, default=Path("effattn-bench"),
                   help="output folder (default ./effattn-bench); reused to resume")
    b.add_argument("--vs-flops", action="store_true",
                   help="also measure the fp32/bf16 matmul peak and show effective GFLOP/s "
                   "against it")
    b.set_defaults(func=_run_bench, on_interrupt=(
        "Every configuration measured so far is saved in {out}; run the same command again to "
        "resume."))

    a = sub.add_parser(
        "approx", help="error of each method against exact attention, and kernel-estimator MSE",
        description="Relative output error of each method against exact attention as its "
        "budget grows (Gaussian and peaked q/k), and the Performer paper's MSE study of "
        "positive vs trigonometric, orthogonal vs iid random features.",
        formatter_class=fmt)
    a.add_argument("--methods", type=_approx_methods, default="default",
                   help="comma list of methods with a budget option, or 'all' (default: all "
                   "registered ones)")
    a.add_argument("--budget", type=_budget, action="append", default=[],
                   metavar="METHOD=V1,V2,...",
                   help="override a method's budget grid, e.g. performer=16,64,256")
    a.add_argument("--length", type=positive_int, default=512, help="N = M (default 512)")
    a.add_argument("--heads", type=positive_int, default=4, help="H (default 4)")
    a.add_argument("--head-dim", type=positive_int, default=64, help="D (default 64)")
    a.add_argument("--seeds", type=positive_int, default=5, help="seeds per point (default 5)")
    a.add_argument("--qk-std", type=float_list, default=[0.25, 0.5, 1.0],
                   help="comma list of q/k standard deviations for the Gaussian data sets; the "
                   "logits then have std qk_std^2 (default 0.25,0.5,1)")
    a.add_argument("--peak-logit", type=positive_float, default=8.0,
                   help="logit of the planted pairs of the peaked data set (default 8)")
    a.add_argument("--fit-steps", type=nonnegative_int, default=0,
                   help="fit the parameters of learned feature maps (feature_parameters()) "
                   "by attention distillation on each seed's q, k for this many Adam steps "
                   "before measuring them (default 0: as built)")
    a.add_argument("--kernel-dim", type=positive_int, default=16,
                   help="d of the kernel-MSE study (default 16)")
    a.add_argument("--kernel-norm", type=positive_float, default=1.0,
                   help="|x| = |y| in the kernel-MSE study (default 1)")
    a.add_argument("--kernel-features", type=int_list, default="4,8,16,32,64,128,256,512,1024",
                   help="random projections m of the kernel-MSE study")
    a.add_argument("--kernel-draws", type=positive_int, default=200,
                   help="projection draws per point of the kernel-MSE study, at least; more "
                   "below m = 64 (default 200)")
    a.add_argument("--out", type=Path, default=Path("effattn-approx"),
                   help="output folder (default ./effattn-approx)")
    a.set_defaults(func=_run_approx, on_interrupt=(
        "approx writes its files when the whole study is done, so nothing was saved; run the "
        "same command again to start over."))
