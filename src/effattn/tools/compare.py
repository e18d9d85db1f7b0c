"""``effattn compare``: every applicable method trained with the same budget, one table.

Each method runs as its own ``effattn train`` process (so that its peak memory is its own) in
``<out>/<label>/``; a method whose results exist with the same configuration is not rerun, and an
interrupted one resumes from its checkpoint. The table (Markdown), JSON, CSV and a PNG bar plot
are written to ``<out>/compare.*``.

The methods are (name, options) pairs (the command line parses ``name:key=value,key=value`` and
expands ``all`` to :func:`every_variant`: every registered method plus the variants its spec names,
``MethodSpec.variants``, such as learned σ and gated RFA); those that cannot run the task are
listed with the spec's reason instead. For ListOps the table shows,
beside ours, the accuracy each method's spec publishes from the Long Range Arena
(``published["lra_listops"]``, Tay et al. 2021, Table 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import effattn
from effattn.registry import DEFAULT_METHOD, methods, spec
from effattn.tools.bench.results import atomic_write, save_figure, write_csv
from effattn.tools.tasks.data import FRACTION_METRICS, METRIC_NAMES, TASK_METRICS
from effattn.tools.train import RESULTS, TrainConfig, applicability, label_of, write_json

CSV_FIELDS = ("label", "metric", "score", "valid", "final_train_loss", "steps_per_s",
              "peak_memory_mb", "masks_padding", "lra_listops", "token_accuracy",
              "decode_tokens_per_s")


def scaled_options(method: str, seq_len: int, head_dim: int) -> dict[str, Any]:
    """Options sized to the comparison's short sequences and small heads.

    The library defaults (windows of 128, 64-token blocks, 256 projections) are sized for
    sequences of thousands; at 256 tokens they would cover the whole sequence and the comparison
    would compare softmax with itself. Windows, blocks, landmarks and projections are scaled to
    the same fraction of the sequence instead (window L/8, block L/16, landmarks L/8, projection
    L/4, bucket L/16). Random-feature counts become 4 D (64 at D = 16, above the D ln D that
    several implementations use) instead of 256, which at D = 16 would make the kernelized
    methods several times slower than softmax for no accuracy the comparison could show. Only
    options the method has are set, and a window that is off by default (the kernelized
    methods' ``window=W`` hybrid) stays off: it is a different model, asked for by name.
    """
    scaled = {"window": seq_len // 8, "block_size": seq_len // 16,
              "num_landmarks": seq_len // 8, "proj_len": seq_len // 4,
              "bucket_size": seq_len // 16, "num_features": 4 * head_dim}
    known = spec(method).options
    return {k: max(2, v) for k, v in scaled.items()
            if k in known and not (k == "window" and known[k] is None)}


def run_options(method: str, options: dict[str, Any], base: TrainConfig) -> dict[str, Any]:
    """The options ``method`` trains with: :func:`scaled_options` for ``base``'s length and head
    size, under the entry's own ``options``."""
    cfg = base.resolved()
    return {**scaled_options(method, cfg.seq_len, cfg.d_model // cfg.heads), **options}


def every_variant() -> list[tuple[str, dict[str, Any]]]:
    """Every registered method with its defaults, then each variant its spec names."""
    return ([(m, {}) for m in methods()]
            + [(m, dict(v.options)) for m in methods() for v in spec(m).variants])


def resolve(task: str, wanted: Iterable[tuple[str, dict[str, Any]]]
            ) -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """The (method, options) of ``wanted`` to run for ``task``, each label once, and the skipped
    labels with the reason."""
    run, skipped, seen = [], {}, set()
    for method, options in wanted:
        label = label_of(method, options)
        if label in seen:
            continue
        seen.add(label)
        reason = applicability(task, method, options)
        if reason is None:
            run.append((method, options))
        else:
            skipped[label] = reason
    return run, skipped


def _train_command(cfg: TrainConfig, out: Path, data_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "effattn", "train", "--task", cfg.task, "--method", cfg.method,
           "--steps", str(cfg.steps), "--batch-size", str(cfg.batch_size), "--lr", str(cfg.lr),
           "--d-model", str(cfg.d_model), "--layers", str(cfg.layers), "--heads", str(cfg.heads),
           "--seq-len", str(cfg.seq_len), "--seed", str(cfg.seed), "--device", cfg.device,
           "--checkpoint-every", str(cfg.checkpoint_every), "--out", str(out),
           "--data-dir", str(data_dir)]
    for key, value in cfg.options.items():
        cmd += ["--option", f"{key}={value!r}"]
    for key, value in cfg.task_options.items():
        cmd += ["--task-option", f"{key}={value!r}"]
    return cmd


def _subprocess_env() -> dict[str, str]:
    # The child must import this very copy of effattn (a source checkout need not be installed).
    src = str(Path(effattn.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _cached(path: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    saved = {k: v for k, v in results["config"].items() if k != "device"}
    now = {k: v for k, v in asdict(cfg).items() if k != "device"}
    return results if saved == now else None


def compare(
    task: str,
    wanted: Iterable[tuple[str, dict[str, Any]]],
    out_dir: str | Path,
    base: TrainConfig | None = None,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every (method, options) of ``wanted`` that can run ``task`` with ``base``'s budget;
    write and return the comparison."""
    base = replace(base or TrainConfig(), task=task, method=DEFAULT_METHOD, options={}).resolved()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run, skipped = resolve(task, wanted)
    rows, failed = [], {}
    for method, options in run:
        cfg = replace(base, method=method, options=run_options(method, options, base)).resolved()
        label = label_of(method, options)
        run_dir = out / label.replace(":", "_").replace("=", "-").replace(",", "_")
        results = _cached(run_dir / RESULTS, cfg)
        if results is None:
            proc = subprocess.run(_train_command(cfg, run_dir, out / "data"),
                                  env=_subprocess_env(),
                                  stdout=None if progress else subprocess.DEVNULL,
                                  stderr=None if progress else subprocess.PIPE, text=True)
            if proc.returncode != 0:
                last = (proc.stderr or "").strip().splitlines()[-1:]
                failed[label] = last[0] if last else (
                    f"exit status {proc.returncode} (see the output above)")
                continue
            results = json.loads((run_dir / RESULTS).read_text())
        rows.append(_row(label, results, task))
    summary = {"task": task, "budget": {k: v for k, v in asdict(base).items()
                                        if k not in ("method", "options")},
               "rows": rows, "skipped": skipped, "failed": failed}
    write_json(out / "compare.json", summary)
    write_csv(out / "compare.csv", rows, CSV_FIELDS)
    atomic_write(out / "compare.md", table(summary) + "\n")
    plot(summary, out / "compare.png")
    return summary


def _row(label: str, results: dict[str, Any], task: str) -> dict[str, Any]:
    metric = results["metric"]
    unit = 100.0 if metric in FRACTION_METRICS else 1.0
    row = {"label": label, "method": results["config"]["method"],
           "options": results["config"]["options"], "metric": metric,
           "score": results["score"] * unit, "valid": results["valid"][metric] * unit,
           "final_train_loss": results["final_train_loss"], "steps_per_s": results["steps_per_s"],
           "peak_memory_mb": results["peak_memory_mb"], "masks_padding": results["masks_padding"]}
    if task == "listops":
        # The published number is for the method's defaults, not for a variant's row.
        method = results["config"]["method"]
        row["lra_listops"] = spec(method).published.get("lra_listops") if label == method else None
    if "decoding_at_length" in results:
        decoding = results["decoding_at_length"]
        row["token_accuracy"] = 100.0 * results["test"]["accuracy"]
        row["decode_tokens_per_s"] = decoding["test"]["tokens_per_s"]
        row["exact_match_at"] = {name: 100.0 * r["exact_match"] for name, r in decoding.items()
                                 if name != "test"}
    return row




def _axis_label(metric: str) -> str:
    return METRIC_NAMES[metric] + (" (%)" if metric in FRACTION_METRICS else "")


def table(summary: dict[str, Any]) -> str:
    """The comparison as a Markdown table (LRA's ListOps numbers alongside for ListOps; for
    seq2seq the teacher-forced token accuracy, greedy exact match at each decoding length and
    decoding speed)."""
    rows = summary["rows"]
    listops = summary["task"] == "listops"
    metric = rows[0]["metric"] if rows else TASK_METRICS[summary["task"]]
    fraction = metric in FRACTION_METRICS
    ref = next((r for r in rows if r["label"] == DEFAULT_METHOD), None)
    head = ["method", _axis_label(metric), f"vs {DEFAULT_METHOD}", "steps/s", "peak MB"]
    if listops:
        head.append("LRA ListOps (%)")
    lengths = list(rows[0].get("exact_match_at", {})) if rows else []
    if "token_accuracy" in (rows[0] if rows else {}):
        head += ["teacher-forced accuracy (%)", *(f"exact match at {n} (%)" for n in lengths),
                 "decoding tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if ref is None:
            rel = "-"
        elif fraction:
            rel = f"{r['score'] - ref['score']:+.1f} pt"
        else:
            rel = f"{100.0 * (r['score'] / ref['score'] - 1.0):+.1f}%"
        note = "" if r["masks_padding"] else " (attends padding)"
        cells = [f"`{r['label']}`{note}", f"{r['score']:.2f}" if fraction
                 else f"{r['score']:.3f}", rel, f"{r['steps_per_s']:.2f}",
                 f"{r['peak_memory_mb']:.0f}"]
        if listops:
            lra = r.get("lra_listops")
            cells.append("-" if lra is None else f"{lra:.2f}")
        if "token_accuracy" in r:
            cells += [f"{r['token_accuracy']:.2f}",
                      *(f"{r['exact_match_at'][n]:.2f}" for n in lengths),
                      f"{r['decode_tokens_per_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for label, reason in summary["skipped"].items():
        lines.append(f"| `{label}` | skipped: {reason} |" + " |" * (len(head) - 2))
    for label, error in summary["failed"].items():
        lines.append(f"| `{label}` | failed: {error} |" + " |" * (len(head) - 2))
    b = summary["budget"]
    lines.append("")
    lines.append(f"Budget: {b['steps']} steps, batch {b['batch_size']}, length {b['seq_len']}, "
                 f"d_model {b['d_model']}, {b['layers']} layers, {b['heads']} heads, "
                 f"lr {b['lr']}, seed {b['seed']}, device {b['device']}.")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bar plots of the score and of steps/s per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * max(4, len(rows)) + 1.5))
    labels = [r["label"] for r in rows]
    metric = rows[0]["metric"] if rows else TASK_METRICS[summary["task"]]
    axes[0].barh(labels, [r["score"] for r in rows], color="tab:blue")
    axes[0].set_xlabel(_axis_label(metric) + ("" if metric in FRACTION_METRICS
                                              else " (lower is better)"))
    if summary["task"] == "listops":
        lra = [(i, r["lra_listops"]) for i, r in enumerate(rows) if r.get("lra_listops")]
        if lra:
            axes[0].scatter([v for _, v in lra], [i for i, _ in lra], color="tab:red",
                            zorder=3, label="LRA (Tay et al.), 2K tokens")
            axes[0].legend(loc="lower right", fontsize=8)
    axes[1].barh(labels, [r["steps_per_s"] for r in rows], color="tab:green")
    axes[1].set_xlabel("training steps/s")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    b = summary["budget"]
    fig.suptitle(f"{summary['task']}: {b['steps']} steps, batch {b['batch_size']}, "
                 f"length {b['seq_len']}, d_model {b['d_model']}, {b['layers']} layers")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
