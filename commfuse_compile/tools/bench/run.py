"""``commfuse bench``: every schedule measured side by side over a bandwidth-limited link.

The ranks run in network namespaces behind token-bucket links (``netns.py``). For each
site (a TP+SP linear's all-gather -> matmul and matmul -> reduce-scatter, at several
sizes; a Ulysses projection's matmul -> all-to-all and all-to-all -> matmul) and each
communication/computation ratio (``Preset.cells``), the link rate is chosen from the
measured matmul time so that the collective alone takes ``ratio`` times the matmul
alone (``link``); then the baseline (collective then matmul), every schedule of
the pass that has steps for the site's direction and the two parts alone are measured
in one run, interleaved (A B C ... A B C ...) after a warm-up, each call started
together on all ranks by a barrier and timed as the slowest rank's (``cells``).
The whole-layer figure is a transformer block's forward + backward, compiled with the
pass and without it (the same compile with ``schedule="off"``; ``block``); the full
preset adds a capacity-MoE layer's and a dropless-MoE layer's.

``auto`` gets the profile a user would calibrate on this link: ``commfuse calibrate``'s
measurement run inside the namespaces at two reference rates, its link times taken to
each cell's rate. ``figures`` turns the results into figures and tables,
``targets`` judges them, ``markdown`` and ``plot`` write results.md
and the plot. This module holds the presets and runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ...options import SCHEDULES
from ...passes.kinds import KINDS as SITE_KINDS
from ...schedules import Direction, by_name, running
from . import figures, targets
from .block import BlockBench, run_block
from .cells import SiteJob, measure_site
from .config import (
    AT_CELL_SPEED,
    AT_CELL_SPEED_TITLE,
    CELL_KINDS,
    CELL_TIMED_S,
    DROPLESS_KIND,
    DROPLESS_SKEW,
    MOE_KIND,
    SERVED_KIND,
    BlockShape,
    Progress,
    SiteShape,
    Variant,
)
from .link import LinkProfiles, calibrated, choose_rate
from .markdown import markdown
from .plot import plot_speedup
from .served import ServedBench, run_served

SLICES = (2, 4)  # chunks of the data-slicing rows
ROW_ORDER = ("off", "slicing", "push", "ring", "bidir", "auto")  # schedules not named go last


def variants(schedules: tuple[str, ...] = SCHEDULES) -> list[Variant]:
    """The rows of every site, baseline first: each schedule the pass offers, slicing
    once per k in ``SLICES`` (the list follows ``options.SCHEDULES``)."""
    order = {name: i for i, name in enumerate(ROW_ORDER)}
    rows = []
    for name in sorted(schedules, key=lambda s: order.get(s, len(order))):
        if name == "off":
            rows.append(Variant("baseline", "off"))
        elif name == "slicing":
            rows += [Variant(f"slicing k={k}", "slicing", k) for k in SLICES]
        else:
            rows.append(Variant(name, name))
    return rows


# Bench cell kinds that are no site kind of the pass, and the directions of their sites:
# the all-reduce between two matmuls (plain TP), which the pass splits into a
# reduce-scatter site and an all-gather site; a capacity MoE's dispatch -> experts ->
# combine, an all-to-all -> bmm site and a bmm -> all-to-all site
SPLIT_KINDS = {
    "mm_ar_mm": (Direction.REDUCE, Direction.GATHER),
    MOE_KIND: (Direction.EXCHANGE_IN, Direction.EXCHANGE_OUT),
}
# Bench cell kinds that are one site of another name: a dropless MoE's dispatch ->
# grouped experts -> combine, the pass's ``moe`` site
SITE_OF = {DROPLESS_KIND: "moe"}


def kind_rows(rows: list[Variant], kind: str) -> list[Variant]:
    """The rows of a site kind's cells: the baseline, ``auto`` and the schedules with
    steps for the kind's direction (an all-to-all has the ring's pairwise order only;
    a split all-reduce needs both the reduce-scatter's and the all-gather's)."""
    directions = SPLIT_KINDS.get(kind) or (SITE_KINDS[SITE_OF.get(kind, kind)].direction,)
    return [
        v
        for v in rows
        if v.schedule in ("off", "auto")
        or all(by_name(running(v.schedule, d)).supports(d) for d in directions)
    ]


@dataclasses.dataclass(frozen=True)
class Cells:
    """Every (kind, size, ratio) of ``kinds`` x ``sizes`` x ``ratios`` (comm-alone /
    matmul-alone of a site) is one cell."""

    kinds: tuple[str, ...]
    sizes: tuple[SiteShape, ...]
    ratios: tuple[float, ...]

    def __iter__(self) -> Iterator[tuple[str, SiteShape, float]]:
        return itertools.product(self.kinds, self.sizes, self.ratios)


TP_KINDS = ("ag_mm", "mm_rs")
ULYSSES_KINDS = ("mm_a2a", "a2a_mm")  # q/k/v projection -> all-to-all; all-to-all -> Wo
PLAIN_TP_KINDS = ("mm_ar_mm",)  # down-projection -> all-reduce -> add + RMSNorm -> up
MOE_KINDS = (MOE_KIND,)  # dispatch all-to-all -> bmm -> SiLU -> bmm -> combine all-to-all
# counts exchanged, .tolist() splits, dispatch -> grouped-GEMM SwiGLU -> combine
DROPLESS_KINDS = (DROPLESS_KIND,)
assert set(CELL_KINDS) == {
    *(*TP_KINDS, *ULYSSES_KINDS, *PLAIN_TP_KINDS, *MOE_KINDS, *DROPLESS_KINDS, SERVED_KIND)
}


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    cells: tuple[Cells, ...]
    warmup: int
    reps: int
    block: BlockBench | None  # None only in a preset cut by ``only``
    calibrate_reps: int
    rate_reps: int = 5  # calls per try while choosing a link rate
    cell_timed_s: float = CELL_TIMED_S  # a site cell's rows timed at least this long
    block_2d: BlockBench | None = None  # measured with ``--block-2d`` only
    block_plain: BlockBench | None = None  # the block under plain TP (the pass splits it)
    block_moe: BlockBench | None = None  # a capacity-MoE layer (expert parallel)
    block_dropless: BlockBench | None = None  # a dropless-MoE layer (expert parallel)
    served: ServedBench | None = None  # plain TP served: prefills and decode steps

    def only(self, kinds: tuple[str, ...]) -> Preset:
        """The preset cut to the cells of ``kinds`` (``--kinds``) and the blocks whose
        sites they are: the TP+SP blocks (1-D and 2-D) with ``ag_mm`` or ``mm_rs``, the
        plain-TP block with ``mm_ar_mm``, the capacity-MoE block with its cell, the
        dropless-MoE block with its; none with the Ulysses kinds alone."""
        cells = tuple(
            dataclasses.replace(c, kinds=tuple(k for k in c.kinds if k in kinds))
            for c in self.cells
        )

        def kept(block: BlockBench | None, *of: str) -> BlockBench | None:
            return block if set(of) & set(kinds) else None

        return dataclasses.replace(
            self,
            cells=tuple(c for c in cells if c.kinds),
            block=kept(self.block, *TP_KINDS),
            block_2d=kept(self.block_2d, *TP_KINDS),
            block_plain=kept(self.block_plain, *PLAIN_TP_KINDS),
            block_moe=kept(self.block_moe, *MOE_KINDS),
            block_dropless=kept(self.block_dropless, *DROPLESS_KINDS),
            served=self.served if SERVED_KIND in kinds else None,
        )


# The 2-D block (data x tensor parallel): training's "fsdp" front with tp=2 on a 2 x 2
# mesh, its own 4 ranks (oversubscribed on a 2-core machine: small, few steps). At this
# shape the pass rewrites every site of the step with the ring.
BLOCK_2D = BlockBench(
    BlockShape(seq=128, dim=128, heads=4, hidden=384, batch=4, front="fsdp", tp=2),
    ratio=1.0,
    schedules=("baseline", "ring", "auto"),
    reps=5,
    world_size=4,
    key="block_2d",
)


# The quick site is the full run's middle size: at the smallest one (matmul ~4 ms) the
# rate that makes comm/compute 0.5 is tens of Gbit/s, i.e. no throttle, and a call's
# fixed costs are a large share of every row. 9 timed rounds: 5 left gaps of up to 46 %
# between two rows that run the same graph. The Ulysses cells: one each, at
# comm/compute 1, with the same FLOPs and bytes per rank as the TP+SP ones. The plain-TP
# cell (all-reduce between two matmuls) at the three ratios, at the same size: twice a
# TP+SP site's FLOPs and bytes.
QUICK_SIZE = SiteShape(2048, 1024, 2048)
QUICK_BLOCK = BlockShape(seq=256, dim=256, heads=4, hidden=768, batch=2)
# Served plain TP at the quick size's width: prompts of 256 to 2048 tokens (the link set
# by the middle one at comm/compute 1), decode batches of 4 to 64 sequences
SERVED = ServedBench(1024, 2048, prompts=(256, 1024, 2048), batches=(4, 16, 64))
QUICK = Preset(
    name="quick",
    cells=(
        Cells(TP_KINDS, (QUICK_SIZE,), (0.5, 1.0, 2.0)),
        Cells(ULYSSES_KINDS, (QUICK_SIZE,), (1.0,)),
        Cells(PLAIN_TP_KINDS, (QUICK_SIZE,), (0.5, 1.0, 2.0)),
    ),
    warmup=2,
    reps=9,
    block=BlockBench(QUICK_BLOCK, ratio=1.0, schedules=("baseline", "ring", "auto"), reps=7),
    # as the full preset: with 3, runs the same day put a P2P step at 0.16-0.28 ms and a
    # matmul's slowdown under a transfer at 0.14-1.61 (the full preset's run: 0.9 ms, 0.32),
    # and ``auto`` took or left a decode step's ring by that
    calibrate_reps=5,
    block_2d=BLOCK_2D,
    block_plain=BlockBench(
        dataclasses.replace(QUICK_BLOCK, sequence_parallel=False),
        ratio=1.0,
        schedules=("baseline", "ring", "auto"),
        reps=7,
        key="block_plain_tp",
        compare=QUICK_BLOCK,
    ),
    served=SERVED,
)
FULL_BLOCK = BlockShape(seq=256, dim=512, heads=8, hidden=1536, batch=4)
# The MoE cell: S = 2048 token slots per rank (n x 2 experts x capacity 512 at n = 2),
# D = 1024, every expert's hidden F = 1024: the plain-TP cell's FLOPs and bytes per rank
# at the quick size (two matmuls of 2 x 2048 x 1024 x 1024; 2(n-1) blocks of S/n x D).
# Not in ``--quick``: three cells of the heaviest kind would add about 2 minutes to it.
MOE_SIZE = SiteShape(2048, 1024, 1024)
# The MoE block: 512 tokens per rank, top-2 of 2 experts per rank (capacity 256 at n = 2)
MOE_BLOCK = BlockShape(seq=512, dim=256, heads=1, hidden=1024, front="moe")
# The dropless-MoE cell: 1024 rows per rank (tokens x top-k), D=256, every expert's
# hidden F=128, bfloat16; balanced at the three ratios, and skewed routing (one peer 2x
# the average rows) at comm/compute 1. Sized when this machine's _grouped_mm ran at about
# 1 GFLOP/s (0.2 s of experts, the other cells' compute); on its AMX cores now (0.3-1.2
# TFLOP/s) the experts take about 1 ms, and the cell's fixed costs are most of its time
DROPLESS_SIZE = SiteShape(1024, 256, 128)
DROPLESS_SKEWED = dataclasses.replace(DROPLESS_SIZE, skew=DROPLESS_SKEW)
# The dropless-MoE block (torchtitan's): 256 tokens per rank, top-2 of 2 experts per
# rank, SwiGLU experts of hidden 256 in bfloat16
DROPLESS_BLOCK = BlockShape(seq=256, dim=256, heads=1, hidden=256, front="moe", moe="dropless")
FULL = Preset(
    name="full",
    cells=(
        Cells(
            TP_KINDS,
            (SiteShape(1024, 512, 1024), QUICK_SIZE, SiteShape(4096, 1024, 2048)),
            (0.5, 1.0, 2.0),
        ),
        Cells(ULYSSES_KINDS, (QUICK_SIZE,), (0.5, 1.0, 2.0)),
        Cells(PLAIN_TP_KINDS, (SiteShape(1024, 512, 1024), QUICK_SIZE), (0.5, 1.0, 2.0)),
        Cells(MOE_KINDS, (MOE_SIZE,), (0.5, 1.0, 2.0)),
        Cells(DROPLESS_KINDS, (DROPLESS_SIZE,), (0.5, 1.0, 2.0)),
        Cells(DROPLESS_KINDS, (DROPLESS_SKEWED,), (1.0,)),
    ),
    warmup=2,
    reps=9,
    block=BlockBench(FULL_BLOCK, ratio=1.0, schedules=None, reps=7),
    calibrate_reps=5,
    block_2d=BLOCK_2D,
    block_plain=BlockBench(
        dataclasses.replace(FULL_BLOCK, sequence_parallel=False),
        ratio=1.0,
        schedules=None,
        reps=7,
        key="block_plain_tp",
        compare=FULL_BLOCK,
    ),
    block_moe=BlockBench(
        MOE_BLOCK, ratio=1.0, schedules=("baseline", "ring", "auto"), reps=7, key="block_moe"
    ),
    block_dropless=BlockBench(
        DROPLESS_BLOCK,
        ratio=1.0,
        schedules=("baseline", "ring", "auto"),
        reps=7,
        key="block_moe_dropless",
    ),
    served=SERVED,
)
PRESETS = {p.name: p for p in (QUICK, FULL)}


# ----------------------------------------------------------------------------------------
# In the parent: progress and the machine


def machine() -> dict[str, Any]:
    """What the numbers were measured on (and how loaded it was)."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
    }


# ----------------------------------------------------------------------------------------
# The run


def run(
    preset: Preset,
    out: Path,
    world_size: int = 2,
    topology: str | None = None,
    echo: Callable[[str], None] = print,
    block_2d: bool = False,
) -> dict[str, Any]:
    """The whole benchmark; writes ``out``/results.json, results.md, speedup.svg.
    ``block_2d``: also the preset's 2-D block, on ranks of its own after the rest."""
    from .netns import throttled_ranks

    out.mkdir(parents=True, exist_ok=True)
    rows = variants()
    cells = [cell for cells in preset.cells for cell in cells]
    extra = preset.block_2d if block_2d else None
    blocks = [
        b
        for b in (preset.block, preset.block_plain, preset.block_moe, preset.block_dropless)
        if b is not None
    ]
    served = preset.served is not None
    progress = Progress(len(cells) + 1 + len(blocks) + served + 2 * (extra is not None), echo)
    results = _results(preset, world_size, rows)
    with throttled_ranks(world_size, out / "logs", topology) as (network, ranks, description):
        results["meta"]["network"] = _network(network, description, echo)
        base = calibrated(network, ranks, description, preset.calibrate_reps, progress)
        results["meta"]["profile"] = base.reference.as_json()
        results["meta"]["profile_low"] = base.low.as_json()
        results["meta"]["profile_unthrottled"] = base.free.as_json()
        progress.advance()
        results["sites"] = _measure_cells(preset, cells, rows, network, ranks, base, out, progress)
        for spec in blocks:
            results[spec.key] = run_block(spec, network, ranks, base, rows, out, progress)
            progress.advance()
        if preset.served is not None:
            served_rows = kind_rows(rows, "mm_ar_mm")
            reps = (preset.warmup, preset.reps, preset.cell_timed_s)
            results["served"] = run_served(
                preset.served, network, ranks, base, served_rows, reps, out, progress
            )
            progress.advance()
        results["meta"]["qdisc"] = network.qdisc_stats()
    if extra is not None:
        results[extra.key] = _block_apart(extra, preset, world_size, topology, rows, out, progress)
    results["meta"]["machine_after"] = machine()
    results["noise"] = targets.run_noise(results["sites"])
    predicted = targets.predicted_cells(results)
    results["model_error"] = targets.error_distribution(predicted)
    results[AT_CELL_SPEED] = targets.error_distribution(predicted, AT_CELL_SPEED)
    results["targets"] = targets.check_targets(results)
    write(results, out)
    progress.stage(f"done: {out / 'results.md'}")
    echo(figures.format_targets(results["targets"]))
    echo(figures.format_errors(results["model_error"]))
    echo(figures.format_errors(results[AT_CELL_SPEED], AT_CELL_SPEED_TITLE))
    return results


def _results(preset: Preset, world_size: int, rows: list[Variant]) -> dict[str, Any]:
    """The results before any measurement: how the run is made, on what machine."""
    return {
        "meta": {
            "preset": preset.name,
            "command": " ".join(["commfuse", *sys.argv[1:]]) if sys.argv else "commfuse bench",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "world_size": world_size,
            "warmup": preset.warmup,
            "reps": preset.reps,
            "rows": [dataclasses.asdict(v) for v in rows],
            "machine_before": machine(),
        },
        "sites": [],
        "block": None,
        "block_plain_tp": None,
        "block_moe": None,
        "block_moe_dropless": None,
        "block_2d": None,
        "served": None,
    }


def _network(network: Any, description: str, echo: Callable[[str], None]) -> dict[str, Any]:
    """The link the ranks talk over, said first, with a warning when it is unthrottled."""
    throttled = network.topology != "none"
    echo(f"network: {description}")
    if not throttled:
        echo("WARNING: " + "!" * 60)
        echo(f"WARNING: the link is NOT throttled: {description}.")
        echo("WARNING: overlap cannot show; run as root for meaningful numbers.")
        echo("WARNING: " + "!" * 60)
    return {"topology": network.topology, "description": description, "throttled": throttled}


def _measure_cells(
    preset: Preset,
    cells: list[tuple[str, SiteShape, float]],
    rows: list[Variant],
    network: Any,
    ranks: Any,
    base: LinkProfiles,
    out: Path,
    progress: Progress,
) -> list[dict[str, Any]]:
    """Every cell (of ``preset``): its link rate (on a throttled link), then its rows."""
    sites = []
    tries: list[dict[str, float]]
    for index, (kind, size, ratio) in enumerate(cells):
        shape = size.fitted(ranks.world_size, kind)  # the same shape where n divides it
        rate, tries = math.inf, []
        if network.topology != "none":
            progress.stage(f"{kind} {shape.label} ratio {ratio:g}: choosing the link rate")
            rate, tries = choose_rate(network, ranks, kind, shape, ratio, preset.rate_reps)
        profile = base.file(rate, out / "profiles" / f"cell{index:02d}.json")
        cell_rows = kind_rows(rows, kind)
        progress.stage(
            f"{kind} {shape.label} ratio {ratio:g}: {len(cell_rows) + 4} rows x "
            f"{preset.warmup}+{preset.reps} at {rate / 1e6:.0f} Mbit/s"
        )
        job = SiteJob(
            kind, shape, tuple(cell_rows), profile, preset.warmup, preset.reps, preset.cell_timed_s
        )
        per_rank = ranks.run(measure_site, job)
        cell = figures.site_cell(
            kind, shape, ratio, rate, tries, per_rank, cell_rows, ranks.world_size
        )
        sites.append(cell)
        progress.advance()
        progress.echo(figures.format_cell(cell))
    return sites


def _block_apart(
    spec: BlockBench,
    preset: Preset,
    world_size: int,
    topology: str | None,
    rows: list[Variant],
    out: Path,
    progress: Progress,
) -> dict[str, Any]:
    """A block on ranks of its own (``spec.world_size``), with its own network and
    calibrated profile, after the rest of the run."""
    from .netns import throttled_ranks

    n = spec.world_size or world_size
    with throttled_ranks(n, out / f"logs_{spec.key}", topology) as (network, ranks, description):
        progress.echo(f"network of the {spec.key} ranks: {description}")
        before = machine()
        base = calibrated(network, ranks, description, preset.calibrate_reps, progress)
        progress.advance()
        block = run_block(spec, network, ranks, base, rows, out, progress)
        block |= {"network": description, "machine_before": before, "machine_after": machine()}
        progress.advance()
    return block


def write(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and speedup.svg in ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot_speedup(results, out / "speedup.svg")
    (out / "results.md").write_text(markdown(results))


def main(
    quick: bool,
    out: str,
    world_size: int = 2,
    network: str | None = None,
    block_2d: bool = False,
    kinds: tuple[str, ...] | None = None,
) -> int:
    preset = QUICK if quick else FULL
    if kinds is not None:
        preset = preset.only(kinds)
        if not preset.cells and preset.served is None:
            print(
                f"commfuse bench: error: the {preset.name} preset has no cells of "
                f"{', '.join(kinds)} (every kind: the full preset)",
                file=sys.stderr,
            )
            return 2
    results = run(preset, Path(out), world_size, network, block_2d=block_2d)
    return 0 if results["sites"] or results["served"] else 1
