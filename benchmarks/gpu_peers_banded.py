"""effattn's banded methods on a GPU against their peers, in one process: compiled FlexAttention
with the same mask, flash SDPA for reformer.

For each method (its options below), length N, dtype and pass (forward ``fwd``, forward +
backward ``fwdbwd``) it writes rows of the schema shared with benchmarks/gpu_peers.py::

    {impl: effattn|flex|sdpa, method, n, batch, heads, causal, pass, dtype, ms, peak_mib,
     device, compile_s}

- ``effattn``: the registered method (``effattn.build``), which on CUDA runs the banded engine's
  FlexAttention strategy (effattn.sparse.flex);
- ``flex``: what a user would write by hand: ``torch.compile(flex_attention)`` with the same
  BlockMask (the one effattn caches for the pattern, built from the pattern's rule) and the
  same score_mod (soft cap), no log-sum-exp, no dtype handling: the target of the issue's goal
  (effattn at most 1.15x flex);
- ``sdpa``: ``scaled_dot_product_attention`` over all keys (flash in bf16), the peer of
  ``reformer`` (and of nothing else: it computes another pattern).

The window hybrid (``linear`` with ``window=128``, effattn only) is measured beside the pure
``linear`` and ``local`` (window 128, causal), the two parts it is made of. ``ms``: median of
``--repeats`` paired samples (CUDA events), the implementations of a point alternating;
``peak_mib``: ``torch.cuda.max_memory_allocated`` above the inputs, one more call;
``compile_s``: the first call's seconds (compilation and BlockMask included), excluded from
``ms``; the file also keeps ``effattn.sparse.flex.COMPILE_SECONDS`` (``flex_compile_seconds``).
A failure (out of memory, a refusal) is a row with ``ms`` null and ``error``. Rows are written
atomically to ``--out`` (JSON) after every point, and a PNG beside it at the end.

    PYTHONPATH=src python3 benchmarks/gpu_peers_banded.py           # N 4096 16384 65536
    PYTHONPATH=src python3 benchmarks/gpu_peers_banded.py --methods local bigbird \\
        --lengths 16384 --dtypes bfloat16
    PYTHONPATH=src python3 benchmarks/gpu_peers_banded.py --device cpu --smoke  # the test's

Without CUDA (and without ``--device cpu``) it prints one line and exits with status 2. On the
CPU (``--smoke``: N = 256, two heads, fp32, forward only) FlexAttention runs its eager form,
which has no backward there; the numbers mean nothing, the run checks that the script works.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import effattn
from effattn import strategy
from effattn.sparse import flex as flex_strategy
from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import save_figure, write_json
from effattn.tools.bench.timing import Clock, paired, time_once

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Config:
    """A measured method: its name in the rows, effattn method and options, call inputs, the
    causal forms, and its peer (``flex``, ``sdpa`` or None: effattn only)."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)
    causal: tuple[bool, ...] = (False,)
    peer: str | None = "flex"


CONFIGS = [
    Config("local", "local", {"window": 128}, causal=(False, True)),
    Config("longformer", "longformer", {"window": 128}),
    Config("bigbird", "bigbird"),
    Config("sparse-strided", "sparse-strided", causal=(True,)),
    Config("sparse-fixed", "sparse-fixed", causal=(True,)),
    # Window 1024, or N / 4 where that is shorter (a window of N would be plain causal SDPA).
    Config("softmax+window1024", "softmax", call={"sliding_window": 1024}, causal=(True,)),
    Config("softmax+softcap50", "softmax", {"softcap": 50.0}, causal=(False, True)),
    Config("linear+window128", "linear", {"window": 128}, causal=(True,), peer=None),
    Config("linear", "linear", causal=(True,), peer=None),
    Config("reformer", "reformer", causal=(False, True), peer="sdpa"),
]


def _pattern(module: torch.nn.Module, q: Tensor, causal: bool,
             call: dict[str, Any]) -> tuple[list, dict[str, Any]]:
    """The pieces and keyword arguments the module hands the banded engine for q's shape."""
    seen: list[tuple[list, dict[str, Any]]] = []
    real = flex_strategy.sparse_attention

    def record(q, k, v, pieces, **kwargs):
        seen.append((list(pieces), kwargs))
        return real(q, k, v, pieces, **kwargs)

    flex_strategy.sparse_attention = record
    try:
        with torch.no_grad(), strategy.force(banded="flex"):
            module(q, q, q, causal=causal, **call)
    finally:
        flex_strategy.sparse_attention = real
    if len(seen) != 1:
        raise RuntimeError(f"expected one banded call, saw {len(seen)}")
    return seen[0]


def _flex_peer(module: torch.nn.Module, q: Tensor, causal: bool,
               call: dict[str, Any]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Compiled flex_attention with the module's BlockMask and score_mod."""
    from torch.nn.attention.flex_attention import flex_attention

    pieces, kwargs = _pattern(module, q, causal, call)
    mask = flex_strategy.block_mask(pieces, q.shape[1], q.shape[2], q.device)
    modify = flex_strategy.score_mod(kwargs.get("softcap"), None)
    kernel = torch.compile(flex_attention, dynamic=False) if q.device.type == "cuda" \
        else flex_attention

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the CPU's eager form warns
            return kernel(q, k, v, score_mod=modify, block_mask=mask, scale=kwargs["scale"])

    return run


def _calls(config: Config, module: torch.nn.Module, q: Tensor,
           causal: bool) -> dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    calls: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
        "effattn": lambda q, k, v: module(q, k, v, causal=causal, **config.call)}
    if config.peer == "flex":
        calls["flex"] = _flex_peer(module, q, causal, config.call)
    elif config.peer == "sdpa":
        calls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return calls


def _pass(fn: Callable[[Tensor, Tensor, Tensor], Tensor], inputs: list[Tensor],
          backward: bool) -> Callable[[], None]:
    if not backward:
        def forward() -> None:
            with torch.no_grad():
                fn(*inputs)
        return forward
    grad = torch.randn_like(inputs[2])

    def both() -> None:
        fn(*inputs).backward(grad)
        for x in inputs:
            x.grad = None
    return both


def _peak_mib(run: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def measure(config: Config, n: int, dtype: torch.dtype, causal: bool, backward: bool,
            args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one point: every implementation of ``config``, paired."""
    device = torch.device(args.device)
    call = {key: min(value, n // 4) if key == "sliding_window" else value
            for key, value in config.call.items()}
    config = Config(config.label, config.method, config.options, call, config.causal,
                    config.peer)
    common = {"method": config.label, "n": n, "batch": args.batch, "heads": args.heads,
              "causal": causal, "pass": "fwdbwd" if backward else "fwd",
              "dtype": str(dtype).removeprefix("torch."), "device": args.device_name,
              "options": {**config.options, **config.call}}
    gen = torch.Generator(device="cpu").manual_seed(n)
    inputs = [torch.randn(args.batch, args.heads, n, args.head_dim, generator=gen)
              .to(device=device, dtype=dtype).requires_grad_(backward) for _ in range(3)]
    try:
        module = effattn.build(config.method, head_dim=args.head_dim, heads=args.heads, seed=0,
                               **config.options).eval().to(device)
        runs = {impl: _pass(fn, inputs, backward)
                for impl, fn in _calls(config, module, inputs[0].detach(), causal).items()}
        clock = Clock(device)
        compile_s = {impl: time_once(run, clock) for impl, run in runs.items()}
        peak = {impl: _peak_mib(run, device) for impl, run in runs.items()}
        samples = paired(runs, args.repeats, clock)
    except Exception as err:  # noqa: BLE001 - a failed point is a row; the sweep goes on
        if device.type == "cuda":
            torch.cuda.empty_cache()
        message = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        return [{**common, "impl": "effattn", "ms": None, "peak_mib": None, "compile_s": None,
                 "error": message}]
    rows = []
    for impl, times in samples.items():
        times = sorted(times)
        rows.append({**common, "impl": impl, "ms": 1e3 * times[len(times) // 2],
                     "peak_mib": peak[impl], "compile_s": compile_s[impl]})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """ms against N, one panel per (dtype, pass), a line per (impl, method, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["pass"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 5),
                             squeeze=False)
    for ax, (dtype, pass_name) in zip(axes[0], panels, strict=False):
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if (r["dtype"], r["pass"]) == (dtype, pass_name) and r["ms"] is not None:
                name = f"{r['impl']} {r['method']}{' causal' if r['causal'] else ''}"
                lines.setdefault(name, []).append((r["n"], r["ms"]))
        for name, points in sorted(lines.items()):
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o",
                    linestyle="--" if not name.startswith("effattn") else "-", label=name)
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel="ms",
               title=f"{dtype}, {pass_name}")
        ax.legend(fontsize=6)
    fig.suptitle(rows[0]["device"] if rows else "", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (N 256, 2 heads, fp32, forward, 2 repeats): the test's run")
    p.add_argument("--methods", nargs="+", default=[c.label for c in CONFIGS],
                   choices=[c.label for c in CONFIGS])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES),
                   default=["bfloat16", "float32"])
    p.add_argument("--passes", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("benchmarks/gpu/peers/banded.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_peers_banded.py: no CUDA device visible to torch; nothing measured "
              "(--device cpu --smoke checks the script)", file=sys.stderr)
        return 2
    if args.smoke:
        args.lengths, args.dtypes, args.passes = [256], ["float32"], ["fwd"]
        args.heads, args.head_dim, args.repeats = 2, 16, 2
    if device.type != "cuda" and "fwdbwd" in args.passes:
        p.error("FlexAttention has no CPU backward: --passes fwd on the CPU")
    info = machine_info(device)
    args.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    configs = [c for c in CONFIGS if c.label in args.methods]
    rows: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for dtype in args.dtypes:
        for n in args.lengths:
            for config in configs:
                for causal in config.causal:
                    for pass_name in args.passes:
                        point = measure(config, n, DTYPES[dtype], causal, pass_name == "fwdbwd",
                                        args)
                        rows.extend(point)
                        for r in point:
                            ms = "failed" if r["ms"] is None else f"{r['ms']:.3f} ms"
                            print(f"{r['impl']:>8} {r['method']:>20} n={n:<6} "
                                  f"{'causal' if causal else 'full':>6} {pass_name:>6} "
                                  f"{dtype:>8} {ms} {r.get('error', '')}", flush=True)
                        write_json(args.out, {
                            "command": " ".join(["gpu_peers_banded.py",
                                                 *(sys.argv[1:] if argv is None else argv)]),
                            "started_utc": started, "machine": describe(info),
                            "torch": torch.__version__, "rows": rows,
                            # The strategy's own first-call time per compiled shape.
                            "flex_compile_seconds": dict(flex_strategy.COMPILE_SECONDS)})
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
