"""Round trip: an all-to-all, a computation on each received block, and the results sent
back where they came from (an MoE layer's dispatch, experts and combine: ``kinds/moe``).

Pairwise, by ring offset, the same for every rank: step s receives the block of offset
s + 1 (sends this rank's tokens to rank r + s + 1, receives rank r - s - 1's), computes
the block of offset s, and sends back the result computed in step s - 1. This rank's own
block (offset 0) needs no transfer: its first half runs in step 0, under the first
transfer, its second half in step n, under the last result's way back, so that neither
end of the exchange waits bare.
"""

from __future__ import annotations

import dataclasses

from .exchange import ScheduleError


@dataclasses.dataclass(frozen=True)
class RoundTripStep:
    """Ring offsets, or None: ``compute``: the block from rank r - t (``half``: 0 or 1,
    that half of it; None: all of it); ``dispatch``: send to r + t, receive from r - t;
    ``combine``: send r - t's result back to it, receive this rank's from r + t."""

    compute: int
    dispatch: int | None
    combine: int | None
    half: int | None = None


def steps(n: int) -> list[RoundTripStep]:
    return [
        RoundTripStep(
            compute=s % n,
            dispatch=s + 1 if s + 1 < n else None,
            combine=s - 1 if s >= 2 else None,
            half=0 if s == 0 else 1 if s == n else None,
        )
        for s in range(n + 1)
    ]


def round_trip_steps(rank: int, n: int) -> list[RoundTripStep]:
    """``steps`` as ``Schedule.steps`` asks for them (every rank runs the same offsets)."""
    return steps(n)


def check(n: int) -> None:
    """Every block is computed once, after it arrived (its own at once), and every other
    block's result is sent back once, after it was computed. Each transfer's peer runs
    the same offset in the same step, so every send meets its receive there."""
    arrived, computed, returned = {0: -1}, dict[int, int](), dict[int, int]()
    halves: list[int] = []
    for s, step in enumerate(steps(n)):
        if step.half is not None:
            if step.compute != 0 or step.half != len(halves):
                raise ScheduleError(f"step {s}: half {step.half} of offset {step.compute}")
            halves.append(s)
            if len(halves) == 2:
                computed[0] = s
        elif arrived.get(step.compute, s) >= s or step.compute in computed:
            raise ScheduleError(f"step {s}: offset {step.compute} computed out of turn")
        else:
            computed[step.compute] = s
        if step.dispatch is not None:
            arrived[step.dispatch] = s
        if step.combine is not None:
            if computed.get(step.combine, s) >= s or step.combine in returned:
                raise ScheduleError(f"step {s}: offset {step.combine} sent back out of turn")
            returned[step.combine] = s
    if sorted(computed) != list(range(n)) or sorted(returned) != list(range(1, n)):
        raise ScheduleError(f"computed {sorted(computed)}, returned {sorted(returned)} of {n}")
