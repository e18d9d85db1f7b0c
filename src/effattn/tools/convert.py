"""``effattn convert``: a softmax teacher converted to other methods, every stage measured.

Stages, per method (the teacher once):

- ``teacher``: softmax trained on the task (:func:`effattn.tools.train.train`), or an existing
  run folder (``teacher_dir``);
- ``swap``: the teacher's weights in a model with the method (:func:`effattn.convert.linearize`),
  no training;
- ``transfer``: attention transfer of the parameters the method adds
  (:func:`effattn.convert.transfer`) on training batches the teacher never saw, by the MSE of
  the layers' outputs or (``transfer_loss="ce"``) the cross-entropy of their weights; skipped
  for a method that adds none (random or fixed feature maps, a window);
- ``finetune``: trained from there for each of ``finetune_steps`` (a run of
  ``effattn train --init-from``, the task's loop and learning rate), for each kind of
  ``finetune``: ``full`` (every weight) or ``lora`` (rank-``lora_rank`` adapters on the q, k, v
  and output projections alone, :func:`effattn.convert.lora`); its ``steps`` count the
  transfer's too;
- ``scratch``: the method trained from scratch for the teacher's steps plus the conversion's
  longest (transfer + finetune).

Everything lives under ``out``: ``teacher/`` (a run folder), then per method label
``<label>/swap.json``, ``<label>/transfer/`` (``checkpoint.pt`` that the fine-tuning starts from,
``transfer.json``; ``transfer-ce/`` with the weights' loss), ``<label>/finetune-<F>/``
(``finetune-lora-r<R>-<F>/`` with LoRA, ``finetune-ce-...`` after the weights' loss) and
``<label>/scratch/`` (run folders). A stage
whose result exists is not redone, an interrupted training resumes from its checkpoint, and an
interrupted transfer is redone (it is short). The rows of every stage done so far are written
atomically after each one to ``results.json`` (a list of ``{"task", "method", "stage", "steps",
"bpc" | "accuracy"}``, accuracy in %; a LoRA fine-tuning row adds ``"finetune":
"lora:rank=R,alpha=A,lr=LR"``, a row without it fine-tuned every weight; the transfer and
fine-tuning rows after the weights' loss add ``"transfer": "ce"``), ``results.csv``,
``convert.md`` (the table) and ``convert.png`` (score against conversion steps).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from effattn.convert import TRANSFER_LOSSES, linearize, transfer
from effattn.registry import DEFAULT_METHOD
from effattn.tools.bench.results import atomic_write, save_figure, write_csv
from effattn.tools.checkpoints import FORMAT, VERSION, save
from effattn.tools.compare import run_options
from effattn.tools.runs import load_run
from effattn.tools.tasks.data import FRACTION_METRICS, METRIC_NAMES
from effattn.tools.train import (
    CHECKPOINT,
    RESULTS,
    TrainConfig,
    config_diff,
    evaluate,
    label_of,
    train,
    write_json,
)

CSV_FIELDS = ("task", "method", "stage", "steps", "bpc", "accuracy", "finetune", "transfer")

STAGES = ("teacher", "swap", "transfer", "finetune", "scratch")
# What fine-tuning trains: every weight, or LoRA adapters on the attention projections.
FINETUNE_KINDS = ("full", "lora")
# The tasks a conversion is measured on: causal LMs, scored by bits/char or accuracy.
TASKS = ("charlm", "recall", "recall-small")


@dataclass
class ConvertPlan:
    """What ``effattn convert`` runs.

    teacher: the teacher's configuration (its method is softmax), used when ``teacher_dir`` is
        None; otherwise the configuration is the one ``teacher_dir`` was trained with.
    methods: (method, options) pairs; options are those of ``effattn compare`` for the task's
        length, under the given ones.
    finetune_lr: peak learning rate of fine-tuning and scratch (None: the teacher's).
    finetune: the kinds of fine-tuning to run, each for every ``finetune_steps`` count: ``full``
        (every weight) and ``lora`` (adapters of rank ``lora_rank``, scale ``lora_alpha``).
    transfer_loss: ``mse`` (the layers' outputs, LoLCATs) or ``ce`` (their weights, Hedgehog).
    trust_checkpoint: also load a ``teacher_dir`` checkpoint that holds objects other than
        tensors and data, with the full unpickler (:mod:`effattn.tools.checkpoints`).
    """

    teacher: TrainConfig
    methods: Sequence[tuple[str, dict[str, Any]]]
    teacher_dir: Path | None = None
    transfer_steps: int = 75
    transfer_lr: float = 1e-2
    transfer_loss: str = "mse"
    finetune_steps: Sequence[int] = (75,)
    finetune_lr: float | None = None
    stages: Sequence[str] = STAGES
    finetune: Sequence[str] = ("full",)
    lora_rank: int = 8
    lora_alpha: float = 16.0
    trust_checkpoint: bool = False


def _score_key(metric: str) -> str:
    return "accuracy" if metric in FRACTION_METRICS else metric


def _scale(metric: str) -> float:
    return 100.0 if metric in FRACTION_METRICS else 1.0


class _Rows:
    """The result rows, rewritten (JSON, CSV, table, plot) after every stage."""

    def __init__(self, out: Path, task: str, metric: str) -> None:
        self.out, self.task, self.metric = out, task, metric
        self.rows: list[dict[str, Any]] = []

    def add(self, method: str, stage: str, steps: int, score: float,
            extra: dict[str, Any] | None = None) -> None:
        self.rows.append({"task": self.task, "method": method, "stage": stage, "steps": steps,
                          _score_key(self.metric): score * _scale(self.metric), **(extra or {})})
        write_json(self.out / "results.json", self.rows)
        write_csv(self.out / "results.csv", self.rows, CSV_FIELDS)
        atomic_write(self.out / "convert.md", table(self.rows) + "\n")
        plot(self.rows, self.out / "convert.png")


def _say(text: str, echo: bool) -> None:
    if echo:
        print(text, file=sys.stderr, flush=True)


def _cached(path: Path, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The JSON at ``path``, computed and written atomically first when missing."""
    if path.is_file():
        return json.loads(path.read_text())
    result = compute()
    write_json(path, result)
    return result


def _trained(cfg: TrainConfig, run_dir: Path, echo: bool, trust: bool = False
             ) -> dict[str, Any]:
    """The results of training ``cfg`` in ``run_dir`` (resumed or reused when already there)."""
    done = run_dir / RESULTS
    if done.is_file() and (run_dir / CHECKPOINT).is_file():
        results = json.loads(done.read_text())
        if not config_diff(results["config"], dataclasses.asdict(cfg)):
            return results
    results = train(cfg, run_dir, progress=None if echo else False, trust_checkpoint=trust)
    assert results is not None
    return results


def _batches(cfg: TrainConfig, task: Any, start: int) -> Iterator[torch.Tensor]:
    """Training inputs from step ``start`` on (past the teacher's: data it never trained on)."""
    step = start
    while True:
        yield task.train_batch(step, cfg.batch_size)[0].to(cfg.device)
        step += 1


@dataclass
class _Context:
    """What every method's stages share: the teacher's run and the result rows."""

    plan: ConvertPlan
    teacher_dir: Path
    cfg: TrainConfig
    task: Any
    device: torch.device
    rows: _Rows
    echo: bool

    @property
    def key(self) -> str:
        return _score_key(self.task.metric)

    def test_score(self, model: torch.nn.Module) -> dict[str, Any]:
        return {"score": evaluate(model, self.task, "test", self.device)[self.key]}

    def report(self, label: str, stage: str, steps: int, score: float, how: str = "",
               extra: dict[str, Any] | None = None) -> None:
        self.rows.add(label, stage, steps, score, extra)
        _say(f"{label}: {stage}{how} ({steps} steps) test {self.key} "
             f"{score * _scale(self.task.metric):.3f}", self.echo)


def convert(plan: ConvertPlan, out: str | Path, *, echo: bool = True) -> list[dict[str, Any]]:
    """Run ``plan`` in ``out`` and return the result rows (see the module docstring)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = [s for s in plan.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {', '.join(unknown)}; valid: {', '.join(STAGES)}")
    unknown = [k for k in plan.finetune if k not in FINETUNE_KINDS]
    if unknown or not plan.finetune:
        raise ValueError(f"finetune: got {list(plan.finetune)}; valid kinds: "
                         f"{', '.join(FINETUNE_KINDS)}")
    if plan.transfer_loss not in TRANSFER_LOSSES:
        raise ValueError(f"transfer_loss: got {plan.transfer_loss!r}; valid: "
                         f"{', '.join(TRANSFER_LOSSES)}")
    teacher_dir = out / "teacher" if plan.teacher_dir is None else Path(plan.teacher_dir)
    if plan.teacher_dir is None:
        _say(f"teacher: {DEFAULT_METHOD}, {plan.teacher.resolved().steps} steps", echo)
        _trained(plan.teacher.resolved(), teacher_dir, echo)
    loaded = load_run(teacher_dir, device=plan.teacher.device,
                      trust_checkpoint=plan.trust_checkpoint)
    cfg = loaded.config
    if cfg.task not in TASKS:
        raise ValueError(f"the teacher's task is {cfg.task}; convert measures {', '.join(TASKS)}")
    if cfg.method != DEFAULT_METHOD:
        raise ValueError(f"the teacher {teacher_dir} was trained with {cfg.method}; convert "
                         f"starts from {DEFAULT_METHOD}")
    ctx = _Context(plan, teacher_dir, cfg, loaded.task, loaded.device,
                   _Rows(out, cfg.task, loaded.task.metric), echo)
    teacher = _cached(out / "teacher.json", lambda: ctx.test_score(loaded.model))["score"]
    if "teacher" in plan.stages:
        ctx.report(DEFAULT_METHOD, "teacher", cfg.steps, teacher)
    for method, options in plan.methods:
        _convert_method(ctx, out, method, run_options(method, options, cfg))
    return ctx.rows.rows


def _convert_method(ctx: _Context, out: Path, method: str, options: dict[str, Any]) -> None:
    """The stages of one method (see the module docstring)."""
    plan, cfg = ctx.plan, ctx.cfg
    label = label_of(method, options)
    folder = out / label
    folder.mkdir(exist_ok=True)
    model = load_run(ctx.teacher_dir, device=cfg.device,
                     trust_checkpoint=ctx.plan.trust_checkpoint).model
    new = linearize(model, method, seed=cfg.seed, **options)
    if "swap" in plan.stages:
        swapped = _cached(folder / "swap.json", lambda: ctx.test_score(model))["score"]
        ctx.report(label, "swap", 0, swapped)
    transferred = bool(new) and plan.transfer_steps > 0
    spent = plan.transfer_steps if transferred else 0
    start_from = ctx.teacher_dir
    # The weights' loss is another transfer, and the fine-tuning from it another run.
    ce = transferred and plan.transfer_loss == "ce"
    suffix, marked = ("-ce", {"transfer": "ce"}) if ce else ("", {})
    if transferred and ("transfer" in plan.stages or "finetune" in plan.stages):
        start_from = folder / f"transfer{suffix}"
        if not (start_from / CHECKPOINT).is_file():
            (start_from / "transfer.json").unlink(missing_ok=True)
        done = _cached(start_from / "transfer.json",
                       lambda: _transfer(ctx, model, new, method, options, start_from))
        if "transfer" in plan.stages:
            ctx.report(label, "transfer", spent, done["score"],
                       f" (loss {done['losses'][0]:.4g} -> {done['losses'][-1]:.4g})",
                       marked or None)
    tuned = cfg if plan.finetune_lr is None else dataclasses.replace(cfg, lr=plan.finetune_lr)
    if "finetune" in plan.stages:
        for kind in plan.finetune:
            rank = plan.lora_rank if kind == "lora" else 0
            name = f"finetune{suffix}-lora-r{rank}" if rank else f"finetune{suffix}"
            extra = {"finetune": lora_label(rank, plan.lora_alpha, tuned.lr)} if rank else {}
            extra = {**extra, **marked} or None
            for steps in plan.finetune_steps:
                ft = dataclasses.replace(tuned, method=method, options=options, steps=steps,
                                         init_from=str(start_from), eval_every=0,
                                         lora_rank=rank, lora_alpha=plan.lora_alpha)
                score = _trained(ft, folder / f"{name}-{steps}", ctx.echo,
                                 plan.trust_checkpoint)["score"]
                ctx.report(label, "finetune", spent + steps, score, f" {kind}", extra)
    if "scratch" in plan.stages:
        total = cfg.steps + spent + max(plan.finetune_steps, default=0)
        scratch = dataclasses.replace(tuned, method=method, options=options, steps=total,
                                      init_from=None, eval_every=0)
        ctx.report(label, "scratch", total,
                   _trained(scratch, folder / "scratch", ctx.echo)["score"])


def _transfer(ctx: _Context, model: torch.nn.Module, new: dict[str, torch.nn.Parameter],
              method: str, options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Attention transfer of ``new`` in ``model``, saved as a checkpoint in ``folder`` that
    ``--init-from`` reads; its test score, losses and the parameters it trained."""
    plan, cfg = ctx.plan, ctx.cfg
    losses = transfer(model, _batches(cfg, ctx.task, cfg.steps), steps=plan.transfer_steps,
                      parameters=new, lr=plan.transfer_lr, loss=plan.transfer_loss)
    config = dataclasses.replace(cfg, method=method, options=options,
                                 steps=plan.transfer_steps, init_from=str(ctx.teacher_dir))
    state = {"format": FORMAT, "version": VERSION, "config": dataclasses.asdict(config),
             "model": model.state_dict(), "step": plan.transfer_steps}
    folder.mkdir(exist_ok=True)
    save(folder / CHECKPOINT, state)
    return {**ctx.test_score(model), "losses": losses, "new": list(new)}




def lora_label(rank: int, alpha: float, lr: float) -> str:
    """The ``finetune`` field of a LoRA fine-tuning row, with its peak learning rate (adapters
    often want another than the full model's): ``lora:rank=8,alpha=16,lr=0.005``."""
    return f"lora:rank={rank},alpha={alpha:g},lr={lr:g}"


def _name(row: dict[str, Any]) -> str:
    """A row's line in the table and the plot: its method, marked when its transfer matched the
    weights (``"transfer": "ce"``)."""
    return row["method"] + (f" (transfer {row['transfer']})" if row.get("transfer") else "")


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: one line per method, one column per stage (fine-tuning per
    step count and kind), each score with its change against the teacher's."""
    if not rows:
        return "(no results yet)"
    key = "accuracy" if "accuracy" in rows[0] else "bpc"
    teacher = next((r[key] for r in rows if r["stage"] == "teacher"), None)
    transferred = {_name(r): r["steps"] for r in rows if r["stage"] == "transfer"}

    def finetuned(r: dict[str, Any]) -> int:
        """The fine-tuning steps of a finetune row (its ``steps`` count the transfer's too)."""
        return r["steps"] - transferred.get(_name(r), 0)

    columns: list[tuple[str, int | None, str]] = [("swap", None, ""), ("transfer", None, "")]
    columns += sorted({("finetune", finetuned(r), r.get("finetune", ""))
                       for r in rows if r["stage"] == "finetune"}, key=lambda c: (c[2], c[1]))
    columns.append(("scratch", None, ""))

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        value = f"{r[key]:.2f}%" if key == "accuracy" else f"{r[key]:.3f}"
        if teacher is None:
            return value
        change = (f"{r[key] - teacher:+.1f} pt" if key == "accuracy"
                  else f"{100.0 * (r[key] / teacher - 1.0):+.1f}%")
        return f"{value} ({change}) @{r['steps']}"

    head = ["method", *(f"{s}" if n is None else f"{s}{' ' + k if k else ''} (+{n})"
                        for s, n, k in columns)]
    lines = [f"{METRIC_NAMES.get(key, key)} on {rows[0]['task']}; teacher "
             + ("-" if teacher is None else (f"{teacher:.2f}%" if key == "accuracy"
                                             else f"{teacher:.3f}"))
             + "; each cell: score (change against the teacher) @ steps", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    methods = list(dict.fromkeys(_name(r) for r in rows if r["stage"] != "teacher"))
    for method in methods:
        mine = [r for r in rows if _name(r) == method]
        cells = []
        for stage, n, kind in columns:
            found = [r for r in mine if r["stage"] == stage]
            if n is not None:
                found = [r for r in found
                         if finetuned(r) == n and r.get("finetune", "") == kind]
            cells.append(cell(found[0] if found else None))
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Score against conversion steps per method (swap, transfer, fine-tuning), the teacher and
    each method's from-scratch score as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "accuracy" if "accuracy" in rows[0] else "bpc"
    fig, ax = plt.subplots(figsize=(8, 5))
    teacher = next((r for r in rows if r["stage"] == "teacher"), None)
    if teacher is not None:
        ax.axhline(teacher[key], color="black", lw=1.5, label=f"teacher ({teacher['steps']} steps)")
    methods = list(dict.fromkeys(_name(r) for r in rows if r["stage"] != "teacher"))
    for i, method in enumerate(methods):
        color = f"C{i % 10}"
        mine = [r for r in rows if _name(r) == method]
        start = [r for r in mine if r["stage"] in ("swap", "transfer")]
        kinds = dict.fromkeys(r.get("finetune", "") for r in mine if r["stage"] == "finetune")
        for kind in kinds or [""]:
            curve = sorted((r["steps"], r[key]) for r in start + [
                r for r in mine if r["stage"] == "finetune" and r.get("finetune", "") == kind])
            if curve:
                ax.plot(*zip(*curve, strict=True), marker="o", color=color,
                        ls="--" if kind else "-", label=f"{method} {kind}".strip())
        for r in mine:
            if r["stage"] == "scratch":
                ax.axhline(r[key], color=color, ls=":", lw=1)
    ax.set_xlabel("conversion steps (transfer + fine-tuning)")
    ax.set_ylabel(METRIC_NAMES.get(key, key) + (" (%)" if key == "accuracy" else
                                                " (lower is better)"))
    ax.set_title(f"{rows[0]['task']}: converted from softmax (dashed: LoRA fine-tuning; "
                 "dotted: the method from scratch)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
