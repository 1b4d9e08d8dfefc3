"""Run a schedule for all n ranks at once, in one process, on plain values.

Checks that every receive is matched by the peer's send of the same block in the
same step (the exchange cannot deadlock or mix blocks) and returns what each rank
computes, so a schedule can be compared with the unfused collective + matmul.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TypeVar

from . import Direction, Transfer

T = TypeVar("T")


class ScheduleError(AssertionError):
    pass


def _exchange(
    n: int,
    step: int,
    sends: dict[int, tuple[Transfer, ...]],
    recvs: dict[int, tuple[Transfer, ...]],
) -> None:
    """Every recv (r <- r+o, block b) must be a send (r+o -> r, block b) of the same step."""
    sent = {((r + t.peer) % n, r, t.block) for r, ts in sends.items() for t in ts}
    wanted = {(r, (r + t.peer) % n, t.block) for r, ts in recvs.items() for t in ts}
    if wanted != sent:
        raise ScheduleError(
            f"step {step}: (dst, src, block) receives {sorted(wanted)} != sends {sorted(sent)}"
        )


def gather(
    schedule: ModuleType, blocks: Sequence[T], compute: Callable[[int, T], object]
) -> list[dict[int, object]]:
    """For each rank, {block index: compute(block index, block)} as the schedule runs it."""
    n = len(blocks)
    plans = [schedule.gather_steps(r, n) for r in range(n)]
    held: list[dict[int, T]] = [{r: blocks[r]} for r in range(n)]
    out: list[dict[int, object]] = [{} for _ in range(n)]
    for s in range(len(plans[0])):
        steps = [plans[r][s] for r in range(n)]
        _exchange(
            n,
            s,
            {r: st.sends for r, st in enumerate(steps)},
            {r: st.recvs for r, st in enumerate(steps)},
        )
        for r, st in enumerate(steps):
            for b in st.compute:
                out[r][b] = compute(b, held[r][b])
        arrived = [
            {t.block: held[(r + t.peer) % n][t.block] for t in st.recvs}
            for r, st in enumerate(steps)
        ]
        for r in range(n):
            held[r].update(arrived[r])
    return out


def reduce(
    schedule: ModuleType, n: int, partial: Callable[[int, int], T], add: Callable[[T, T], T]
) -> list[T]:
    """For each rank, the finished block it holds: sum over ranks of partial(rank, block)."""
    plans = [schedule.reduce_steps(r, n) for r in range(n)]
    inbox: list[dict[tuple[int, int], T]] = [{} for _ in range(n)]  # (block, peer) -> sum
    sums: list[dict[int, T]] = []
    for s in range(len(plans[0])):
        steps = [plans[r][s] for r in range(n)]
        _exchange(
            n,
            s,
            {r: st.sends for r, st in enumerate(steps)},
            {r: st.recvs for r, st in enumerate(steps)},
        )
        sums = []
        for r, st in enumerate(steps):
            values = {}
            for b in st.blocks:
                value = partial(r, b)
                for t in st.adds:
                    if t.block == b:
                        if (b, t.peer) not in inbox[r]:
                            raise ScheduleError(
                                f"step {s}: rank {r} adds block {b} from "
                                f"{t.peer:+d} before receiving it"
                            )
                        value = add(value, inbox[r].pop((b, t.peer)))
                values[b] = value
            sums.append(values)
        for r, st in enumerate(steps):
            for t in st.recvs:
                inbox[r][(t.block, t.peer)] = sums[(r + t.peer) % n][t.block]
    for r in range(n):
        if r not in sums[r] or inbox[r]:
            raise ScheduleError(f"rank {r} does not end holding exactly its own block")
    return [sums[r][r] for r in range(n)]


def all_to_all(schedule: ModuleType, n: int, direction: Direction) -> None:
    """Check an all-to-all schedule for all n ranks: every message meets its receive in
    the same step, carries the block meant for its receiver, and every rank ends with the
    n blocks of the all-to-all's output, each multiplied once (``exchange_in``: as they
    arrive; ``exchange_out``: each computed before it is sent, its own one too)."""
    incoming = direction == Direction.EXCHANGE_IN
    make = schedule.exchange_in_steps if incoming else schedule.exchange_out_steps
    plans = [make(r, n) for r in range(n)]
    held = [{r} for r in range(n)]  # exchange_in: output blocks (by source rank) at hand
    done: list[list[int]] = [[] for _ in range(n)]  # blocks multiplied, in order
    for s in range(len(plans[0])):
        steps = [plans[r][s] for r in range(n)]
        _exchange(
            n,
            s,
            {r: st.sends for r, st in enumerate(steps)},
            {r: st.recvs for r, st in enumerate(steps)},
        )
        for r, st in enumerate(steps):
            if any(t.block != (r + t.peer) % n for t in st.sends):
                raise ScheduleError(f"step {s}: rank {r} sends a block meant for another rank")
            computing = st.compute if incoming else st.blocks
            if incoming and not set(computing) <= held[r]:
                raise ScheduleError(f"step {s}: rank {r} multiplies a block before it arrived")
            if not incoming and any(t.block not in done[r] + list(computing) for t in st.sends):
                raise ScheduleError(f"step {s}: rank {r} sends a block before computing it")
            done[r] += computing
        for r, st in enumerate(steps):
            held[r] |= {(r + t.peer) % n for t in st.recvs}
    for r in range(n):
        if sorted(done[r]) != list(range(n)) or held[r] != set(range(n)):
            raise ScheduleError(f"rank {r} does not end with every block exactly once")


@functools.cache
def check(schedule: ModuleType, n: int, direction: Direction) -> None:
    """``schedule``'s steps in ``direction``, run for all n ranks: every block reaches
    the ranks that need it (gathered: every rank multiplies every block; reduced: every
    block sums every rank's partial; exchanged: ``all_to_all``)."""
    if direction in (Direction.EXCHANGE_IN, Direction.EXCHANGE_OUT):
        all_to_all(schedule, n, direction)
    elif direction is Direction.GATHER:
        held = gather(schedule, list(range(n)), lambda b, x: x)
        if any(sorted(h) != list(range(n)) for h in held):
            raise ScheduleError("a rank does not multiply every block")
    else:
        sums = reduce(schedule, n, lambda r, b: {(r, b)}, lambda x, y: x | y)
        if sums != [{(r, b) for r in range(n)} for b in range(n)]:
            raise ScheduleError("a block does not sum every rank's partial")
