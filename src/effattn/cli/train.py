"""``effattn train`` and ``effattn compare``: train models with any method on generated tasks."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from effattn.cli.common import (
    TRUST_HELP,
    check_method,
    device_or_auto,
    method_defaults,
    nonnegative_int,
    parse_entry,
    parse_options,
    positive_float,
    prepare_out,
    user_input,
)
from effattn.distributed.training import World, launched, torchrun_rank
from effattn.registry import DEFAULT_METHOD
from effattn.tools.compare import compare, every_variant, resolve, run_options, table
from effattn.tools.tasks.data import FRACTION_METRICS, TASKS, task_options
from effattn.tools.train import (
    MODEL_DEFAULTS,
    TASK_DEFAULTS,
    TrainConfig,
    check_parallel,
    label_of,
    train,
)


def _budget_args(p: argparse.ArgumentParser) -> None:
    defaults = ", ".join(f"{t}: {d['steps']} steps, length {d['seq_len']}, lr {d['lr']}"
                         for t, d in TASK_DEFAULTS.items())
    p.add_argument("--task", choices=TASKS, default="listops", help="task (default listops)")
    p.add_argument("--steps", type=int, help=f"training steps (task default; {defaults})")
    p.add_argument("--batch-size", type=int,
                   help=f"examples per step (task default; {MODEL_DEFAULTS['batch_size']} but "
                   f"recall: {TASK_DEFAULTS['recall']['batch_size']})")
    p.add_argument("--lr", type=float, help="peak learning rate (task default)")
    p.add_argument("--d-model", type=int, default=MODEL_DEFAULTS["d_model"])
    p.add_argument("--layers", type=int, default=MODEL_DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=MODEL_DEFAULTS["heads"])
    p.add_argument("--seq-len", type=int, help="sequence length (task default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--device", type=device_or_auto, default="auto",
                   help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="task option, repeatable (e.g. --task-option train_size=20000 for "
                   "listops, --task-option test_windows=1024 for charlm)")


def _config(args: argparse.Namespace, method: str, options: dict) -> TrainConfig:
    """The run's configuration, checked (task defaults filled in): ``ValueError`` otherwise."""
    extra = parse_options(args.task_option, task_options(args.task), f"task {args.task!r}")
    return TrainConfig(task=args.task, method=method, options=options, task_options=extra,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                       d_model=args.d_model, layers=args.layers, heads=args.heads,
                       seq_len=args.seq_len, seed=args.seed, dropout=args.dropout,
                       checkpoint_every=args.checkpoint_every,
                       eval_every=getattr(args, "eval_every", 0), device=args.device,
                       init_from=getattr(args, "init_from", None),
                       lora_rank=getattr(args, "lora_rank", 0),
                       lora_alpha=getattr(args, "lora_alpha", 16.0)).resolved()


def _check(cfg: TrainConfig) -> None:
    """Build the method once with the run's options, before any data is generated."""
    check_method(cfg.method, cfg.options, head_dim=cfg.d_model // cfg.heads, heads=cfg.heads,
                 max_len=cfg.seq_len)


def _run_train(args: argparse.Namespace) -> int:
    with user_input():
        options = parse_options(args.option, method_defaults(args.method),
                                f"options of {args.method!r}")
        cfg = _config(args, args.method, options)
        _check(cfg)
        launch = torchrun_rank()
        if args.sequence_parallel and launch is None:
            raise ValueError("--sequence-parallel splits each sequence across processes: run "
                             "under torchrun --nproc-per-node P")
        if launch is not None:
            # The checks that need the number of processes, before the process group exists:
            # a mistake ends every rank alike, none waits for the others.
            rank, size, local = launch
            check_parallel(cfg, World(rank, size, local, args.sequence_parallel,
                                      distributed=True))
    args.out = prepare_out(Path(args.out or f"runs/{args.task}-{label_of(args.method, options)}"))
    if args.data_dir is not None:
        prepare_out(Path(args.data_dir), "--data-dir")
    with launched(cfg.device, args.sequence_parallel) as world, user_input():
        results = train(cfg, args.out, resume=True if args.resume else None,
                        data_dir=args.data_dir, progress=None, world=world,
                        trust_checkpoint=args.trust_checkpoint)
    if not world.is_main:
        return 0
    metric = results["metric"]
    percent = metric in FRACTION_METRICS
    value = results["score"] * (100 if percent else 1)
    on = f" on {world.size} processes ({world.mode} parallel)" if world.distributed else ""
    print(f"{args.task} {results['label']}: test {metric.replace('_', ' ')} "
          f"{value:.2f}{'%' if percent else ''}, "
          f"{results['steps_per_s']:.2f} steps/s{on}, peak {results['peak_memory_mb']:.0f} MB "
          f"({results['peak_memory_kind']}); results in {args.out / 'results.json'}")
    return 0


def _wanted(entries: list[str]) -> list[tuple[str, dict]]:
    """``all`` and ``name:key=value,...`` entries -> (method, options) pairs."""
    wanted: list[tuple[str, dict]] = []
    for entry in entries:
        wanted += every_variant() if entry == "all" else [parse_entry(entry)]
    return wanted


def _run_compare(args: argparse.Namespace) -> int:
    with user_input():
        base = _config(args, DEFAULT_METHOD, {})
        wanted = _wanted(args.methods)
        run, _ = resolve(args.task, wanted)
        for method, options in run:
            _check(replace(base, method=method, options=run_options(method, options, base)))
    args.out = prepare_out(Path(args.out or f"runs/compare-{args.task}"))
    summary = compare(args.task, wanted, args.out, base)
    print(table(summary))
    print(f"\nwritten: {args.out / 'compare.json'}, compare.csv, compare.md, compare.png")
    return 1 if summary["failed"] else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model with one method on a generated task",
                       description="Train a tiny Transformer with one attention method; "
                       "checkpoints atomically and resumes from its output directory.")
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help="registered method (effattn methods)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, repeatable (e.g. --option num_features=64 or "
                   "--option orthogonal=false), typed by its default")
    _budget_args(p)
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate on the validation set every N steps (0: only at the end)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start from the checkpoint of another run (DIR/checkpoint.pt, same task "
                   "and model size, any method): every weight of the same name is loaded, the "
                   "new method's own ones are initialised and named in the log (fine-tuning a "
                   "converted model)")
    p.add_argument("--lora-rank", type=nonnegative_int, default=0, metavar="R",
                   help="with --init-from: train rank-R adapters (LoRA) on the attention's q, k, "
                   "v and output projections instead of every weight, which stays frozen "
                   "(default 0: every weight trains)")
    p.add_argument("--lora-alpha", type=positive_float, default=16.0,
                   help="LoRA's scale: the update is (alpha / R) B A (default 16)")
    p.add_argument("--out", help="run directory (default runs/<task>-<method>)")
    p.add_argument("--data-dir", help="cache of generated data sets (default <out>/data)")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in --out (resuming is automatic when one exists)")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="under torchrun: split each sequence across the processes instead of "
                   "the batch (causal LM tasks, methods that effattn.distributed splits)")
    p.set_defaults(func=_run_train, on_interrupt=(
        "The last checkpoint (every --checkpoint-every steps) is in {out}; run the same command "
        "again to resume from it."))

    c = sub.add_parser("compare", help="train every applicable method with the same budget",
                       description="Train each method on one task with the same budget and "
                       "print an LRA-style table; writes compare.{json,csv,md,png}.")
    c.add_argument("--methods", nargs="+", default=["all"], metavar="METHOD",
                   help="'all' and/or names, with options as name:key=value,key=value")
    _budget_args(c)
    c.add_argument("--out", help="output directory (default runs/compare-<task>)")
    c.set_defaults(func=_run_compare, on_interrupt=(
        "Finished runs and the checkpoint of the interrupted one are in {out}; run the same "
        "command again to resume."))
