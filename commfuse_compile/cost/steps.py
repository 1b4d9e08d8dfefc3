"""Steps with a size per message and per block: an uneven all-to-all's pairwise steps,
and the round trip of an MoE layer (``schedules/round_trip``, what ``kinds/moe``
lowers), timed as the simulator times its rings.

A step starts its messages and computes its blocks under them (``gather_like``: the
blocks arrived before), or computes its blocks under the messages of the step before and
then sends them (``reduce_like``). Messages leaving one rank together share its port.
"""

from __future__ import annotations

from collections.abc import Callable

from ..schedules import round_trip as round_trip_schedule
from .profiles import Profile
from .timeline import Event, Timeline, overlapped

Message = tuple[int, float]  # (destination rank, bytes)
Work = tuple[str, float]  # (what is computed, seconds)


def leaving_s(p: Profile, sizes: list[float]) -> list[float]:
    """How long each of a step's messages takes when they leave one rank together: behind
    one port they share it fairly, so a message of b bytes ends once the port has moved
    min(b, b') of every message b' (``Profile.message_s`` when all are the same size; a
    small message no longer slows a large one for its whole length)."""
    if p.duplex_neighbours:
        return [p.message_s(b) for b in sizes]
    return [p.link_alpha_s + sum(min(o, b) for o in sizes) / p.link_bytes_per_s for b in sizes]


def _transfer(
    p: Profile,
    r: int,
    step: int,
    sends: list[Message],
    start: list[float],
    done: list[float],
    events: list[Event],
) -> None:
    """Rank ``r``'s messages of one step, each leaving when both ends have started
    (``start``): ``done`` of both ends moves to the message's arrival; one comm event
    from the first start to the last end."""
    if not sends:
        return
    spans = []
    for (dst, _), took in zip(sends, leaving_s(p, [b for _, b in sends]), strict=True):
        begin = max(start[r], start[dst])
        spans.append((begin, begin + took))
        done[r], done[dst] = max(done[r], begin + took), max(done[dst], begin + took)
    name = "send " + ", ".join(f"{b / 2**10:.1f} KiB to rank {dst}" for dst, b in sends)
    events.append(Event(r, "comm", step, name, min(s for s, _ in spans), max(e for _, e in spans)))


def _compute(
    p: Profile, r: int, step: int, work: list[Work], start: float, in_flight_until: float
) -> tuple[float, list[Event]]:
    """``work`` one after the other from ``start``, slowed while a message is in flight."""
    now, events = start, []
    for name, seconds in work:
        took = overlapped(seconds, in_flight_until - now, p.overlap_slowdown)
        events.append(Event(r, "compute", step, name, now, now + took))
        now += took
    return now, events


def gather_like(
    schedule: str, p: Profile, sends: list[list[list[Message]]], compute: list[list[list[Work]]]
) -> Timeline:
    """Per rank and step, ``sends[r][s]`` and ``compute[r][s]``: each step issues its
    messages (paying ``step_overhead_s``) and computes under them."""
    n, events = len(sends), list[Event]()
    now = [0.0] * n
    for s in range(len(sends[0])):
        issue = [now[r] + (p.step_overhead_s if sends[r][s] else 0.0) for r in range(n)]
        done = list(issue)
        for r in range(n):
            _transfer(p, r, s, sends[r][s], issue, done, events)
        for r in range(n):
            computed, took = _compute(p, r, s, compute[r][s], issue[r], done[r])
            events += took
            done[r] = max(done[r], computed)
        now = done
    return Timeline(schedule, events)


def reduce_like(
    schedule: str, p: Profile, sends: list[list[list[Message]]], compute: list[list[list[Work]]]
) -> Timeline:
    """Per rank and step: compute ``compute[r][s]`` under the messages of the step
    before, wait them, then issue ``sends[r][s]`` (no adds: an all-to-all's)."""
    n, events = len(sends), list[Event]()
    now, arrivals = [0.0] * n, [0.0] * n
    for s in range(len(sends[0])):
        ready = []
        for r in range(n):
            computed, took = _compute(p, r, s, compute[r][s], now[r], arrivals[r])
            events += took
            ready.append(max(computed, arrivals[r]) + (p.step_overhead_s if sends[r][s] else 0.0))
        arrivals = list(ready)
        for r in range(n):
            _transfer(p, r, s, sends[r][s], ready, arrivals, events)
        now = ready
    return Timeline(schedule, events)


def round_trip(
    p: Profile,
    sent: list[list[float]],
    returned: list[list[float]],
    experts_s: Callable[[int, int, float], float],
) -> Timeline:
    """The round trip ``kinds/moe`` lowers, step by step (``schedules.round_trip``): rank
    r dispatches ``sent[r][d]`` bytes to rank d, which sends ``returned[d][r]`` bytes of
    results back; ``experts_s(r, src, fraction)``: rank r's experts on that fraction of
    the block rank src sent it. Its own block runs in halves, in the first and the last
    step."""
    n = len(sent)
    plan = round_trip_schedule.steps(n)
    sends: list[list[list[Message]]] = [[] for _ in range(n)]
    compute: list[list[list[Work]]] = [[] for _ in range(n)]
    for r in range(n):
        for step in plan:
            out: list[Message] = []
            if step.dispatch is not None:
                dst = (r + step.dispatch) % n
                out.append((dst, sent[r][dst]))
            if step.combine is not None:
                src = (r - step.combine) % n
                out.append((src, returned[r][src]))
            sends[r].append(out)
            if step.half is not None:
                compute[r].append([(f"experts: own block, half {step.half}", experts_s(r, r, 0.5))])
            else:
                src = (r - step.compute) % n
                compute[r].append([(f"experts: block of rank {src}", experts_s(r, src, 1.0))])
    return gather_like("round_trip", p, sends, compute)
