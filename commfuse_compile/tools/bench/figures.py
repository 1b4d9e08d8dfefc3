"""``commfuse bench``'s figures: per-row numbers and the terminal's tables.

Every row gets its median time (min and max kept), its speedup over the baseline
(collective then matmul), its time over ``max(matmul alone, comm alone)`` (1.00 =
perfect overlap) and the cost model's predicted time. ``targets`` judges the
figures; ``markdown`` and ``plot`` write results.md and the plot.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from .config import AT_CELL_SPEED, COMPARED, OVERLAP_PROBE, BlockShape, SiteShape, Variant

KIND_TITLES = {
    "ag_mm": "all-gather -> matmul",
    "mm_rs": "matmul -> reduce-scatter",
    "mm_a2a": "matmul -> all-to-all (Ulysses q/k/v)",
    "a2a_mm": "all-to-all -> matmul (Ulysses output)",
    "mm_ar_mm": "matmul -> all-reduce -> add + RMSNorm -> matmul (plain TP)",
    "a2a_experts_a2a": "all-to-all -> bmm -> SiLU -> bmm -> all-to-all (capacity MoE experts)",
    "a2a_gmm_a2a": "counts, all-to-all -> grouped SwiGLU -> all-to-all (dropless MoE experts)",
}


def slowest(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per label and repetition, the slowest rank's time (the step's time)."""
    return {
        label: [max(ts) for ts in zip(*(r[label] for r in per_rank), strict=True)]
        for label in per_rank[0]
    }


def summary(times: list[float]) -> dict[str, float]:
    """Median, min and max of one row's times."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def site_cell(
    kind: str,
    shape: SiteShape,
    ratio: float,
    rate: float,
    rate_tries: list[dict[str, float]],
    per_rank: list[dict[str, Any]],
    rows: list[Variant],
    n: int,
) -> dict[str, Any]:
    """One (site, size, ratio) cell from every rank's ``measure_site`` result."""
    times = slowest([r["times"] for r in per_rank])
    matmul, comm = summary(times["matmul alone"]), summary(times["comm alone"])
    collective = summary(times["collective alone"])
    limit = max(matmul["median"], comm["median"])
    baseline = statistics.median(times[rows[0].label])
    # every row's compile predicts every schedule on the same profile, except the
    # baseline's (``off`` declines before predicting): one table for the cell
    predictions: dict[str, float] = next(
        (r["predicted_us"] for r in per_rank[0]["rows"].values() if r["predicted_us"]), {}
    )
    out_rows = [
        _cell_row(row.label, per_rank[0], summary(times[row.label]), baseline, limit, predictions)
        for row in rows
    ]
    t_mm, t_comm = matmul["median"], comm["median"]
    probe = summary(times[OVERLAP_PROBE])
    return {
        "kind": kind,
        "shape": dataclasses.asdict(shape),
        "size": shape.label,
        "ratio": ratio,
        "measured_ratio": t_comm / t_mm,
        "rate_bits_per_s": rate if math.isfinite(rate) else None,
        "rate_tries": rate_tries,  # how the rate was found: matmul and comm alone per try
        "matmul_alone": matmul,
        "comm_alone": comm,
        "collective_alone": collective,
        "limit_s": limit,
        "overlap_probe": {**probe, "vs_limit": probe["median"] / limit},
        # The best any schedule with n blocks can do: one block's matmul cannot overlap.
        "n_block_bound_s": t_mm / n + max(t_mm * (n - 1) / n, t_comm),
        "timed_calls": len(times[rows[0].label]),  # per row (``config.CELL_TIMED_S``)
        "rows": out_rows,
    }


def _cell_row(
    label: str,
    rank0: dict[str, Any],
    took: dict[str, float],
    baseline: float,
    limit: float,
    predictions: dict[str, float],
) -> dict[str, Any]:
    """A row of a cell: what rank 0's compile ran (``rank0``: its ``measure_site``
    result), the row's times ``took`` against the baseline's median and the cell's limit,
    and the cost model's time for what ran (``predicted.program_us``)."""
    record = rank0["rows"][label]
    ran = record["schedule"]
    predicted_us = record["predicted_program_us"]
    return {
        "label": label,
        "ran": ran,
        "program": record.get("program"),
        "decision": record["decision"],
        "reason": record["reason"],
        "sites": record.get("sites", []),  # each site the pass found: kind, decision, schedule
        **{f"{k}_s": v for k, v in took.items()},
        "speedup": baseline / took["median"],
        "vs_limit": took["median"] / limit,
        "predicted_s": predicted_us / 1e6 if predicted_us is not None else None,
        "model_error": (
            predicted_us / 1e6 / took["median"] - 1 if predicted_us is not None else None
        ),
        # the same at the compute speed the cell ran at (``profiles.at_compute_speed``)
        "compute_factor": record.get("compute_factor"),
        AT_CELL_SPEED: (
            at_speed / 1e6 / took["median"] - 1
            if (at_speed := record.get("predicted_at_cell_speed_us")) is not None
            else None
        ),
        "predicted_all_us": predictions,
        "breakdown_rank0_s": rank0["breakdown"][label],
    }


def block_result(
    shape: BlockShape,
    rate: float,
    alone: dict[str, tuple[float, ...]],
    times: dict[str, list[float]],
    sites: dict[str, dict[str, Any]],
    ratio: float,
    world_size: int = 2,
    cores: int | None = None,
) -> dict[str, Any]:
    """The block rows; ``alone``: by row, its program's compute and communication, each
    measured alone (``alone``: its transfers local copies; its transfers with nothing
    computed), whose larger is the row's limit (the first row's are the block's);
    ``world_size`` ranks on a machine of ``cores`` cores. A row of the compared layout
    (``COMPARED``) is sped up against that layout's baseline; ``vs_first`` is every row's
    speedup against the first baseline."""
    labels = list(times)
    baseline = statistics.median(times[labels[0]])
    compute_s, comm = alone[labels[0]]
    limit = max(compute_s, comm)
    rows = []
    for label in labels:
        took = summary(times[label])
        own = COMPARED + "baseline" if label.startswith(COMPARED) else labels[0]
        rows.append(
            {
                "label": label,
                **{f"{k}_s": v for k, v in took.items()},
                "speedup": statistics.median(times[own]) / took["median"],
                "vs_first": baseline / took["median"],
                "vs_limit": took["median"] / max(alone[label]),
                "compute_alone_s": alone[label][0],
                "communication_alone_s": alone[label][1],
                "sites": sites[label],
                **sites[label].get("footprint", {}),
            }
        )
    return {
        "shape": dataclasses.asdict(shape),
        "size": shape.label,
        "world_size": world_size,
        "mesh": shape.mesh(world_size),
        "cores": cores,
        "ratio": ratio,
        "rate_bits_per_s": rate if math.isfinite(rate) else None,
        "compute_s": compute_s,
        "comm_s": comm,
        "limit_s": limit,
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------
# Text


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def row_name(row: dict[str, Any]) -> str:
    if row["label"] == "auto":
        return f"auto ({row['ran']})"
    if row["label"] != "baseline" and row["decision"] != "rewritten":
        return f"{row['label']} (declined)"
    return row["label"]


def format_cell(cell: dict[str, Any]) -> str:
    """The terminal table of one cell."""
    rate = cell["rate_bits_per_s"]
    head = (
        f"\n{cell['kind']} {cell['size']}  comm/compute {cell['ratio']:g} "
        f"(measured {cell['measured_ratio']:.2f})  link "
        + (f"{rate / 1e6:.0f} Mbit/s" if rate else "UNTHROTTLED")
        + f"\n  matmul alone {ms(cell['matmul_alone']['median'])} ms, comm alone "
        f"{ms(cell['comm_alone']['median'])} ms (gloo's collective "
        f"{ms(cell['collective_alone']['median'])} ms); both at once "
        f"{cell['overlap_probe']['vs_limit']:.2f}x limit, best with n blocks "
        f"{cell['n_block_bound_s'] / cell['limit_s']:.2f}x limit"
    )
    lines = [
        head,
        f"  {'row':<22}{'median ms':>10}{'min':>8}{'max':>8}{'speedup':>9}"
        f"{'/limit':>8}{'predicted':>11}{'error':>8}{'at speed':>10}",
    ]
    for row in cell["rows"]:
        lines.append(
            f"  {row_name(row):<22}{ms(row['median_s']):>10}{ms(row['min_s']):>8}"
            f"{ms(row['max_s']):>8}{row['speedup']:>8.2f}x{row['vs_limit']:>8.2f}"
            f"{ms(row['predicted_s']):>11}{percent(row.get('model_error')):>8}"
            f"{percent(row.get(AT_CELL_SPEED)):>10}"
        )
    return "\n".join(lines)


def percent(error: float | None) -> str:
    return "" if error is None else f"{error:+.0%}"


def ranks_text(block: dict[str, Any]) -> str:
    """The block's ranks, and whether they share the cores."""
    n, cores = block.get("world_size", 2), block.get("cores")
    shared = f", sharing {cores} cores" if cores is not None and n > cores else ""
    return f"{n} ranks ({block.get('mesh', f'tp={n}')}{shared})"


def site_counts(sites: dict[str, Any]) -> str:
    """A row's sites rewritten per graph and kind: ``forward ag_mm 20/20, ...``; in a job
    of several nodes, then per level: ``; node 4/8, nodes 8/8``."""
    counts = ", ".join(
        f"{r['graph']} {r['kind']} {r['rewritten']}/{r['found']}" for r in sites["summary"]
    )
    levels = sites.get("levels", {})
    if "nodes" in levels:
        counts += "; " + ", ".join(f"{k} {done}/{of}" for k, (done, of) in levels.items())
    return counts


def auto_against(block: dict[str, Any]) -> dict[str, Any]:
    """A block's ``auto`` row against its baseline (the first row) and its best fixed
    schedule: the fastest other row, the baseline's ``off`` included."""
    off = block["rows"][0]
    auto = next(r for r in block["rows"] if r["label"] == "auto")
    best = min((r for r in block["rows"] if r is not auto), key=lambda r: r["median_s"])
    return {
        "off_s": off["median_s"],
        "best": best["label"],
        "best_s": best["median_s"],
        "auto_s": auto["median_s"],
        "auto_ran": ",".join(auto["sites"]["schedules"]) or "off",
        # every site declined: the baseline's program, whatever the two medians say
        "auto_is_off": auto["sites"]["rewritten"] == 0,
        "auto_vs_best": auto["median_s"] / best["median_s"],
        "auto_vs_off": off["median_s"] / auto["median_s"],
    }


def format_block(block: dict[str, Any]) -> str:
    rate = block["rate_bits_per_s"]
    lines = [
        f"\nblock step (forward + backward) {block['size']}, {ranks_text(block)}  link "
        + (f"{rate / 1e6:.0f} Mbit/s" if rate else "UNTHROTTLED")
        + f"  compute {ms(block['compute_s'])} ms, communication {ms(block['comm_s'])} ms",
        f"  {'row':<22}{'median ms':>10}{'min':>8}{'max':>8}{'speedup':>9}{'/limit':>8}"
        f"{'sent MB':>9}{'saved MB':>9}{'peak MB':>9}  sites rewritten",
    ]
    for row in block["rows"]:
        sites = row["sites"]
        lines.append(
            f"  {row['label']:<22}{ms(row['median_s']):>10}{ms(row['min_s']):>8}"
            f"{ms(row['max_s']):>8}{row['speedup']:>8.2f}x{row['vs_limit']:>8.2f}"
            f"{mb(row.get('sent_bytes')):>9}{mb(row.get('saved_bytes')):>9}"
            f"{mb(row.get('peak_bytes')):>9}"
            f"  {sites['rewritten']}/{sites['found']} {','.join(sites['schedules'])}"
            f" ({site_counts(sites)})"
        )
    return "\n".join(lines)


def mb(n_bytes: int | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / 1e6:.2f}"


def format_targets(targets: list[dict[str, Any]]) -> str:
    lines = ["\ntargets:"]
    for t in targets:
        mark = {True: "reached", False: "MISSED", None: "not judged"}[t["reached"]]
        lines.append(f"  [{mark}] {t['target']}")
        lines += [f"      miss: {m}" for m in t["misses"]]
    return "\n".join(lines)


def format_errors(errors: dict[str, Any], title: str = "model error") -> str:
    """``targets.error_distribution`` as the terminal and results.md print it."""
    if not errors["rows"]:
        return f"{title}: no row with a prediction"

    def line(name: str, e: dict[str, Any]) -> str:
        return (
            f"{name}: {e['rows']} rows, {e['min']:+.0%} .. {e['max']:+.0%}, median "
            f"{e['median']:+.0%} (|error| {e['median_abs']:.0%}), {e['beyond']} beyond "
            f"{errors['bound']:.0%}"
        )

    return "\n".join(
        [line(title, errors)] + [f"  {line(k, e)}" for k, e in errors["by_kind"].items()]
    )
