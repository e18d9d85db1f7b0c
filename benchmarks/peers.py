"""effattn's kernelized methods against their peers, timed in one process, paired and alternating.

Two sections (B = 1, H = 8, D = 64, fp32, the methods' default options unless told otherwise):

- ``peers``: effattn ``performer`` (F = 256 positive orthogonal features) against
  performer-pytorch's ``FastAttention`` (same F, softmax kernel; its causal form on CPU is its
  non-CUDA fallback) and ``scaled_dot_product_attention``, forward, forward + backward and causal
  forward. performer-pytorch is not a dependency: without it the section is skipped with a message.
- ``kernelized``: performer, favor, rfa and linear, forward, causal and not, against SDPA and a
  fixed 1024³ fp32 GEMM timed among them: GFLOP/s from each spec's FLOP model
  (``effattn.spec(name).flops``) as a fraction of that GEMM's, and causal / non-causal.

Each repeat times every implementation once, in an order that alternates between repeats, and
the reported ratios are medians of the per-repeat ratios: a machine shared with other work slows
neighbouring samples alike, so the ratios hold where the absolute times do not. Prints tables and
writes JSON with the machine (``effattn.tools.bench.machine.machine_info``).

    PYTHONPATH=src python3 benchmarks/peers.py                       # both sections (minutes)
    PYTHONPATH=src python3 benchmarks/peers.py --sections peers --lengths 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import effattn
from effattn.registry import Problem
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_json
from effattn.tools.bench.timing import median_ratio, paired

HEADS, HEAD_DIM, FEATURES = 8, 64, 256
KERNELIZED = ("performer", "favor", "rfa", "linear")
PEAK = "gemm1024"






def inputs(n: int, grad: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n)
    return tuple(torch.randn(1, HEADS, n, HEAD_DIM, generator=gen).requires_grad_(grad)
                 for _ in range(3))


def call(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], backward: bool,
         **kwargs: Any) -> Callable[[], Any]:
    if backward:
        return lambda: fn(*args, **kwargs).sum().backward()

    def forward() -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return forward


def peers(lengths: list[int], repeats: int, slow_repeats: int) -> list[dict[str, Any]]:
    try:
        from performer_pytorch import FastAttention
    except ImportError:
        print("peers: performer-pytorch is not installed (pip install --no-deps performer-pytorch "
              "einops local-attention==1.4.4 axial-positional-embedding): section skipped")
        return []
    records = []
    print(f"\n{'pass':>7} {'N':>6} {'effattn ms':>11} {'performer-pytorch':>18} {'sdpa':>14}")
    for n in lengths:
        for pass_name in ("fwd", "fwdbwd", "causal"):
            causal, backward = pass_name == "causal", pass_name == "fwdbwd"
            torch.manual_seed(0)
            ours = effattn.build("performer", head_dim=HEAD_DIM, heads=HEADS, seed=0,
                                 num_features=FEATURES).eval()
            theirs = FastAttention(dim_heads=HEAD_DIM, nb_features=FEATURES, causal=causal).eval()
            args = inputs(n, backward)
            fns = {
                "effattn": call(ours, args, backward, causal=causal),
                "performer-pytorch": call(theirs, args, backward),
                "sdpa": call(F.scaled_dot_product_attention, args, backward, is_causal=causal),
            }
            # performer-pytorch's causal CPU fallback is seconds per call: fewer repeats.
            samples = paired(fns, slow_repeats if causal else repeats)
            rec = {"pass": pass_name, "n": n, "repeats": len(samples["effattn"]),
                   "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
                   "speedup_vs": {k: median_ratio(samples[k], samples["effattn"])
                                  for k in fns if k != "effattn"}}
            records.append(rec)
            ms, up = rec["median_ms"], rec["speedup_vs"]
            print(f"{pass_name:>7} {n:>6} {ms['effattn']:>11.1f} "
                  f"{ms['performer-pytorch']:>9.1f} ({up['performer-pytorch']:>5.2f}x) "
                  f"{ms['sdpa']:>7.1f} ({up['sdpa']:>4.2f}x)", flush=True)
    return records


def kernelized(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    """Forward GFLOP/s of each method as a fraction of a 1024³ GEMM timed among them."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    out = torch.empty(1024, 1024)
    records = []
    print(f"\n{'method':>10} {'N':>6} {'ms':>8} {'causal ms':>10} {'causal/non':>10} "
          f"{'% peak':>7} {'% peak c':>8} {'sdpa/ours':>9}")
    for n in lengths:
        args = inputs(n, False)
        fns: dict[str, Callable[[], Any]] = {PEAK: lambda: torch.mm(a, b, out=out)}
        flops = {PEAK: 2.0 * 1024**3}
        for name in KERNELIZED:
            spec = effattn.spec(name)
            module = effattn.build(name, head_dim=HEAD_DIM, heads=HEADS, seed=0).eval()
            for causal in (False, True):
                key = f"{name}{'-causal' if causal else ''}"
                fns[key] = call(module, args, False, causal=causal)
                flops[key] = spec.flops(spec.options, Problem(1, HEADS, n, n, HEAD_DIM, HEAD_DIM,
                                                              causal))
        fns["sdpa"] = call(F.scaled_dot_product_attention, args, False)
        samples = paired(fns, repeats)
        for name in KERNELIZED:
            causal = f"{name}-causal"
            rec = {"method": name, "n": n, "repeats": repeats,
                   "median_ms": statistics.median(samples[name]) * 1e3,
                   "causal_median_ms": statistics.median(samples[causal]) * 1e3,
                   "causal_over_noncausal": median_ratio(samples[causal], samples[name]),
                   "sdpa_over_ours": median_ratio(samples["sdpa"], samples[name]),
                   # (flops / t) / (peak flops / t_peak), per repeat, then the median.
                   "fraction_of_gemm": flops[name] / flops[PEAK]
                   / median_ratio(samples[name], samples[PEAK]),
                   "causal_fraction_of_gemm": flops[causal] / flops[PEAK]
                   / median_ratio(samples[causal], samples[PEAK]),
                   "gemm_gflops": flops[PEAK] / statistics.median(samples[PEAK]) / 1e9}
            records.append(rec)
            print(f"{name:>10} {n:>6} {rec['median_ms']:>8.1f} {rec['causal_median_ms']:>10.1f} "
                  f"{rec['causal_over_noncausal']:>10.2f} {100 * rec['fraction_of_gemm']:>6.1f}% "
                  f"{100 * rec['causal_fraction_of_gemm']:>7.1f}% "
                  f"{rec['sdpa_over_ours']:>9.2f}", flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", choices=("peers", "kernelized"),
                   default=["peers", "kernelized"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096],
                   help="sequence lengths of the peers section")
    p.add_argument("--kernelized-lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--slow-repeats", type=int, default=5,
                   help="repeats of the causal peers comparison (performer-pytorch's causal CPU "
                   "form takes seconds per call)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/peers/results.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    print(describe(machine))
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "shape": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "machine": machine,
    }
    if "peers" in args.sections:
        result["peers"] = peers(args.lengths, args.repeats, args.slow_repeats)
    if "kernelized" in args.sections:
        result["kernelized"] = kernelized(args.kernelized_lengths, args.repeats)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
