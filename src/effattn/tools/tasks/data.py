"""Training tasks: what the model sees at each step and what it is scored on.

Every training batch is a deterministic function of (seed, step), so a run resumed from a
checkpoint at step s sees exactly the batches an uninterrupted run would. Held-out sets are fixed
by the seed and disjoint streams of it.

| task | model | input | score |
|---|---|---|---|
| ``listops`` | EncoderClassifier | ListOps expression (LRA grammar) | accuracy, 10 classes |
| ``charlm`` | DecoderLM | Python stdlib source, random windows | bits per character |
| ``recall`` | DecoderLM | multi-query associative recall (MQAR) | accuracy on the answers |
| ``recall-small`` | DecoderLM | the earlier recall (16 keys, 16 values) | accuracy on the answers |
| ``copy`` | DecoderLM | ``x SEP x`` | accuracy on the copy |
| ``reverse`` | EncoderDecoder | digit string -> the string reversed | greedy exact match |
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from effattn.tools.checkpoints import load_data, save
from effattn.tools.tasks import charlm, listops, synthetic

# Each task's score.
TASK_METRICS = {"listops": "accuracy", "charlm": "bpc", "recall": "accuracy",
                "recall-small": "accuracy", "copy": "accuracy", "reverse": "exact_match"}
TASKS = tuple(TASK_METRICS)
# Each task's model, by the kind of its targets (see Task.kind).
TASK_KINDS = {"listops": "classify", "charlm": "lm", "recall": "lm", "recall-small": "lm",
              "copy": "lm", "reverse": "seq2seq"}
# Metrics that are fractions of the test set (shown in %, higher is better); bpc is a loss, lower
# is better.
FRACTION_METRICS = ("accuracy", "exact_match")
METRIC_NAMES = {"accuracy": "test accuracy", "exact_match": "test exact match",
                "bpc": "test bits/char"}


def stream_seed(seed: int, *keys: int | str) -> int:
    """A well-mixed 63-bit seed for the stream named by ``keys`` under ``seed``."""
    words = [seed] + [k if isinstance(k, int) else int.from_bytes(k.encode(), "little")
                      for k in keys]
    return int(np.random.SeedSequence(words).generate_state(2, np.uint64)[0] >> np.uint64(1))


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of the training batch at ``step``."""
    return torch.Generator().manual_seed(stream_seed(seed, "train", step))


@dataclass
class Task:
    """A task bound to a sequence length and a seed.

    kind: ``"classify"`` (targets (B,)), ``"lm"`` (targets (B, L), -100 = not scored) or
        ``"seq2seq"`` (inputs are sources (B, M), targets (B, T) end with EOS, then -100; the
        decoder reads BOS and the targets shifted right, see :func:`decoder_inputs`).
    metric: ``"accuracy"``, ``"bpc"`` or ``"exact_match"`` (seq2seq: greedy decoding reproduces
        the whole target).
    bos_id: seq2seq only, the token that starts decoding.
    length_sets: seq2seq only, test sets at other lengths for the evaluation of decoding at
        length, by name.
    model_len: the longest sequence the model is given, which mechanisms with length-dependent
        parameters are built for (None: ``seq_len``).
    """

    name: str
    kind: str
    metric: str
    vocab_size: int
    seq_len: int
    num_classes: int | None
    train_batch: Callable[[int, int], tuple[Tensor, Tensor]]
    eval_sets: dict[str, tuple[Tensor, Tensor]]
    info: dict[str, Any] = field(default_factory=dict)
    bos_id: int | None = None
    length_sets: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    model_len: int | None = None


def _is_pair(obj: Any) -> bool:
    return (isinstance(obj, tuple) and len(obj) == 2
            and all(isinstance(t, torch.Tensor) for t in obj))


def _listops(seq_len: int, seed: int, data_dir: Path | None, *, train_size: int = 10_000,
             valid_size: int = 500, test_size: int = 2_000, min_len: int | None = None) -> Task:
    # LRA draws lengths in [500, 2000]: the same ratio of min to max length by default.
    min_len = max(1, seq_len // 4) if min_len is None else min_len
    sizes = {"train": train_size, "valid": valid_size, "test": test_size}
    sets = {}
    for split, count in sizes.items():
        key = f"listops-L{seq_len}-min{min_len}-seed{seed}-{split}{count}.pt"
        path = None if data_dir is None else Path(data_dir) / key
        if path is not None and path.exists():
            sets[split] = load_data(path, _is_pair, "a pair of tensors (inputs, labels)")
            continue
        sets[split] = listops.generate(count, seed=stream_seed(seed, "listops", split),
                                       min_len=min_len, max_len=seq_len)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            save(path, sets[split])
    pool_x, pool_y = sets.pop("train")

    def train_batch(step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(0, len(pool_x), (batch_size,), generator=step_generator(seed, step))
        return pool_x[idx], pool_y[idx]

    return Task("listops", TASK_KINDS["listops"], TASK_METRICS["listops"], len(listops.VOCAB),
                seq_len, listops.NUM_CLASSES, train_batch, sets,
                {"min_len": min_len, "train_size": train_size})


BatchMaker = Callable[[int, int], tuple[Tensor, Tensor]]


def _streams(name: str, seed: int, make: BatchMaker, valid_size: int, test_size: int
             ) -> tuple[BatchMaker, dict[str, tuple[Tensor, Tensor]]]:
    """Training batches and held-out sets from ``make(count, seed)``: a batch is drawn by
    (seed, step), each held-out split from its own stream."""

    def train_batch(step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        return make(batch_size, stream_seed(seed, "train", step))

    sets = {split: make(count, stream_seed(seed, name, split))
            for split, count in (("valid", valid_size), ("test", test_size))}
    return train_batch, sets


def _recall(seq_len: int, seed: int, *, num_pairs: int | None = None, vocab: int = 256,
            valid_size: int = 256, test_size: int = 1024) -> Task:
    pairs = min(8, seq_len // 4) if num_pairs is None else num_pairs

    def make(count: int, s: int) -> tuple[Tensor, Tensor]:
        return synthetic.mqar(count, seed=s, seq_len=seq_len, num_pairs=pairs, vocab=vocab)

    train_batch, sets = _streams("recall", seed, make, valid_size, test_size)
    return Task("recall", TASK_KINDS["recall"], TASK_METRICS["recall"], vocab, seq_len, None,
                train_batch, sets, {"generator": "mqar", "vocab": vocab, "num_pairs": pairs})


def _synthetic(name: str, seq_len: int, seed: int, *, valid_size: int = 256,
               test_size: int = 1024, vocab: int | None = None) -> Task:
    if name == "recall-small":
        vocab = 16 if vocab is None else vocab

        def make(count: int, s: int) -> tuple[Tensor, Tensor]:
            return synthetic.associative_recall(count, seed=s, seq_len=seq_len, vocab=vocab)

        vocab_size = 2 * vocab + 1
    else:
        vocab = 16 if vocab is None else vocab

        def make(count: int, s: int) -> tuple[Tensor, Tensor]:
            return synthetic.copy_task(count, seed=s, seq_len=seq_len, vocab=vocab)

        vocab_size = vocab + 2

    # recall-small keeps the held-out streams it had under its old name, recall.
    stream = "recall" if name == "recall-small" else name
    train_batch, sets = _streams(stream, seed, make, valid_size, test_size)
    return Task(name, TASK_KINDS[name], TASK_METRICS[name], vocab_size, seq_len, None,
                train_batch, sets, {"vocab": vocab})


def _reverse(seq_len: int, seed: int, *, min_len: int | None = None,
             max_len: int | None = None, digits: int = 10, valid_size: int = 256,
             test_size: int = 1024, length_size: int = 256,
             length_factors: tuple[int, ...] = (1, 2, 4)) -> Task:
    # A source and its reversal together fill about seq_len tokens, as `x SEP x` does in copy;
    # lengths spread over [L/4, L/2] like ListOps' [L/4, L].
    max_len = max(1, seq_len // 2) if max_len is None else max_len
    min_len = max(1, seq_len // 4) if min_len is None else min_len

    def make(count: int, s: int, low: int = min_len, high: int = max_len
             ) -> tuple[Tensor, Tensor]:
        return synthetic.reverse_task(count, seed=s, min_len=low, max_len=high, digits=digits)

    train_batch, sets = _streams("reverse", seed, make, valid_size, test_size)
    # Decoding at length: strings of exactly k times the longest training string.
    length_sets = {f"{k}x": make(length_size, stream_seed(seed, "reverse", "length", k),
                                 k * max_len, k * max_len)
                   for k in length_factors}
    info = {"min_len": min_len, "max_len": max_len, "digits": digits,
            "length_factors": list(length_factors)}
    # Targets are one wider than their sources (EOS), and so are the decoder's inputs.
    widest = max(t.shape[1] for _, t in [*sets.values(), *length_sets.values()])
    return Task("reverse", TASK_KINDS["reverse"], TASK_METRICS["reverse"],
                digits + synthetic.SPECIALS, seq_len, None, train_batch, sets, info,
                bos_id=synthetic.BOS, length_sets=length_sets, model_len=widest)


def decoder_inputs(task: Task, targets: Tensor) -> Tensor:
    """Teacher forcing for seq2seq: BOS, then ``targets`` (B, T) shifted right by one.

    Positions after EOS (-100 in the targets) become padding; a causal decoder never lets them
    reach a scored position.
    """
    shifted = targets[:, :-1].masked_fill(targets[:, :-1] == synthetic.IGNORE, synthetic.PAD)
    return torch.cat((shifted.new_full((len(targets), 1), task.bos_id), shifted), dim=1)


_CORPUS: dict[str, charlm.Corpus] = {}


def _charlm(seq_len: int, seed: int, *, valid_windows: int = 128,
            test_windows: int = 512) -> Task:
    if "stdlib" not in _CORPUS:
        _CORPUS["stdlib"] = charlm.Corpus.stdlib()
    corpus = _CORPUS["stdlib"]
    train = corpus.split("train")

    def train_batch(step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        return charlm.random_windows(train, batch_size, seq_len, step_generator(seed, step))

    sets = {"valid": charlm.tiled_windows(corpus.split("valid"), seq_len, valid_windows),
            "test": charlm.tiled_windows(corpus.split("test"), seq_len, test_windows)}
    info = {"corpus": "python-stdlib", "python": corpus.python, "sha256": corpus.sha256,
            "chars": {s: len(corpus.split(s)) for s in charlm.SPLITS},
            "eval_chars": {s: int(sets[s][1].numel()) for s in sets}}
    return Task("charlm", TASK_KINDS["charlm"], TASK_METRICS["charlm"], corpus.vocab_size,
                seq_len, None, train_batch, sets, info)


def _builder(name: str) -> Callable[..., Task]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return {"listops": _listops, "charlm": _charlm, "reverse": _reverse,
            "recall": _recall}.get(name, _synthetic)


def task_options(name: str) -> dict[str, Any]:
    """The options of task ``name`` (keyword arguments of :func:`make_task`) and their defaults."""
    return {p.name: p.default for p in inspect.signature(_builder(name)).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def make_task(name: str, seq_len: int, seed: int, data_dir: Path | None = None,
              **options: Any) -> Task:
    """The task ``name`` at sequence length ``seq_len`` (data cached under ``data_dir`` when the
    generator is slow: ListOps). ``options``: see :func:`task_options`."""
    unknown = sorted(set(options) - set(task_options(name)))
    if unknown:
        raise ValueError(f"task {name!r} has no option {', '.join(map(repr, unknown))}; its "
                         f"options: {', '.join(task_options(name))}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 4:
        raise ValueError(f"seq_len must be an int >= 4, got {seq_len!r}")
    build = _builder(name)
    if build is _listops:
        return _listops(seq_len, seed, data_dir, **options)
    if build is _synthetic:
        return _synthetic(name, seq_len, seed, **options)
    return build(seq_len, seed, **options)


def score(task: Task, loss_sum: float, correct: int, count: int) -> dict[str, float]:
    """Metrics from summed cross-entropy (nats) and correct predictions over ``count`` targets."""
    loss = loss_sum / count
    out = {"loss": loss, "accuracy": correct / count}
    if task.metric == "bpc":
        out["bpc"] = loss / math.log(2)
    return out
