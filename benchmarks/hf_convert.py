"""A tiny Hugging Face Llama trained with ``sdpa`` on the character corpus, converted to a
linear-time effattn method (linearize, attention transfer, fine-tuning of every weight or of LoRA
adapters), then ``generate()`` with ``RecurrentCache`` against ``sdpa``'s growing cache.

Stages, scored by test bits/char on effattn's ``charlm`` task (its text and splits; no download):

- ``teacher``: ``LlamaForCausalLM`` from a ``LlamaConfig`` (random init), ``sdpa``, trained
  ``--teacher-steps`` with AdamW and the task's schedule (``effattn.tools.train.learning_rate``);
- ``swap``: :func:`effattn.convert.linearize` to ``--method``, no training;
- ``transfer``: :func:`effattn.convert.transfer` of the method's parameters, on batches after
  the teacher's;
- ``finetune``: from the transferred model, every weight (``full``) or rank-8 LoRA adapters on
  q/k/v/o_proj (``lora``, :func:`effattn.convert.lora`), ``--finetune-steps`` each.

Then: the converted model's greedy ``generate()`` with ``RecurrentCache`` is checked against a
full forward of the generated text (max |logit difference|) and its cache size at two lengths,
and tokens/s (batch 1, a 16-character prompt of test text, the whole generate call) is measured
for the teacher (``sdpa``, transformers' default cache) and the converted model at each
``--lengths``, the two alternating ``--repeats`` times, the fastest kept. The teacher and the
converted stages are cached in ``--out``'s folder (``teacher.pt``, ``stages.pt``): a rerun skips
their training and only measures decoding (on a machine otherwise idle).

    python3 benchmarks/hf_convert.py --out benchmarks/hf-convert/results.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from effattn.cli.common import parse_entry
from effattn.convert import layer_errors, linearize, lora, transfer
from effattn.integrations.hf_cache import RecurrentCache
from effattn.tools.bench.machine import machine_info
from effattn.tools.bench.results import write_json
from effattn.tools.tasks.data import make_task
from effattn.tools.tasks.synthetic import IGNORE
from effattn.tools.train import TrainConfig, evaluate, label_of, learning_rate


class Logits(nn.Module):
    """A Hugging Face causal LM as the training loop's models are called: tokens -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits


def llama(vocab: int, args: argparse.Namespace) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=max(args.seq_len, args.prompt + max(args.lengths)),
                      eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def fit(model: nn.Module, task: Any, args: argparse.Namespace, steps: int, start: int) -> list:
    """AdamW on the parameters that require grad, the task's warm-up and cosine schedule, on
    training batches start, start + 1, ...; the losses."""
    cfg = dataclasses.replace(TrainConfig(task="charlm"), steps=steps, lr=args.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    net = Logits(model).train()
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        x, y = task.train_batch(start + step, args.batch_size)
        logits = net(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, steps // 10) == 0:
            print(f"  step {step + 1}/{steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}",
                  file=sys.stderr, flush=True)
    return losses


def bpc(model: nn.Module, task: Any) -> float:
    return evaluate(Logits(model), task, "test", torch.device("cpu"))["bpc"]


def generate(model: nn.Module, prompt: torch.Tensor, new: int, recurrent: bool) -> tuple:
    cache = RecurrentCache() if recurrent else DynamicCache(config=model.config)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             past_key_values=cache)
    seconds = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new
    nbytes = cache.nbytes() if recurrent else sum(
        t.numel() * t.element_size() for layer in cache.layers
        for t in (layer.keys, layer.values) if t is not None)
    return seconds, nbytes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="hedgehog",
                   help="method with options, as effattn convert's: hedgehog, "
                        "hedgehog:window=32,window_factor=true (num_features defaults to 4 D)")
    p.add_argument("--teacher-steps", type=int, default=600)
    p.add_argument("--transfer-steps", type=int, default=75)
    p.add_argument("--finetune-steps", type=int, default=75)
    p.add_argument("--lr", type=float, default=5e-3, help="teacher and fine-tuning peak lr")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/hf-convert/results.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    task = make_task("charlm", args.seq_len, args.seed)
    rows: list[dict[str, Any]] = []
    timings: dict[str, float] = {}

    def row(stage: str, steps: int, model: nn.Module, **extra: Any) -> None:
        rows.append({"task": "charlm", "model": "llama", "method": extra.pop("method"),
                     "stage": stage, "steps": steps, "bpc": bpc(model, task), **extra})
        print(rows[-1], file=sys.stderr, flush=True)

    teacher = llama(task.vocab_size, args)
    saved = args.out.parent / "teacher.pt"
    if saved.is_file():
        teacher.load_state_dict(torch.load(saved)["model"])
        timings["teacher_s"] = torch.load(saved)["seconds"]
    else:
        t0 = time.perf_counter()
        fit(teacher, task, args, args.teacher_steps, 0)
        timings["teacher_s"] = time.perf_counter() - t0
        torch.save({"model": teacher.state_dict(), "seconds": timings["teacher_s"]}, saved)
    teacher.eval()
    row("teacher", args.teacher_steps, teacher, method="sdpa")

    model = copy.deepcopy(teacher)
    method, options = parse_entry(args.method)
    options = {"num_features": 4 * (args.hidden // args.heads), **options}
    new = linearize(model, method, **options)
    label = label_of(method, options)
    stages = args.out.parent / "stages.pt"
    if stages.is_file():
        done = torch.load(stages, weights_only=False)
        rows, timings = done["rows"], done["timings"]
        model.load_state_dict(done["student"])
        measure(args, teacher, model.eval(), label, rows, timings)
        return
    row("swap", 0, model, method=label)
    x = task.train_batch(args.teacher_steps, args.batch_size)[0]
    before = layer_errors(model, x)
    t0 = time.perf_counter()
    batches = (task.train_batch(args.teacher_steps + i, args.batch_size)[0]
               for i in range(args.transfer_steps))
    losses = transfer(model, batches, steps=args.transfer_steps, parameters=new)
    timings["transfer_s"] = time.perf_counter() - t0
    row("transfer", args.transfer_steps, model, method=label, layer_mse_before=before,
        layer_mse_after=layer_errors(model, x), transfer_loss=[losses[0], losses[-1]])
    start = args.teacher_steps + args.transfer_steps
    tuned: dict[str, nn.Module] = {}
    for kind in ("full", "lora"):
        student = copy.deepcopy(model)
        extra: dict[str, Any] = {}
        if kind == "lora":
            adapters = lora(student, rank=8, alpha=16)
            extra = {"finetune": f"lora:rank=8,alpha=16,lr={args.lr:g}",
                     "trained_parameters": sum(p.numel() for p in adapters.values())}
        t0 = time.perf_counter()
        fit(student, task, args, args.finetune_steps, start)
        timings[f"finetune_{kind}_s"] = time.perf_counter() - t0
        tuned[kind] = student.eval()
        row("finetune", args.transfer_steps + args.finetune_steps, student, method=label,
            **extra)

    torch.save({"rows": rows, "timings": timings, "student": tuned["full"].state_dict()}, stages)
    measure(args, teacher, tuned["full"], label, rows, timings)


def measure(args: argparse.Namespace, teacher: nn.Module, student: nn.Module, label: str,
            rows: list, timings: dict) -> None:
    """Decoding of the fully fine-tuned model against the teacher; writes the results."""
    task = make_task("charlm", args.seq_len, args.seed)
    test = task.eval_sets["test"][0]
    prompt = test[:1, :args.prompt]
    check: dict[str, Any] = {}
    out = student.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64,
                           min_new_tokens=64, do_sample=False,
                           past_key_values=RecurrentCache(), output_logits=True,
                           return_dict_in_generate=True)
    with torch.no_grad():
        full = student(out.sequences[:, :-1]).logits[:, args.prompt - 1:]
    check["max_abs_logit_diff_generate_vs_forward"] = float(
        (torch.stack(out.logits, 1) - full).abs().max())
    check["cache_bytes_at"] = {n: generate(student, prompt, n, True)[1] for n in (64, 512)}
    print(check, file=sys.stderr, flush=True)
    load = [os.getloadavg()]
    records = []
    impls = {"sdpa": (teacher, False), label: (student, True)}
    for m, recurrent in impls.values():
        generate(m, prompt, 8, recurrent)  # warm-up
    for n in args.lengths:
        times: dict[str, list[float]] = {impl: [] for impl in impls}
        nbytes: dict[str, int] = {}
        for _ in range(args.repeats):
            for impl, (m, recurrent) in impls.items():
                seconds, nbytes[impl] = generate(m, prompt, n, recurrent)
                times[impl].append(seconds)
        for impl in impls:
            rec = {"impl": impl, "batch": 1, "tokens": n, "seconds": min(times[impl]),
                   "all_seconds": times[impl], "tokens_per_s": n / min(times[impl]),
                   "cache_bytes": nbytes[impl]}
            records.append(rec)
            print(rec, file=sys.stderr, flush=True)
    load.append(os.getloadavg())
    write_json(args.out, {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "seq_len",
                                                "batch_size", "lr", "seed", "prompt")},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "machine": machine_info(),
                        "threads": torch.get_num_threads(),
                        "load_average_before_after_generate": load},
        "timings_s": timings,
        "rows": rows,
        "decoding_check": check,
        "generate": records,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
