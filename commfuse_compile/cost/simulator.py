"""Discrete-event simulation of one site on n ranks, for every schedule.

The cost model of the plan stage and ``commfuse sim`` are this one simulation: each
rank has a compute lane and a comm lane; a step's P2P messages start when both sides
have issued them, take ``alpha + bytes/beta`` (shared when several leave a rank at
once over one port), and a step ends when its matmuls and its messages are done, plus
the fixed cost of issuing and waiting them. The schedules' own step lists drive it, so
what is simulated is exactly what the lowering emits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from ..schedules import NAMES, Direction, Transfer, by_name, slicing
from . import steps
from .profile_checks import COLLECTIVES
from .profiles import Curve, Profile
from .timeline import Event, Timeline, overlapped

__all__ = ["SCHEDULES", "Event", "Timeline", "Work", "overlapped", "predict", "simulate"]

SCHEDULES = ("collective", *NAMES)  # a site's alternatives, in the order reports list them
ROUND_TRIP = "round_trip"  # the one program of a round trip (``Direction.ROUND_TRIP``)


@dataclasses.dataclass(frozen=True)
class Work:
    """One site as the simulator sees it: n blocks, each a matmul and a message."""

    # the exchanges (all-to-all) time like a gather or a reduce without adds
    direction: Direction
    n: int
    block_flops: float  # FLOPs of one block's matmuls (all the site's matmuls)
    block_bytes: float  # bytes of one block's message (a shard, or a partial sum)
    matmuls_per_block: int = 1  # matmul calls per block (each pays the call latency)
    # the reduced blocks are then all-gathered (an all-reduce's second half, the same
    # on every schedule and after the collective alike)
    then_gather: bool = False
    # a round trip's way back: the bytes of one block's results (None: ``block_bytes``)
    back_bytes: float | None = None
    # other op calls per block (a round trip's sorting and indexing of each block's rows),
    # each paying a call's fixed cost (``Profile.op_s``); once for the
    # collective, which runs them on all the rows at once
    block_ops: int = 0
    # bytes those ops read and write for one block (``Profile.memory_op_s``: a dropless
    # MoE's sorted rows, its experts' element-wise ops, its rows put back)
    block_op_bytes: float = 0.0
    # bytes of the operands the site's matmuls read whole in every call, whatever its
    # block (the weights of a product cut by tokens): a block's matmuls read them again
    # (``Profile.matmul_bytes_per_s``)
    whole_bytes: float = 0.0
    # the matmuls' class ("bfloat16", "bfloat16 grouped": ``Profile.matmul_rates``),
    # None: the profile's own
    matmul_class: str | None = None
    # what a decomposed gather's rewrite concatenates once its blocks are in, where the
    # collective wrote it in place (``Profile.memory_op_s`` of a copy): the products cut
    # into blocks of rows or columns (Inductor has each block's matmul write into its
    # slice of the concatenation: ``plan.site_work`` leaves them out there), and the
    # collected tensor rebuilt where the program reads it after the site
    product_bytes: float = 0.0
    rebuilt_bytes: float = 0.0
    # the collective calls the program as written makes for the site, one after the
    # other: DTensor gathers a linear's input once per linear that reads it (q, k and v,
    # or w1 and w3: one all-gather each of one shard), where the rewrite runs one ring
    written_calls: int = 1

    @property
    def returned_bytes(self) -> float:
        return self.block_bytes if self.back_bytes is None else self.back_bytes

    def __post_init__(self) -> None:  # a direction's name is taken too ("gather")
        object.__setattr__(self, "direction", Direction(self.direction))


def simulate(work: Work, schedule: str, profile: Profile, slices: int = 2) -> Timeline:
    timeline = _simulate(work, schedule, profile, slices)
    one_call = schedule == "collective" and _all_reduce(work, profile) is not None
    return (
        _then_gathered(work, timeline, profile) if work.then_gather and not one_call else timeline
    )


def _all_reduce(work: Work, p: Profile) -> Curve | None:
    """The measured all-reduce that runs a ``then_gather`` site's collective as one call
    (gloo's is not a reduce-scatter then an all-gather), if the profile has one."""
    return p.curve("all_reduce", work.n) if work.then_gather else None


def _simulate(work: Work, schedule: str, profile: Profile, slices: int) -> Timeline:
    if work.direction is Direction.ROUND_TRIP:
        return _round_trip(work, schedule, profile)
    if schedule == "collective":
        return _collective(work, profile)
    if schedule == "slicing":
        return _then_concatenated(work, _sliced(work, profile, slices), profile)
    if work.direction.collects_first:
        return _then_concatenated(work, _p2p_gather(work, schedule, profile), profile)
    return _p2p_reduce(work, schedule, profile)


def predict(work: Work, profile: Profile, slices: int = 2) -> dict[str, Timeline]:
    """Every schedule's timeline for ``work`` (those with steps for its direction;
    slicing only with more than one chunk): what ``plan`` decides on, the report shows,
    ``commfuse sim`` prints and ``commfuse bench`` predicts."""
    names = ["collective"] + [
        s
        for s in (*SCHEDULES[1:], ROUND_TRIP)
        if by_name(s).supports(work.direction) and (s != "slicing" or slices > 1)
    ]
    return {s: simulate(work, s, profile, slices) for s in names}


def _block_compute_s(work: Work, profile: Profile, fraction: float = 1.0) -> float:
    """``fraction`` of a block's work: its matmuls, and its other ops' calls and bytes."""
    ops = work.block_ops * profile.op_s
    moved = work.block_op_bytes * fraction / profile.memory_bytes_per_s
    return _matmul_calls_s(work, profile, work.block_flops * fraction) + ops + moved


def _matmul_calls_s(work: Work, p: Profile, flops: float) -> float:
    """The site's matmul calls over ``flops`` in all: each pays its call and reads its
    whole operands."""
    calls = work.matmuls_per_block
    return calls * p.matmul_s(flops / calls, work.whole_bytes / calls, work.matmul_class)


def collective_model(work: Work, p: Profile) -> str:
    """How the site's collective is timed on ``p`` (the report says which)."""
    if _all_reduce(work, p) is not None:
        return f"all_reduce as measured on {work.n} ranks ({p.name})"
    collective = work.direction.collective
    if p.curve(collective, work.n) is not None:
        return f"{collective} as measured on {work.n} ranks ({p.name})"
    why = f"ring formula: {p.name} has no measured {collective} curve for {work.n} ranks"
    if any(p.curve(other, work.n) for other in COLLECTIVES if other != collective):
        # a file calibrated before this collective was measured: its other curves are there
        why += " (calibrated before `commfuse calibrate` measured it; re-run it to add one)"
    return why


def matmuls_s(work: Work, p: Profile) -> float:
    """A site's matmuls alone, unsplit (all n blocks in each call)."""
    return _matmul_calls_s(work, p, work.block_flops * work.n)


def collective_s(work: Work, p: Profile) -> float:
    """One all-gather, reduce-scatter or all-to-all call. As the backend runs it where the
    profile has its measured curve (gloo's reduce-scatter, for one, moves far more than a
    ring's bytes; its ``all_to_all_single`` takes about twice a ring's time); else its
    overhead, then the faster of a ring and a bidirectional ring of the same messages (and
    adds; an all-to-all has the ring's pairwise order only): a library picks its
    algorithm, and crediting it with the ring alone would let ``bidir`` beat it on a tiny
    matmul by running fewer rounds."""
    if work.n == 1:
        return 0.0
    curve = p.curve(work.direction.collective, work.n)
    if curve is not None:
        return _measured_call_s(curve, work.block_bytes, p)
    messages_only = dataclasses.replace(p, matmul_latency_s=0.0, step_overhead_s=0.0)
    no_matmul = dataclasses.replace(
        work, block_flops=0.0, block_op_bytes=0.0, product_bytes=0.0, rebuilt_bytes=0.0,
        then_gather=False,
    )  # fmt: skip
    algorithms = [s for s in ("ring", "bidir") if by_name(s).supports(work.direction)]
    rounds = min(simulate(no_matmul, s, messages_only).end_s for s in algorithms)
    return p.collective_overhead_s + rounds


def _measured_call_s(curve: Curve, block_bytes: float, p: Profile) -> float:
    """One call of a measured collective in a program: its curve's time, timed back to
    back, and what a call between computations costs beyond it."""
    return curve.seconds(block_bytes) + p.collective_resume_s


def collective_call_s(work: Work, p: Profile) -> float:
    """The site's collective as the program as written calls it: ``collective_s``; a
    ``then_gather`` site's (an all-reduce) as the measured all-reduce where the profile
    has one, else a reduce-scatter then an all-gather."""
    curve = _all_reduce(work, p)
    if curve is not None:
        return _measured_call_s(curve, work.block_bytes, p)
    seconds = collective_s(dataclasses.replace(work, then_gather=False), p)
    if work.then_gather:
        gather = dataclasses.replace(work, direction=Direction.GATHER, then_gather=False)
        seconds += collective_s(gather, p)
    return seconds


def _collective(work: Work, p: Profile) -> Timeline:
    """The unfused pair: an all-gather (each of the program's ``written_calls``) then one
    matmul over all blocks, or the matmul then a reduce-scatter."""
    n, events = work.n, list[Event]()
    matmul = matmuls_s(work, p)
    comm, name = collective_s(work, p), work.direction.collective
    curve = _all_reduce(work, p)
    if curve is not None:
        comm, name = _measured_call_s(curve, work.block_bytes, p), "all_reduce"
    comm *= work.written_calls
    for r in range(n):
        if work.direction.collects_first:
            events += [
                Event(r, "comm", 0, name, 0.0, comm),
                Event(r, "compute", 0, "matmul", comm, comm + matmul),
            ]
        else:
            events += [
                Event(r, "compute", 0, "matmul", 0.0, matmul),
                Event(r, "comm", 0, name, matmul, matmul + comm),
            ]
    return Timeline("collective", events)


def _round_trip(work: Work, schedule: str, p: Profile) -> Timeline:
    """A round trip, every peer's block the same: the dispatch all-to-all, the matmuls
    on all n blocks and the combine all-to-all; or ``steps.round_trip``, the program
    ``kinds/moe`` lowers."""
    n = work.n
    if schedule == ROUND_TRIP:
        sent = [[work.block_bytes] * n for _ in range(n)]
        returned = [[work.returned_bytes] * n for _ in range(n)]
        return steps.round_trip(
            p, sent, returned, lambda r, src, part: _block_compute_s(work, p, part)
        )
    dispatch = collective_s(dataclasses.replace(work, direction=Direction.EXCHANGE_IN), p)
    back = dataclasses.replace(
        work, direction=Direction.EXCHANGE_OUT, block_bytes=work.returned_bytes
    )
    combine = collective_s(back, p)
    computed = dispatch + _block_compute_s(work, p, work.n)  # every block at once
    events = []
    for r in range(n):
        events += [
            Event(r, "comm", 0, "all_to_all (dispatch)", 0.0, dispatch),
            Event(r, "compute", 0, "matmul", dispatch, computed),
            Event(r, "comm", 0, "all_to_all (combine)", computed, computed + combine),
        ]
    return Timeline("collective", events)


def _then_gathered(work: Work, timeline: Timeline, p: Profile) -> Timeline:
    """``timeline`` then one all-gather of the reduced blocks, started once every rank
    holds its block (a collective starts when the last rank joins it)."""
    gather = dataclasses.replace(work, direction=Direction.GATHER, then_gather=False)
    start, took = timeline.end_s, collective_s(gather, p)
    step = 1 + max((e.step for e in timeline.events), default=-1)
    events = [Event(r, "comm", step, "all_gather", start, start + took) for r in range(work.n)]
    return Timeline(timeline.schedule, [*timeline.events, *events])


def _then_concatenated(work: Work, timeline: Timeline, p: Profile) -> Timeline:
    """``timeline`` then, on each rank once its last block is in and computed, the copy
    (read and written) that puts the blocks together."""
    concatenated = work.product_bytes + work.rebuilt_bytes
    if not concatenated:
        return timeline
    took = p.memory_op_s(2 * concatenated)
    events = list(timeline.events)
    step = 1 + max((e.step for e in events), default=-1)
    for r in range(work.n):
        start = max((e.end_s for e in timeline.on_rank(r)), default=0.0)
        events.append(Event(r, "compute", step, "concatenate the blocks", start, start + took))
    return Timeline(timeline.schedule, events)


def _sliced(work: Work, p: Profile, k: int) -> Timeline:
    """The lowering's program on each rank, step by step in its order: start ``issue``'s
    chunk collective (the compute thread's ``collective_issue_s``), run ``compute``'s
    chunk matmuls (n blocks each) under it, then wait for it. A collective in flight
    while the matmuls hold the rank's core ends up to ``collective_stall_s`` later."""
    n, events = work.n, list[Event]()
    chunk_compute = n * _block_compute_s(work, p, 1 / k)
    chunk_comm = collective_s(dataclasses.replace(work, block_bytes=work.block_bytes / k), p)
    gather = work.direction == Direction.GATHER
    steps = slicing.gather_steps(k) if gather else slicing.reduce_steps(k)
    name = "all_gather" if gather else "reduce_scatter"
    for r in range(n):
        now, ends = 0.0, dict[int, float]()
        for s, step in enumerate(steps):
            started = now
            if step.issue is not None:
                now += p.collective_issue_s
                ends[step.issue] = started + chunk_comm
            if step.compute is not None:
                in_flight = ends[step.issue] if step.issue is not None else now
                took = overlapped(chunk_compute, in_flight - now, p.overlap_slowdown)
                events.append(
                    Event(r, "compute", s, f"matmul chunk {step.compute}", now, now + took)
                )
                if step.issue is not None:  # the matmuls held the core meanwhile
                    held = max(min(in_flight, now + took) - now, 0.0)
                    ends[step.issue] += min(p.collective_stall_s, held)
                now += took
            if step.issue is not None:
                events.append(
                    Event(r, "comm", s, f"{name} chunk {step.issue}", started, ends[step.issue])
                )
            if step.wait is not None:
                now = max(now, ends[step.wait])
    return Timeline("slicing", events)


def _send(
    work: Work,
    p: Profile,
    rank: int,
    step: int,
    sends: Sequence[Transfer],
    ready: list[float],
    events: list[Event],
) -> list[tuple[int, float]]:
    """``rank``'s messages of ``step``, each starting once both ends are ready; adds the
    step's comm event and returns (destination, arrival) per message."""
    spans, arrivals = [], []
    for t in sends:
        dst = (rank + t.peer) % work.n
        start = max(ready[rank], ready[dst])
        end = start + p.message_s(work.block_bytes, sharing=len(sends))
        spans.append((start, end))
        arrivals.append((dst, end))
    events += _comm_event(rank, step, sends, spans)
    return arrivals


@functools.lru_cache(maxsize=64)
def _plans(schedule: str, direction: Direction, n: int) -> tuple[tuple[Any, ...], ...]:
    """Every rank's steps: pure functions of (schedule, direction, n), built once (a
    128-rank ring's are 16,384 steps, and ``commfuse sim`` prices many sites on it)."""
    return tuple(tuple(by_name(schedule).steps(direction, r, n, 0)) for r in range(n))


def _p2p_gather(work: Work, schedule: str, p: Profile) -> Timeline:
    n, events = work.n, list[Event]()
    plans = _plans(schedule, work.direction, n)
    c = _block_compute_s(work, p)
    now = [0.0] * n
    for s in range(len(plans[0])):
        issue = [now[r] + (p.step_overhead_s if plans[r][s].sends else 0.0) for r in range(n)]
        done = list(issue)
        for r in range(n):
            for dst, end in _send(work, p, r, s, plans[r][s].sends, issue, events):
                done[r], done[dst] = max(done[r], end), max(done[dst], end)
        for r in range(n):
            computed, in_flight = issue[r], done[r]  # this rank's messages end by done[r]
            for b in plans[r][s].compute:
                took = overlapped(c, in_flight - computed, p.overlap_slowdown)
                events.append(
                    Event(r, "compute", s, f"matmul block {b}", computed, computed + took)
                )
                computed += took
            done[r] = max(done[r], computed)
        now = done
    return Timeline(schedule, events)


def _p2p_reduce(work: Work, schedule: str, p: Profile) -> Timeline:
    n, events = work.n, list[Event]()
    plans = _plans(schedule, work.direction, n)
    c, a = _block_compute_s(work, p), p.add_s(work.block_bytes)
    now = [0.0] * n
    arrivals: list[float] = [0.0] * n  # when the messages a rank waits on next have landed
    for s in range(len(plans[0])):
        ready = []
        for r in range(n):
            step = plans[r][s]
            computed = now[r]
            for b in step.blocks:  # under the messages of the step before
                took = overlapped(c, arrivals[r] - computed, p.overlap_slowdown)
                events.append(
                    Event(r, "compute", s, f"matmul block {b}", computed, computed + took)
                )
                computed += took
            added = max(computed, arrivals[r])
            if step.adds:
                end = added + len(step.adds) * a
                events.append(
                    Event(r, "compute", s, f"add {len(step.adds)} partial(s)", added, end)
                )
                added = end
            ready.append(added + (p.step_overhead_s if step.sends else 0.0))
        arrivals = list(ready)
        for r in range(n):
            step = plans[r][s]
            for dst, end in _send(work, p, r, s, step.sends, ready, events):
                arrivals[dst] = max(arrivals[dst], end)
                arrivals[r] = max(arrivals[r], end)  # its buffer is waited too
        now = ready
    return Timeline(schedule, events)


def _comm_event(
    rank: int, step: int, sends: Sequence[Transfer], spans: list[tuple[float, float]]
) -> list[Event]:
    """A step's messages leave together (bidir: one to each neighbour): one comm event
    from the first start to the last end, so that a lane never holds overlapping events."""
    if not sends:
        return []
    name = "send " + ", ".join(f"{t.block} to {t.peer:+d}" for t in sends)
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    return [Event(rank, "comm", step, name, start, end)]
