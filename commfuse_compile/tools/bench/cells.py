"""``commfuse bench``'s cells, measured on the ranks: one site at one size, every row.

The site is built by ``sites.build_site``. Each row is the pass applied to it with one
schedule; the matmul alone, the communication alone and both at once are measured with
the rows, interleaved (A B C ... A B C ...) after a warm-up, each call started together
on all ranks by a barrier. These are jobs fed by
``NamespaceRanks.run``: every rank runs the same code in order.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ... import report
from ...cost.profiles import at_compute_speed, load, save
from .config import MAX_CALLS_PER_TIMING, MAX_ROUNDS, MIN_TIMED_S, OVERLAP_PROBE, SiteShape, Variant
from .predicted import matmul_alone_s, program_us
from .sites import GROUPED_MM, SiteProgram, build_site

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _comm(site: SiteProgram, overlap: Callable[[], object] | None = None) -> None:
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


def _timed(fn: Callable[[], object], calls: int = 1) -> float:
    """``fn`` started together on every rank, ``calls`` times back to back; this rank's
    seconds per call."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved(
    fns: dict[str, Callable[[], object]], warmup: int, reps: int, timed_s: float = 0.0
) -> dict[str, list[float]]:
    """A B C ... repeated; the first ``warmup`` rounds are dropped. With ``timed_s``: a
    call shorter than ``MIN_TIMED_S`` timed as several back to back (their mean), and
    more than ``reps`` rounds where ``reps`` of them would take less, as many as fit in
    it (up to ``MAX_ROUNDS``), every rank the same counts (from the slowest rank's first
    round)."""
    times: dict[str, list[float]] = {label: [] for label in fns}
    calls = dict.fromkeys(fns, 1)
    rounds, rep = warmup + reps, 0
    while rep < rounds:
        took: dict[str, float] = {}
        for label, fn in fns.items():
            took[label] = _timed(fn, calls[label])
            if rep >= warmup:
                times[label].append(took[label])
        if rep == 0 and timed_s > 0:
            slowest = torch.tensor(list(took.values()))
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            call_s = dict(zip(fns, slowest.tolist(), strict=True))
            calls = {
                label: min(MAX_CALLS_PER_TIMING, max(1, math.ceil(MIN_TIMED_S / max(s, 1e-9))))
                for label, s in call_s.items()
            }
            round_s = sum(calls[label] * s for label, s in call_s.items())
            fit = min(MAX_ROUNDS, math.ceil(timed_s / max(round_s, 1e-9)))
            rounds = warmup + max(reps, fit)
        rep += 1
    return times


_SITES: dict[tuple[str, SiteShape], SiteProgram] = {}  # this rank's sites, built once


def _site(kind: str, shape: SiteShape, n: int, rank: int) -> SiteProgram:
    if (kind, shape) not in _SITES:
        _SITES[(kind, shape)] = build_site(kind, shape, n, rank)
    return _SITES[(kind, shape)]


def site_alone(rank: int, n: int, kind: str, shape: SiteShape, reps: int) -> dict[str, Any]:
    """Job: the matmul alone and the collective alone (to choose the link rate)."""
    site = _site(kind, shape, n, rank)
    times = interleaved({"matmul": site.matmul, "comm": lambda: _comm(site)}, 1, reps)
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
    timed_s: float = 0.0  # more rounds where ``reps`` take less (``interleaved``)
    breakdown_reps: int = 3


NODE_CATEGORIES = ("matmul", "comm issue", "comm wait", "other")


def _category(node: torch.fx.Node) -> str:
    if node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default, GROUPED_MM):
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
    from ...api import apply

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
        rows[row.label] = _row_record(records) | {
            "program": program_key(gm),
            "predicted_program_us": program_us(gm, records, job.profile),
        }
    times = interleaved(fns, job.warmup, job.reps, job.timed_s)
    if job.profile is not None:
        _predict_at_cell_speed(site, job, rows, times["matmul alone"])
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


def _predict_at_cell_speed(
    site: SiteProgram, job: SiteJob, rows: dict[str, Any], matmul_s: list[float]
) -> None:
    """Each row's program as the model times it at the compute speed the cell ran at
    (``profiles.at_compute_speed``: the matmul alone of the rank slowest at it, its
    median against the model's time of it, one factor on every rank: a rank's own work
    differs under skewed routing, and ranks given different profiles refuse to run):
    the row's program planned again on that profile with the schedule it ran (None where
    that gives another program, or a row ran two schedules)."""
    from ...api import apply

    p = load(job.profile)  # type: ignore[arg-type]
    mine = torch.tensor([statistics.median(matmul_s), matmul_alone_s(site, p)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    measured, modelled = max(every, key=lambda t: t[0].item()).tolist()
    factor = measured / modelled
    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(scratch) / "at-cell-speed.json")
        save(at_compute_speed(p, factor), path)
        for row in job.rows:
            record = rows[row.label]
            record["compute_factor"] = factor
            record["predicted_at_cell_speed_us"] = None
            ran = {"round_trip": "ring"}.get(record["schedule"], record["schedule"])
            if "+" in ran:
                continue
            first = len(report.REPORT.sites)
            options = dataclasses.replace(row, schedule=ran).options(path)
            gm = apply(copy.deepcopy(site.graph), **options)
            records = report.REPORT.sites[first:]
            if program_key(gm) == record["program"]:
                record["predicted_at_cell_speed_us"] = program_us(gm, records, path)


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
    """What the pass did at the site: the schedule it ran and the cost model's times.
    The dropless MoE cell: its ``moe`` site (the token counts' exchange is declined for
    its dtype, in every row). A split all-reduce (``mm_ar_mm``) gives two sites,
    ``mm_rs`` then ``ag_mm`` (the capacity-MoE cell: ``a2a_mm`` then ``mm_a2a``): the
    row ran their schedules ("ring", or "ring+bidir" where ``auto`` chose two), its
    predicted times are the two sites' summed, and ``sites`` lists each with its
    decision."""
    if not records:
        return {
            "schedule": "off",
            "decision": "no site found",
            "reason": "",
            "predicted_us": {},
            "sites": [],
        }
    rewritten = [r for r in records if r.decision == "rewritten"]
    ran = list(dict.fromkeys(r.schedule for r in rewritten))
    # the dropless MoE's token counts (integers, no matmul: declined in every row, before
    # any prediction) are listed in ``sites`` but say nothing of the row
    timed = [r for r in records if r.decline_code != "site.dtype"] or records
    declined = [r for r in timed if r.decision != "rewritten"]
    common = set.intersection(*(set(r.predicted_us) for r in timed))
    return {
        "schedule": "+".join(ran) if rewritten else "off",
        "decision": "rewritten" if rewritten and not declined else timed[0].decision,
        "reason": "; ".join(r.reason for r in declined if r.reason),
        "predicted_us": {k: sum(r.predicted_us[k] for r in timed) for k in sorted(common)},
        "sites": [
            {"kind": r.kind, "decision": r.decision, "schedule": r.schedule} for r in records
        ],
    }
