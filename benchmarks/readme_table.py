"""The results table, crossover line and machine line of docs/results/cpu.md, from a bench folder.

    PYTHONPATH=src python3 benchmarks/readme_table.py benchmarks/bench

Reads ``results.json`` and ``summary.json`` (written by ``effattn bench --vs-flops``) and prints
Markdown: forward time at N = 1024 / 4096 / 16384 and its growth, forward peak memory and its
growth, forward+backward time at 4096 / 16384, forward+backward peak memory at 4096 / 16384 with
its ratio to SDPA's (``softmax``) in the same sweep, and the fp32 GFLOP/s and share of the
measured peak at 4096 for methods with a FLOP model. Disturbed measurements keep their ``*``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from effattn.tools.bench.machine import gpu_label

LENGTHS = (1024, 4096, 16384)


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _cell(rec: dict[str, Any] | None, key: str) -> str:
    if rec is None:
        return "-"
    if rec["status"] != "ok":
        return rec["status"].split(":")[0].replace("_", " ")
    mark = "*" if rec.get("disturbed") else ""
    return _fmt(rec[key]) + mark


def _growth(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> str:
    if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{b[key] / a[key]:.1f}x"


def _vs(rec: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    """Peak memory with its ratio to the baseline's in parentheses, when both were measured."""
    cell = _cell(rec, "peak_mib")
    if rec is None or base is None or rec["status"] != "ok" or base["status"] != "ok":
        return cell
    return f"{cell} ({rec['peak_mib'] / base['peak_mib']:.2f}x)"


def table(folder: Path) -> str:
    records = json.loads((folder / "results.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    machine = summary["machine"]
    peak = machine["matmul_peak_gflops"]["float32"]
    by = {(r["method"], r["length"], r["pass"]): r for r in records if not r["causal"]}
    methods = sorted({r["method"] for r in records},
                     key=lambda m: (by.get((m, 4096, "fwd")) or {}).get("median_ms") or 1e9)
    gpu = gpu_label(machine)
    lines = [
        f"Measured on {f'{gpu}, host ' if gpu else ''}"
        f"{machine['cpu_model']} ({', '.join(machine['vector_extensions'])}), "
        f"{machine['cpu_count']} cores, {machine['torch_threads']} torch threads, fp32 matmul "
        f"peak {peak:.0f} GFLOP/s (bf16 {machine['matmul_peak_gflops']['bfloat16']:.0f}), "
        f"torch {machine['torch']}.",
        "",
        "| method | fwd ms, N=1024 | 4096 | 16384 | growth 4096→16384 | fwd peak MiB, 1024 | "
        "4096 | 16384 | growth | fwd+bwd ms, 4096 | 16384 | growth | fwd+bwd peak MiB, 4096 "
        "(/ SDPA's) | 16384 | fwd GFLOP/s, 4096 (% of peak) |",
        "|---" * 15 + "|",
    ]
    for m in methods:
        fwd = [by.get((m, n, "fwd")) for n in LENGTHS]
        bwd = [by.get((m, n, "fwdbwd")) for n in LENGTHS[1:]]
        rate = fwd[1].get("gflops") if fwd[1] and fwd[1]["status"] == "ok" else None
        flops = "-" if not rate else f"{rate:.0f} ({100 * rate / peak:.0f}%)"
        sdpa = [by.get(("softmax", n, "fwdbwd")) for n in LENGTHS[1:]]
        lines.append(
            f"| `{m}` | " + " | ".join(_cell(r, "median_ms") for r in fwd)
            + f" | {_growth(fwd[1], fwd[2], 'median_ms')} | "
            + " | ".join(_cell(r, "peak_mib") for r in fwd)
            + f" | {_growth(fwd[1], fwd[2], 'peak_mib')} | "
            + " | ".join(_cell(r, "median_ms") for r in bwd)
            + f" | {_growth(bwd[0], bwd[1], 'median_ms')} | "
            + " | ".join(_vs(r, s) for r, s in zip(bwd, sdpa, strict=True))
            + f" | {flops} |"
        )
    cross = summary["crossover"]
    lines += ["", "**Crossover** (smallest measured N from which on a method is faster than "
              "SDPA, forward / forward+backward): " + "; ".join(
                  f"`{m}` {cross['fwd'].get(m) or 'none'} / {cross['fwdbwd'].get(m) or 'none'}"
                  for m in methods if m in cross["fwd"]) + "."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="an `effattn bench --vs-flops` output folder")
    print(table(p.parse_args().folder))


if __name__ == "__main__":
    main()
