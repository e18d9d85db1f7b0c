"""effattn's sparse patterns against compiled FlexAttention with the same masks, paired.

FlexAttention (``torch.nn.attention.flex_attention``) is what a PyTorch user would pick for a
sliding-window or block-sparse pattern: a ``mask_mod`` describes the pattern, ``create_block_mask``
turns it into a BlockMask once per shape, and ``torch.compile(flex_attention)`` generates a kernel
that skips the empty blocks. For each of

- ``local``: sliding window (``--window``, 128), non-causal ``|i - j| <= window // 2`` and causal
  ``0 <= i - j <= window - 1``;
- ``longformer``: the same non-causal window plus its default global token (position 0);
- ``bigbird``: its defaults (block 64, 1 global block, 3 random blocks per head and query block),
  the random blocks read from the effattn module's eval-mode layout (``random_blocks``), so that
  both sides compute the same pattern;

the script builds the ``mask_mod`` that reproduces the effattn module's pattern exactly, checks
the compiled flex output against the module's (max abs error, fp32: ~1e-6; a mask that differs
shows up as ~1e-2), and times the forward of both, paired: each repeat times every
implementation once, in an order that alternates between repeats, and the effattn speed-up over
flex is the median of the per-repeat ratios flex / effattn (> 1: effattn is faster), which holds
on a machine shared with other work where absolute times do not.

FlexAttention is run with BlockMasks of two block sizes (``--block-sizes``): 128, its default,
and 64, the scale of the patterns (window 128 = 2 x 64; bigbird's blocks): a BlockMask at the
pattern's own scale leaves fewer partial blocks to compute and mask. Not in the forward time:
the BlockMask's creation (``torch.compile(create_block_mask)``, reported separately: first call
with its compilation, then the median of 3 calls, what a user pays once per shape) and the
compile warm-up of ``flex_attention`` (reported as ``compile_s``).

Forward + backward: FlexAttention refuses gradients on the CPU (torch 2.13: ``NotImplementedError:
FlexAttention does not support backward on CPU``, raised by flex_attention's input check when an
input requires grad, compiled or not; compiled with fullgraph, dynamo reports it as
``Unsupported: Observed exception``). The script tries it at every point and records the error's
chain; where it works (``--device cuda``, or a later torch on the CPU) forward + backward is timed
as well. On CUDA the timing uses CUDA events and the peak ``torch.cuda.max_memory_allocated``
above the inputs is recorded per implementation and pass.

B = 1, H = 8, D = 64, fp32 unless ``--dtype bfloat16`` (effattn computes in fp32 inside and
returns the input dtype; flex computes in the input dtype). Writes ``results.json`` (with the
machine and the load average at each point) and ``results.md`` into ``--out``, after every
configuration; prints the tables.

    PYTHONPATH=src python3 benchmarks/flex.py --threads 1 --repeats 9    # CPU, N 1024 4096 16384
    PYTHONPATH=src python3 benchmarks/flex.py --methods local --lengths 1024 --repeats 3  # a look
    PYTHONPATH=src python3 benchmarks/flex.py --device cuda --repeats 20 \\
        --out benchmarks/gpu/flex-fp32
    PYTHONPATH=src python3 benchmarks/flex.py --device cuda --dtype bfloat16 --repeats 20 \\
        --out benchmarks/gpu/flex-bf16

On a GPU each point compiles flex's forward and backward kernels and create_block_mask for each
block size (up to minutes for bigbird's per-head mask at N = 16384): ``--block-sizes 128`` halves
that.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import effattn
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import atomic_write, write_json
from effattn.tools.bench.timing import Clock, median_ratio, paired

HEADS, HEAD_DIM = 8, 64
# Causal forms each method is measured in: only local has a causal pattern.
CAUSAL = {"local": (False, True), "longformer": (False,), "bigbird": (False,)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest max abs difference between the two outputs that still means "the same pattern": fp32
# rounding gives ~1e-6, one key more or less in a row ~1e-2; bf16 rounding alone gives ~1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}
MASK_REPEATS = 3

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class FlexMask:
    """A pattern in FlexAttention's terms: ``mask_mod(b, h, q_idx, kv_idx)`` -> bool tensor, and
    ``heads``: the number of heads it varies over (None: the same for every head, so the
    BlockMask is built once and broadcast)."""

    mask_mod: MaskMod
    heads: int | None


def local_mask_mod(window: int, dilation: int, causal: bool) -> MaskMod:
    """effattn local's pattern: ``-right <= i - j <= left`` with (left, right) = (window - 1, 0)
    causal, (window // 2, window // 2) not, and ``(i - j) % dilation == 0``."""
    left, right = (window - 1, 0) if causal else (window // 2, window // 2)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        near = (d >= -right) & (d <= left)
        # Dilation 1 (the default) needs no modulo, which would cost flex on every masked block.
        return near & (d % dilation == 0) if dilation > 1 else near

    return mask_mod


def longformer_mask_mod(
    window: int, global_tokens: Sequence[int], n: int, device: torch.device
) -> MaskMod:
    """effattn longformer's pattern: ``|i - j| <= window // 2``, or i or j a global token."""
    half = window // 2
    is_global = torch.zeros(n, dtype=torch.bool, device=device)
    is_global[list(global_tokens)] = True

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ((q_idx - kv_idx).abs() <= half) | is_global[q_idx] | is_global[kv_idx]

    return mask_mod


def bigbird_block_table(module: torch.nn.Module, n: int) -> Tensor:
    """The block pattern an eval-mode effattn bigbird module computes at length n: bool
    (H, nb, nb), query block a sees key block b when ``|a - b| <= 1``, a or b is a global block,
    or b is one of a's random blocks for that head (the module's ``random_blocks``, the same
    draws its forward makes in eval mode)."""
    nb = -(-n // module.block_size)
    g = module.num_global_blocks
    a = torch.arange(nb)
    fixed = ((a[:, None] - a[None, :]).abs() <= 1) | (a[:, None] < g) | (a[None, :] < g)
    drawn = module.random_blocks(nb).cpu()  # (H, nb, r), -1 in unused slots
    chosen = torch.zeros(module.heads, nb, nb + 1, dtype=torch.bool)
    # Unused slots point to the extra column nb, which is dropped.
    chosen.scatter_(2, drawn.masked_fill(drawn < 0, nb), True)
    return fixed | chosen[:, :, :nb]


def bigbird_mask_mod(table: Tensor, block_size: int) -> MaskMod:
    """A per-head block pattern (H, nb, nb) (:func:`bigbird_block_table`) as a mask_mod."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return table[h, q_idx // block_size, kv_idx // block_size]

    return mask_mod


def flex_mask(
    method: str, module: torch.nn.Module, n: int, causal: bool, device: torch.device
) -> FlexMask:
    """The FlexAttention mask of the effattn module ``module`` (registered as ``method``) at
    length n: the same allowed (query, key) pairs, from the module's own options and draws."""
    if method == "local":
        return FlexMask(local_mask_mod(module.window, module.dilation, causal), None)
    if causal:
        raise ValueError(f"{method} has no causal form")
    if method == "longformer":
        return FlexMask(longformer_mask_mod(module.window, module.global_tokens, n, device), None)
    if method == "bigbird":
        table = bigbird_block_table(module, n).to(device)
        return FlexMask(bigbird_mask_mod(table, module.block_size), module.heads)
    raise ValueError(f"no FlexAttention mask for {method!r}; known: {sorted(CAUSAL)}")


def block_mask(
    mask: FlexMask,
    n: int,
    block_size: int,
    device: torch.device,
    create: Callable[..., BlockMask] = create_block_mask,
) -> BlockMask:
    """The BlockMask of ``mask`` for n queries and keys in blocks of ``block_size``; ``create`` is
    ``create_block_mask`` or its compiled form (which, unlike the eager one, does not materialise
    the (H, N, N) mask: 2 GiB and more at N = 16384)."""
    return create(mask.mask_mod, None, mask.heads, n, n, device=device, BLOCK_SIZE=block_size)








def peak_mib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def backward_error(
    flex: Callable[..., Tensor], args: tuple[Tensor, ...], mask: BlockMask
) -> str | None:
    """None when forward + backward of ``flex`` runs on these inputs, else the error: the first
    line of each exception in its chain, outermost first (compiled with fullgraph, dynamo wraps
    flex's own error in its ``Unsupported``)."""
    grads = tuple(x.detach().clone().requires_grad_() for x in args)
    try:
        flex(*grads, block_mask=mask).sum().backward()
    except Exception as err:  # any error: its message is the finding
        chain: list[str] = []
        cause: BaseException | None = err
        while cause is not None:
            chain.append(f"{type(cause).__name__}: {str(cause).splitlines()[0]}")
            cause = cause.__cause__ or cause.__context__
        return " <- ".join(chain)
    return None


@dataclass
class Config:
    """What every measurement shares: device, dtype, block sizes, repeats, window."""

    device: torch.device
    dtype: torch.dtype
    block_sizes: list[int]
    repeats: int
    window: int


def build_module(method: str, cfg: Config) -> torch.nn.Module:
    """The eval-mode effattn module: default options but the window (local, longformer)."""
    options = {"window": cfg.window} if "window" in effattn.spec(method).options else {}
    return effattn.build(method, head_dim=HEAD_DIM, heads=HEADS, seed=0, **options).to(
        cfg.device).eval()


def inputs(n: int, cfg: Config) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (1, H, n, D), standard normal, fixed by n."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=gen).to(cfg.device, cfg.dtype)
               for _ in range(3))
    return q, k, v


def build_masks(
    mask: FlexMask, n: int, cfg: Config, create: Callable[..., BlockMask]
) -> tuple[dict[str, BlockMask], dict[str, dict[str, float]]]:
    """The BlockMask of every block size, by name (``flex-b<size>``), and their creation times:
    the first call (compiling ``create``) and the median of ``MASK_REPEATS`` calls, wall clock
    (ms), with the device synchronised; plus each mask's sparsity (% of blocks skipped)."""
    sync = torch.cuda.synchronize if cfg.device.type == "cuda" else (lambda: None)
    masks: dict[str, BlockMask] = {}
    info: dict[str, dict[str, float]] = {}
    for size in cfg.block_sizes:
        name = f"flex-b{size}"
        times = []
        for _ in range(1 + MASK_REPEATS):
            start = time.perf_counter()
            masks[name] = block_mask(mask, n, size, cfg.device, create)
            sync()
            times.append(time.perf_counter() - start)
        info[name] = {"first_ms": 1e3 * times[0], "median_ms": 1e3 * statistics.median(times[1:]),
                      "sparsity_percent": masks[name].sparsity()}
    return masks, info


def measure(method: str, causal: bool, n: int, cfg: Config) -> dict[str, Any]:
    """One (method, causal, n) point: BlockMasks, output errors, the flex backward's error if
    any, then the forward (and forward + backward where flex has one) timed paired."""
    torch.compiler.reset()  # each point compiles afresh: no recompile limit, no dynamic shapes
    sync = torch.cuda.synchronize if cfg.device.type == "cuda" else (lambda: None)
    module = build_module(method, cfg)
    args = inputs(n, cfg)
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    masks, mask_info = build_masks(flex_mask(method, module, n, causal, cfg.device), n, cfg,
                                   torch.compile(create_block_mask, dynamic=False))
    record: dict[str, Any] = {
        "method": method, "causal": causal, "n": n, "options": module.extra_repr(),
        "block_mask": mask_info, "compile_s": {}, "max_abs_error": {},
    }
    calls: dict[str, Callable[..., Tensor]] = {
        "effattn": lambda q, k, v: module(q, k, v, causal=causal),
        **{name: lambda q, k, v, m=m: flex(q, k, v, block_mask=m) for name, m in masks.items()},
    }
    with torch.no_grad():
        ours = calls["effattn"](*args).float()
        for name in masks:
            start = time.perf_counter()
            theirs = calls[name](*args).float()
            sync()
            record["compile_s"][name] = time.perf_counter() - start
            record["max_abs_error"][name] = (theirs - ours).abs().max().item()
    worst = max(record["max_abs_error"].values())
    if worst > TOLERANCE[cfg.dtype]:
        raise RuntimeError(f"{method} causal={causal} N={n}: flex and effattn differ by "
                           f"{worst:.3g} (tolerance {TOLERANCE[cfg.dtype]:g}): the masks are not "
                           "the same")
    passes = {"fwd": {name: forward(call, args) for name, call in calls.items()}}
    error = backward_error(flex, args, next(iter(masks.values())))
    record["flex_backward_error"] = error
    if error is None:
        grads = tuple(x.detach().clone().requires_grad_() for x in args)
        passes["fwdbwd"] = {name: forward_backward(call, grads) for name, call in calls.items()}
    else:
        record["fwdbwd"] = {"status": f"not supported by FlexAttention on the {cfg.device.type}: "
                                      f"{error}"}
    timer = Clock(cfg.device)
    for pass_name, fns in passes.items():
        samples = paired(fns, cfg.repeats, timer)
        result: dict[str, Any] = {
            "repeats": cfg.repeats,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()},
            "effattn_speedup": {k: median_ratio(samples[k], samples["effattn"]) for k in masks},
        }
        if cfg.device.type == "cuda":
            result["peak_mib"] = {k: peak_mib(fn) for k, fn in fns.items()}
        record[pass_name] = result
    record["loadavg"] = os.getloadavg()
    return record


def forward(call: Callable[..., Tensor], args: tuple[Tensor, ...]) -> Callable[[], object]:
    """A no-grad forward of ``call`` on ``args``, ready to time."""

    def run() -> object:
        with torch.no_grad():
            return call(*args)

    return run


def forward_backward(call: Callable[..., Tensor], args: tuple[Tensor, ...]) -> Callable[[], None]:
    """Forward and backward of ``call`` on ``args`` (leaves requiring grad). The gradients are
    dropped after the backward, so that no accumulation is timed and the next call's peak memory
    is measured above the inputs alone."""

    def run() -> None:
        call(*args).float().sum().backward()
        for x in args:
            x.grad = None

    return run


def summary(record: dict[str, Any]) -> str:
    """One line of progress: the forward times and speed-ups and the output errors of a point."""
    fwd = record["fwd"]
    parts = [f"effattn {fwd['median_ms']['effattn']:.1f} ms"]
    parts += [f"{k} {fwd['median_ms'][k]:.1f} ms ({fwd['effattn_speedup'][k]:.2f}x, "
              f"err {record['max_abs_error'][k]:.1e})" for k in fwd["effattn_speedup"]]
    return f"{label(record):>14} N={record['n']:<6} " + ", ".join(parts)


def label(record: dict[str, Any]) -> str:
    """The method's name in tables: ``local causal`` for the causal form."""
    return f"{record['method']}{' causal' if record['causal'] else ''}"


def table(records: list[dict[str, Any]], block_sizes: list[int], pass_name: str) -> list[str]:
    """Markdown rows of one pass: times, effattn speed-ups, errors, BlockMask creation, load."""
    names = [f"flex-b{s}" for s in block_sizes]
    head = ["method", "N", "effattn ms"]
    for name in names:
        head += [f"{name} ms", f"effattn speed-up vs {name}"]
    head += ["max abs error", "BlockMask ms (first, then median)", "load (1 min)"]
    if any("peak_mib" in r.get(pass_name, {}) for r in records):
        head.insert(3 + 2 * len(names), "peak MiB (effattn, " + ", ".join(names) + ")")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        p = r.get(pass_name, {})
        if "median_ms" not in p:
            continue
        cells = [label(r), str(r["n"]), f"{p['median_ms']['effattn']:.1f}"]
        for name in names:
            cells += [f"{p['median_ms'][name]:.1f}", f"{p['effattn_speedup'][name]:.2f}x"]
        if "peak_mib" in p:
            cells.append(", ".join(f"{v:.0f}" for v in p["peak_mib"].values()))
        cells.append(", ".join(f"{r['max_abs_error'][n]:.1e}" for n in names))
        cells.append(", ".join(f"{r['block_mask'][n]['first_ms']:.0f} then "
                               f"{r['block_mask'][n]['median_ms']:.1f}" for n in names))
        cells.append(f"{r['loadavg'][0]:.1f}")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown: conditions, the forward table, forward + backward or why not."""
    records, sizes = result["records"], result["block_sizes"]
    shape = result["shape"]
    lines = [
        "# effattn vs compiled FlexAttention, same masks",
        "",
        f"`{result['command']}`",
        "",
        f"{describe(result['machine'])}; {result['machine'].get('cuda_device', 'cpu')}, "
        f"B={shape['batch']}, "
        f"H={shape['heads']}, D={shape['head_dim']}, {shape['dtype']}; load average at the start "
        f"{', '.join(f'{x:.1f}' for x in result['loadavg_start'])} (1, 5, 15 min).",
        "",
        "Speed-up: median over the repeats of the per-repeat ratio flex / effattn (> 1: effattn "
        "is faster). `flex-bS`: FlexAttention with a BlockMask of BLOCK_SIZE S. BlockMask ms: "
        "compiled `create_block_mask`, first call (with its compilation), then the median of "
        f"{MASK_REPEATS} calls; not in the forward times, nor is flex's compile warm-up.",
        "",
        "## Forward",
        "",
        *table(records, sizes, "fwd"),
        "",
        "## Forward + backward",
        "",
    ]
    statuses = {r["fwdbwd"]["status"] for r in records if "status" in r.get("fwdbwd", {})}
    lines += sorted(statuses) or table(records, sizes, "fwdbwd")
    return "\n".join(lines) + "\n"


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", choices=list(CAUSAL), default=list(CAUSAL))
    p.add_argument("--lengths", nargs="+", type=positive_int, default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=positive_int, default=7, help="paired samples per pass")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's)")
    p.add_argument("--window", type=positive_int, default=128, help="local and longformer window")
    p.add_argument("--block-sizes", nargs="+", type=positive_int, default=[128, 64],
                   help="BLOCK_SIZE of flex's BlockMask, each timed as its own implementation")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--out", type=Path, default=Path("benchmarks/flex"),
                   help="folder of results.json and results.md")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(torch.device(args.device), DTYPES[args.dtype], args.block_sizes, args.repeats,
                 args.window)
    machine = machine_info()
    if cfg.device.type == "cuda":
        machine["cuda_device"] = torch.cuda.get_device_name(cfg.device)
    print(describe(machine) + (f"; {machine['cuda_device']}" if "cuda_device" in machine else ""))
    result: dict[str, Any] = {
        "command": " ".join(["flex.py", *(sys.argv[1:] if argv is None else argv)]),
        "shape": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": args.dtype,
                  "device": args.device},
        "block_sizes": args.block_sizes, "machine": machine, "loadavg_start": os.getloadavg(),
        "records": [],
    }
    interrupted: list[int] = []

    def on_interrupt(signum: int, frame: object) -> None:
        # torch.compile can swallow the KeyboardInterrupt raised here (seen once while it
        # compiled create_block_mask): the flag then drops the point and stops the run after it.
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        for n in args.lengths:
            for method in args.methods:
                for causal in CAUSAL[method]:
                    record = measure(method, causal, n, cfg)
                    if interrupted:
                        raise KeyboardInterrupt
                    result["records"].append(record)
                    write_json(args.out / "results.json", result)
                    atomic_write(args.out / "results.md", markdown(result))
                    print(summary(record), flush=True)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the points measured so far are in {args.out}", file=sys.stderr)
        sys.exit(130)
    print("\n" + markdown(result))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")


if __name__ == "__main__":
    main()
