"""``commfuse bench --nodes N``: training steps of jobs that span nodes, launched as on a
cluster.

Each node is a network namespace holding its ranks (they talk over the node's own
address, at memory speed); its NIC is a veth link to a bridge behind a token bucket
(``netns``'s ``veth`` topology, a "rank" per node). Each node's ranks are started by its
own torchrun, joined by c10d rendezvous (``nodes.LaunchedRanks``): one job, not one
process tree. On it, in one launch: ``commfuse calibrate``'s measurement by level (each
node's ranks, then the NIC and the collectives between nodes; at two reference rates and
unthrottled, the NIC's link times taken to each cell's rate, ``link.LinkProfiles``),
then each cell, a whole block's training step (``block.run_block``): the NIC rate chosen
so that the baseline's time on the link (its communication alone, throttled minus
unthrottled) is about its compute alone, then every row (the baseline, each fixed
schedule, ``auto``) compiled and timed interleaved. The pass takes the topology from
torchrun (``LOCAL_WORLD_SIZE``), so each site is priced by its group's level.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import targets
from .block import BlockBench, run_block
from .config import BlockShape, Progress
from .figures import auto_against, format_targets, ms, site_counts
from .link import calibrated
from .markdown import block_table, loads, targets_section
from .netns import can_throttle
from .nodes import describe, launched_ranks
from .run import machine, variants

# the rows of a dense block: the baseline, each fixed schedule (slicing once), auto; of
# an MoE layer: its all-to-alls have the ring's pairwise order only
DENSE_ROWS = ("baseline", "slicing k=2", "push", "ring", "bidir", "auto")
EXPERT_ROWS = ("baseline", "ring", "auto")
CALIBRATE_REPS = 5
REPS = 15  # timed steps per row, after one warm-up


@dataclasses.dataclass(frozen=True)
class NodeCell:
    """A cell: a block laid out over the nodes (``tp``: set to the ranks per node)."""

    name: str
    shape: BlockShape
    rows: tuple[str, ...]
    key: str

    def bench(self, ranks_per_node: int) -> BlockBench:
        shape = self.shape
        if shape.front == "fsdp":  # TP inside a node, sharded DP across the nodes
            shape = dataclasses.replace(shape, tp=ranks_per_node)
        return BlockBench(
            shape, ratio=1.0, schedules=self.rows, reps=REPS, key=self.key, rate_from_alone=True
        )


# Small, since every node's ranks share this machine's cores, but with 8 sequences per
# step. The rate makes the link's time about the compute, but the collectives also take
# the CPU of 4 gloo ranks on 2 cores, unthrottled; at 2 sequences TP across the nodes
# had 43 ms of compute and 126 ms of communication alone (49 of it the link), so ``off``
# was 1.29x its overlap limit and no schedule could reach 1.3x; at 8, 120 and 310 ms
# (139 the link): 1.42x.
CELLS = (
    NodeCell(
        "2-D block: sharded DP across nodes, TP inside a node",
        BlockShape(seq=256, dim=256, heads=4, hidden=768, batch=8, front="fsdp"),
        DENSE_ROWS,
        "nodes_block_2d",
    ),
    NodeCell(
        "TP+SP across the nodes",
        BlockShape(seq=256, dim=256, heads=4, hidden=768, batch=8),
        DENSE_ROWS,
        "nodes_block_tp",
    ),
    NodeCell(
        "MoE (capacity): expert parallel across the nodes",
        BlockShape(seq=512, dim=128, heads=1, hidden=512, front="moe"),
        EXPERT_ROWS,
        "nodes_block_moe",
    ),
    # torchtitan's layer, whose compute is mostly its experts' grouped GEMMs: the
    # capacity layer's einsums around its small expert matmuls leave its all-to-alls
    # little to overlap across the nodes (its ring 0.87-0.96x of ``off`` in six runs)
    NodeCell(
        "MoE (dropless): expert parallel across the nodes",
        BlockShape(seq=1024, dim=256, heads=1, hidden=512, front="moe", moe="dropless"),
        EXPERT_ROWS,
        "nodes_block_moe_dropless",
    ),
)


def run(
    out: Path, nodes: int, ranks_per_node: int = 2, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every cell on ``nodes`` x ``ranks_per_node`` launched ranks; writes
    ``out``/results.json and results.md."""
    out.mkdir(parents=True, exist_ok=True)
    rows = variants()
    progress = Progress(1 + len(CELLS), echo)
    description = describe(nodes, ranks_per_node)
    results: dict[str, Any] = {
        "meta": {
            "preset": f"nodes {nodes}x{ranks_per_node}",
            "command": " ".join(["commfuse", *sys.argv[1:]]) if sys.argv else "commfuse bench",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "nodes": nodes,
            "ranks_per_node": ranks_per_node,
            "network": {"topology": "veth", "description": description, "throttled": True},
            "machine_before": machine(),
        },
        "cells": [],
    }
    echo(f"network: {description}")
    progress.stage(f"launching {nodes} torchruns (c10d rendezvous), {ranks_per_node} ranks each")
    with launched_ranks(nodes, ranks_per_node, out / "logs") as (network, ranks, _):
        results["meta"]["launch"] = ranks.commands
        base = calibrated(
            network, ranks, description, CALIBRATE_REPS, progress, per_node=ranks_per_node
        )
        results["meta"]["profile"] = base.reference.as_json()
        results["meta"]["profile_low"] = base.low.as_json()
        results["meta"]["profile_unthrottled"] = base.free.as_json()
        progress.advance()
        for cell in CELLS:
            spec = cell.bench(ranks_per_node)
            block = run_block(spec, network, ranks, base, rows, out, progress)
            block |= {"cell": cell.name, "key": cell.key, "link_ratio": link_ratio(block)}
            results["cells"].append(block)
            progress.advance()
            progress.echo(_against_line(block))
        results["meta"]["qdisc"] = network.qdisc_stats()
    results["meta"]["machine_after"] = machine()
    results["targets"] = targets.nodes_targets(results["cells"])
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(results))
    progress.stage(f"done: {out / 'results.md'}")
    echo(format_targets(results["targets"]))
    return results


def link_ratio(block: dict[str, Any]) -> float | None:
    """The baseline's time on the link (its communication alone, throttled minus
    unthrottled) over its compute alone, as the rate search last measured them; None
    where that was not at the cell's rate (the search did not settle)."""
    last = block["rate_tries"][-1] if block["rate_tries"] else None
    if last is None or last["rate_bits_per_s"] != block["rate_bits_per_s"]:
        return None
    return float(last["link_s"] / last["compute_s"])


def _against_line(block: dict[str, Any]) -> str:
    a = auto_against(block)
    return (
        f"  auto ({a['auto_ran']}): {a['auto_vs_best']:.2f}x the best fixed row's time "
        f"({a['best']}), {a['auto_vs_off']:.2f}x faster than off"
    )


def markdown(results: dict[str, Any]) -> str:
    """results.md of a multi-node run: the setting, a line per cell, the targets, each
    cell's block table."""
    meta = results["meta"]
    nodes, per_node = meta["nodes"], meta["ranks_per_node"]
    profile = meta["profile"]
    nic = profile["across_nodes"]
    lines = [
        f"# commfuse bench --nodes {nodes} ({nodes} nodes x {per_node} ranks)",
        "",
        f"* command: `{meta['command']}`, {meta['date']}",
        f"* machine: {meta['machine_before']['cpu']}, {meta['machine_before']['cores']} cores, "
        f"torch {meta['machine_before']['torch']}; load average before "
        f"{loads(meta['machine_before'])}, after {loads(meta['machine_after'])} (the "
        f"benchmark's ranks make {nodes * per_node})",
        f"* network: {meta['network']['description']}",
        "* launch, one torchrun per node (c10d rendezvous; `GLOO_SOCKET_IFNAME` names the "
        "node's NIC):",
        *(f"  * `{command}`" for command in meta["launch"]),
        f"* profile `auto` decides on: `commfuse calibrate` by level in the same launch, "
        f"inside a node {profile['link_bytes_per_s'] / 1e6:.0f} MB/s, across nodes "
        f"{nic['bytes_per_s'] / 1e6:.0f} MB/s per NIC at the reference rate (its link times "
        "taken to each cell's rate from it and a lower one); the pass's topology from torchrun "
        f"(`LOCAL_WORLD_SIZE={per_node}`)",
        "* every row 1 warm-up + the timed steps, interleaved; a step's time is the slowest "
        "rank's; median reported",
        "",
        "| cell | mesh | link Mbit/s | link time / compute | off ms | best fixed ms | auto ms "
        "(ran) | auto / best | auto vs off | auto's sites rewritten |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        a = auto_against(cell)
        auto_sites = next(r for r in cell["rows"] if r["label"] == "auto")["sites"]
        rate = cell["rate_bits_per_s"]
        lines.append(
            f"| {cell['cell']} | {cell['mesh']} | {f'{rate / 1e6:.0f}' if rate else '-'} | "
            + ("-" if cell["link_ratio"] is None else f"{cell['link_ratio']:.2f}")
            + f" | {ms(a['off_s'])} | "
            f"{ms(a['best_s'])} ({a['best']}) | {ms(a['auto_s'])} ({a['auto_ran']}) | "
            f"{a['auto_vs_best']:.2f} | {a['auto_vs_off']:.2f}x | "
            f"{auto_sites['rewritten']}/{auto_sites['found']} ({site_counts(auto_sites)}) |"
        )
    lines += ["", *targets_section({"targets": results["targets"], "sites": []}), ""]
    for cell in results["cells"]:
        lines += block_table(cell, f" on {nodes} nodes x {per_node} ranks")
    return "\n".join(lines) + "\n"


def main(out: str, nodes: int, ranks_per_node: int = 2) -> int:
    why_not = can_throttle()
    if why_not is not None:
        print(
            f"commfuse bench: error: --nodes needs network namespaces: {why_not}", file=sys.stderr
        )
        return 2
    results = run(Path(out), nodes, ranks_per_node)
    return 0 if results["cells"] else 1
