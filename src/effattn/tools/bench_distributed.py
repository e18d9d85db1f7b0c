"""Sequence-parallel benchmark (``effattn bench-distributed``): per-rank memory, time and bytes
communicated of one attention layer split across P processes (:mod:`effattn.distributed`).

A configuration is (method, N, P, batch, heads, head dim, dtype, causal, method options, memory
budget). Each is measured by P fresh processes started with ``torch.multiprocessing`` (spawn),
joined in a gloo process group on the CPU; rank r holds slice r (N / P tokens) of q, k, v
(B, H, N, D) and calls :class:`~effattn.distributed.SequenceParallel` around the module of
``effattn.build(name, head_dim=D, heads=H, max_len=N, seed=0)`` in eval mode (P = 1 runs the same
code on a group of one). Every rank:

1. uses one thread, so that P ranks need P cores. With more threads than free cores, torch's
   OpenMP threads wait for each other: on the 2-core machine of docs/distributed.md, with other
   work running, a performer forward at N = 4096 took 1.4 s on 2 threads and 85 ms on one. With
   more ranks than cores, the ranks share them and the times are not speed-ups;
2. warms up with one call of each pass at 32 tokens per rank, so that thread pools, the autograd
   engine and gloo's buffers exist before the memory baseline;
3. with a budget (``max_memory_mib``), caps its own address space at the current size plus the
   budget (:func:`~effattn.tools.bench.memory.cap_memory`): an allocation beyond it fails as
   ``oom``. The budget covers the rank's inputs and everything the call allocates;
4. reads its resident set (the baseline), makes its slices of q, k, v (requiring grad when
   "fwdbwd" is measured), and for each pass ("fwd" under ``torch.inference_mode``, then "fwdbwd",
   forward and ``out.sum().backward()``):
5. makes one call with the RSS high-water mark reset and the collectives counted
   (:class:`CollectiveBytes`): ``peak_mib`` is the high-water mark over the baseline (the
   rank's slices, the call's working memory, received buffers, output and gradients), and
   ``sent_bytes``/``received_bytes`` the tensor bytes handed to / returned by the collectives of
   that call (the header exchange included);
6. if the slowest rank's call took at most ``max_seconds``, times ``repeats`` samples of one call
   each, every sample started by a barrier (:func:`~effattn.tools.bench.timing.time_fn`); else the
   record is "too slow" (memory and bytes kept) and the later passes are skipped.

A record per pass holds the largest value over the ranks (``peak_mib``, ``sent_bytes``,
``median_ms``: the layer is done when its slowest rank is) and every rank's peak
(``peak_mib_ranks``). The sweep saves each record as it comes (resumable, like ``effattn
bench``) and skips a method's larger lengths at the same P after an oom, a timeout, an error or
"too slow", so that a doubling list of lengths under a budget finds the longest N that fits.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from tqdm import tqdm

import effattn
from effattn.distributed import SequenceParallel
from effattn.tools.bench.machine import cpu_label, machine_info
from effattn.tools.bench.memory import MiB, cap_memory, peak_rss_bytes, reset_peak_rss, rss_bytes
from effattn.tools.bench.plots import PASS_TITLES, panel
from effattn.tools.bench.results import ResultStore, write_json
from effattn.tools.bench.speed import DTYPES, PASSES, classify_error, format_options
from effattn.tools.bench.timing import time_fn

KEY_FIELDS = ("method", "length", "nproc", "pass", "batch", "heads", "head_dim", "dtype",
              "causal", "options", "max_memory_mib")
CSV_FIELDS = (*KEY_FIELDS, "status", "peak_mib", "inputs_mib", "runtime_mib", "sent_bytes",
              "received_bytes", "collectives", "median_ms", "iqr_ms", "samples", "peak_mib_ranks",
              "cpu", "timestamp")
_MEASURED = ("peak_mib", "inputs_mib", "runtime_mib", "sent_bytes", "received_bytes",
             "collectives", "median_ms", "iqr_ms", "samples")
# Statuses after which a method's larger lengths at the same P are not tried.
BLOCKING = ("too slow", "timeout", "oom", "error")
WARM_TOKENS = 32

# Goals of the benchmark (docs/distributed.md).
MEMORY_GOAL = 1.2  # per-rank peak x P / peak at P = 1, at most: memory per rank ∝ N / P


def supported_methods() -> list[str]:
    """The registered methods that :class:`~effattn.distributed.SequenceParallel` can split."""
    names = []
    for name in effattn.methods():
        try:
            SequenceParallel(effattn.build(name, head_dim=8, heads=1, max_len=64))
        except ValueError:
            continue
        names.append(name)
    return names


@dataclass(frozen=True)
class DistConfig:
    """One measured (method, N, P): both passes run in the same P processes."""

    method: str
    length: int
    nproc: int
    passes: tuple[str, ...] = PASSES
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    max_memory_mib: float | None = None

    def fields(self, pass_name: str) -> dict[str, Any]:
        """The identifying fields of this configuration's record for ``pass_name``."""
        return {"method": self.method, "length": self.length, "nproc": self.nproc,
                "pass": pass_name, "batch": self.batch, "heads": self.heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal,
                "options": format_options(self.options), "max_memory_mib": self.max_memory_mib}


@dataclass(frozen=True)
class DistSettings:
    """How each configuration is measured."""

    warmup: int = 1
    repeats: int = 3
    max_seconds: float = 20.0
    timeout: float = 600.0


class CollectiveBytes:
    """Context manager counting the tensors handed to ``torch.distributed.all_reduce`` and
    ``all_gather`` while it is active: the collectives :mod:`effattn.distributed.collectives`
    calls, looked up on ``torch.distributed`` at every call, so replacing them there sees them all.

    ``sent``: bytes of the tensor this rank contributes (all_reduce's tensor, all_gather's input);
    ``received``: bytes of what it gets back (all_reduce's tensor, all_gather's P outputs);
    ``calls``: collectives made. Bytes handed to the library, not bytes on the wire (a ring
    all-reduce moves about 2 (P - 1) / P times its tensor).
    """

    def __init__(self) -> None:
        self.sent = self.received = self.calls = 0

    def __enter__(self) -> CollectiveBytes:
        self._originals = dist.all_reduce, dist.all_gather
        all_reduce, all_gather = self._originals

        def counted_all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            self._count(tensor.nbytes, tensor.nbytes)
            return all_reduce(tensor, *args, **kwargs)

        def counted_all_gather(outputs: list[Tensor], tensor: Tensor, *args: Any,
                               **kwargs: Any) -> Any:
            self._count(tensor.nbytes, sum(t.nbytes for t in outputs))
            return all_gather(outputs, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
        return self

    def _count(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.calls += 1

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather = self._originals


def _caller(sp: SequenceParallel, pass_name: str, causal: bool, q: Tensor, k: Tensor,
            v: Tensor) -> Callable[[], None]:
    """One layer's call, as in ``effattn bench``: a forward under inference_mode, or forward and
    backward of out.sum() with the gradients reset to None first."""
    tensors = (q, k, v, *sp.parameters())

    def fwd() -> None:
        with torch.inference_mode():
            sp(q, k, v, causal=causal)

    def fwdbwd() -> None:
        for t in tensors:
            t.grad = None
        sp(q, k, v, causal=causal).sum().backward()

    return fwdbwd if pass_name == "fwdbwd" else fwd


def _slices(cfg: DistConfig, tokens: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.batch, cfg.heads, tokens, cfg.head_dim)
    grad = "fwdbwd" in cfg.passes
    return tuple(  # type: ignore[return-value]
        torch.randn(shape, generator=gen).to(DTYPES[cfg.dtype]).requires_grad_(grad)
        for _ in range(3))


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``, so that all ranks take the same decision."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure_rank(cfg: DistConfig, settings: DistSettings) -> dict[str, Any]:
    """This rank's measurements of ``cfg`` (the process group is initialised); see the module
    docstring. Returns {"status", "runtime_mib", "inputs_mib", "passes": {pass: {...}}}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = SequenceParallel(effattn.build(cfg.method, head_dim=cfg.head_dim, heads=cfg.heads,
                                        max_len=cfg.length, seed=0, **dict(cfg.options)).eval())
    warm = _slices(cfg, WARM_TOKENS, seed=rank)
    for p in cfg.passes:
        _caller(sp, p, cfg.causal, *warm)()
    del warm
    if cfg.max_memory_mib is not None:
        cap_memory("cpu", cfg.max_memory_mib)
    base = rss_bytes()
    result: dict[str, Any] = {"status": "ok", "runtime_mib": base / MiB,
                              "passes": {}}
    n = cfg.length // world
    q, k, v = _slices(cfg, n, seed=cfg.length * world + rank)
    result["inputs_mib"] = 3 * q.nbytes / MiB
    for p in cfg.passes:
        call = _caller(sp, p, cfg.causal, q, k, v)
        reset_peak_rss()
        with CollectiveBytes() as comm:
            start = time.perf_counter()
            call()
            first = time.perf_counter() - start
        row: dict[str, Any] = {"peak_mib": max(0, peak_rss_bytes() - base) / MiB,
                               "sent_bytes": comm.sent, "received_bytes": comm.received,
                               "collectives": comm.calls}
        result["passes"][p] = row
        slowest = _slowest(first)
        if slowest > settings.max_seconds:
            row["status"] = (f"too slow: one call took {slowest:.3g} s > --max-seconds "
                             f"{settings.max_seconds:g}")
            break
        timing = time_fn(call, repeats=settings.repeats, warmup=settings.warmup,
                         min_block_s=0.0, estimate_s=first, between=dist.barrier)
        row.update(status="ok", median_ms=timing.median * 1e3, iqr_ms=timing.iqr * 1e3,
                   samples=len(timing.samples))
    return result


def _rank_main(rank: int, cfg: DistConfig, settings: DistSettings, folder: str) -> None:
    """One spawned rank: join the group, measure, write ``rank<r>.json``, end the group. After a
    failure it writes its status and waits for the parent, which ends every rank."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(folder, 'init')}", rank=rank,
            world_size=cfg.nproc, timeout=datetime.timedelta(seconds=settings.timeout))
        result = measure_rank(cfg, settings)
    except Exception as err:  # noqa: BLE001  (the status reports it)
        result = {"status": classify_error(err)}
    write_json(Path(folder) / f"rank{rank}.json", result)
    if result["status"] == "ok":
        dist.destroy_process_group()
        return
    # The other ranks may wait in a collective that this rank will not join. Ending the group
    # would fail theirs with errors of their own, which the parent could report instead of this
    # one; exiting would leave the group and gloo's threads to interpreter shutdown, where their
    # teardown can abort the process (exit code -6), which the parent would report instead.
    threading.Event().wait()


def _read_ranks(folder: Path, nproc: int) -> list[dict[str, Any] | None]:
    paths = [folder / f"rank{r}.json" for r in range(nproc)]
    return [json.loads(p.read_text()) if p.exists() else None for p in paths]


def run_spawned(cfg: DistConfig, settings: DistSettings) -> tuple[str, list[dict[str, Any]]]:
    """Measure ``cfg`` in ``cfg.nproc`` fresh spawned processes: ("ok", every rank's result), or
    a failure status and no results ("timeout: ...", "oom: ..." for a rank the kernel killed, the
    first failing rank's error). The processes are ended on return, on failure and on Ctrl-C."""
    with tempfile.TemporaryDirectory(prefix="effattn-dist-") as tmp:
        folder = Path(tmp)
        context = mp.start_processes(_rank_main, args=(cfg, settings, tmp), nprocs=cfg.nproc,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + settings.timeout
        status = "ok"
        try:
            while not context.join(timeout=0.2):
                failed = [r["status"] for r in _read_ranks(folder, cfg.nproc)
                          if r is not None and r["status"] != "ok"]
                if failed:  # its partners wait in a collective that will not complete
                    status = failed[0]
                    break
                if time.monotonic() > deadline:
                    status = f"timeout: no result within --timeout {settings.timeout:g} s"
                    break
        except mp.ProcessExitedException as err:
            status = ("oom: a rank was killed by SIGKILL (likely the kernel's OOM killer)"
                      if err.signal_name == "SIGKILL"
                      else f"error: rank {err.error_index} exited with code {err.exit_code}")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        ranks = _read_ranks(folder, cfg.nproc)
    if status == "ok":
        status = next((r["status"] if r else "error: a rank wrote no result"
                       for r in ranks if r is None or r["status"] != "ok"), "ok")
    return (status, ranks) if status == "ok" else (status, [])  # type: ignore[return-value]


def make_records(cfg: DistConfig, status: str, ranks: Sequence[dict[str, Any]],
                 cpu: str) -> list[dict[str, Any]]:
    """One record per pass of ``cfg`` from the status and ranks of :func:`run_spawned`: the
    largest value over the ranks of each measurement, and every rank's peak."""
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    records, reason = [], None
    for p in cfg.passes:
        record = {**cfg.fields(p), "status": status, **dict.fromkeys(_MEASURED),
                  "peak_mib_ranks": None, "cpu": cpu, "timestamp": stamp}
        rows = [{**rank, **rank["passes"][p]} for rank in ranks if p in rank["passes"]]
        if status == "ok" and (reason or len(rows) < len(ranks)):
            record["status"] = f"skipped: {reason or 'an earlier pass failed'}"
        elif status == "ok":
            record["status"] = next((r["status"] for r in rows if r["status"] != "ok"), "ok")
            for key in _MEASURED:
                values = [r.get(key) for r in rows]
                record[key] = None if None in values else max(values)
            record["peak_mib_ranks"] = [r["peak_mib"] for r in rows]
            if record["status"] != "ok":
                reason = f"{record['status'].split(':')[0]} in {p}"
        records.append(record)
    return records


def open_store(folder: Any) -> ResultStore:
    """The resumable store of ``effattn bench-distributed`` records in ``folder``."""
    return ResultStore(folder, KEY_FIELDS, CSV_FIELDS)


@dataclass
class DistStats:
    measured: int = 0
    resumed: int = 0


def sweep(configs: Sequence[DistConfig], store: ResultStore, settings: DistSettings, *,
          progress: bool = True) -> DistStats:
    """Measure every configuration not already complete in ``store``, saving its records as soon
    as they are known. ``configs`` in increasing length: after an oom, a timeout, an error or
    "too slow" of a method at P, its larger lengths at P are recorded as skipped."""
    stats = DistStats()
    cpu = cpu_label(machine_info())
    blocked: dict[tuple[str, int, str], str] = {}
    bar = tqdm(configs, desc="effattn bench-distributed", unit="config", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    for cfg in bar:
        bar.set_postfix_str(f"{cfg.method} N={cfg.length} P={cfg.nproc}", refresh=False)
        stored = [store.get(cfg.fields(p)) for p in cfg.passes]
        if all(r is not None for r in stored):
            stats.resumed += 1
            records: list[dict[str, Any]] = stored  # type: ignore[assignment]
        else:
            reason = blocked.get((cfg.method, cfg.nproc, cfg.passes[0]))
            if reason:
                status, ranks = f"skipped: {reason}", []
            else:
                status, ranks = run_spawned(cfg, settings)
                stats.measured += 1
            records = make_records(cfg, status, ranks, cpu)
            for record in records:
                store.add(record)
        for record in records:
            status = record["status"]
            if status.startswith(BLOCKING):
                why = f"{status.split(':')[0]} at N={cfg.length}"
                for p in cfg.passes[cfg.passes.index(record["pass"]):]:
                    blocked.setdefault((cfg.method, cfg.nproc, p), why)
    bar.close()
    return stats


# Summary: pure functions of the records.

def _reached(record: dict[str, Any]) -> bool:
    """Did the measured call complete (memory and bytes known), whether or not it was timed?"""
    return record.get("peak_mib") is not None


def memory_scaling(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, pass, N and P > 1 measured at P = 1 too: ``ratio`` = per-rank peak x P / the
    peak at P = 1. Memory per rank ∝ N / P means a ratio near 1 (goal: <= :data:`MEMORY_GOAL`)."""
    index = {(r["method"], r["pass"], r["length"], r["nproc"]): r for r in records if _reached(r)}
    rows = []
    for (method, p, n, nproc), r in sorted(index.items()):
        single = index.get((method, p, n, 1))
        if nproc == 1 or single is None or not single["peak_mib"]:
            continue
        ratio = r["peak_mib"] * nproc / single["peak_mib"]
        rows.append({"method": method, "pass": p, "length": n, "nproc": nproc,
                     "peak_mib": r["peak_mib"], "peak_mib_p1": single["peak_mib"],
                     "ratio": ratio, "goal_met": ratio <= MEMORY_GOAL})
    return rows


def bytes_by_length(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, P and pass: the bytes sent per layer at each N, and whether they are the same
    at every measured N."""
    groups: dict[tuple[str, int, str], dict[int, int]] = {}
    for r in records:
        if _reached(r):
            groups.setdefault((r["method"], r["nproc"], r["pass"]), {})[r["length"]] = \
                r["sent_bytes"]
    return [{"method": m, "nproc": nproc, "pass": p, "sent_bytes": dict(sorted(by_n.items())),
             "independent_of_n": len(set(by_n.values())) == 1 and len(by_n) > 1}
            for (m, nproc, p), by_n in sorted(groups.items())]


def longest(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, P and pass: the longest N whose call completed (``None`` if none), its per-rank
    peak, and the first longer N that did not, with its status."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["method"], r["nproc"], r["pass"]), []).append(r)
    rows = []
    for (m, nproc, p), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["length"])
        done = [r for r in rs if _reached(r)]
        best = done[-1] if done else None
        shortest = best["length"] if best else 0
        beyond = [r for r in rs if not _reached(r) and r["length"] > shortest]
        rows.append({"method": m, "nproc": nproc, "pass": p,
                     "longest": best["length"] if best else None,
                     "peak_mib": best["peak_mib"] if best else None,
                     "budget_mib": rs[0]["max_memory_mib"],
                     "failed_at": beyond[0]["length"] if beyond else None,
                     "failed_status": beyond[0]["status"] if beyond else None})
    return rows


def grid(records: Iterable[dict[str, Any]], pass_name: str, value: str, fmt: str) -> str:
    """A text table of ``value`` for one pass: a row per (method, P), a column per N; a cell is
    the value wherever the call completed (also when too slow to time), else the status word."""
    rows: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in records:
        if r["pass"] == pass_name:
            rows.setdefault((r["method"], r["nproc"]), {})[r["length"]] = r
    lengths = sorted({n for by_n in rows.values() for n in by_n})

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        x = r.get(value)
        return r["status"].split(":")[0] if x is None else format(x, fmt)

    cells = [["method", "P", *map(str, lengths)]]
    cells += [[m, str(nproc), *(cell(by_n.get(n)) for n in lengths)]
              for (m, nproc), by_n in sorted(rows.items())]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(records: Sequence[dict[str, Any]], path: Path, *, value: str, ylabel: str,
         title: str, passes: Sequence[str]) -> None:
    """A grid of panels, a row per pass and a column per P: ``value`` against N (log-log), a line
    per method, from every record whose call completed."""
    import matplotlib.pyplot as plt

    nprocs = sorted({r["nproc"] for r in records}) or [1]
    names = sorted({r["method"] for r in records})
    # One y scale per row, so that heights compare across P.
    fig, axes = plt.subplots(len(passes), len(nprocs), figsize=(5.2 * len(nprocs),
                             4.2 * len(passes)), squeeze=False, sharey="row")
    for row, p in zip(axes, passes, strict=True):
        for ax, nproc in zip(row, nprocs, strict=True):
            series: dict[str, list[tuple[int, float, bool]]] = {}
            for r in records:
                if r["pass"] == p and r["nproc"] == nproc and _reached(r) and r.get(value):
                    series.setdefault(r["method"], []).append((r["length"], r[value], False))
            panel(ax, {m: sorted(s) for m, s in sorted(series.items())}, names,
                             xlabel="sequence length N (whole sequence)", ylabel=ylabel,
                             title=f"{title}, P = {nproc}: {PASS_TITLES.get(p, p)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(records: Sequence[dict[str, Any]], folder: Path,
                passes: Sequence[str]) -> list[str]:
    """memory.png (per-rank peak), bytes.png (bytes sent per layer) and, when any call was
    timed, time.png; the names written."""
    figures = [("memory.png", "peak_mib", "peak memory per rank (MiB)", "memory per rank"),
               ("bytes.png", "sent_bytes", "bytes sent per rank and layer", "communication")]
    if any(r.get("median_ms") for r in records):
        figures.append(("time.png", "median_ms", "time per layer call (ms)", "time"))
    for name, value, ylabel, title in figures:
        plot(records, folder / name, value=value, ylabel=ylabel, title=title, passes=passes)
    return [f[0] for f in figures]
