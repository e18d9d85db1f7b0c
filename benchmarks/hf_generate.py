"""Greedy ``model.generate()`` of a tiny random Llama: effattn methods with RecurrentCache against
transformers' ``sdpa`` with its default (growing) cache.

For each implementation, batch size and number of generated tokens it records tokens/s
(batch x tokens / wall time of the whole generate call, a short prompt's prefill included) and
the bytes the cache holds at the end. Prints a table and writes the records as JSON.

``--window W`` makes the model a Mistral (a Llama with a sliding window of W): ``sdpa``'s default
cache then keeps the last W - 1 keys per layer, and effattn-softmax honours the window with
RecurrentCache (its KV cache keeps the window's keys) or, spelled ``softmax:hf``, with the same
transformers cache as sdpa. ``--repeats R`` runs the implementations in turn R times per setting
and keeps the fastest, which evens out a machine shared with other work.

    python3 benchmarks/hf_generate.py                        # the full run (minutes)
    python3 benchmarks/hf_generate.py --lengths 64 128 --batches 1   # a quick check
    python3 benchmarks/hf_generate.py --window 512 --impls sdpa softmax softmax:hf \
        --lengths 2048 8192 --repeats 3 --out benchmarks/hf-generate-window/results.json

``--prefill T ...`` times the prefill instead: one forward of a prompt of T tokens without a
cache (``use_cache=False``), milliseconds per call (``--device cuda``: CUDA events' wall time
after a synchronize, and the peak of ``torch.cuda.max_memory_allocated``). On a GPU
effattn-softmax computes the window through the banded engine's FlexAttention strategy; sdpa
through transformers' own window mask:

    python3 benchmarks/hf_generate.py --device cuda --dtype bfloat16 --window 4096 \
        --prefill 32768 --batches 1 --impls sdpa softmax --repeats 5 \
        --out benchmarks/gpu/hf-prefill/results.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig

from effattn.integrations import transformers as hf
from effattn.tools.bench.machine import machine_info
from effattn.tools.bench.results import write_json

# An effattn method spelled METHOD:hf runs with transformers' default cache, not RecurrentCache.
HF_CACHE = ":hf"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_model(impl: str, args: argparse.Namespace, max_len: int) -> Any:
    sizes = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=max_len, eos_token_id=None,
        pad_token_id=0,
    )
    cfg = LlamaConfig(**sizes) if args.window is None else MistralConfig(
        **sizes, sliding_window=args.window)
    torch.manual_seed(0)
    name = impl if impl == "sdpa" else hf.name(impl.removesuffix(HF_CACHE))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name).eval()
    return model.to(device=args.device, dtype=DTYPES[args.dtype])


def cache_for(impl: str, model: Any) -> Any:
    if impl == "sdpa" or impl.endswith(HF_CACHE):
        return DynamicCache(config=model.config)
    return hf.RecurrentCache()


def cache_bytes(cache: Any) -> int:
    if isinstance(cache, hf.RecurrentCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)


def run(model: Any, impl: str, prompt: torch.Tensor, new: int) -> tuple[float, int]:
    cache = cache_for(impl, model)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             past_key_values=cache)
    seconds = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new
    return seconds, cache_bytes(cache)


def prefill(model: Any, prompt: torch.Tensor) -> tuple[float, int]:
    """Seconds of one cache-free forward of ``prompt`` and the peak bytes above the model on a
    GPU (0 on a CPU)."""
    cuda = prompt.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.no_grad():
        model(prompt, use_cache=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - base) if cuda else 0


def main_prefill(args: argparse.Namespace, models: dict[str, Any]) -> list[dict]:
    """The ``--prefill`` records: ms per forward of each prompt length, the fastest repeat."""
    records = []
    print(f"{'impl':>12} {'batch':>5} {'tokens':>6} {'ms':>9} {'peak MiB':>9}")
    for batch in args.batches:
        for tokens in args.prefill:
            prompt = torch.randint(1, args.vocab, (batch, tokens),
                                   generator=torch.Generator().manual_seed(0)).to(args.device)
            for model in models.values():
                prefill(model, prompt)  # warm-up: compilation, block masks
            times: dict[str, list[float]] = {impl: [] for impl in models}
            peak: dict[str, int] = {}
            for _ in range(args.repeats):
                for impl, model in models.items():
                    seconds, peak[impl] = prefill(model, prompt)
                    times[impl].append(seconds)
            for impl in models:
                rec = {"impl": impl, "batch": batch, "prefill_tokens": tokens,
                       "ms": 1e3 * min(times[impl]),
                       "all_ms": [1e3 * t for t in times[impl]],
                       "peak_mib": peak[impl] / 2**20}
                records.append(rec)
                print(f"{impl:>12} {batch:>5} {tokens:>6} {rec['ms']:>9.2f} "
                      f"{rec['peak_mib']:>9.1f}", flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", nargs="+", default=["sdpa", "softmax", "performer", "linear", "rfa",
                                                  "local"],
                   help="'sdpa' (transformers, default cache), effattn methods (RecurrentCache) "
                        f"or METHOD{HF_CACHE} (an effattn method with transformers' cache)")
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 2048, 4096, 8192],
                   help="generated tokens per run")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=16, help="random prompt tokens")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--window", type=int, default=None,
                   help="a sliding window: the model becomes a Mistral with this window")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per setting, the implementations in turn; the fastest is kept")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--prefill", nargs="+", type=int, default=None,
                   help="time a cache-free forward of prompts of these lengths instead of "
                        "generate()")
    p.add_argument("--out", type=Path, default=Path("benchmarks/hf-generate/results.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("hf_generate.py: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        sys.exit(2)
    hf.register()
    max_len = max(args.prefill) if args.prefill else args.prompt + max(args.lengths)
    models = {impl: make_model(impl, args, max_len) for impl in args.impls}
    load = [os.getloadavg()]
    records = main_prefill(args, models) if args.prefill else []
    header = f"{'impl':>12} {'batch':>5} {'tokens':>6} {'tokens/s':>9} {'cache KiB':>10}"
    if not args.prefill:
        print(header, "-" * len(header), sep="\n")
    for batch in [] if args.prefill else args.batches:
        prompt = torch.randint(1, args.vocab, (batch, args.prompt),
                               generator=torch.Generator().manual_seed(0)).to(args.device)
        for impl, model in models.items():
            run(model, impl, prompt, 8)  # warm-up
        for new in args.lengths:
            times: dict[str, list[float]] = {impl: [] for impl in models}
            nbytes: dict[str, int] = {}
            for _ in range(args.repeats):
                for impl, model in models.items():
                    seconds, nbytes[impl] = run(model, impl, prompt, new)
                    times[impl].append(seconds)
            for impl in models:
                seconds = min(times[impl])
                rec = {"impl": impl, "batch": batch, "tokens": new, "seconds": seconds,
                       "all_seconds": times[impl], "tokens_per_s": batch * new / seconds,
                       "cache_bytes": nbytes[impl]}
                records.append(rec)
                print(f"{impl:>12} {batch:>5} {new:>6} {rec['tokens_per_s']:>9.0f} "
                      f"{nbytes[impl] / 1024:>10.1f}", flush=True)
    load.append(os.getloadavg())
    write_json(args.out, {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "prompt",
                                                "window", "device", "dtype", "prefill")},
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "machine": machine_info(),
                        "threads": torch.get_num_threads(),
                        "load_average_before_after": load},
        "records": records,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
