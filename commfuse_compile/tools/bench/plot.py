"""``commfuse bench``'s plot (matplotlib, as SVG): the speedup over the baseline against
the comm/compute ratio, per schedule, one panel per site kind."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from .figures import KIND_TITLES


def _reference(cell: dict[str, Any], what: str) -> float:
    """The speedup over this cell's measured baseline of perfect overlap (time = limit)
    or of the best schedule with n blocks (one block's matmul cannot overlap)."""
    baseline = cell["rows"][0]["median_s"]
    return baseline / (cell["limit_s"] if what == "perfect" else cell["n_block_bound_s"])


def _speedup(cell: dict[str, Any], label: str) -> float:
    return next(r["speedup"] for r in cell["rows"] if r["label"] == label)


def _by_ratio(
    cells: list[dict[str, Any]], value: Callable[[dict[str, Any]], float]
) -> tuple[list[float], list[float]]:
    """Per ratio of ``cells``: the ratio and the geometric mean over sizes of ``value``."""
    ratios = sorted({c["ratio"] for c in cells})
    means = [
        statistics.geometric_mean(value(c) for c in cells if c["ratio"] == ratio)
        for ratio in ratios
    ]
    return ratios, means


def plot_speedup(results: dict[str, Any], path: Path) -> None:
    """Speedup over the baseline against comm/compute, one panel per site kind: a line per
    schedule through the geometric mean over sizes, a dot per size; gray: what perfect
    overlap and the best schedule of n blocks would gain over the same measured baseline."""
    kinds = [k for k in KIND_TITLES if any(c["kind"] == k for c in results["sites"])]
    # every schedule row of any cell, one color each in every panel (a kind's cells have
    # the rows of the schedules for its direction)
    labels = list(dict.fromkeys(r["label"] for c in results["sites"] for r in c["rows"][1:]))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    n = results["meta"]["world_size"]
    figure = Figure(figsize=(4.5 * max(len(kinds), 1) + 2, 4), layout="constrained")
    axes = figure.subplots(1, max(len(kinds), 1), sharey=True, squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=False):
        cells = [c for c in results["sites"] if c["kind"] == kind]
        ax.axhline(1.0, color="0.6", linewidth=1, label="baseline")
        for what, style, name in (
            ("perfect", "--", "perfect overlap"),
            ("bound", ":", f"best with {n} blocks"),
        ):
            reference = functools.partial(_reference, what=what)
            ax.plot(*_by_ratio(cells, reference), color="0.6", linestyle=style, label=name)
        for label in labels:
            if not all(any(r["label"] == label for r in c["rows"]) for c in cells):
                continue
            speedup = functools.partial(_speedup, label=label)
            ax.plot(*_by_ratio(cells, speedup), marker="o", color=colors[label], label=label)
            ax.scatter(
                [c["ratio"] for c in cells],
                [speedup(c) for c in cells],
                color=colors[label],
                alpha=0.4,
                s=8,
            )
        ratios = sorted({c["ratio"] for c in cells})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
        ax.set_xlabel("comm alone / matmul alone")
        ax.set_title(KIND_TITLES[kind])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over the baseline")
    axes[0].set_ylim(bottom=0)
    legend: dict[str, Any] = {}  # label -> handle, over the panels
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    figure.legend(list(legend.values()), list(legend), loc="outside right center")
    title = "speedup over collective-then-matmul"
    if not results["meta"]["network"]["throttled"]:
        title += " (UNTHROTTLED: not meaningful)"
    figure.suptitle(title)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "commfuse"}):
        figure.savefig(path, format="svg")  # text as text, ids the same on every run
