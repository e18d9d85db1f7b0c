"""Rebuild a trained model from its run folder (``effattn train --out DIR``).

>>> from effattn.tools.runs import load_run
>>> from effattn.tools.train import evaluate
>>> run = load_run("runs/charlm-softmax")          # config, task, model with its weights
>>> evaluate(run.model, run.task, "test", run.device)["bpc"]

The model is built as the training loop builds it (:func:`effattn.tools.train.build_model`) and
loads the checkpoint strictly: every key must match, so a folder of another effattn or a
damaged checkpoint is an error rather than a half-loaded model. To switch a loaded model to
another method, see :func:`effattn.convert.linearize`; to fine-tune it,
``effattn train --init-from DIR``. A run fine-tuned with LoRA (``lora_rank`` > 0) comes back with
its adapters (frozen weights, trainable adapters, as it trained); :func:`effattn.convert.merge_lora`
folds them into plain weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from effattn.convert import lora
from effattn.tools.checkpoints import load_checkpoint
from effattn.tools.tasks.data import Task, make_task
from effattn.tools.train import CHECKPOINT, TrainConfig, build_model

__all__ = ["LoadedRun", "load_run"]


@dataclass
class LoadedRun:
    """A run's configuration, its task (data), its model at the checkpoint's step (eval mode)
    and that step."""

    config: TrainConfig
    task: Task
    model: nn.Module
    step: int
    device: torch.device


def load_run(run_dir: str | Path, *, device: str = "cpu", data_dir: str | Path | None = None,
             trust_checkpoint: bool = False) -> LoadedRun:
    """The model of the run in ``run_dir``, rebuilt and loaded from its ``checkpoint.pt``.

    ``data_dir``: where the task's generated data is cached (default ``run_dir/data``; the
    character corpus is read from the Python installation either way). ``ValueError`` when the
    folder holds no checkpoint or one this effattn cannot rebuild, and when the checkpoint is
    not data alone (:mod:`effattn.tools.checkpoints`; ``trust_checkpoint=True`` loads such a
    file with the full unpickler, which runs any code it holds).
    """
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ValueError(f"run_dir {run_dir}: no {CHECKPOINT} (a folder of effattn train is "
                         "expected)")
    saved = load_checkpoint(path, trust=trust_checkpoint)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(saved["config"]) - fields)
    if unknown:
        raise ValueError(f"{path}: written by another effattn (unknown config fields: "
                         f"{', '.join(unknown)})")
    cfg = TrainConfig(**saved["config"])  # saved resolved: every default filled in
    task = make_task(cfg.task, cfg.seq_len, cfg.seed,
                     data_dir=Path(run_dir) / "data" if data_dir is None else Path(data_dir),
                     **cfg.task_options)
    model = build_model(task, cfg)
    if cfg.lora_rank:
        lora(model, cfg.lora_rank, cfg.lora_alpha)
    try:
        model.load_state_dict(saved["model"])
    except RuntimeError as err:
        raise ValueError(f"{path}: the checkpoint does not fit the model its config builds: "
                         f"{err}") from None
    target = torch.device(device)
    return LoadedRun(cfg, task, model.to(target).eval(), int(saved["step"]), target)
