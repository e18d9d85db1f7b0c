"""Result records on disk, the crossover lengths, and terminal tables.

A record is a flat dict: the configuration's fields (method, length, pass, batch, heads,
head_dim, dtype, causal, device, options), a ``status`` ("ok", or "refused: ...",
"too slow: ...", "timeout: ...", "oom: ...", "skipped: ...", "error: ...") and the measurements
(median_ms, iqr_ms, peak_mib, flops, gflops, ...), whether the machine was ``disturbed`` during
the measurement (with the reference GEMM's ``slowdown`` and the ``attempts`` made; absent from
records of older versions) and the ``cpu`` that measured it. :class:`ResultStore` rewrites the
JSON list and the CSV atomically after every record, so an interrupted sweep loses at most the
configuration it was measuring, and a rerun with the same output folder skips what is already
there (except disturbed measurements, which it repeats).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from effattn.registry import DEFAULT_METHOD
from effattn.tools.bench.timing import MAX_SLOWDOWN, MAX_SPREAD

KEY_FIELDS = ("method", "length", "pass", "batch", "heads", "head_dim", "dtype", "causal",
              "device", "options")
# mkstemp creates files readable by their owner only; results are meant to be shared, so they get
# the mode a plain open() would give (read once here: os.umask can only be read by setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
CSV_FIELDS = (*KEY_FIELDS, "status", "median_ms", "iqr_ms", "peak_mib", "gflops", "flops",
              "samples", "calls_per_sample", "disturbed", "slowdown", "attempts", "cpu",
              "gpu", "timestamp")
# Table marks: a measurement disturbed by other processes, a rate above the measured peak.
DISTURBED = "*"
# The values a disturbance falsifies (peak memory does not depend on the machine's load).
TIMED = ("median_ms", "iqr_ms", "gflops")
ABOVE_PEAK = "!"


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Save a matplotlib figure to ``path`` (PNG) through a temporary file and ``os.replace``,
    creating the folder, and close it: a reader never sees half an image."""
    import matplotlib.pyplot as plt  # an extra (tools): imported where a figure is saved

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)


def write_json(path: Path, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=1) + "\n")


def write_csv(path: Path, rows: Sequence[dict[str, Any]], fields: Sequence[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, buf.getvalue())


def record_key(record: dict[str, Any], fields: Sequence[str] = KEY_FIELDS) -> tuple:
    return tuple(record[f] for f in fields)


class ResultStore:
    """The records of ``<folder>/results.json`` (and ``results.csv``), keyed by configuration.

    ``key_fields`` identify a configuration and ``csv_fields`` are the CSV columns; the defaults
    are those of ``effattn bench`` (``effattn decode`` passes its own).
    """

    def __init__(self, folder: Path | str, key_fields: Sequence[str] = KEY_FIELDS,
                 csv_fields: Sequence[str] = CSV_FIELDS) -> None:
        self.folder = Path(folder)
        self.json_path = self.folder / "results.json"
        self.csv_path = self.folder / "results.csv"
        self.key_fields = tuple(key_fields)
        self.csv_fields = tuple(csv_fields)
        self._records: dict[tuple, dict[str, Any]] = {}
        if self.json_path.exists():
            try:
                data = json.loads(self.json_path.read_text())
                if not isinstance(data, list):
                    raise ValueError("not a list of records")
                for record in data:
                    self._records[record_key(record, self.key_fields)] = record
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"cannot resume from {self.json_path}: {err}; move it away to start afresh"
                ) from err

    def __len__(self) -> int:
        return len(self._records)

    def get(self, fields: dict[str, Any]) -> dict[str, Any] | None:
        return self._records.get(record_key(fields, self.key_fields))

    def records(self) -> list[dict[str, Any]]:
        return list(self._records.values())

    def add(self, record: dict[str, Any]) -> None:
        self._records[record_key(record, self.key_fields)] = record
        self.save()

    def save(self) -> None:
        records = self.records()
        write_json(self.json_path, records)
        write_csv(self.csv_path, records, self.csv_fields)


def select(records: Iterable[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """Records whose fields equal ``fields`` (e.g. the settings of the current run)."""
    return [r for r in records if all(r.get(k) == v for k, v in fields.items())]


def _by_method_length(records: Iterable[dict[str, Any]], pass_name: str | None) -> dict:
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        if pass_name is None or r["pass"] == pass_name:
            table.setdefault(r["method"], {})[r["length"]] = r
    return table


def _ok(record: dict[str, Any] | None) -> bool:
    return record is not None and record["status"] == "ok" and record["median_ms"] is not None


def _failed(record: dict[str, Any] | None) -> bool:
    # softmax did not finish (too slow, out of memory, timed out, skipped after one of these).
    return record is not None and record["status"].startswith(("too slow", "timeout", "oom",
                                                                "skipped"))


def crossover(records: Iterable[dict[str, Any]], pass_name: str = "fwd",
              baseline: str = DEFAULT_METHOD) -> dict[str, int | None]:
    """Per method, the smallest measured length from which on it is faster than ``baseline``.

    At each length both were tried at, the method wins when it finished and the baseline was
    slower or did not finish (too slow / out of memory / timed out); it loses when the baseline
    finished and the method was slower or did not. The crossover is the smallest length L with a
    win at L and no loss above L; None when there is none (or nothing to compare).
    """
    table = _by_method_length(records, pass_name)
    base = table.get(baseline, {})
    out: dict[str, int | None] = {}
    for method, rows in sorted(table.items()):
        if method == baseline:
            continue
        outcome: dict[int, bool] = {}
        for length, r in rows.items():
            b = base.get(length)
            if _ok(r) and (_failed(b) or (_ok(b) and r["median_ms"] < b["median_ms"])):
                outcome[length] = True
            elif _ok(b) and (not _ok(r) or r["median_ms"] >= b["median_ms"]):
                outcome[length] = False
        best = None
        for length in sorted(outcome, reverse=True):
            if not outcome[length]:
                break
            best = length
        out[method] = best
    return out


def above_peak(record: dict[str, Any], peak: float | None) -> bool:
    """Whether ``record``'s effective GFLOP/s exceeds ``peak``, the measured matmul peak: a rate
    no method can reach, so the peak probe or the FLOP model is off."""
    gflops = record.get("gflops")
    return peak is not None and gflops is not None and gflops > peak


def _cell(record: dict[str, Any] | None, value: str, fmt: str, peak: float | None) -> str:
    if record is None:
        return "-"
    mark = DISTURBED if record.get("disturbed") else ""
    if record["status"] != "ok":  # "too slow" may be the load's doing
        return record["status"].split(":")[0] + mark
    if value not in TIMED:
        mark = ""
    x = record.get(value)
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a" + mark
    return format(x, fmt) + mark + (ABOVE_PEAK if peak is not None and x > peak else "")


def table(records: Iterable[dict[str, Any]], pass_name: str | None, value: str = "median_ms",
          fmt: str = ".3g", *, peak: float | None = None) -> str:
    """A method x length text table of ``value`` for one pass, or for every record when
    ``pass_name`` is None (records without a pass); the status word where not ok.

    A disturbed record's cell ends in ``*`` (timed values and statuses); with ``peak`` (for
    ``value="gflops"``, the measured matmul peak) a value above it ends in ``!``. :func:`notes`
    explains the marks.
    """
    rows = _by_method_length(records, pass_name)
    lengths = sorted({n for r in rows.values() for n in r})
    names = sorted(rows, key=lambda m: (m != DEFAULT_METHOD, m))
    cells = [["method", *map(str, lengths)]]
    cells += [[m, *(_cell(rows[m].get(n), value, fmt, peak) for n in lengths)] for m in names]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def notes(records: Sequence[dict[str, Any]], peak: float | None = None) -> list[str]:
    """Warning lines for the marks :func:`table` put on ``records``."""
    lines = []
    disturbed = [r for r in records if r.get("disturbed")]
    if disturbed:
        lines.append(
            f"{DISTURBED} disturbed ({len(disturbed)} of {len(records)}): other processes "
            f"competed for the machine in every attempt (the reference GEMM ran more than "
            f"{MAX_SLOWDOWN:g}x slower than at its quietest, or the samples' IQR exceeded "
            f"{MAX_SPREAD:.0%} of their median), so these numbers are likely too slow. "
            "Rerun the same command with the same --out on a quiet machine to measure them "
            "again.")
    if any(above_peak(r, peak) for r in records):
        lines.append(f"{ABOVE_PEAK} above measured peak ({peak:.0f} GFLOP/s): the peak probe or "
                     "the FLOP model is off")
    return lines
