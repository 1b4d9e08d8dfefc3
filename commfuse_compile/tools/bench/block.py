"""``commfuse bench``'s whole-block figure: a transformer block's training step (forward +
backward), compiled with the pass and without it (the same compile with
``schedule="off"``), on a link whose rate makes the baseline's communication a given
multiple of its compute. The blocks are training's (``training.fronts``), and its MoE
layers (``training.moe``: the capacity one, GShard / DeepSpeed, and the dropless one,
torchtitan; front "moe")."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import report
from . import figures
from .alone import local_backend, recording, replay
from .cells import interleaved
from .config import COMPARED, REFERENCE_RATE, BlockShape, Progress, Variant
from .footprint import measure
from .link import MAX_RATE_TRIES, RATE_TOLERANCE, LinkProfiles


@dataclasses.dataclass(frozen=True)
class BlockBench:
    """A whole-block figure: the block, its rows, how they are timed and on what ranks."""

    shape: BlockShape
    ratio: float  # communication / compute of the baseline's step (sets the link rate)
    schedules: tuple[str, ...] | None  # rows (labels of ``variants()``; None: every row)
    reps: int
    world_size: int | None = None  # ranks of its own (None: the run's)
    key: str = "block"  # in results.json, and its profile's file name
    # the same block in another layout (the plain-TP block's: TP+SP written by hand), its
    # rows (labelled ``COMPARED`` + the row's) timed on this block's link, each against
    # that layout's own baseline
    compare: BlockShape | None = None
    # how the link rate is chosen: False, the throttled step minus the unthrottled one
    # against the unthrottled step; True, the baseline's communication alone (``alone``)
    # throttled minus unthrottled against its compute alone: the link's own time, steadier
    # where the ranks share few cores (their transfers' CPU time is no link time)
    rate_from_alone: bool = False


# ----------------------------------------------------------------------------------------
# The MoE layers: training's (``training.moe``), one block and its loss


class _MoELoss(nn.Module):
    """One of training's MoE blocks (``CapacityMoEBlock``: GShard / DeepSpeed; or
    ``DroplessMoEBlock``: torchtitan) and its loss: ``forward(x, target)`` = the mean
    squared error of the block's output plus 0.01 x its load-balancing loss (the
    dropless block's is 0)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out, l_aux = self.block(x)
        return F.mse_loss(out, target) + 0.01 * l_aux


def _moe_setup(shape: BlockShape, rank: int, n: int) -> Any:
    """The MoE layer as ``fronts.build`` gives a block: its loss module (training's
    block of ``shape.moe`` kind, from one seed: the router and norm equal on every rank,
    rank r's experts the r-th ``shape.experts`` of the set) and this rank's (tokens,
    target) per step."""
    from ..training.moe import MoEConfig, build

    cfg = MoEConfig(
        moe=shape.moe, dim=shape.dim, hidden=shape.hidden, experts_per_rank=shape.experts
    )
    module = _MoELoss(build(cfg).blocks[0])

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(2, shape.seq, shape.dim, generator=gen).unbind(0)  # type: ignore[return-value]

    return SimpleNamespace(loss_module=module, inputs=inputs)


# ----------------------------------------------------------------------------------------
# On the ranks


def alone_labels(label: str) -> tuple[str, str]:
    """The labels of a row's compute alone and communication alone (``alone``), timed
    with the rows: the row's limit is the larger."""
    return f"{label}: compute alone", f"{label}: communication alone"


_BLOCK: dict[str, Any] = {}  # this rank's compiled block variants, kept between jobs


@dataclasses.dataclass(frozen=True)
class BlockJob:
    shape: BlockShape
    rows: tuple[Variant, ...]
    profile: str | None
    prefix: str = ""  # of the rows' labels (``COMPARED``: the compared layout's)


def block_compile(rank: int, n: int, job: BlockJob) -> dict[str, dict[str, Any]]:
    """Job: build the block once per row, compile it (eager inner compiler) and run one
    step (which compiles forward and backward); returns the pass's sites per row."""
    from ..training.fronts import TrainConfig, build
    from ..training.loop import summarize

    torch._dynamo.config.recompile_limit = 64  # one entry per row, same code objects
    shape = job.shape

    def setup_of() -> Any:
        if shape.front == "moe":
            return _moe_setup(shape, rank, n)
        cfg = TrainConfig(
            front=shape.front,
            tp=shape.tp,
            blocks=1,
            dim=shape.dim,
            heads=shape.heads,
            hidden=shape.hidden,
            batch=shape.batch,
            seq=shape.seq,
            sequence_parallel=shape.sequence_parallel,
        )
        return build(cfg, rank, n)

    sites = {}
    for row in job.rows:
        setup = setup_of()
        options = {**row.options(job.profile), "inner": "eager"}
        compiled = torch.compile(setup.loss_module, backend="commfuse", options=options)
        step = _stepper(setup, compiled, shape)
        first = len(report.REPORT.sites)
        step()
        label = job.prefix + row.label
        _BLOCK[label] = step
        found = [s.as_json() for s in report.REPORT.sites[first:]]
        sites[label] = {
            "rewritten": sum(s["decision"] == "rewritten" for s in found),
            "found": len(found),
            "schedules": sorted({s["schedule"] for s in found if s["decision"] == "rewritten"}),
            "summary": [dataclasses.asdict(r) for r in summarize(found)],
            # by the level of each site's group (a job of several nodes: "node", "nodes")
            "levels": {
                level: [
                    sum(s["decision"] == "rewritten" for s in found if s["level"] == level),
                    sum(s["level"] == level for s in found),
                ]
                for level in sorted({s["level"] for s in found if s["level"]})
            },
        }
        _BLOCK.update(_alone(setup_of(), options, shape, label))
    return sites


def _stepper(setup: Any, compiled: Any, shape: BlockShape) -> Callable[[], None]:
    """One training step of ``compiled`` (``setup``'s loss module) on its first inputs."""
    x, target = setup.inputs(0)
    # the dropless layer's ``.tolist()`` splits: unbacked sizes in the graph, as
    # torchtitan compiles it (a graph break otherwise)
    scalars = shape.front == "moe" and shape.moe == "dropless"

    def step() -> None:
        with torch._dynamo.config.patch(capture_scalar_outputs=scalars):
            compiled(x, target).backward()
        setup.loss_module.zero_grad(set_to_none=True)

    return step


def _alone(
    setup: Any, options: dict[str, Any], shape: BlockShape, label: str
) -> dict[str, Callable[[], object]]:
    """A row's compute alone (its collectives and P2P batches local copies) and its
    communication alone (those of one step, one after the other), as rows
    (``alone_labels``)."""
    local = _stepper(setup, torch.compile(setup.loss_module, backend=local_backend(options)), shape)
    local()
    with recording() as calls:
        local()
    compute, communication = alone_labels(label)
    return {compute: local, communication: lambda: replay(calls)}


def block_footprints(rank: int, n: int, labels: list[str]) -> dict[str, dict[str, int]]:
    """Job: one more step of each compiled row, measured (``footprint``)."""
    return {label: dataclasses.asdict(measure(_BLOCK[label], n)) for label in labels}


def _largest(per_rank: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Per row, each figure of the footprint at its largest over the ranks."""
    return {
        label: {k: max(rank[label][k] for rank in per_rank) for k in figures}
        for label, figures in per_rank[0].items()
    }


def block_times(rank: int, n: int, labels: list[str], warmup: int, reps: int) -> dict[str, Any]:
    """Job: the compiled rows' steps, interleaved."""
    return interleaved({label: _BLOCK[label] for label in labels}, warmup, reps)


# ----------------------------------------------------------------------------------------
# In the parent


def next_rate(tries: list[dict[str, float]], target_s: float) -> float:
    """The next link rate to try after ``tries`` (each its rate and the link's time
    measured at it), at most 8x from the last. The link's time is about affine in 1/rate
    (the bytes' time at the rate, less what the unthrottled transfers' own time covers,
    so it is ~0 at high rates): the secant through the last two tries in 1/rate, where it
    rises; else the last rate scaled by its miss."""
    rate, link_s = tries[-1]["rate_bits_per_s"], tries[-1]["link_s"]
    wanted = rate * link_s / target_s
    if len(tries) > 1:
        before = tries[-2]
        dx = 1 / rate - 1 / before["rate_bits_per_s"]
        slope = (link_s - before["link_s"]) / dx if dx else 0.0
        x = 1 / rate + (target_s - link_s) / slope if slope > 0 else 0.0
        if x > 0:
            wanted = 1 / x
    return min(max(wanted, rate / 8), rate * 8)


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

    def step_s(rate: float | None, of: str = label) -> float:
        network.set_rate(rate)
        return figures.slowest(ranks.run(block_times, [of], 0, 1))[of][0]

    rate = math.inf
    compute_label, comm_label = alone_labels(label)

    def compute_and_link_s(rate: float) -> tuple[float, float, float]:
        """(compute, communication unthrottled, throttled) of the baseline."""
        if spec.rate_from_alone:
            return step_s(None, compute_label), step_s(None, comm_label), step_s(rate, comm_label)
        free = step_s(None)
        return free, free, step_s(rate)

    tries = []
    if network.topology != "none":
        # The link's time = throttled minus unthrottled, alternated so that both see the
        # same machine; then the rate that makes it the target.
        rate = REFERENCE_RATE
        for _ in range(MAX_RATE_TRIES):
            progress.stage(f"{spec.key}: communication at {rate / 1e6:.0f} Mbit/s")
            measured = [compute_and_link_s(rate) for _ in range(3)]
            compute_s = statistics.median(compute for compute, _, _ in measured)
            comm_s = statistics.median(slow - free for _, free, slow in measured)
            tries.append({"rate_bits_per_s": rate, "compute_s": compute_s, "link_s": comm_s})
            target = spec.ratio * compute_s
            if abs(comm_s / target - 1) <= 2 * RATE_TOLERANCE:
                break
            rate = next_rate(tries, target)
        network.set_rate(rate)
    profile = base.file(rate, out / "profiles" / f"{spec.key}.json")
    progress.stage(f"{spec.key}: compiling {', '.join(v.label for v in others)}")
    sites.update(ranks.run(block_compile, BlockJob(shape, tuple(others), profile))[0])
    labels = [v.label for v in block_rows]
    if spec.compare is not None:
        compared = spec.compare.fitted(ranks.world_size)
        progress.stage(
            f"{spec.key}: compiling the compared layout ({compared.mesh(ranks.world_size)})"
        )
        job = BlockJob(compared, tuple(block_rows), profile, COMPARED)
        sites.update(ranks.run(block_compile, job)[0])
        labels += [COMPARED + v.label for v in block_rows]
    for label, footprint in _largest(ranks.run(block_footprints, labels)).items():
        sites[label]["footprint"] = footprint
    progress.stage(f"{spec.key}: {len(labels)} rows x 1+{spec.reps} at {rate / 1e6:.0f} Mbit/s")
    timed = [*labels, *(x for label in labels for x in alone_labels(label))]
    times = figures.slowest(ranks.run(block_times, timed, 1, spec.reps))
    alone = {
        label: tuple(statistics.median(times.pop(x)) for x in alone_labels(label))
        for label in labels
    }
    block = figures.block_result(
        shape, rate, alone, times, sites, spec.ratio, ranks.world_size, os.cpu_count()
    )
    block["rate_tries"] = tries  # how the rate was found
    progress.echo(figures.format_block(block))
    return block
