"""PNG figures (matplotlib with the Agg backend, so no display is needed)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from effattn.registry import DEFAULT_METHOD  # noqa: E402
from effattn.tools.bench.results import TIMED  # noqa: E402

PASS_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}


def _style(method: str, index: int) -> dict[str, Any]:
    if method == DEFAULT_METHOD:  # the quadratic baseline every other line is read against
        return {"color": "black", "linewidth": 3.0, "marker": "o", "zorder": 10}
    # Ten distinct colours, then the same colours dashed, then dotted.
    return {"color": plt.get_cmap("tab10")(index % 10), "linewidth": 1.6, "marker": ".",
            "linestyle": ("-", "--", ":")[index // 10 % 3], "zorder": 5}


ABOVE_PEAK_NOTE = "above measured peak: the peak probe or the FLOP model is off"
DISTURBED_LABEL = "hollow: disturbed (busy machine)"


def _series(records: Iterable[dict[str, Any]], value: str, **match: Any) -> dict:
    """Per method, the sorted (length, value, disturbed) points of the ok records whose fields
    equal ``match``; softmax first. Only a timed ``value`` can be disturbed."""
    timed = value in TIMED
    series: dict[str, list[tuple[int, float, bool]]] = {}
    for r in records:
        x = r.get(value)
        if (all(r.get(k) == v for k, v in match.items()) and r["status"] == "ok"
                and x is not None and x > 0):
            point = (r["length"], x, timed and bool(r.get("disturbed")))
            series.setdefault(r["method"], []).append(point)
    return {m: sorted(p) for m, p in sorted(series.items(), key=lambda kv: kv[0] != DEFAULT_METHOD)}


def _guides(ax: Any, series: dict) -> None:
    # Faint slope-1 and slope-2 lines through the smallest point: linear vs quadratic growth.
    points = [p[:2] for pts in series.values() for p in pts]
    if len(points) < 2:
        return
    lengths = sorted({n for n, _ in points})
    if len(lengths) < 2:
        return
    n0, y0 = lengths[0], min(y for n, y in points if n == lengths[0])
    for power, label in ((1, "∝ N"), (2, "∝ N²")):
        ys = [y0 * (n / n0) ** power for n in lengths]
        ax.plot(lengths, ys, color="grey", linestyle=":", linewidth=1, zorder=1)
        ax.annotate(label, (lengths[-1], ys[-1]), color="grey", fontsize=8)


def panel(
    ax: Any,
    series: dict,
    names: Sequence[str],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    hlines: Mapping[str, float] | None = None,
    guides: bool = True,
    logy: bool = True,
) -> None:
    """One panel: a line per method of ``series`` against length (log2 x axis); disturbed points
    get hollow markers, and points above every horizontal line (the measured peak) a warning."""
    hollow_label = DISTURBED_LABEL
    for method, points in series.items():
        style = _style(method, names.index(method) if method in names else 0)
        ax.plot([p[0] for p in points], [p[1] for p in points], label=method, **style)
        disturbed = [p for p in points if p[2]]
        if disturbed:
            ax.plot([p[0] for p in disturbed], [p[1] for p in disturbed], linestyle="none",
                    marker="o", markersize=9, markerfacecolor="white",
                    markeredgecolor=style["color"], zorder=style["zorder"] + 1,
                    label=hollow_label)
            hollow_label = "_nolegend_"
    if guides:
        _guides(ax, series)
    for label, y in (hlines or {}).items():
        ax.axhline(y, color="red", linestyle="--", linewidth=1.2, label=label)
    if hlines and any(p[1] > max(hlines.values()) for pts in series.values() for p in pts):
        ax.text(0.01, 0.01, ABOVE_PEAK_NOTE, transform=ax.transAxes, color="red", fontsize=8)
    ax.set_xscale("log", base=2)
    lengths = sorted({p[0] for pts in series.values() for p in pts})
    if lengths:
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if series or hlines:
        ax.legend(fontsize=8, loc="best")


def _other_methods(records: Sequence[dict[str, Any]]) -> list[str]:
    # A fixed order, so that a method keeps its colour in every panel and figure.
    return sorted({r["method"] for r in records} - {DEFAULT_METHOD})


def plot_vs_length(
    records: Sequence[dict[str, Any]],
    path: Path,
    *,
    value: str,
    ylabel: str,
    title: str,
    passes: Sequence[str],
    hlines: Mapping[str, float] | None = None,
    guides: bool = True,
    logy: bool = True,
) -> None:
    """One panel per pass: ``value`` against length (log-log), one line per method."""
    fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.8), squeeze=False)
    names = _other_methods(records)
    for ax, pass_name in zip(axes[0], passes, strict=True):
        panel(ax, _series(records, value, **{"pass": pass_name}), names,
               xlabel="sequence length N (= M)", ylabel=ylabel,
               title=f"{title}: {PASS_TITLES.get(pass_name, pass_name)}", hlines=hlines,
               guides=guides, logy=logy)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decode(
    records: Sequence[dict[str, Any]],
    path: Path,
    *,
    value: str,
    ylabel: str,
    title: str,
    batches: Sequence[int],
    logy: bool,
) -> None:
    """``effattn decode``: one panel per batch size, ``value`` against the number of decoded
    tokens (log2 x axis), one line per method entry, softmax (KV cache) the thick black line."""
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    names = _other_methods(records)
    for ax, batch in zip(axes[0], batches, strict=True):
        series = _series(records, value, batch=batch)
        panel(ax, series, names, xlabel="decoded tokens (position in the output)",
               ylabel=ylabel, title=f"{title}: batch {batch}", guides=False, logy=logy)
        if series and not logy:
            # From zero, so that heights compare as ratios (flatness, speed-up) by eye.
            ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_approx(records: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per method: relative output error against its budget, one line per data set."""
    methods = sorted({r["method"] for r in records if r["status"] == "ok"})
    if not methods:
        methods = ["(no results)"]
    cols = min(4, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    datasets = sorted({r["dataset"] for r in records})
    for ax, method in zip(axes.flat, methods, strict=False):
        label_note = ""
        for i, dataset in enumerate(datasets):
            pts = sorted((r["budget"], r["mean"], r["std"]) for r in records
                         if r["method"] == method and r["dataset"] == dataset
                         and r["status"] == "ok")
            if not pts:
                continue
            label_note = next((r["note"] for r in records
                               if r["method"] == method and r.get("note")), "")
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                        label=dataset, marker="o", markersize=3, capsize=2,
                        color=plt.get_cmap("tab10")(i))
        option = next((r["option"] for r in records if r["method"] == method), "")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(method + (f"\n({label_note})" if label_note else ""), fontsize=9)
        ax.set_xlabel(option)
        ax.set_ylabel("relative error ‖out − exact‖/‖exact‖", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kernel_mse(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Left: kernel-estimate MSE against the number of projections m (random pairs); right: MSE
    against the angle between x and y at a fixed m (small kernel values at large angles)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {("positive", "orthogonal"): ("tab:blue", "-"),
              ("positive", "iid"): ("tab:blue", "--"),
              ("trig", "orthogonal"): ("tab:orange", "-"),
              ("trig", "iid"): ("tab:orange", "--")}
    for (estimator, projection), (color, ls) in styles.items():
        rows = [r for r in records if r["estimator"] == estimator
                and r["projection"] == projection]
        feats = sorted((r["m"], r["mse"]) for r in rows if r["sweep"] == "features")
        angles = sorted((r["angle_deg"], r["mse"]) for r in rows if r["sweep"] == "angle")
        label = f"{estimator}, {projection}"
        for ax, points in ((axes[0], feats), (axes[1], angles)):
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color, linestyle=ls,
                    marker="o", markersize=3, label=label)
    theory = sorted((r["m"], r["mse_theory_iid"]) for r in records
                    if r["sweep"] == "features" and r["estimator"] == "positive"
                    and r["projection"] == "iid")
    axes[0].plot([p[0] for p in theory], [p[1] for p in theory], color="grey", linestyle=":",
                 label="positive, iid (theory)")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("random projections m (trig features have 2m dimensions)")
    axes[1].set_xlabel("angle between x and y (degrees); exp(x·y) falls to the right")
    first = records[0]
    axes[0].set_title(f"MSE of exp(x·y) estimates, |x| = |y| = {first['norm']:g}, "
                      f"d = {first['dim']}", fontsize=10)
    m_angle = next((r["m"] for r in records if r["sweep"] == "angle"), None)
    axes[1].set_title(f"MSE against angle, m = {m_angle}", fontsize=10)
    for ax in axes:
        ax.set_yscale("log")
        ax.set_ylabel("mean squared error")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
