"""``effattn convert``: train (or load) a softmax teacher, convert it to each method, measure every
stage (see :mod:`effattn.tools.convert`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from effattn.cli.common import (
    TRUST_HELP,
    check_method,
    device_or_auto,
    int_list,
    nonnegative_int,
    parse_entry,
    positive_float,
    positive_int,
    prepare_out,
    user_input,
)
from effattn.convert import TRANSFER_LOSSES
from effattn.registry import DEFAULT_METHOD
from effattn.tools.compare import run_options
from effattn.tools.convert import FINETUNE_KINDS, STAGES, TASKS, ConvertPlan, convert, table
from effattn.tools.train import MODEL_DEFAULTS, TASK_DEFAULTS, TrainConfig, applicability


def _stages(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in STAGES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"stages must be a comma list of {', '.join(STAGES)}")
    return [s for s in STAGES if s in names]


def _kinds(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in FINETUNE_KINDS for n in names):
        raise argparse.ArgumentTypeError(
            f"finetune must be a comma list of {', '.join(FINETUNE_KINDS)}")
    return list(dict.fromkeys(names))


def _run(args: argparse.Namespace) -> int:
    with user_input():
        teacher = TrainConfig(task=args.task, method=DEFAULT_METHOD, steps=args.teacher_steps,
                              batch_size=args.batch_size, lr=args.lr, d_model=args.d_model,
                              layers=args.layers, heads=args.heads, seq_len=args.seq_len,
                              seed=args.seed, device=args.device,
                              eval_every=args.eval_every).resolved()
        if args.teacher is not None and not (Path(args.teacher) / "checkpoint.pt").is_file():
            raise ValueError(f"--teacher {args.teacher}: no checkpoint.pt (a run folder of "
                             "effattn train is expected)")
        methods = [parse_entry(entry) for entry in args.methods]
        for method, options in methods:
            reason = applicability(args.task, method, options)
            if reason is not None:
                raise ValueError(f"{method} cannot run {args.task}: {reason}")
            check_method(method, run_options(method, options, teacher),
                         head_dim=teacher.d_model // teacher.heads, heads=teacher.heads,
                         max_len=teacher.seq_len)
        plan = ConvertPlan(teacher=teacher, methods=methods,
                           teacher_dir=None if args.teacher is None else Path(args.teacher),
                           transfer_steps=args.transfer_steps, transfer_lr=args.transfer_lr,
                           transfer_loss=args.transfer_loss,
                           finetune_steps=args.finetune_steps, finetune_lr=args.lr,
                           stages=args.stages, finetune=args.finetune,
                           lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                           trust_checkpoint=args.trust_checkpoint)
    args.out = prepare_out(Path(args.out or f"runs/convert-{args.task}"))
    with user_input():
        rows = convert(plan, args.out)
    print(table(rows))
    print(f"\nwritten: {args.out / 'results.json'}, results.csv, convert.md, convert.png")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    defaults = ", ".join(f"{t}: {TASK_DEFAULTS[t]['steps']} steps, length "
                         f"{TASK_DEFAULTS[t]['seq_len']}, lr {TASK_DEFAULTS[t]['lr']}"
                         for t in TASKS)
    p = sub.add_parser(
        "convert", help="convert a trained softmax model to other methods, measured by stage",
        description="Train (or load with --teacher) a softmax teacher, switch it to each method "
        "keeping its weights, train the new parameters by attention transfer, fine-tune every "
        "weight, and compare with the method trained from scratch for the same total steps. "
        "Stages: teacher, swap (no training), transfer, finetune, scratch. Resumable: run the "
        "same command again.")
    p.add_argument("--methods", nargs="+", required=True, metavar="METHOD",
                   help="methods to convert to, with options as name:key=value,key=value "
                   "(effattn compare's options for the length under them)")
    p.add_argument("--task", choices=TASKS, default="charlm", help="task (default charlm)")
    p.add_argument("--teacher", metavar="DIR",
                   help="an effattn train run folder of softmax to convert, whose configuration "
                   "(task, model size, seed, lr) the other stages take; the budget options below "
                   "then only apply to --lr (default: train a teacher in OUT/teacher)")
    p.add_argument("--trust-checkpoint", action="store_true", help=f"for --teacher: {TRUST_HELP}")
    p.add_argument("--teacher-steps", type=positive_int,
                   help=f"steps of the teacher's training (task default; {defaults})")
    p.add_argument("--transfer-steps", type=nonnegative_int, default=75,
                   help="attention-transfer steps of the new parameters (default 75; 0 skips)")
    p.add_argument("--transfer-lr", type=positive_float, default=1e-2,
                   help="Adam step size of attention transfer (default 1e-2)")
    p.add_argument("--transfer-loss", choices=TRANSFER_LOSSES, default="mse",
                   help="what attention transfer matches: mse, the layers' outputs (LoLCATs), or "
                   "ce, the cross-entropy of their attention weights (Hedgehog; N x N per layer) "
                   "(default mse)")
    p.add_argument("--finetune-steps", type=int_list, default=[75], metavar="N[,N...]",
                   help="fine-tuning steps of every weight after the transfer, one run per "
                   "count (default 75)")
    p.add_argument("--finetune", type=_kinds, default=["full"], metavar="KIND[,KIND]",
                   help="what fine-tuning trains: full (every weight) or lora (low-rank "
                   "adapters on the attention's q, k, v and output projections, every other "
                   "weight frozen); both: full,lora (default full)")
    p.add_argument("--lora-rank", type=positive_int, default=8,
                   help="rank of the LoRA adapters (default 8)")
    p.add_argument("--lora-alpha", type=positive_float, default=16.0,
                   help="LoRA's scale: the update is (alpha / rank) B A (default 16)")
    p.add_argument("--stages", type=_stages, default=list(STAGES), metavar="STAGE[,STAGE...]",
                   help=f"stages to run (default all: {','.join(STAGES)})")
    p.add_argument("--lr", type=float,
                   help="peak learning rate of the teacher, fine-tuning and scratch (default: the "
                   "task's, or --teacher's)")
    p.add_argument("--batch-size", type=int,
                   help=f"examples per step (task default; {MODEL_DEFAULTS['batch_size']} but "
                   f"recall: {TASK_DEFAULTS['recall']['batch_size']})")
    p.add_argument("--d-model", type=int, default=MODEL_DEFAULTS["d_model"])
    p.add_argument("--layers", type=int, default=MODEL_DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=MODEL_DEFAULTS["heads"])
    p.add_argument("--seq-len", type=int, help="sequence length (task default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0,
                   help="validation every N steps of the teacher's training (0: only at the end)")
    p.add_argument("--device", type=device_or_auto, default="auto",
                   help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--out", help="output folder (default runs/convert-<task>)")
    p.set_defaults(func=_run, on_interrupt=(
        "Finished stages and the checkpoint of the interrupted training are in {out}; run the "
        "same command again to resume."))
