"""Decoding benchmark (``effattn decode``): speed and memory of token-by-token generation.

A run is one (method entry, batch size) pair, measured in its own fresh worker process
(:func:`effattn.tools.bench.speed.run_isolated`), which:

1. builds ``DecoderLM(vocab, d_model, heads, layers, method, seed=0, **options).eval()`` (the
   kernelized methods with their library-default feature counts);
2. warms up (prefill of the prompt and ``WARM_STEPS`` steps on a throwaway state), so that thread
   pools and lazily built state exist before the memory baseline;
3. prefills a random prompt (B, prompt_len) with the parallel path (``DecoderLM.prefill``);
4. decodes greedily, one token per step (``DecoderLM.step``, then the argmax of the logits, which
   is the next input), under ``torch.inference_mode``, timing every step with
   ``time.perf_counter`` (synchronising the device on CUDA);
5. at every report length L (decoded tokens, i.e. steps) records a point: tokens/s over the L
   steps, the per-token time near position L (median of the last ``TAIL_STEPS`` steps), the
   exact bytes of the decoding state (all layers) in use and allocated, and the peak memory growth
   since decoding started (:class:`~effattn.tools.bench.memory.PeakMemory`: the process's RSS on the
   CPU, the allocator's peak on CUDA).

One run decodes once to the largest length. When the decode has taken longer than
``max_seconds`` it stops: the lengths reached are recorded, the rest are ``too slow``.

The summary numbers (:func:`summarize`) are computed from the records alone: flatness of the
per-token time, the state as a percentage of softmax's KV cache, speed-ups over softmax.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from effattn.nn.models import DecoderLM, DecoderState
from effattn.registry import DEFAULT_METHOD
from effattn.tools.bench.memory import MiB, PeakMemory
from effattn.tools.bench.results import ResultStore
from effattn.tools.bench.speed import SweepStats, classify_error, format_options, run_isolated
from effattn.tools.bench.timing import synchronizer

# Steps whose median is the per-token time "near position L".
TAIL_STEPS = 32
WARM_STEPS = 8

# Goals of the decoding benchmark (see docs/benchmarks.md).
FLAT_GOAL = 1.2  # per-token time at the largest length over the smallest, at most
FLAT_GOAL_SPAN = (128, 8192)  # ... over at least these lengths (shorter spans say nothing)
STATE_GOAL_PCT = 10.0  # state as % of softmax's KV cache (in use), below
GOAL_LENGTH = 2048  # output length of the memory goal and of the headline speed-up
RFA_CLAIMS = ("Peng et al. 2021 (RFA): about 2x faster decoding than softmax in machine "
              "translation at equal quality; up to 12x faster, with less than 10% of the memory, "
              "for 2,048-token outputs")

KEY_FIELDS = ("method", "batch", "length", "d_model", "heads", "layers", "vocab", "prompt_len",
              "device")
CSV_FIELDS = (*KEY_FIELDS, "status", "ms_per_token", "tokens_per_s", "state_mib", "state_bytes",
              "state_alloc_bytes", "peak_mib", "decode_s", "timestamp")
_MEASURED = ("ms_per_token", "tokens_per_s", "state_bytes", "state_alloc_bytes", "peak_mib",
             "decode_s")


@dataclass(frozen=True)
class DecodeConfig:
    """One run: a method entry (name and options) at one batch size, decoded to ``max(lengths)``."""

    method: str
    lengths: tuple[int, ...]
    options: tuple[tuple[str, Any], ...] = ()
    batch: int = 1
    d_model: int = 256
    heads: int = 4
    layers: int = 2
    vocab: int = 256
    prompt_len: int = 16
    device: str = "cpu"

    @property
    def label(self) -> str:
        """The entry as one word, ``name:key=value,...`` (the ``method`` field of its records)."""
        return self.method + (f":{format_options(self.options)}" if self.options else "")

    def fields(self, length: int) -> dict[str, Any]:
        """The identifying fields of this run's record at report length ``length``."""
        return {"method": self.label, "batch": self.batch, "length": length,
                "d_model": self.d_model, "heads": self.heads, "layers": self.layers,
                "vocab": self.vocab, "prompt_len": self.prompt_len, "device": self.device}


def state_bytes(state: Any) -> tuple[int, int]:
    """(in use, allocated) bytes of one attention layer's decoding state.

    Every method's decoding state says both (``nbytes_in_use()``, ``nbytes()``): a KV cache grows
    by doubling beyond the positions seen, a window cache fills its ring, a recurrent state is
    fixed-size and all in use.
    """
    if not (hasattr(state, "nbytes") and hasattr(state, "nbytes_in_use")):
        raise TypeError(f"no byte count for a decoding state of type {type(state).__name__}")
    return state.nbytes_in_use(), state.nbytes()


def decoder_state_bytes(state: DecoderState) -> tuple[int, int]:
    """(in use, allocated) bytes of a model's decoding state: the sum over its layers."""
    sizes = [state_bytes(layer.self_state) for layer in state.layers]
    return sum(u for u, _ in sizes), sum(a for _, a in sizes)


def point(times: Sequence[float], state: DecoderState, peak_bytes: int) -> dict[str, Any]:
    """The measurements after ``len(times)`` decoding steps of ``times`` seconds each."""
    in_use, allocated = decoder_state_bytes(state)
    total = sum(times)
    return {"length": len(times), "status": "ok",
            "ms_per_token": statistics.median(times[-TAIL_STEPS:]) * 1e3,
            "tokens_per_s": len(times) / total, "decode_s": total,
            "state_bytes": in_use, "state_alloc_bytes": allocated,
            "peak_mib": peak_bytes / MiB}


def decode_points(
    step: Callable[[Tensor, DecoderState], tuple[Tensor, DecoderState]],
    token: Tensor,
    state: DecoderState,
    lengths: Sequence[int],
    *,
    max_seconds: float,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """Decode greedily from ``token`` (B,) and ``state`` to ``max(lengths)`` steps; one point
    per length (:func:`point`, or a status for the lengths not reached).

    ``step`` is ``DecoderLM.step``. A step that raises (e.g. out of memory) ends the decode, and
    so does passing ``max_seconds`` of decoding; the lengths reached keep their points.
    """
    pending = sorted(set(lengths))
    sync = synchronizer(device)
    points: list[dict[str, Any]] = []
    times: list[float] = []
    status = "ok"  # replaced by the reason the decode stopped early, if it does
    try:
        with torch.inference_mode(), PeakMemory(device) as mem:
            start = time.perf_counter()
            while pending:
                t0 = time.perf_counter()
                logits, state = step(token, state)
                token = logits.argmax(-1)
                sync()
                times.append(time.perf_counter() - t0)
                if len(times) == pending[0]:
                    points.append(point(times, state, mem.read()))
                    pending.pop(0)
                if pending and time.perf_counter() - start > max_seconds:
                    last = points[-1]["length"] if points else "none"
                    status = (f"too slow: decoding passed --max-seconds {max_seconds:g} s after "
                              f"{len(times)} tokens (last length reached: {last})")
                    break
    except Exception as err:  # every failure becomes a status; the lengths reached are kept
        status = classify_error(err)
    return points + [{"length": n, "status": status} for n in pending]


def _warm_up(model: DecoderLM, prompt: Tensor) -> None:
    with torch.inference_mode():
        logits, state = model.prefill(prompt)
        token = logits[:, -1].argmax(-1)
        for _ in range(WARM_STEPS):
            logits, state = model.step(token, state)
            token = logits.argmax(-1)


def measure_decode(cfg: DecodeConfig, max_seconds: float) -> dict[str, Any]:
    """Run ``cfg`` in this process (meant to be a fresh worker): ``{"status", "points"}``."""
    device = torch.device(cfg.device)
    try:
        model = DecoderLM(cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, cfg.method, seed=0,
                          **dict(cfg.options))
    except (ValueError, TypeError) as err:
        return {"status": classify_error(err)}
    model = model.to(device).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(cfg.vocab, (cfg.batch, cfg.prompt_len), generator=gen, device=device)
    _warm_up(model, prompt)
    synchronizer(device)()
    with torch.inference_mode():
        logits, state = model.prefill(prompt)
    points = decode_points(model.step, logits[:, -1].argmax(-1), state, cfg.lengths,
                           max_seconds=max_seconds, device=device)
    return {"status": "ok", "points": points}


def make_records(cfg: DecodeConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per report length of ``cfg`` from a run's result (its points, or the run's
    status for every length when it produced none: refused, timeout, oom, error)."""
    by_length = {p["length"]: p for p in result.get("points", ())}
    stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    records = []
    for length in sorted(cfg.lengths):
        p = by_length.get(length, {"status": result["status"]})
        record = {**cfg.fields(length), "status": p["status"]}
        record.update({key: p.get(key) for key in _MEASURED})
        record["state_mib"] = None if p.get("state_bytes") is None else p["state_bytes"] / MiB
        record["timestamp"] = stamp
        records.append(record)
    return records


def open_store(folder: Any) -> ResultStore:
    """The resumable store of ``effattn decode`` records in ``folder``."""
    return ResultStore(folder, KEY_FIELDS, CSV_FIELDS)


def is_done(store: ResultStore, cfg: DecodeConfig) -> bool:
    """Does ``store`` hold a record for every report length of ``cfg``?"""
    return all(store.get(cfg.fields(n)) is not None for n in cfg.lengths)


def run_all(
    configs: Sequence[DecodeConfig],
    store: ResultStore,
    *,
    max_seconds: float,
    timeout: float,
    progress: bool = True,
) -> SweepStats:
    """Run every configuration not already complete in ``store``, each in a fresh worker,
    saving its records as soon as it finishes."""
    stats = SweepStats()
    bar = tqdm(configs, desc="effattn decode", unit="run", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    for cfg in bar:
        bar.set_postfix_str(f"{cfg.label} B={cfg.batch}", refresh=False)
        if is_done(store, cfg):
            stats.resumed += 1
            continue
        result = run_isolated(measure_decode, (cfg, max_seconds), timeout)
        for record in make_records(cfg, result):
            store.add(record)
        stats.measured += 1
    bar.close()
    return stats


# Summary: pure functions of the records.

def _index(records: Iterable[dict[str, Any]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    return {(r["method"], r["batch"], r["length"]): r for r in records}


def _ok(record: dict[str, Any] | None, value: str) -> bool:
    return record is not None and record["status"] == "ok" and bool(record.get(value))


def speedups(records: Iterable[dict[str, Any]], method: str, batch: int,
             baseline: str = DEFAULT_METHOD) -> dict[str, dict[int, float]]:
    """Speed-ups of ``method`` over ``baseline`` at every length both reached, at one batch.

    ``tokens_per_s``: ratio of the tokens/s over the whole output of L tokens (time to generate
    it); ``at_position``: ratio of the per-token times near position L.
    """
    index = _index(records)
    lengths = sorted(n for m, b, n in index if m == method and b == batch)
    out: dict[str, dict[int, float]] = {"tokens_per_s": {}, "at_position": {}}
    for n in lengths:
        r, base = index[method, batch, n], index.get((baseline, batch, n))
        if _ok(r, "tokens_per_s") and _ok(base, "tokens_per_s"):
            out["tokens_per_s"][n] = r["tokens_per_s"] / base["tokens_per_s"]
        if _ok(r, "ms_per_token") and _ok(base, "ms_per_token"):
            out["at_position"][n] = base["ms_per_token"] / r["ms_per_token"]
    return out


def flatness(records: Iterable[dict[str, Any]], method: str,
             batch: int) -> tuple[float, int, int] | None:
    """(per-token time at the largest length reached / at the smallest, smallest, largest);
    None with fewer than two lengths measured."""
    rows = {r["length"]: r for r in records
            if r["method"] == method and r["batch"] == batch and _ok(r, "ms_per_token")}
    if len(rows) < 2:
        return None
    lo, hi = min(rows), max(rows)
    return rows[hi]["ms_per_token"] / rows[lo]["ms_per_token"], lo, hi


def state_percent(records: Iterable[dict[str, Any]], method: str, batch: int, length: int,
                  baseline: str = DEFAULT_METHOD) -> float | None:
    """The decoding state of ``method`` after ``length`` tokens as % of the baseline's (its KV
    cache, bytes in use) at the same length and batch; None where either is missing."""
    index = _index(records)
    r, base = index.get((method, batch, length)), index.get((baseline, batch, length))
    if not (_ok(r, "state_bytes") and _ok(base, "state_bytes")):
        return None
    return 100.0 * r["state_bytes"] / base["state_bytes"]


def flat_goal_applies(lengths: Sequence[int] | None) -> bool:
    """Does a flatness measured from ``lengths[0]`` to ``lengths[1]`` span the goal's lengths?"""
    return lengths is not None and lengths[0] <= FLAT_GOAL_SPAN[0] \
        and lengths[1] >= FLAT_GOAL_SPAN[1]


def summarize(records: Sequence[dict[str, Any]], length: int,
              baseline: str = DEFAULT_METHOD) -> list[dict[str, Any]]:
    """One row per (method, batch): flatness, state as % of the baseline at ``length``, the
    speed-ups at every length, and whether each goal is met. A goal is judged only where it is
    defined: the state goal at ``GOAL_LENGTH`` tokens, the flatness goal over a span covering
    ``FLAT_GOAL_SPAN``; elsewhere, or where a record is not ok, it is None."""
    rows = []
    for method, batch in sorted({(r["method"], r["batch"]) for r in records},
                                key=lambda mb: (mb[1], mb[0] != baseline, mb[0])):
        flat = flatness(records, method, batch)
        pct = state_percent(records, method, batch, length, baseline)
        ups = speedups(records, method, batch, baseline)
        rows.append({
            "method": method, "batch": batch,
            "flatness": None if flat is None else flat[0],
            "flatness_lengths": None if flat is None else [flat[1], flat[2]],
            "flat_goal_met": flat[0] <= FLAT_GOAL if flat and flat_goal_applies(flat[1:])
            else None,
            "state_length": length, "state_pct_of_softmax": pct,
            "state_goal_met": pct < STATE_GOAL_PCT if pct is not None and length == GOAL_LENGTH
            else None,
            "speedup": ups["tokens_per_s"], "speedup_at_position": ups["at_position"],
            "speedup_at_goal_length": ups["tokens_per_s"].get(length),
        })
    return rows


def with_speedup(records: Sequence[dict[str, Any]],
                 baseline: str = DEFAULT_METHOD) -> list[dict[str, Any]]:
    """Copies of ``records`` with ``speedup``: tokens/s over the baseline's at the same batch
    and length (None where either did not finish)."""
    index = _index(records)
    out = []
    for r in records:
        base = index.get((baseline, r["batch"], r["length"]))
        ok = _ok(r, "tokens_per_s") and _ok(base, "tokens_per_s")
        out.append({**r, "speedup": r["tokens_per_s"] / base["tokens_per_s"] if ok else None})
    return out
