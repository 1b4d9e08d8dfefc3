"""``commfuse bench``'s results.md: how the run was made, a table per site kind, where the
time goes, the block tables and the targets."""

from __future__ import annotations

from typing import Any

from .config import (
    AT_CELL_SPEED,
    AT_CELL_SPEED_TITLE,
    CELL_TIMED_S,
    COMPARED,
    LOW_RATE,
    MAX_ROUNDS,
    MIN_TIMED_S,
    REFERENCE_RATE,
)
from .figures import (
    KIND_TITLES,
    format_errors,
    mb,
    ms,
    percent,
    ranks_text,
    row_name,
    site_counts,
)


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# commfuse bench ({results['meta']['preset']})", "", *_setting(results), ""]
    lines += ["![speedup over the baseline against comm/compute](speedup.svg)", ""]
    lines += [
        "## Sites (a TP+SP linear; a Ulysses projection; a plain-TP all-reduce; MoE experts)",
        "",
    ]
    for kind, title in KIND_TITLES.items():
        cells = [c for c in results["sites"] if c["kind"] == kind]
        if cells:
            lines += _site_table(title, cells)
    lines += _breakdown_table(results)
    for key in ("block", "block_plain_tp", "block_moe", "block_moe_dropless", "block_2d"):
        if results.get(key) is not None:
            lines += block_table(results[key])
    if results.get("served") is not None:
        lines += served_table(results["served"])
    lines += targets_section(results)
    return "\n".join(lines) + "\n"


def _site_table(title: str, cells: list[dict[str, Any]]) -> list[str]:
    """A site kind's cells: the cell's figures on its first row, then a line per row."""
    lines = [
        f"### {title}",
        "",
        "| size | comm/compute (measured) | link Mbit/s | matmul alone ms | comm alone ms "
        "| collective alone ms | both at once / limit | row | median ms | min-max ms "
        "| speedup | / limit | predicted ms | model error | at the cell's compute speed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        rate = cell["rate_bits_per_s"]
        head = [
            cell["size"],
            f"{cell['ratio']:g} ({cell['measured_ratio']:.2f})",
            f"{rate / 1e6:.0f}" if rate else "unthrottled",
            ms(cell["matmul_alone"]["median"]),
            ms(cell["comm_alone"]["median"]),
            ms(cell["collective_alone"]["median"]),
            f"{cell['overlap_probe']['vs_limit']:.2f}",
        ]
        for i, row in enumerate(cell["rows"]):
            lines.append(
                "| "
                + " | ".join(
                    (head if i == 0 else [""] * len(head))
                    + [
                        row_name(row),
                        ms(row["median_s"]),
                        f"{ms(row['min_s'])}-{ms(row['max_s'])}",
                        f"{row['speedup']:.2f}x",
                        f"{row['vs_limit']:.2f}",
                        ms(row["predicted_s"]),
                        percent(row.get("model_error")) or "-",
                        percent(row.get(AT_CELL_SPEED)) or "-",
                    ]
                )
                + " |"
            )
    return [*lines, ""]


def targets_section(results: dict[str, Any]) -> list[str]:
    """Each target with its figures, then the rows the pass declined."""
    lines = ["## Targets", ""]
    for t in results["targets"]:
        mark = {True: "reached", False: "**missed**", None: "not judged"}[t["reached"]]
        lines.append(f"* {mark}: {t['target']}" + (f" ({t['note']})" if "note" in t else ""))
        lines += [f"  * {line}" for line in t["figures"]]
    if results.get("model_error"):  # predicted / measured - 1, over every row that has one
        lines += ["", "The cost model's error (predicted / measured - 1):", "", "```"]
        lines += [format_errors(results["model_error"]), "```"]
    if results.get(AT_CELL_SPEED):
        lines += [
            "",
            "The same, each cell's compute at the speed it ran at (its matmul alone against "
            "the model's time of it; the link and the collectives as calibrated):",
            "",
            "```",
            format_errors(results[AT_CELL_SPEED], AT_CELL_SPEED_TITLE),
            "```",
        ]
    declined = [
        f"{c['kind']} {c['size']} ratio {c['ratio']:g} {r['label']}: {r['reason']}"
        for c in results["sites"]
        for r in c["rows"]
        if r["label"] not in ("baseline", "auto") and r["decision"] != "rewritten"
    ]
    if declined:
        lines += ["", "Rows the pass declined (they ran the collective):", ""]
        lines += [f"* {d}" for d in declined]
    return lines


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
                f"| {cell['kind']} | {cell['size']} | {row_name(row)} | "
                + " | ".join(ms(parts[c]) for c in ("matmul", "comm issue", "comm wait", "other"))
                + f" | {ms(sum(parts.values()))} |"
            )
    return [*lines, ""]


COMPARED_NOTE = (
    f"Rows `{COMPARED}...`: the same block written with sequence parallelism by hand "
    "(DTensor's `SequenceParallel` norms, `ColwiseParallel(input_layouts=Shard(1))`, "
    "`RowwiseParallel(output_layouts=Shard(1))`), on the same link, each row's speedup "
    f"against `{COMPARED}baseline`. sent = the bytes a rank's collectives and P2P steps "
    "send per step (a collective counted as a ring sends it); saved = the bytes saved for "
    "the backward per rank (`saved_tensors_hooks`); peak = the most CPU memory allocated "
    "during the step above what was live before it (the profiler's events); each the "
    "largest over the ranks."
)


def block_table(block: dict[str, Any], where: str = "") -> list[str]:
    """A block's section; ``where``: what its title adds (the nodes it runs on)."""
    rate = block["rate_bits_per_s"]
    n = block.get("world_size", 2)
    if block["shape"].get("front", "tp") == "fsdp":
        title = f"2-D block (data x tensor parallel, {n} ranks)"
        layout = (
            f"on a {block['mesh']} mesh: every parameter sharded on dim 0 over the data-"
            "parallel group and all-gathered in forward (its gradient reduce-scattered), "
            "TP+SP over the tensor-parallel group (DTensor)"
        )
    elif not block["shape"].get("sequence_parallel", True):
        title = "Whole block, plain TP"
        layout = (
            "plain TP over the ranks (DTensor's default `ColwiseParallel`/`RowwiseParallel`: "
            "every token on every rank, an all-reduce after each row-parallel linear; with "
            "the pass, each is split into a reduce-scatter, the residual add and norm on "
            "1/n of the tokens and all-gathers into the next matmuls)"
        )
    else:
        title, layout = "Whole block", "TP+SP over the ranks (DTensor)"
    what = f"One Llama-style block ({block['size']}) with final norm and head, {layout}"
    if block["shape"].get("front") == "moe" and block["shape"].get("moe") == "dropless":
        title = "Whole dropless MoE layer, expert parallel"
        what = (
            f"One dropless MoE layer ({block['size']}: S tokens per rank, torchtitan's: a "
            "top-2 softmax router, tokens sorted by expert, the token counts exchanged, "
            "`.tolist()` splits, the uneven dispatch all-to-all, grouped-GEMM SwiGLU "
            "experts in bfloat16, the combine all-to-all and `scatter_add`; pre-norm, "
            "residual, loss = MSE; compiled with `capture_scalar_outputs`), expert "
            "parallel over every rank"
        )
    elif block["shape"].get("front") == "moe":
        title = "Whole MoE layer, expert parallel"
        what = (
            f"One capacity-MoE layer ({block['size']}: S tokens per rank, a top-2 softmax "
            "router with capacity 2S/E, einsum dispatch, DeepSpeed's `_AllToAll`, "
            "`bmm` experts with GELU, the combine all-to-all and einsum; pre-norm, "
            "residual, loss = MSE + 0.01 x load balancing), expert parallel over every rank"
        )
    lines = [
        f"## {title}{where}: training step (forward + backward)",
        "",
        f"{what}; {ranks_text(block)}, 1 torch thread each. "
        '`torch.compile(backend="commfuse")` with the eager inner compiler; '
        'without the pass = the same compile with `schedule="off"`. Link '
        + (f"{rate / 1e6:.0f} Mbit/s" if rate else "unthrottled")
        + f", chosen so that the step's communication is {block['ratio']:g}x its compute: "
        f"the baseline's compute alone {ms(block['compute_s'])} ms, its communication "
        f"alone {ms(block['comm_s'])} ms."
        + (
            f" Load average before {loads(block['machine_before'])}, after "
            f"{loads(block['machine_after'])}."
            if "machine_before" in block
            else ""
        ),
        "",
        "| row | median ms | min-max ms | speedup | / limit | sent MB | saved MB | peak MB "
        "| sites rewritten (schedules) | per graph and kind |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in block["rows"]:
        sites = row["sites"]
        lines.append(
            f"| {row['label']} | {ms(row['median_s'])} | {ms(row['min_s'])}-"
            f"{ms(row['max_s'])} | {row['speedup']:.2f}x | {row['vs_limit']:.2f} | "
            f"{mb(row.get('sent_bytes'))} | {mb(row.get('saved_bytes'))} | "
            f"{mb(row.get('peak_bytes'))} | "
            f"{sites['rewritten']}/{sites['found']} ({', '.join(sites['schedules']) or '-'}) "
            f"| {site_counts(sites)} |"
        )
    if any(row["label"].startswith(COMPARED) for row in block["rows"]):
        lines += ["", COMPARED_NOTE]
    return [*lines, ""]


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
        f"* load average (1/5/15 min) before {loads(before)}, after {loads(after)} "
        f"(the benchmark's own ranks make {meta['world_size']}; more means other work shared "
        "the machine)",
        f"* network: {network['description']}",
        f"* {meta['world_size']} gloo ranks, 1 torch thread each; per cell every row runs "
        f"{meta['warmup']} warm-up + {meta['reps']} timed calls, interleaved (a site cell: "
        f"more where those take under {CELL_TIMED_S:g} s, as many as fit, up to {MAX_ROUNDS}); "
        "a call's time is the slowest rank's (all start on a barrier; in a site cell, a call "
        f"under {MIN_TIMED_S * 1e3:g} ms is timed as several back to back, their mean); "
        "median reported, min and max kept",
        "* comm alone = the bytes the collective must move (n-1 blocks per rank, the ring "
        "algorithm's traffic) sent as P2P in one batch, nothing computed: the link time of "
        "the site (the plain-TP all-reduce cells: 2(n-1) blocks, the reduce-scatter's and "
        "the all-gather's, against both matmuls; the MoE cells: 2(n-1), the dispatch's and "
        "the combine's, against both bmm or the three grouped matmuls; the dropless "
        "cells: the busiest rank's rows); collective alone = gloo's collective "
        "alone (its reduce-scatter sends every rank the whole product, twice a ring's bytes "
        "for n = 2); comm/compute = comm alone / matmul alone, set by the link rate",
        "* speedup = baseline median / row median; / limit = row median / max(matmul alone, "
        "comm alone), 1.00 = perfect overlap; both at once = comm alone started, the whole "
        "matmul run, then waited (no schedule: how much this machine overlaps at all); "
        "predicted = the cost model's time for what ran (profile: `commfuse calibrate` run "
        f"on this link at {REFERENCE_RATE / 1e6:.0f} and {LOW_RATE / 1e6:.0f} Mbit/s, its link "
        "times taken to each cell's rate)",
    ]
    return lines


def loads(machine: dict[str, Any]) -> str:
    return "/".join(f"{x:.1f}" for x in machine["load_average"])


def served_table(served: dict[str, Any]) -> list[str]:
    """results.md's served section: per phase and token count, each row's median."""
    cells = served["cells"]
    labels = [row["label"] for row in cells[0]["rows"]]
    rate = served["rate_bits_per_s"]
    lines = [
        "## Served plain TP: prefill (time to first token) and decode (time per output token)",
        "",
        f"A plain-TP block's sublayer (down-projection -> all-reduce -> add + RMSNorm -> "
        f"up-projection, D={served['dim']} F={served['ffn']}) at a prefill's tokens (one "
        f"prompt) and a decode step's (one token per sequence), on one link of "
        + (f"{rate / 1e6:.0f} Mbit/s" if rate else "unthrottled speed")
        + "; median ms per call (min-max in results.json); `auto / off`: auto's median "
        "over the baseline's.",
        "",
        "| phase | tokens | comm/compute | " + " | ".join(labels) + " | auto / off |",
        "|---|---|---|" + "---|" * len(labels) + "---|",
    ]
    for cell in cells:
        by_label = {row["label"]: row for row in cell["rows"]}
        auto = by_label.get("auto")
        ratio = f"{auto['median_s'] / cell['rows'][0]['median_s']:.2f}" if auto else "-"
        medians = [
            f"{ms(by_label[label]['median_s'])} ({row_name(by_label[label])})"
            if label == "auto"
            or (label != "baseline" and by_label[label]["decision"] != "rewritten")
            else ms(by_label[label]["median_s"])
            for label in labels
        ]
        lines.append(
            f"| {cell['phase']} | {cell['tokens']} | {cell['measured_ratio']:.2f} | "
            + " | ".join(medians)
            + f" | {ratio} |"
        )
    return [*lines, ""]
