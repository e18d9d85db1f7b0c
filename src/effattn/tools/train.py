"""The training loop: one method, one task, resumable, reproducible.

A run lives in its own directory:

- ``checkpoint.pt``: model, optimizer, step, RNG states (torch, Python, and the generators that
  methods keep for redrawing random features), training time; written
  atomically (temporary file + ``os.replace``) every ``checkpoint_every`` steps and at the end.
- ``train.log``: human-readable log; ``log.jsonl``: one JSON record per logged step or evaluation.
- ``results.json``: configuration, capabilities, held-out metrics, speed and memory; atomic.

A run may start from another run's checkpoint (``init_from``, ``effattn train --init-from``),
with another method: every weight of the same name is loaded and the report names the new ones.
With ``lora_rank`` > 0 such a run trains low-rank adapters on the attention projections alone
(:func:`effattn.convert.lora`), every loaded weight frozen; the checkpoint holds the adapters
beside the frozen weights.

Re-running with the same configuration resumes from the checkpoint; since every batch is a
function of (seed, step) and the RNG states are restored, the result equals an uninterrupted run.

Under torchrun the run is split over the processes, by examples (data parallel) or by positions
of each sequence (sequence parallel), and equals the one-process run up to rounding: see
:mod:`effattn.distributed.training` and docs/distributed.md. Rank 0 alone writes the files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from effattn.convert import lora
from effattn.distributed import SequenceParallel
from effattn.distributed.training import World
from effattn.nn import DecoderLM, EncoderClassifier, EncoderDecoder, generate
from effattn.registry import DEFAULT_METHOD, build, spec
from effattn.tools.checkpoints import FORMAT, VERSION, load_checkpoint, save
from effattn.tools.tasks.data import (
    TASK_KINDS,
    TASKS,
    Task,
    decoder_inputs,
    make_task,
    score,
    stream_seed,
)
from effattn.tools.tasks.synthetic import IGNORE

# Defaults of `effattn train` and `effattn compare`: tiny models, short sequences, so that a
# comparison of ~15 methods on one task runs in about ten minutes on two CPU cores. LRA trains
# 4-6 layer models of width 256-512 on 2K-4K tokens for 5K-250K steps: these are far smaller.
MODEL_DEFAULTS = {"d_model": 64, "layers": 2, "heads": 4, "batch_size": 16}
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "listops": {"seq_len": 256, "steps": 500, "lr": 2e-3},
    "charlm": {"seq_len": 256, "steps": 500, "lr": 5e-3},
    # MQAR with 8 pairs: softmax forms its recall circuit after 500-750 steps of batch 64 at
    # lr 0.003; at batch 16 it had not after 3000 (docs/training.md).
    "recall": {"seq_len": 64, "steps": 1500, "lr": 3e-3, "batch_size": 64},
    "recall-small": {"seq_len": 64, "steps": 3000, "lr": 2e-3},
    "copy": {"seq_len": 64, "steps": 600, "lr": 2e-3},
    "reverse": {"seq_len": 32, "steps": 600, "lr": 2e-3},
}
# What a method must be able to do for a task; listops needs nothing but refuses causal-only
# call inputs, a gate (below).
# Reverse is scored by greedy decoding, which runs through the decoder's recurrent `step`.
TASK_NEEDS: dict[str, tuple[str, ...]] = {
    "listops": (), "charlm": ("causal",), "recall": ("causal",), "recall-small": ("causal",),
    "copy": ("causal",),
    "reverse": ("causal", "cross", "decoding"),
}
_NEED_WORDS = {"causal": "no causal form", "cross": "cannot cross-attend",
               "decoding": "no recurrent decoding"}
CHECKPOINT = "checkpoint.pt"
RESULTS = "results.json"
# Fields of the configuration that may change between a run and its resumption.
RESUMABLE_CHANGES = ("device", "checkpoint_every", "eval_every")


@dataclass
class TrainConfig:
    """Everything that defines a run. ``None`` fields take the task's defaults."""

    task: str = "listops"
    method: str = DEFAULT_METHOD
    options: dict[str, Any] = field(default_factory=dict)
    task_options: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    d_model: int = MODEL_DEFAULTS["d_model"]
    layers: int = MODEL_DEFAULTS["layers"]
    heads: int = MODEL_DEFAULTS["heads"]
    seq_len: int | None = None
    seed: int = 0
    dropout: float = 0.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    eval_every: int = 0
    device: str = "cpu"
    init_from: str | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0

    def resolved(self) -> TrainConfig:
        """A copy with the task defaults filled in and every field checked."""
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; valid tasks: {', '.join(TASKS)}")
        spec(self.method)
        defaults = {"batch_size": MODEL_DEFAULTS["batch_size"], **TASK_DEFAULTS[self.task]}
        filled = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        cfg = dataclasses.replace(self, options=dict(self.options),
                                  task_options=dict(self.task_options), **filled)
        for name in ("steps", "batch_size", "d_model", "layers", "heads", "seq_len",
                     "checkpoint_every"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(cfg.eval_every, bool) or not isinstance(cfg.eval_every, int) \
                or cfg.eval_every < 0:
            raise ValueError(f"eval_every must be an int >= 0, got {cfg.eval_every!r}")
        if not (isinstance(cfg.lr, (int, float)) and cfg.lr > 0):
            raise ValueError(f"lr must be a positive number, got {cfg.lr!r}")
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by heads={cfg.heads}")
        if cfg.d_model % 2:
            raise ValueError(f"d_model must be even (sinusoidal positions), got {cfg.d_model}")
        if cfg.init_from is not None and not (Path(cfg.init_from) / CHECKPOINT).is_file():
            raise ValueError(f"init_from {cfg.init_from}: no {CHECKPOINT} there (a run folder of "
                             "effattn train is expected)")
        if isinstance(cfg.lora_rank, bool) or not isinstance(cfg.lora_rank, int) \
                or cfg.lora_rank < 0:
            raise ValueError(f"lora_rank must be an int >= 0, got {cfg.lora_rank!r}")
        if not (isinstance(cfg.lora_alpha, (int, float)) and cfg.lora_alpha > 0):
            raise ValueError(f"lora_alpha must be a positive number, got {cfg.lora_alpha!r}")
        if cfg.lora_rank and cfg.init_from is None:
            raise ValueError(f"lora_rank={cfg.lora_rank} adapts trained weights: it needs "
                             "init_from (adapters on a freshly initialised model would leave it "
                             "untrained)")
        return cfg


def applicability(task: str, method: str, options: dict[str, Any] | None = None) -> str | None:
    """Why ``method`` cannot run ``task`` (the spec's reason), or None when it can."""
    method_spec = spec(method)
    causal_inputs = [c.name for c in method_spec.required_inputs(options or {}) if c.causal_only]
    if "causal" not in TASK_NEEDS[task] and causal_inputs:
        return (f"the call input {', '.join(causal_inputs)} is defined for causal self-attention "
                f"only; {task} has no causal model")
    for need in TASK_NEEDS[task]:
        if not getattr(method_spec, need):
            return f"{_NEED_WORDS[need]}: {method_spec.refusals[need]}"
    return None


def build_model(task: Task, cfg: TrainConfig) -> nn.Module:
    """The model for ``task`` (classifier, causal LM or encoder-decoder) with ``cfg``'s method
    and size."""
    common = {"d_model": cfg.d_model, "num_heads": cfg.heads, "num_layers": cfg.layers,
              "method": cfg.method, "dropout": cfg.dropout,
              "max_len": task.seq_len if task.model_len is None else task.model_len,
              "seed": cfg.seed, **cfg.options}
    if task.kind == "classify":
        return EncoderClassifier(task.vocab_size, task.num_classes, **common)
    if task.kind == "seq2seq":
        return EncoderDecoder(task.vocab_size, task.vocab_size, **common)
    return DecoderLM(task.vocab_size, **common)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over min(100, steps/10) steps, then cosine decay to lr/10."""
    warmup = max(1, min(100, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def predict(model: nn.Module, task: Task, inputs: torch.Tensor, targets: torch.Tensor,
            offset: int = 0) -> torch.Tensor:
    """The model's logits for a batch; a seq2seq decoder reads the targets (teacher forcing).
    ``offset``: the position of the inputs' first token (a causal LM's slice of sequences)."""
    if task.kind == "seq2seq":
        return model(inputs, decoder_inputs(task, targets))
    if task.kind == "lm":
        return model(inputs, offset=offset)
    return model(inputs)


def loss_and_counts(task: Task, logits: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, int, int]:
    """Summed cross-entropy, correct predictions and the number of scored targets."""
    if task.kind != "classify":
        logits, targets = logits.flatten(0, 1), targets.flatten()
    keep = targets != IGNORE
    loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
    correct = int((logits.argmax(-1)[keep] == targets[keep]).sum())
    return loss, correct, int(keep.sum())


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def greedy_scores(model: nn.Module, task: Task, sources: torch.Tensor, targets: torch.Tensor,
                  device: torch.device, batch_size: int = 64) -> dict[str, float]:
    """Greedy decoding of ``sources`` from BOS (seq2seq), scored against ``targets``.

    exact_match: fraction of examples whose every target token, EOS included, is decoded right;
    token_accuracy: fraction of target tokens decoded right at their position (once the model
    has gone wrong it continues from its own tokens, unlike teacher forcing); tokens_per_s: decoded
    tokens per second, encoding the source included. Every example is decoded for the full
    width of ``targets`` (no early stop at EOS), so the work is the same for every method.
    """
    exact, correct, seconds = 0, 0, 0.0
    with _eval_mode(model):
        for i in range(0, len(sources), batch_size):
            src = sources[i:i + batch_size].to(device)
            tgt = targets[i:i + batch_size].to(device)
            t0 = time.perf_counter()
            out = generate(model, src.new_full((len(src), 1), task.bos_id), tgt.shape[1],
                           src=src)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds += time.perf_counter() - t0
            scored = tgt != IGNORE
            right = (out[:, 1:] == tgt) | ~scored
            exact += int(right.all(1).sum())
            correct += int((right & scored).sum())
    return {"exact_match": exact / len(sources),
            "token_accuracy": correct / int((targets != IGNORE).sum()),
            "tokens_per_s": targets.numel() / max(seconds, 1e-9)}


def evaluate(model: nn.Module, task: Task, split: str, device: torch.device,
             batch_size: int = 64, world: World | None = None) -> dict[str, float]:
    """Metrics of ``model`` on the held-out ``split`` (eval mode, restored afterwards): loss and
    accuracy with teacher forcing, and for seq2seq the exact match of greedy decoding.

    ``world``: sequence parallel, each rank scores its slice of every sequence and the sums
    are added over the ranks; otherwise every rank scores the whole split (data parallel: the
    same model everywhere, so the same metrics)."""
    world = World() if world is None else world
    inputs, targets = task.eval_sets[split]
    total, correct, count = 0.0, 0, 0
    with _eval_mode(model):
        for i in range(0, len(inputs), batch_size):
            x, y, offset = world.sequence_part(inputs[i:i + batch_size],
                                               targets[i:i + batch_size])
            x, y = x.to(device), y.to(device)
            loss, c, n = loss_and_counts(task, predict(model, task, x, y, offset), y)
            total += float(loss)
            correct += c
            count += n
    if world.mode == "sequence":
        sums = world.sum(torch.tensor([total, correct, count], dtype=torch.float64,
                                      device=device))
        total, correct, count = float(sums[0]), int(sums[1]), int(sums[2])
    metrics = score(task, total, correct, count)
    if task.kind == "seq2seq":
        metrics["exact_match"] = greedy_scores(model, task, inputs, targets, device,
                                               batch_size)["exact_match"]
    return metrics


def decoding_at_length(model: nn.Module, task: Task, device: torch.device
                       ) -> dict[str, dict[str, Any]]:
    """Greedy decoding (:func:`greedy_scores`) of the test set, at the training lengths, and of
    the task's length sets, longer ones included: beyond the training lengths a model meets
    positions it never saw, and the scores say how far it generalises."""
    out = {}
    for name, (sources, targets) in {"test": task.eval_sets["test"],
                                     **task.length_sets}.items():
        lengths = (targets != IGNORE).sum(1) - 1  # without EOS
        out[name] = {"min_len": int(lengths.min()), "max_len": int(lengths.max()),
                     "examples": len(sources),
                     **greedy_scores(model, task, sources, targets, device)}
    return out


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (never a half-written file, even if killed)."""
    _atomic_write(Path(path), lambda p: p.write_text(json.dumps(obj, indent=2) + "\n"))


class _PeakMemory:
    """Peak memory of the training loop: CUDA allocator peak, or on CPU the peak resident set
    (VmHWM, reset at the start through /proc/self/clear_refs) minus the resident set then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss_increase"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = 0
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                self.kind = "cpu_maxrss_increase"
            self.base = self._rss()

    @staticmethod
    def _status(field_name: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def _rss(self) -> int:
        rss = self._status("VmRSS")
        if rss is None:
            scale = 1 if sys.platform == "darwin" else 1024
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        return rss

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = self._status("VmHWM") if self.kind == "cpu_peak_rss_increase" else None
        if peak is None:
            scale = 1 if sys.platform == "darwin" else 1024
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        return max(0, peak - self.base)


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fields (but ``RESUMABLE_CHANGES``) where a saved configuration differs from the
    current one; a field the saved one lacks (written before the field existed) has its
    default."""
    saved = {**dataclasses.asdict(TrainConfig()), **saved}
    return [f"{k}: checkpoint {saved.get(k)!r} != now {current.get(k)!r}"
            for k in sorted(set(saved) | set(current))
            if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k)]


def _log(out: Path, record: dict[str, Any], text: str, echo: bool) -> None:
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    with open(out / "train.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
    if echo:
        tqdm.write(text, file=sys.stderr)


@dataclass
class _Run:
    """A run ready to train: its model and optimizer, restored from ``saved`` if resuming."""

    cfg: TrainConfig
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    saved: dict[str, Any] | None
    init: dict[str, Any] | None


def _prepare(config: TrainConfig, out: Path, resume: bool | None, data_dir: str | Path | None,
             world: World, trust_checkpoint: bool) -> _Run:
    """Check the configuration against ``out``'s checkpoint, make the task and the model."""
    cfg = config.resolved()
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT
    saved = None
    if ckpt_path.exists():
        if resume is False:
            raise ValueError(f"{ckpt_path} exists; use another output directory or resume")
        saved = load_checkpoint(ckpt_path, trust=trust_checkpoint)
        if "hidden" in saved:
            # Such checkpoints kept the modules' random state beside the model's state_dict,
            # which now carries it: their model state lacks it, so they cannot resume exactly.
            raise ValueError(f"{ckpt_path} was written by an older effattn (random state "
                             "outside the model's state_dict); use another output directory")
        diff = config_diff(saved["config"], dataclasses.asdict(cfg))
        if diff:
            raise ValueError(f"{ckpt_path} was written by a different configuration ("
                             + "; ".join(diff) + "); use another output directory")
    elif resume:
        raise ValueError(f"--resume given but {ckpt_path} does not exist")
    reason = applicability(cfg.task, cfg.method, cfg.options)
    if reason is not None:
        raise ValueError(f"{cfg.method} cannot run task {cfg.task}: {reason}")
    check_parallel(cfg, world)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device.type == "cuda" and world.distributed:
        device = torch.device("cuda", world.local_rank)

    task = make_task(cfg.task, cfg.seq_len, cfg.seed,
                     data_dir=out / "data" if data_dir is None else Path(data_dir),
                     **cfg.task_options)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = build_model(task, cfg).to(device)
    init = None
    if saved is None and cfg.init_from is not None:
        init = initialize_from(model, cfg, trust_checkpoint=trust_checkpoint)
    if cfg.lora_rank:
        # After the trained weights are in (their names change under the adapters), before a
        # checkpoint of this run is loaded (it holds the adapters).
        lora(model, cfg.lora_rank, cfg.lora_alpha)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in trained if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["python_rng"])
        if device.type == "cuda" and saved.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"], device)
        init = saved.get("init")
    return _Run(cfg, task, model, optimizer, device, saved, init)


def initialize_from(model: nn.Module, cfg: TrainConfig, *,
                    trust_checkpoint: bool = False) -> dict[str, Any]:
    """Load into ``model`` every weight of ``cfg.init_from``'s checkpoint that it has under the
    same name (another method's run: the projections, embeddings, norms and output layer); the
    report names the new weights (the new method's own) and the unused ones (the old method's).

    ``ValueError`` when the checkpoint's task differs or a weight of the same name has another
    shape (another model size), naming them."""
    path = Path(cfg.init_from) / CHECKPOINT
    source = load_checkpoint(path, trust=trust_checkpoint)
    if source["config"]["task"] != cfg.task:
        raise ValueError(f"init_from {cfg.init_from}: a run of task {source['config']['task']}, "
                         f"not {cfg.task}")
    if source["config"].get("lora_rank"):
        raise ValueError(f"init_from {cfg.init_from}: a run with LoRA adapters, whose weights "
                         "are not under their plain names; rebuild it with "
                         "effattn.tools.runs.load_run, fold them with effattn.convert.merge_lora "
                         "and save that model's state_dict as a run folder's checkpoint")
    own = model.state_dict()
    state = source["model"]
    # Entries that are not tensors (a generator's state) have no shape to disagree on.
    mismatched = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in own.items()
                  if isinstance(v, torch.Tensor) and k in state and state[k].shape != v.shape]
    if mismatched:
        raise ValueError(f"init_from {cfg.init_from}: weights of another shape (checkpoint != "
                         "this run; same --d-model, --layers, --heads needed): "
                         + "; ".join(mismatched))
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return {"from": str(cfg.init_from), "method": source["config"]["method"],
            "step": source.get("step"), "loaded": sum(k in state for k in own),
            "new": [k for k in own if k not in state], "unused": [k for k in state if k not in own]}


def check_parallel(cfg: TrainConfig, world: World) -> None:
    """ValueError, before any work, when ``cfg`` cannot be split over ``world``'s processes:
    data parallel needs their number P to divide the batch; sequence parallel a task of
    :class:`~effattn.nn.DecoderLM`, a method that SequenceParallel splits, and N >= P."""
    if world.mode == "data" and cfg.batch_size % world.size:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the {world.size} "
                         "processes (WORLD_SIZE): each takes batch_size / WORLD_SIZE examples "
                         "of every batch")
    if world.mode != "sequence":
        return
    if TASK_KINDS[cfg.task] != "lm":
        causal = [t for t, kind in TASK_KINDS.items() if kind == "lm"]
        model = {"classify": "an EncoderClassifier", "seq2seq": "an EncoderDecoder"}
        raise ValueError(f"sequence parallel splits the sequences of a DecoderLM (tasks "
                         f"{', '.join(causal)}); {cfg.task} trains {model[TASK_KINDS[cfg.task]]}")
    if cfg.seq_len < world.size:
        raise ValueError(f"seq_len={cfg.seq_len} is shorter than the {world.size} processes "
                         "it is split over (WORLD_SIZE)")
    attn = build(cfg.method, head_dim=cfg.d_model // cfg.heads, heads=cfg.heads,
                 max_len=cfg.seq_len, seed=0, **cfg.options)
    try:
        SequenceParallel(attn)
    except ValueError as err:
        raise ValueError(f"sequence parallel: {err}") from None


def train(
    config: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool | None = None,
    data_dir: str | Path | None = None,
    stop_after: int | None = None,
    progress: bool | None = True,
    world: World | None = None,
    trust_checkpoint: bool = False,
) -> dict[str, Any] | None:
    """Train ``config`` in ``out_dir`` and return the results (also written to results.json).

    resume: None resumes when ``out_dir`` holds a checkpoint; True requires one; False refuses to
        overwrite one. A checkpoint of a different configuration is an error.
    data_dir: where slow-to-generate data sets are cached (default ``out_dir/data``).
    stop_after: stop (as if interrupted) once this many steps are done; returns None.
    progress: progress bar and log lines on stderr; None shows the bar only on a terminal,
        False is silent (the log files are written either way).
    world: the processes of a torchrun launch to split each step over
        (:func:`effattn.distributed.training.launched`; default: this process alone). Every
        rank calls ``train`` with the same arguments and gets the results; rank 0 alone writes
        the checkpoint, logs and results and shows progress. A checkpoint resumes on any
        number of processes, in either mode.
    trust_checkpoint: also load a checkpoint (to resume, or ``init_from``'s) that holds objects
        other than tensors and data, with the full unpickler, which runs any code the file
        holds (:mod:`effattn.tools.checkpoints`); otherwise such a file is a ``ValueError``.
    """
    world = World() if world is None else world
    echo = progress is not False and world.is_main
    out = Path(out_dir)
    ckpt_path = out / CHECKPOINT
    error, run = None, None
    try:
        run = _prepare(config, out, resume, data_dir, world, trust_checkpoint)
    except Exception as err:  # every rank must hear of it before the first collective
        error = err
    world.agree(error)
    assert run is not None
    cfg, task, model, optimizer, device = run.cfg, run.task, run.model, run.optimizer, run.device
    net = world.wrap(model, cfg.seq_len)

    def log(record: dict[str, Any], text: str) -> None:
        if world.is_main:
            _log(out, record, text, echo)

    step, train_time, peak, losses = 0, 0.0, 0, []
    if run.saved is not None:
        step, train_time, peak, losses = (run.saved["step"], run.saved["train_time"],
                                          run.saved["peak_bytes"], run.saved["losses"])
        log({"event": "resume", "step": step}, f"resumed from step {step}")
    elif run.init is not None:
        init = run.init
        log({"event": "init", **init},
            f"initialised from {init['from']} ({init['method']}, step {init['step']}): "
            f"{init['loaded']} weights loaded; new: {', '.join(init['new']) or 'none'}; "
            f"unused: {', '.join(init['unused']) or 'none'}")

    def save_checkpoint() -> None:
        state = {"format": FORMAT, "version": VERSION,
                 "config": dataclasses.asdict(cfg), "model": model.state_dict(),
                 "optimizer": optimizer.state_dict(), "step": step, "train_time": train_time,
                 "peak_bytes": peak, "losses": losses, "torch_rng": torch.get_rng_state(),
                 "python_rng": random.getstate(), "init": run.init,
                 "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        save(ckpt_path, state)

    memory = _PeakMemory(device)
    log_every = max(1, cfg.steps // 20)
    bar = tqdm(total=cfg.steps, initial=step, desc=f"{cfg.task}/{cfg.method}", unit="step",
               disable=None if echo and progress is None else not echo, dynamic_ncols=True)
    model.train()
    while step < cfg.steps:
        if stop_after is not None and step >= stop_after:
            bar.close()
            return None
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        x, y = task.train_batch(step, cfg.batch_size)
        count = int((y != IGNORE).sum())  # of the whole batch: every rank draws all of it
        x, y, offset = world.batch_part(x, y)
        if world.distributed:
            # Dropout: a stream per rank and step, so that a checkpoint resumes on any number
            # of processes (one process keeps the saved generator state instead).
            torch.manual_seed(stream_seed(cfg.seed, "dropout", step, world.rank))
        t0 = time.perf_counter()
        x, y = x.to(device), y.to(device)
        loss = loss_and_counts(task, predict(net, task, x, y, offset), y)[0] / count
        optimizer.zero_grad(set_to_none=True)
        (loss * world.loss_scale).backward()
        world.sum_gradients(model.parameters())
        grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        optimizer.step()
        loss_value = float(world.sum(loss.detach()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{cfg.method}: training loss is {loss_value} at step {step}")
        losses.append(loss_value)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        if step % log_every == 0 or step == cfg.steps:
            recent = losses[-log_every:]
            mean = sum(recent) / len(recent)
            log({"event": "train", "step": step, "loss": mean, "grad_norm": grad_norm,
                 "lr": learning_rate(cfg, step - 1), "steps_per_s": step / max(train_time, 1e-9)},
                f"step {step}/{cfg.steps} loss {mean:.4f}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            metrics = evaluate(model, task, "valid", device, world=world)
            log({"event": "eval", "step": step, "split": "valid", **metrics},
                f"step {step} valid " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            peak = world.max(max(peak, memory.peak_bytes()))
            if world.is_main:
                save_checkpoint()
    bar.close()
    peak = world.max(max(peak, memory.peak_bytes()))

    metrics = {split: evaluate(model, task, split, device, world=world)
               for split in ("valid", "test")}
    tail = losses[-max(1, cfg.steps // 10):]
    method_spec = spec(cfg.method)
    results = {
        "config": dataclasses.asdict(cfg),
        "label": label_of(cfg.method, cfg.options),
        "metric": task.metric,
        "score": metrics["test"][task.metric],
        "valid": metrics["valid"],
        "test": metrics["test"],
        "final_train_loss": sum(tail) / len(tail),
        "losses": losses,
        "steps_per_s": cfg.steps / max(train_time, 1e-9),
        "train_time_s": train_time,
        "peak_memory_mb": peak / 2**20,
        "peak_memory_kind": memory.kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "masks_padding": bool(getattr(model, "masks_padding", True)),
        "capabilities": {c: getattr(method_spec, c)
                         for c in ("causal", "padding_mask", "cross", "decoding")},
        "task_info": task.info,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": str(device), "threads": torch.get_num_threads()},
        "processes": {"parallel": world.mode, "count": world.size},
        "init": run.init,
    }
    if task.kind == "seq2seq":
        results["decoding_at_length"] = decoding_at_length(model, task, device)
        for name, r in results["decoding_at_length"].items():
            log({"event": "decode", "set": name, **r},
                f"greedy decoding, {name} (lengths {r['min_len']}-{r['max_len']}): exact match "
                f"{r['exact_match']:.4f}, token accuracy {r['token_accuracy']:.4f}, "
                f"{r['tokens_per_s']:.0f} tokens/s")
    if world.is_main:
        write_json(out / RESULTS, results)
    log({"event": "done", **{f"test_{k}": v for k, v in metrics["test"].items()}},
        f"test {task.metric} {results['score']:.4f}")
    return results


def label_of(method: str, options: dict[str, Any]) -> str:
    """A method with options as one word: ``rfa:gated=True``."""
    if not options:
        return method
    return method + ":" + ",".join(f"{k}={v}" for k, v in sorted(options.items()))
