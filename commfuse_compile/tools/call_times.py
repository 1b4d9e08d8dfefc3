"""How ``commfuse calibrate`` times a call: back to back on one rank, in rounds of every
point it measures, and across the job's ranks (a collective call at its slowest rank; a
probe's rounds, the median over every rank's)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

# A curve's point, and each matmul shape, the add and the op graph, is timed in this
# many rounds of every point (``rounds``), its calls split among them: a slow spell of
# the machine (gloo's 4 KiB all-reduce at 1.0, 0.3 and 1.7 ms in three calibrations a
# minute apart here, its 256 KiB all-to-all 2.0 ms against 0.4) then lands on a few
# calls of many points, not on all the calls of one
CURVE_ROUNDS = 4


def times(fn: Callable[[], object], reps: int, warm_up: bool = True) -> list[float]:
    """``reps`` calls of ``fn`` back to back (after one untimed call, with ``warm_up``)."""
    if warm_up:
        fn()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def median(fn: Callable[[], object], reps: int) -> float:
    """The median of ``times``."""
    return statistics.median(times(fn, reps))


def rounds(
    timers: Mapping[Any, tuple[Callable[[int, bool], list[float]], int]],
) -> dict[Any, list[float]]:
    """Each key's ``reps`` call times, from ``CURVE_ROUNDS`` rounds that each visit every
    key in one order: ``timer(calls, warm_up)`` times its share of the calls, warmed up
    in the first round only."""
    seconds: dict[Any, list[float]] = {key: [] for key in timers}
    for turn in range(CURVE_ROUNDS):
        for key, (timer, reps) in timers.items():
            seconds[key] += timer(-(-reps // CURVE_ROUNDS), turn == 0)
    return seconds


def in_rounds(calls: Mapping[Any, tuple[Callable[[], object], int]]) -> dict[Any, float]:
    """Each call's median time over its ``reps``, spread over ``CURVE_ROUNDS`` rounds that
    each visit every call, warmed up once: a slow spell of the machine then lands on a
    few calls of many, not on all the calls of one (one calibration here timed the
    element-wise add at 3.8 GB/s and float32 matmuls at 85 GFLOP/s, where the one before
    had 13.3 and 149, and the bench's cells then ran up to 1.5x faster than it said)."""
    timers = {key: (functools.partial(times, fn), reps) for key, (fn, reps) in calls.items()}
    return {key: statistics.median(seconds) for key, seconds in rounds(timers).items()}


def slowest_rank(seconds: list[float], group: Any) -> list[float]:
    """Each call's time at the rank of ``group`` slowest at it (every rank times the same
    calls in one order). A collective is done when its last rank has its data, and the
    ranks do not finish together: gloo's all-to-all of 4 MiB blocks at 749 Mbit/s,
    started on two ranks at once, took 48 ms on one and 89 ms on the other (the one whose
    peer's data queued behind its own send). Rank 0's own times gave one calibration that
    all-to-all at 1.05x the wire's time; the others, the bench's cells and the programs
    (whose ranks never arrive together) see 2.0x."""
    every = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(every, op=dist.ReduceOp.MAX, group=group)
    return every.tolist()


def median_over_ranks(probe_rounds: list[list[float]]) -> list[float]:
    """Each column of this rank's ``probe_rounds``, the median over every rank's rounds."""
    mine = torch.tensor(probe_rounds, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.cat(every).quantile(0.5, dim=0).tolist()
