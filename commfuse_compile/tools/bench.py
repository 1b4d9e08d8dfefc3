"""``commfuse bench``: every schedule measured side by side over a bandwidth-limited link.

The ranks run in network namespaces behind token-bucket links (``netns.py``). For each
site (a TP+SP linear's all-gather -> matmul and matmul -> reduce-scatter, at several
sizes; a Ulysses projection's matmul -> all-to-all and all-to-all -> matmul) and each
communication/computation ratio (``Preset.cells``), the link rate is chosen from the
measured matmul time so that the collective alone takes ``ratio`` times the matmul
alone; then the baseline (collective then matmul), every schedule of the pass that has
steps for the site's direction and the two parts alone are measured in one run,
interleaved (A B C ... A B C ...) after a
warm-up, each call started together on all ranks by a barrier and timed as the slowest
rank's. The whole-layer figure is a transformer block's forward + backward, compiled
with the pass and without it (the same compile with ``schedule="off"``).

``auto`` gets the profile a user would calibrate on this link: ``commfuse calibrate``'s
measurement run inside the namespaces at a reference rate, its bandwidth scaled to each
cell's rate. ``bench_report.py`` turns the results into tables, files and the plot.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import report
from ..cost.profiles import Curve
from ..options import SCHEDULES
from ..passes.kinds import KINDS as SITE_KINDS
from ..schedules import by_name
from . import bench_report, bench_targets
from .bench_config import OVERLAP_PROBE, BlockShape, SiteShape, Variant
from .bench_markdown import markdown
from .bench_plot import plot_speedup

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

SLICES = (2, 4)  # chunks of the data-slicing rows
ROW_ORDER = ("off", "slicing", "push", "ring", "bidir", "auto")  # schedules not named go last
REFERENCE_RATE = 1e9  # bit/s of the link while calibrating the profile ``auto`` uses
RATE_TOLERANCE = 0.08  # accept a link rate whose comm-alone time is this close to target
MAX_RATE_TRIES = 5  # the first one measures the matmul unthrottled


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


def kind_rows(rows: list[Variant], kind: str) -> list[Variant]:
    """The rows of a site kind's cells: the baseline, ``auto`` and the schedules with
    steps for the kind's direction (an all-to-all has the ring's pairwise order only)."""
    direction = SITE_KINDS[kind].direction
    return [
        v for v in rows if v.schedule in ("off", "auto") or by_name(v.schedule).supports(direction)
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


@dataclasses.dataclass(frozen=True)
class BlockBench:
    """A whole-block figure: the block, its rows, how they are timed and on what ranks."""

    shape: BlockShape
    ratio: float  # communication / compute of the baseline's step (sets the link rate)
    schedules: tuple[str, ...] | None  # rows (labels of ``variants()``; None: every row)
    reps: int
    world_size: int | None = None  # ranks of its own (None: the run's)
    key: str = "block"  # in results.json, and its profile's file name


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    cells: tuple[Cells, ...]
    warmup: int
    reps: int
    block: BlockBench
    calibrate_reps: int
    rate_reps: int = 5  # calls per try while choosing a link rate
    block_2d: BlockBench | None = None  # measured with ``--block-2d`` only


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
# comm/compute 1, with the same FLOPs and bytes per rank as the TP+SP ones.
QUICK_SIZE = SiteShape(2048, 1024, 2048)
QUICK = Preset(
    name="quick",
    cells=(
        Cells(TP_KINDS, (QUICK_SIZE,), (0.5, 1.0, 2.0)),
        Cells(ULYSSES_KINDS, (QUICK_SIZE,), (1.0,)),
    ),
    warmup=2,
    reps=9,
    block=BlockBench(
        BlockShape(seq=256, dim=256, heads=4, hidden=768, batch=2),
        ratio=1.0,
        schedules=("baseline", "ring", "auto"),
        reps=7,
    ),
    calibrate_reps=3,
    block_2d=BLOCK_2D,
)
FULL = Preset(
    name="full",
    cells=(
        Cells(
            TP_KINDS,
            (SiteShape(1024, 512, 1024), QUICK_SIZE, SiteShape(4096, 1024, 2048)),
            (0.5, 1.0, 2.0),
        ),
        Cells(ULYSSES_KINDS, (QUICK_SIZE,), (0.5, 1.0, 2.0)),
    ),
    warmup=2,
    reps=9,
    block=BlockBench(
        BlockShape(seq=256, dim=512, heads=8, hidden=1536, batch=4),
        ratio=1.0,
        schedules=None,
        reps=7,
    ),
    calibrate_reps=5,
    block_2d=BLOCK_2D,
)
PRESETS = {p.name: p for p in (QUICK, FULL)}


# ----------------------------------------------------------------------------------------
# On the ranks (jobs fed by NamespaceRanks.run; every rank runs the same code in order)


@dataclasses.dataclass
class _Site:
    graph: torch.fx.GraphModule  # the site as DTensor writes it, traced to aten
    inputs: list[torch.Tensor]
    matmul: Callable[[], object]  # the site's matmul alone, unsplit
    collective: Callable[[], object]  # the site's collective alone (gloo's own algorithm)
    message: torch.Tensor  # the bytes the collective must send per rank, as one tensor
    flops: float  # of this rank's matmul


@dataclasses.dataclass
class _Parts:
    """What a kind's builder makes of a shape; ``_build_site`` derives the rest."""

    program: Callable[..., tuple[torch.Tensor]]  # the site as DTensor or Ulysses writes it
    inputs: list[torch.Tensor]
    operands: tuple[torch.Tensor, torch.Tensor]  # the site's matmul alone, unsplit: a @ b
    collective: Callable[[], object]
    block: int  # elements of one rank's block (a shard, a partial sum, a peer's heads)


def _exchanged(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    """``all_to_all_single`` of n equal blocks of dim 0 (block j to rank j), as Ulysses."""
    m = [x.shape[0] // n] * n
    return c10d.wait_tensor(c10d.all_to_all_single(x, m, m, group))


def _ag_mm(s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str) -> _Parts:
    x, w = rand(1, s // n, d), rand(d, f // n)

    def program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group))
        g = torch.cat(torch.split(g, 1), dim=1)  # DTensor's gather on the sequence dim
        return (torch.mm(g.reshape(-1, d), w),)

    def collective() -> object:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group))

    return _Parts(program, [x, w], (rand(s, d), w), collective, (s // n) * d)


def _mm_rs(s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str) -> _Parts:
    a, w = rand(s, f // n), rand(f // n, d)
    product = rand(n, s // n, d)

    def program(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        z = torch.mm(a, w).view(1, s, d)
        z = torch.cat(torch.split(z, s // n, dim=1), dim=0)  # DTensor's scatter on dim 1
        return (c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", n, group)),)

    def collective() -> object:
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(product, "sum", n, group))

    return _Parts(program, [a, w], (a, w), collective, (s // n) * d)


def _mm_a2a(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str
) -> _Parts:
    """Ulysses' q projection: this rank's s/n tokens times W (d -> f = heads x head
    dim), its head groups sent one to each rank (heads scattered, the sequence whole)."""
    m = s // n
    x, w = rand(m, d), rand(d, f)
    heads = rand(n, m, f // n)

    def program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        q = torch.mm(x, w).view(m, n, f // n).permute(1, 0, 2).contiguous()
        return (_exchanged(q, n, group).view(s, f // n),)

    return _Parts(program, [x, w], (x, w), lambda: _exchanged(heads, n, group), m * (f // n))


def _a2a_mm(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str
) -> _Parts:
    """Ulysses' attention output into the output projection: the whole sequence of this
    rank's heads, each rank's tokens sent to it (heads gathered), then @ Wo (f -> d),
    contracting over the heads."""
    m = s // n
    a, w = rand(s, f // n), rand(f, d)

    def program(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        g = _exchanged(a.view(n, m, f // n), n, group)  # block j: rank j's heads
        return (torch.mm(g.permute(1, 0, 2).reshape(m, f), w),)

    def collective() -> object:
        return _exchanged(a.view(n, m, f // n), n, group)

    return _Parts(program, [a, w], (rand(m, f), w), collective, m * (f // n))


_BUILDERS = {"ag_mm": _ag_mm, "mm_rs": _mm_rs, "mm_a2a": _mm_a2a, "a2a_mm": _a2a_mm}


def _build_site(kind: str, shape: SiteShape, n: int, rank: int) -> _Site:
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD.group_name  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(1000 + rank)
    parts = _BUILDERS[kind](
        shape.seq, shape.dim, shape.ffn, n, functools.partial(torch.randn, generator=gen), group
    )
    a, b = parts.operands
    return _Site(
        graph=make_fx(parts.program, tracing_mode="fake")(*parts.inputs),
        inputs=parts.inputs,
        matmul=lambda: torch.mm(a, b),
        collective=parts.collective,
        message=torch.randn((n - 1) * parts.block, generator=gen),  # n-1 blocks leave a rank
        flops=2.0 * a.shape[0] * a.shape[1] * b.shape[1],
    )


def _comm(site: _Site, overlap: Callable[[], object] | None = None) -> None:
    """The site's communication as the link sees it at best: the n-1 blocks each rank
    must send (an all-gather's or a reduce-scatter's ring traffic), sent to the next rank
    in one batch, nothing computed. With ``overlap``: that runs while the bytes travel
    (the machine's own overlap, no schedule; the result is not the site's).

    The receive is posted first: gloo sends a message only once the peer has announced
    its receive, and an announcement queued behind this rank's own outgoing megabytes
    (a send started before the receive was posted) serializes the two directions
    (measured: a 4 MiB exchange at 1 Gbit/s takes 34 ms receive-first, 66 ms send-first).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(site.message)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, received, (rank - 1) % n),
            dist.P2POp(dist.isend, site.message, (rank + 1) % n),
        ]
    )
    if overlap is not None:
        overlap()
    for work in works:
        work.wait()


def _timed(fn: Callable[[], object]) -> float:
    """``fn`` started together on every rank; this rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleaved(
    fns: dict[str, Callable[[], object]], warmup: int, reps: int
) -> dict[str, list[float]]:
    """A B C ... repeated; the first ``warmup`` rounds are dropped."""
    times: dict[str, list[float]] = {label: [] for label in fns}
    for rep in range(warmup + reps):
        for label, fn in fns.items():
            elapsed = _timed(fn)
            if rep >= warmup:
                times[label].append(elapsed)
    return times


_SITES: dict[tuple[str, SiteShape], _Site] = {}  # this rank's sites, built once


def _site(kind: str, shape: SiteShape, n: int, rank: int) -> _Site:
    if (kind, shape) not in _SITES:
        _SITES[(kind, shape)] = _build_site(kind, shape, n, rank)
    return _SITES[(kind, shape)]


def site_alone(rank: int, n: int, kind: str, shape: SiteShape, reps: int) -> dict[str, Any]:
    """Job: the matmul alone and the collective alone (to choose the link rate)."""
    site = _site(kind, shape, n, rank)
    times = _interleaved({"matmul": site.matmul, "comm": lambda: _comm(site)}, 1, reps)
    sent = site.message.numel() * site.message.element_size()
    return {"times": times, "flops": site.flops, "sent_bytes": sent}


@dataclasses.dataclass(frozen=True)
class SiteJob:
    kind: str
    shape: SiteShape
    rows: tuple[Variant, ...]
    profile: str | None  # profile file for every row's cost model (``auto`` decides on it)
    warmup: int
    reps: int
    breakdown_reps: int = 3


NODE_CATEGORIES = ("matmul", "comm issue", "comm wait", "other")


def _category(node: torch.fx.Node) -> str:
    if node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return "matmul"
    if node.target is c10d.wait_tensor.default:
        return "comm wait"
    name = str(node.target)
    if "c10d" in name or "commfuse" in name:
        return "comm issue"
    return "other"


class _NodeClock(torch.fx.Interpreter):
    """Runs a graph node by node, adding each node's wall time to its category."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.spent = dict.fromkeys(NODE_CATEGORIES, 0.0)

    def run_node(self, n: torch.fx.Node) -> Any:
        start = time.perf_counter()
        out = super().run_node(n)
        if n.op == "call_function":
            self.spent[_category(n)] += time.perf_counter() - start
        return out


def measure_site(rank: int, n: int, job: SiteJob) -> dict[str, Any]:
    """Job: every row of one cell, plus the matmul and the collective alone, interleaved;
    then, per row, where a call's time goes (node by node, median of a few calls)."""
    from ..api import apply

    site = _site(job.kind, job.shape, n, rank)
    fns: dict[str, Callable[[], object]] = {
        "matmul alone": site.matmul,
        "comm alone": lambda: _comm(site),
        "collective alone": site.collective,
        OVERLAP_PROBE: lambda: _comm(site, overlap=site.matmul),
    }
    rows: dict[str, dict[str, Any]] = {}
    graphs: dict[str, torch.fx.GraphModule] = {}
    for row in job.rows:
        first = len(report.REPORT.sites)
        gm = apply(copy.deepcopy(site.graph), **row.options(job.profile))
        records = report.REPORT.sites[first:]
        graphs[row.label] = gm
        fns[row.label] = _bind(gm, site.inputs)
        rows[row.label] = _row_record(records) | {"program": program_key(gm)}
    times = _interleaved(fns, job.warmup, job.reps)
    breakdown = {}
    for label, gm in graphs.items():
        runs = []
        for _ in range(job.breakdown_reps):
            clock = _NodeClock(gm)
            dist.barrier()
            clock.run(*site.inputs)
            runs.append(clock.spent)
        breakdown[label] = {c: statistics.median(r[c] for r in runs) for c in NODE_CATEGORIES}
    return {"times": times, "rows": rows, "breakdown": breakdown}


def program_key(gm: torch.fx.GraphModule) -> str:
    """What a row runs, without names, tags or labels: rows with one key run the same
    program (at n = 2 the ring and push send the same block to the same peer), so any
    gap between their times is the run's noise."""
    nodes = {node: i for i, node in enumerate(gm.graph.nodes)}
    p2p = torch.ops.commfuse.p2p.default

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return f"%{nodes[a]}"
        return [arg(x) for x in a] if isinstance(a, (list, tuple)) else a

    lines = []
    for node in gm.graph.nodes:
        args = list(node.args[:4]) if node.target is p2p else node.args  # not tag or label
        lines.append(f"{node.op} {node.target} {arg(args)} {arg(dict(node.kwargs))}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _bind(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[[], object]:
    return lambda: gm(*inputs)


def _row_record(records: list[report.SiteRecord]) -> dict[str, Any]:
    """What the pass did at the site: the schedule it ran and the cost model's times."""
    if not records:
        return {"schedule": "off", "decision": "no site found", "reason": "", "predicted_us": {}}
    record = records[0]
    return {
        "schedule": record.schedule if record.decision == "rewritten" else "off",
        "decision": record.decision,
        "reason": record.reason,
        "predicted_us": dict(record.predicted_us),
    }


_BLOCK: dict[str, Any] = {}  # this rank's compiled block variants, kept between jobs


@dataclasses.dataclass(frozen=True)
class BlockJob:
    shape: BlockShape
    rows: tuple[Variant, ...]
    profile: str | None


def block_compile(rank: int, n: int, job: BlockJob) -> dict[str, dict[str, Any]]:
    """Job: build the block once per row, compile it (eager inner compiler) and run one
    step (which compiles forward and backward); returns the pass's sites per row."""
    from .training import TrainConfig, build, summarize

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
    return _interleaved({label: _BLOCK[label] for label in labels}, warmup, reps)


def calibrate_link(rank: int, n: int, reps: int) -> Any:
    """Job: ``commfuse calibrate``'s measurement, on this (throttled) link."""
    from .calibrate import measure

    return measure(rank, n, reps)


# ----------------------------------------------------------------------------------------
# In the parent: choose rates, run the jobs, collect


class Progress:
    """One line per stage, with the elapsed time: what the run is doing now."""

    def __init__(self, total: int, echo: Callable[[str], None]) -> None:
        self.total, self.done, self.echo = total, 0, echo
        self.start = time.monotonic()

    def stage(self, text: str) -> None:
        minutes, seconds = divmod(round(time.monotonic() - self.start), 60)
        self.echo(f"[{self.done}/{self.total} {minutes:02d}:{seconds:02d}] {text}")

    def advance(self) -> None:
        self.done += 1


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


@dataclasses.dataclass(frozen=True)
class LinkProfiles:
    """``commfuse calibrate``'s measurement at the reference rate and unthrottled: what a
    byte costs on the link splits into the machine's own part (unthrottled) and the part
    that scales with the link's rate, so that each cell's rate gets its own profile."""

    reference: Any  # Profile at REFERENCE_RATE
    free: Any  # Profile without the tbf

    def at(self, rate: float) -> Any:
        if not math.isfinite(rate):
            return self.free

        def per_byte(reference_s: float, free_s: float) -> float:
            return free_s + max(reference_s - free_s, 0.0) * REFERENCE_RATE / rate

        # The matmul's slowdown under a transfer is the throttled link's (measured: 51 %
        # at 1 Gbit/s, 59 % at 2.5, under 1 % unthrottled): the reference's holds.
        ref, free = self.reference, self.free
        return dataclasses.replace(
            ref,
            name=f"bench link {rate / 1e6:.0f} Mbit/s",
            source=ref.source + f"; per-byte costs interpolated to {rate / 1e6:.0f} Mbit/s "
            f"between {REFERENCE_RATE / 1e6:.0f} Mbit/s and unthrottled",
            link_bytes_per_s=1 / per_byte(1 / ref.link_bytes_per_s, 1 / free.link_bytes_per_s),
            collectives={
                kind: {
                    n: Curve(
                        c.latency_s,
                        per_byte(c.seconds_per_byte, free.curve(kind, n).seconds_per_byte),
                    )
                    for n, c in curves.items()
                    if free.curve(kind, n) is not None
                }
                for kind, curves in ref.collectives.items()
            },
        )

    def file(self, rate: float, path: Path) -> str:
        from ..cost.profiles import save

        path.parent.mkdir(parents=True, exist_ok=True)
        save(self.at(rate), path)
        return str(path)


def _choose_rate(
    network: Any, ranks: Any, kind: str, shape: SiteShape, ratio: float, reps: int
) -> tuple[float, list[dict[str, float]]]:
    """A link rate under which the collective alone takes ``ratio`` times the matmul
    alone: start from the bytes sent, then correct by measured times (fixed costs make
    the collective slower than bytes / rate; the matmul time is re-measured each try)."""
    rate, tries = None, []
    for _ in range(MAX_RATE_TRIES):
        network.set_rate(rate)
        per_rank = ranks.run(site_alone, kind, shape, reps)
        times = bench_report.slowest([r["times"] for r in per_rank])
        matmul, comm = statistics.median(times["matmul"]), statistics.median(times["comm"])
        tries.append({"rate_bits_per_s": rate or math.inf, "matmul_s": matmul, "comm_s": comm})
        target = ratio * matmul
        if rate is None:  # unthrottled: the first guess from the bytes alone
            rate = 8 * per_rank[0]["sent_bytes"] / target
            continue
        if abs(comm / target - 1) <= RATE_TOLERANCE:
            break
        rate *= comm / target
    assert rate is not None
    network.set_rate(rate)
    return rate, tries


def _calibrated(
    network: Any, ranks: Any, description: str, reps: int, progress: Progress
) -> LinkProfiles:
    """``commfuse calibrate``'s measurement on these ranks, at the reference rate and
    unthrottled."""
    from .calibrate import profile_from

    progress.stage(
        f"calibrating the cost model's profile on {ranks.world_size} ranks at "
        f"{REFERENCE_RATE / 1e6:.0f} Mbit/s and unthrottled"
    )
    calibrated = []
    for rate in (REFERENCE_RATE, None):
        network.set_rate(rate)
        measured = ranks.run(calibrate_link, reps)[0]
        where = f"{rate / 1e6:.0f} Mbit/s" if rate else "unthrottled"
        calibrated.append(
            profile_from(
                measured,
                ranks.world_size,
                "bench link",
                f"`commfuse calibrate` measurement inside the benchmark's namespaces "
                f"({description}) at {where}",
            )
        )
    return LinkProfiles(*calibrated)


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
    progress = Progress(len(cells) + 3 + 2 * (extra is not None), echo)
    results: dict[str, Any] = {
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
        "block_2d": None,
    }
    with throttled_ranks(world_size, out / "logs", topology) as (network, ranks, description):
        throttled = network.topology != "none"
        results["meta"]["network"] = {
            "topology": network.topology,
            "description": description,
            "throttled": throttled,
        }
        echo(f"network: {description}")
        if not throttled:
            echo("WARNING: " + "!" * 60)
            echo(f"WARNING: the link is NOT throttled: {description}.")
            echo("WARNING: overlap cannot show; run as root for meaningful numbers.")
            echo("WARNING: " + "!" * 60)

        base = _calibrated(network, ranks, description, preset.calibrate_reps, progress)
        results["meta"]["profile"] = base.reference.as_json()
        results["meta"]["profile_unthrottled"] = base.free.as_json()
        tries: list[dict[str, float]]
        progress.advance()

        for index, (kind, shape, ratio) in enumerate(cells):
            rate, tries = math.inf, []
            if throttled:
                progress.stage(f"{kind} {shape.label} ratio {ratio:g}: choosing the link rate")
                rate, tries = _choose_rate(network, ranks, kind, shape, ratio, preset.rate_reps)
            profile = base.file(rate, out / "profiles" / f"cell{index:02d}.json")
            cell_rows = kind_rows(rows, kind)
            progress.stage(
                f"{kind} {shape.label} ratio {ratio:g}: {len(cell_rows) + 4} rows x "
                f"{preset.warmup}+{preset.reps} at {rate / 1e6:.0f} Mbit/s"
            )
            job = SiteJob(kind, shape, tuple(cell_rows), profile, preset.warmup, preset.reps)
            per_rank = ranks.run(measure_site, job)
            cell = bench_report.site_cell(
                kind, shape, ratio, rate, tries, per_rank, cell_rows, world_size
            )
            results["sites"].append(cell)
            progress.advance()
            echo(bench_report.format_cell(cell))

        results["block"] = _run_block(preset.block, network, ranks, base, rows, out, progress)
        progress.advance()
        results["meta"]["qdisc"] = network.qdisc_stats()
    if extra is not None:
        n = extra.world_size or world_size
        with throttled_ranks(n, out / f"logs_{extra.key}", topology) as (
            network,
            ranks,
            description,
        ):
            echo(f"network of the {extra.key} ranks: {description}")
            before = machine()
            base = _calibrated(network, ranks, description, preset.calibrate_reps, progress)
            progress.advance()
            block = _run_block(extra, network, ranks, base, rows, out, progress)
            block |= {"network": description, "machine_before": before, "machine_after": machine()}
            results[extra.key] = block
            progress.advance()
    results["meta"]["machine_after"] = machine()
    results["noise"] = bench_targets.run_noise(results["sites"])
    results["targets"] = bench_targets.check_targets(results)
    write(results, out)
    progress.stage(f"done: {out / 'results.md'}")
    echo(bench_report.format_targets(results["targets"]))
    return results


def write(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and speedup.svg in ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot_speedup(results, out / "speedup.svg")
    (out / "results.md").write_text(markdown(results))


def _run_block(
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

    shape = spec.shape
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
        return bench_report.slowest(ranks.run(block_times, [label], 0, 1))[label][0]

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
    times = bench_report.slowest(ranks.run(block_times, labels, 1, spec.reps))
    block = bench_report.block_result(
        shape, rate, compute_s, times, sites, spec.ratio, ranks.world_size, os.cpu_count()
    )
    progress.echo(bench_report.format_block(block))
    return block


def main(
    quick: bool,
    out: str,
    world_size: int = 2,
    network: str | None = None,
    block_2d: bool = False,
) -> int:
    preset = QUICK if quick else FULL
    results = run(preset, Path(out), world_size, network, block_2d=block_2d)
    return 0 if results["sites"] else 1
