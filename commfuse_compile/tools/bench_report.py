"""``commfuse bench``'s figures: per-row numbers, the targets, tables, files and the plot.

Every row gets its median time (min and max kept), its speedup over the baseline
(collective then matmul), its time over ``max(matmul alone, comm alone)`` (1.00 =
perfect overlap) and the cost model's predicted time. The plot (matplotlib, as SVG) is
the speedup against the comm/compute ratio, per schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from .bench_config import OVERLAP_PROBE, BlockShape, SiteShape, Variant

KIND_TITLES = {
    "ag_mm": "all-gather -> matmul",
    "mm_rs": "matmul -> reduce-scatter",
    "mm_a2a": "matmul -> all-to-all (Ulysses q/k/v)",
    "a2a_mm": "all-to-all -> matmul (Ulysses output)",
}
OVERLAP_LIMIT = 1.15  # targets: ring and bidir near the limit at comm/compute 1 ...
RING_SPEEDUP = 1.4  # ... and this much faster than the baseline on 2 ranks
AUTO_PAYS = 1.10  # where a schedule beats the baseline by more than this ...
AUTO_NEAR_BEST = 1.05  # ... auto is within this of the best row
AUTO_BLOCK = 0.95  # the whole block: auto at least this fraction of the best speedup
MODEL_ERROR = 0.25  # predicted vs measured, every row of every cell


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
    out_rows = []
    for row in rows:
        record = per_rank[0]["rows"][row.label]
        took = summary(times[row.label])
        ran = record["schedule"]
        predicted_us = predictions.get("collective" if ran == "off" else ran)
        out_rows.append(
            {
                "label": row.label,
                "ran": ran,
                "program": record.get("program"),
                "decision": record["decision"],
                "reason": record["reason"],
                **{f"{k}_s": v for k, v in took.items()},
                "speedup": baseline / took["median"],
                "vs_limit": took["median"] / limit,
                "predicted_s": predicted_us / 1e6 if predicted_us is not None else None,
                "model_error": (
                    predicted_us / 1e6 / took["median"] - 1 if predicted_us is not None else None
                ),
                "predicted_all_us": predictions,
                "breakdown_rank0_s": per_rank[0]["breakdown"][row.label],
            }
        )
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
        "rows": out_rows,
    }


def block_result(
    shape: BlockShape,
    rate: float,
    compute_s: float,
    times: dict[str, list[float]],
    sites: dict[str, dict[str, Any]],
    ratio: float,
    world_size: int = 2,
    cores: int | None = None,
) -> dict[str, Any]:
    """The block rows; ``compute_s``: the baseline's step on an unthrottled link;
    ``world_size`` ranks on a machine of ``cores`` cores."""
    labels = list(times)
    baseline = statistics.median(times[labels[0]])
    comm = max(baseline - compute_s, 0.0)
    limit = max(compute_s, comm)
    rows = []
    for label in labels:
        took = summary(times[label])
        rows.append(
            {
                "label": label,
                **{f"{k}_s": v for k, v in took.items()},
                "speedup": baseline / took["median"],
                "vs_limit": took["median"] / limit,
                "sites": sites[label],
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
# Targets


def _rows_by_label(cell: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in cell["rows"]}


def _where(cell: dict[str, Any]) -> str:
    return f"{cell['kind']} {cell['size']} ratio {cell['ratio']:g}"


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each reached or not, with the figures that decide it."""
    cells = results["sites"]
    n = results["meta"]["world_size"]
    targets = []

    # "comm/compute = 1" read two ways: the site's communication alone takes as long as its
    # matmul alone (then no schedule of n blocks beats 1 + 1/n times the limit: the last
    # block's matmul has nothing left to hide), or, as in SPEC.md's cost model, one
    # block's message takes one block's matmul (m = c): the communication alone is then
    # (n-1)/n of the matmul alone, and the ring can overlap perfectly.
    for reading, ratio in (
        ("comm alone = matmul alone", 1.0),
        (
            f"per ring step m = c (SPEC.md), i.e. comm alone / matmul alone = {(n - 1) / n:g}",
            (n - 1) / n,
        ),
    ):
        checked, misses = [], []
        for cell in (c for c in cells if math.isclose(c["ratio"], ratio)):
            rows = _rows_by_label(cell)
            for label in ("ring", "bidir"):
                if label not in rows:
                    continue
                row = rows[label]
                line = (
                    f"{_where(cell)} {label}: {row['vs_limit']:.2f}x limit, "
                    f"{row['speedup']:.2f}x over baseline (best with n blocks "
                    f"{cell['n_block_bound_s'] / cell['limit_s']:.2f}x limit, both at once "
                    f"{cell['overlap_probe']['vs_limit']:.2f}x limit)"
                )
                checked.append(line)
                if row["vs_limit"] > OVERLAP_LIMIT or (n == 2 and row["speedup"] < RING_SPEEDUP):
                    misses.append(line)
        targets.append(
            _target(
                f"ring and bidir at comm/compute = 1 ({reading}): within {OVERLAP_LIMIT}x of "
                f"max(matmul, comm) and >= {RING_SPEEDUP}x faster than the baseline (n = 2)",
                checked,
                misses,
            )
        )

    checked, misses = [], []
    for cell in (c for c in cells if c["ratio"] >= 0.5):
        rows = _rows_by_label(cell)
        if "ring" not in rows:
            continue
        for rival in ("slicing k=4", "push"):
            if rival not in rows:
                continue
            ring, other = rows["ring"]["median_s"], rows[rival]["median_s"]
            line = f"{_where(cell)}: ring {ring * 1e3:.1f} ms vs {rival} {other * 1e3:.1f} ms"
            if _same_program(rows["ring"], rows[rival]):
                continue  # one program (push is the ring at n = 2): nothing to compare
            checked.append(line)
            if ring >= other:
                misses.append(line)
    targets.append(
        _target(
            "ring ahead of slicing (k=4) and push wherever comm >= 0.5 x matmul", checked, misses
        )
    )

    noise = run_noise(cells)
    checked, misses = [], []
    for cell in cells:
        rows = _rows_by_label(cell)
        if "auto" not in rows:
            continue
        auto, baseline = rows["auto"], cell["rows"][0]
        best = min((r for r in cell["rows"] if r["label"] != "auto"), key=lambda r: r["median_s"])
        line = (
            f"{_where(cell)}: auto ran {auto['ran']} {auto['median_s'] * 1e3:.1f} ms, best "
            f"{best['label']} {best['median_s'] * 1e3:.1f} ms, "
            f"baseline {baseline['median_s'] * 1e3:.1f} ms"
        )
        checked.append(line)
        pays = baseline["median_s"] > AUTO_PAYS * best["median_s"]
        same_program = _same_program(auto, best)
        if same_program:
            line += " (the same program as the best row)"
        far = auto["median_s"] > AUTO_NEAR_BEST * best["median_s"]
        if (pays and far and not same_program) or auto["median_s"] > baseline["median_s"] * (
            1 + noise["max"]
        ):
            misses.append(line)
    targets.append(
        _target(
            f"auto within {AUTO_NEAR_BEST - 1:.0%} of the best row wherever a schedule beats "
            f"the baseline by more than {AUTO_PAYS - 1:.0%}, and never slower than the "
            f"baseline beyond the run's noise ({noise['max']:.1%}: the largest gap between "
            "two rows that ran the same program); a row that runs the best row's program "
            "is the best",
            checked,
            misses,
        )
    )

    checked, misses = [], []
    for cell in cells:
        for row in cell["rows"]:
            error = row.get("model_error")
            if error is None:
                continue
            line = f"{_where(cell)} {row['label']} ({row['ran']}): {error:+.0%}"
            checked.append(line)
            if abs(error) > MODEL_ERROR:
                misses.append(line)
    targets.append(
        _target(
            f"the cost model within {MODEL_ERROR:.0%} of the measured time in every row of "
            "every cell (predicted / measured - 1)",
            checked,
            misses,
        )
    )

    block = results.get("block")
    checked, misses = [], []
    if block is not None:
        best = min(block["rows"][1:], key=lambda r: r["median_s"], default=None)
        for row in block["rows"][1:]:
            line = (
                f"block {row['label']}: {row['median_s'] * 1e3:.1f} ms vs without the pass "
                f"{block['rows'][0]['median_s'] * 1e3:.1f} ms ({row['speedup']:.2f}x)"
            )
            checked.append(line)
            if row["label"] == "auto" and best and row["speedup"] < AUTO_BLOCK * best["speedup"]:
                misses.append(line + f"; best {best['label']} {best['speedup']:.2f}x")
    targets.append(
        _target(
            f"whole block step: auto at least {AUTO_BLOCK:.2f}x the best schedule's speedup",
            checked,
            misses,
        )
    )
    if not results["meta"]["network"]["throttled"]:
        for target in targets:
            target["reached"] = None
            target["note"] = "not judged: the link was not throttled"
    return targets


def run_noise(cells: list[dict[str, Any]]) -> dict[str, float]:
    """The run's own noise: per cell, the largest relative gap between two rows that ran
    the same program (``auto`` and the schedule it picked, the ring and push at n = 2,
    ...); the median and the largest gap over cells that have such rows."""
    gaps = []
    for cell in cells:
        by_program: dict[str, list[float]] = {}
        for row in cell["rows"]:
            if row.get("program"):
                by_program.setdefault(row["program"], []).append(row["median_s"])
        twins = [times for times in by_program.values() if len(times) > 1]
        if twins:
            gaps.append(max(max(t) / min(t) - 1 for t in twins))
    if not gaps:
        return {"median": 0.0, "max": 0.0, "cells": 0}
    return {"median": statistics.median(gaps), "max": max(gaps), "cells": len(gaps)}


def _same_program(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a is b or (a.get("program") is not None and a.get("program") == b.get("program"))


def _target(text: str, checked: list[str], misses: list[str]) -> dict[str, Any]:
    return {
        "target": text,
        "reached": (not misses) if checked else None,
        "figures": checked,
        "misses": misses,
    }


# ----------------------------------------------------------------------------------------
# Text


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _row_name(row: dict[str, Any]) -> str:
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
        + f"\n  matmul alone {_ms(cell['matmul_alone']['median'])} ms, comm alone "
        f"{_ms(cell['comm_alone']['median'])} ms (gloo's collective "
        f"{_ms(cell['collective_alone']['median'])} ms); both at once "
        f"{cell['overlap_probe']['vs_limit']:.2f}x limit, best with n blocks "
        f"{cell['n_block_bound_s'] / cell['limit_s']:.2f}x limit"
    )
    lines = [
        head,
        f"  {'row':<22}{'median ms':>10}{'min':>8}{'max':>8}{'speedup':>9}"
        f"{'/limit':>8}{'predicted':>11}{'error':>8}",
    ]
    for row in cell["rows"]:
        error = row.get("model_error")
        lines.append(
            f"  {_row_name(row):<22}{_ms(row['median_s']):>10}{_ms(row['min_s']):>8}"
            f"{_ms(row['max_s']):>8}{row['speedup']:>8.2f}x{row['vs_limit']:>8.2f}"
            f"{_ms(row['predicted_s']):>11}{'' if error is None else f'{error:+.0%}':>8}"
        )
    return "\n".join(lines)


def _ranks(block: dict[str, Any]) -> str:
    """The block's ranks, and whether they share the cores."""
    n, cores = block.get("world_size", 2), block.get("cores")
    shared = f", sharing {cores} cores" if cores is not None and n > cores else ""
    return f"{n} ranks ({block.get('mesh', f'tp={n}')}{shared})"


def site_counts(sites: dict[str, Any]) -> str:
    """A row's sites rewritten per graph and kind: ``forward ag_mm 20/20, ...``."""
    return ", ".join(
        f"{r['graph']} {r['kind']} {r['rewritten']}/{r['found']}" for r in sites["summary"]
    )


def format_block(block: dict[str, Any]) -> str:
    rate = block["rate_bits_per_s"]
    lines = [
        f"\nblock step (forward + backward) {block['size']}, {_ranks(block)}  link "
        + (f"{rate / 1e6:.0f} Mbit/s" if rate else "UNTHROTTLED")
        + f"  compute {_ms(block['compute_s'])} ms, communication {_ms(block['comm_s'])} ms",
        f"  {'row':<22}{'median ms':>10}{'min':>8}{'max':>8}{'speedup':>9}{'/limit':>8}"
        f"  sites rewritten",
    ]
    for row in block["rows"]:
        sites = row["sites"]
        lines.append(
            f"  {row['label']:<22}{_ms(row['median_s']):>10}{_ms(row['min_s']):>8}"
            f"{_ms(row['max_s']):>8}{row['speedup']:>8.2f}x{row['vs_limit']:>8.2f}"
            f"  {sites['rewritten']}/{sites['found']} {','.join(sites['schedules'])}"
            f" ({site_counts(sites)})"
        )
    return "\n".join(lines)


def format_targets(targets: list[dict[str, Any]]) -> str:
    lines = ["\ntargets:"]
    for t in targets:
        mark = {True: "reached", False: "MISSED", None: "not judged"}[t["reached"]]
        lines.append(f"  [{mark}] {t['target']}")
        lines += [f"      miss: {m}" for m in t["misses"]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Files


def write(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and speedup.svg in ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot_speedup(results, out / "speedup.svg")
    (out / "results.md").write_text(markdown(results))


def _setting(results: dict[str, Any]) -> list[str]:
    meta = results["meta"]
    before, after = meta["machine_before"], meta["machine_after"]
    network = meta["network"]
    lines = []
    if not network["throttled"]:
        lines += [
            "> **WARNING: UNTHROTTLED RUN.** " + network["description"] + ". Communication "
            "costs CPU, not wall time: nothing here says anything about overlap.",
            "",
        ]
    lines += [
        f"* command: `{meta['command']}` (preset `{meta['preset']}`), {meta['date']}",
        f"* machine: {before['cpu']}, {before['cores']} cores, Linux {before['kernel']}, "
        f"Python {before['python']}, torch {before['torch']}",
        f"* load average (1/5/15 min) before {_loads(before)}, after {_loads(after)} "
        f"(the benchmark's own ranks make {meta['world_size']}; more means other work shared "
        "the machine)",
        f"* network: {network['description']}",
        f"* {meta['world_size']} gloo ranks, 1 torch thread each; per cell every row runs "
        f"{meta['warmup']} warm-up + {meta['reps']} timed calls, interleaved; a call's time is "
        "the slowest rank's (all start on a barrier); median reported, min and max kept",
        "* comm alone = the bytes the collective must move (n-1 blocks per rank, the ring "
        "algorithm's traffic) sent as P2P in one batch, nothing computed: the link time of "
        "the site; collective alone = gloo's collective alone (its reduce-scatter sends "
        "every rank the whole product, twice a ring's bytes for n = 2); comm/compute = comm "
        "alone / matmul alone, set by the link rate",
        "* speedup = baseline median / row median; / limit = row median / max(matmul alone, "
        "comm alone), 1.00 = perfect overlap; both at once = comm alone started, the whole "
        "matmul run, then waited (no schedule: how much this machine overlaps at all); "
        "predicted = the cost model's time for what ran (profile: `commfuse calibrate` run "
        "on this link, bandwidth scaled to each cell's rate)",
    ]
    return lines


def _loads(machine: dict[str, Any]) -> str:
    return "/".join(f"{x:.1f}" for x in machine["load_average"])


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# commfuse bench ({results['meta']['preset']})", "", *_setting(results), ""]
    lines += ["![speedup over the baseline against comm/compute](speedup.svg)", ""]
    lines += ["## Sites (a TP+SP linear; a Ulysses projection)", ""]
    for kind, title in KIND_TITLES.items():
        cells = [c for c in results["sites"] if c["kind"] == kind]
        if not cells:
            continue
        lines += [
            f"### {title}",
            "",
            "| size | comm/compute (measured) | link Mbit/s | matmul alone ms | comm alone ms "
            "| collective alone ms | both at once / limit | row | median ms | min-max ms "
            "| speedup | / limit | predicted ms | model error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for cell in cells:
            rate = cell["rate_bits_per_s"]
            head = [
                cell["size"],
                f"{cell['ratio']:g} ({cell['measured_ratio']:.2f})",
                f"{rate / 1e6:.0f}" if rate else "unthrottled",
                _ms(cell["matmul_alone"]["median"]),
                _ms(cell["comm_alone"]["median"]),
                _ms(cell["collective_alone"]["median"]),
                f"{cell['overlap_probe']['vs_limit']:.2f}",
            ]
            for i, row in enumerate(cell["rows"]):
                lines.append(
                    "| "
                    + " | ".join(
                        (head if i == 0 else [""] * len(head))
                        + [
                            _row_name(row),
                            _ms(row["median_s"]),
                            f"{_ms(row['min_s'])}-{_ms(row['max_s'])}",
                            f"{row['speedup']:.2f}x",
                            f"{row['vs_limit']:.2f}",
                            _ms(row["predicted_s"]),
                            "-" if row.get("model_error") is None else f"{row['model_error']:+.0%}",
                        ]
                    )
                    + " |"
                )
        lines.append("")
    lines += _breakdown_table(results)
    for key in ("block", "block_2d"):
        if results.get(key) is not None:
            lines += _block_table(results[key])
    lines += ["## Targets", ""]
    for t in results["targets"]:
        mark = {True: "reached", False: "**missed**", None: "not judged"}[t["reached"]]
        lines.append(f"* {mark}: {t['target']}" + (f" ({t['note']})" if "note" in t else ""))
        lines += [f"  * {line}" for line in t["figures"]]
    declined = [
        f"{c['kind']} {c['size']} ratio {c['ratio']:g} {r['label']}: {r['reason']}"
        for c in results["sites"]
        for r in c["rows"]
        if r["label"] not in ("baseline", "auto") and r["decision"] != "rewritten"
    ]
    if declined:
        lines += ["", "Rows the pass declined (they ran the collective):", ""]
        lines += [f"* {d}" for d in declined]
    return "\n".join(lines) + "\n"


def _breakdown_table(results: dict[str, Any]) -> list[str]:
    """Node-by-node time of each row at comm/compute 1 (rank 0): where a call's time goes."""
    cells = [c for c in results["sites"] if c["ratio"] == 1.0]
    if not cells:
        return []
    lines = [
        "## Where the time goes (comm/compute 1, rank 0, node by node)",
        "",
        "Each row's graph run once more node by node (median of 3 runs): `matmul` = the "
        "matmuls (in the overlap windows they share 2 cores with the transfers), `comm wait` "
        "= communication left exposed, `comm issue` = starting transfers and collectives, "
        "`other` = copies, concatenation, partial-sum adds.",
        "",
        "| site | size | row | matmul ms | comm issue ms | comm wait ms | other ms | sum ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        for row in cell["rows"]:
            parts = row["breakdown_rank0_s"]
            lines.append(
                f"| {cell['kind']} | {cell['size']} | {_row_name(row)} | "
                + " | ".join(_ms(parts[c]) for c in ("matmul", "comm issue", "comm wait", "other"))
                + f" | {_ms(sum(parts.values()))} |"
            )
    return [*lines, ""]


def _block_table(block: dict[str, Any]) -> list[str]:
    rate = block["rate_bits_per_s"]
    n = block.get("world_size", 2)
    if block["shape"].get("front", "tp") == "fsdp":
        title = f"2-D block (data x tensor parallel, {n} ranks)"
        layout = (
            f"on a {block['mesh']} mesh: every parameter sharded on dim 0 over the data-"
            "parallel group and all-gathered in forward (its gradient reduce-scattered), "
            "TP+SP over the tensor-parallel group (DTensor)"
        )
    else:
        title, layout = "Whole block", "TP+SP over the ranks (DTensor)"
    lines = [
        f"## {title}: training step (forward + backward)",
        "",
        f"One Llama-style block ({block['size']}) with final norm and head, {layout}; "
        f"{_ranks(block)}, 1 torch thread each. "
        '`torch.compile(backend="commfuse")` with the eager inner compiler; '
        'without the pass = the same compile with `schedule="off"`. Link '
        + (f"{rate / 1e6:.0f} Mbit/s" if rate else "unthrottled")
        + f", chosen so that the step's communication is {block['ratio']:g}x its compute: "
        f"compute (unthrottled step) {_ms(block['compute_s'])} ms, communication "
        f"(throttled minus unthrottled) {_ms(block['comm_s'])} ms."
        + (
            f" Load average before {_loads(block['machine_before'])}, after "
            f"{_loads(block['machine_after'])}."
            if "machine_before" in block
            else ""
        ),
        "",
        "| row | median ms | min-max ms | speedup | / limit | sites rewritten (schedules) "
        "| per graph and kind |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in block["rows"]:
        sites = row["sites"]
        lines.append(
            f"| {row['label']} | {_ms(row['median_s'])} | {_ms(row['min_s'])}-"
            f"{_ms(row['max_s'])} | {row['speedup']:.2f}x | {row['vs_limit']:.2f} | "
            f"{sites['rewritten']}/{sites['found']} ({', '.join(sites['schedules']) or '-'}) "
            f"| {site_counts(sites)} |"
        )
    return [*lines, ""]


# ----------------------------------------------------------------------------------------
# Plot


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
