"""``commfuse bench``'s whole-block figure: a transformer block's training step (forward +
backward), compiled with the pass and without it (the same compile with
``schedule="off"``), on a link whose rate makes the baseline's communication a given
multiple of its compute."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from ... import report
from . import figures
from .cells import interleaved
from .config import BlockShape, Progress, Variant
from .link import MAX_RATE_TRIES, RATE_TOLERANCE, REFERENCE_RATE, LinkProfiles


@dataclasses.dataclass(frozen=True)
class BlockBench:
    """A whole-block figure: the block, its rows, how they are timed and on what ranks."""

    shape: BlockShape
    ratio: float  # communication / compute of the baseline's step (sets the link rate)
    schedules: tuple[str, ...] | None  # rows (labels of ``variants()``; None: every row)
    reps: int
    world_size: int | None = None  # ranks of its own (None: the run's)
    key: str = "block"  # in results.json, and its profile's file name


# ----------------------------------------------------------------------------------------
# On the ranks

_BLOCK: dict[str, Any] = {}  # this rank's compiled block variants, kept between jobs


@dataclasses.dataclass(frozen=True)
class BlockJob:
    shape: BlockShape
    rows: tuple[Variant, ...]
    profile: str | None


def block_compile(rank: int, n: int, job: BlockJob) -> dict[str, dict[str, Any]]:
    """Job: build the block once per row, compile it (eager inner compiler) and run one
    step (which compiles forward and backward); returns the pass's sites per row."""
    from ..training.fronts import TrainConfig, build
    from ..training.loop import summarize

    torch._dynamo.config.recompile_limit = 64  # one entry per row, same code objects
    cfg = TrainConfig(
        front=job.shape.front,
        tp=job.shape.tp,
        blocks=1,
        dim=job.shape.dim,
        heads=job.shape.heads,
        hidden=job.shape.hidden,
        batch=job.shape.batch,
        seq=job.shape.seq,
        sequence_parallel=job.shape.sequence_parallel,
    )
    sites = {}
    for row in job.rows:
        setup = build(cfg, rank, n)
        options = {**row.options(job.profile), "inner": "eager"}
        compiled = torch.compile(setup.loss_module, backend="commfuse", options=options)
        x, target = setup.inputs(0)

        def step(compiled: Any = compiled, x: Any = x, target: Any = target, setup: Any = setup):
            compiled(x, target).backward()
            setup.loss_module.zero_grad(set_to_none=True)

        first = len(report.REPORT.sites)
        step()
        _BLOCK[row.label] = step
        found = [s.as_json() for s in report.REPORT.sites[first:]]
        sites[row.label] = {
            "rewritten": sum(s["decision"] == "rewritten" for s in found),
            "found": len(found),
            "schedules": sorted({s["schedule"] for s in found if s["decision"] == "rewritten"}),
            "summary": [dataclasses.asdict(r) for r in summarize(found)],
        }
    return sites


def block_times(rank: int, n: int, labels: list[str], warmup: int, reps: int) -> dict[str, Any]:
    """Job: the compiled rows' steps, interleaved."""
    return interleaved({label: _BLOCK[label] for label in labels}, warmup, reps)


# ----------------------------------------------------------------------------------------
# In the parent


def run_block(
    spec: BlockBench,
    network: Any,
    ranks: Any,
    base: LinkProfiles,
    rows: list[Variant],
    out: Path,
    progress: Progress,
) -> dict[str, Any]:
    """The block's step, with and without the pass, on a link whose rate makes the
    baseline's communication ``spec.ratio`` times its compute."""

    shape = spec.shape.fitted(ranks.world_size)  # the same shape where n divides it
    block_rows = [v for v in rows if spec.schedules is None or v.label in spec.schedules]
    baseline, others = block_rows[0], block_rows[1:]
    progress.stage(
        f"{spec.key} {shape.label} ({shape.mesh(ranks.world_size)}): compiling the baseline"
    )
    network.set_rate(None)
    sites = ranks.run(block_compile, BlockJob(shape, (baseline,), None))[0]
    label = baseline.label

    def step_s(rate: float | None) -> float:
        network.set_rate(rate)
        return figures.slowest(ranks.run(block_times, [label], 0, 1))[label][0]

    rate = math.inf
    compute_s = statistics.median(step_s(None) for _ in range(3))
    if network.topology != "none":
        # The step's communication = throttled minus unthrottled step, alternated so that
        # both see the same machine; then the rate that makes it the target.
        rate = REFERENCE_RATE
        for _ in range(MAX_RATE_TRIES):
            progress.stage(f"{spec.key}: communication at {rate / 1e6:.0f} Mbit/s")
            pairs = [(step_s(None), step_s(rate)) for _ in range(3)]
            compute_s = statistics.median(free for free, _ in pairs)
            comm_s = statistics.median(slow - free for free, slow in pairs)
            target = spec.ratio * compute_s
            if abs(comm_s / target - 1) <= 2 * RATE_TOLERANCE:
                break
            rate *= min(max(comm_s / target, 1 / 8), 8)
        network.set_rate(rate)
    profile = base.file(rate, out / "profiles" / f"{spec.key}.json")
    progress.stage(f"{spec.key}: compiling {', '.join(v.label for v in others)}")
    sites.update(ranks.run(block_compile, BlockJob(shape, tuple(others), profile))[0])
    progress.stage(f"{spec.key}: {len(block_rows)} rows x 1+{spec.reps} at {rate / 1e6:.0f} Mbit/s")
    labels = [v.label for v in block_rows]
    times = figures.slowest(ranks.run(block_times, labels, 1, spec.reps))
    block = figures.block_result(
        shape, rate, compute_s, times, sites, spec.ratio, ranks.world_size, os.cpu_count()
    )
    progress.echo(figures.format_block(block))
    return block
