"""The sites ``commfuse calibrate`` runs whole, to read the fixed costs the cost model
lacks without them (``profile_fit``): a decode-sized all-gather -> matmul as a ring and
as written (a P2P step's cost), a larger one as ``slicing`` lowers it and its matmul
alone (a collective's stall under matmuls), and one collective's start. Every rank of
the job calls each function at once."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..cost.profiles import CURVE_BLOCK_BYTES
from .profile_fit import SLICED_SITE_CHUNKS, STEP_SITE


def linear_operands(
    m: int, k: int, n: int, dtype: torch.dtype = torch.float32, groups: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] and a weight as ``F.linear`` reads it: ``w.t()`` of w [n, k] (the layout of
    every framework's linear layers; a skinny matmul on this project's CI machine reads it
    at half the rate of a row-major [k, n]: 8 rows of 1024x1024 take 0.55 ms, not 0.24),
    or with ``groups`` one such weight per group, [groups, k, n]."""
    x = torch.randn(m, k, dtype=dtype)
    if groups:
        return x, torch.randn(groups, n, k, dtype=dtype).transpose(-2, -1)
    return x, torch.randn(n, k, dtype=dtype).t()


def _gather_site(
    n: int, group: str, shape: tuple[int, int, int]
) -> tuple[Callable[[], torch.fx.GraphModule], torch.Tensor, torch.Tensor]:
    """A float32 shard of ``shape`` all-gathered on ``group`` of n ranks into a matmul:
    a function that traces it anew, and its inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    c10d = torch.ops._c10d_functional

    def site(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group)), w)

    x, w = linear_operands(*shape)
    return lambda: make_fx(site, tracing_mode="fake")(x, w), x, w


def _interleaved(
    programs: Mapping[str, Callable[[], object]], calls: int, turns: Sequence[bool]
) -> dict[str, float]:
    """Each program's median call, the programs interleaved (each sees the same machine)
    after a warm-up, once per turn: this rank runs them in the turns it is True, and
    waits at the barriers in the others."""
    times: dict[str, list[float]] = {name: [] for name in programs}
    for runs in turns:
        for i in range(calls + 1):
            for name, program in programs.items():
                dist.barrier()
                start = time.perf_counter()
                if runs:
                    program()
                if runs and i:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def step_site_times(n: int, group: str, calls: int, turns: Sequence[bool]) -> tuple[float, float]:
    """``STEP_SITE`` on ``group`` of n ranks: (as a ring, with its collective)."""
    from ..api import apply

    trace, x, w = _gather_site(n, group, STEP_SITE)
    ring, collective = apply(trace(), schedule="ring"), trace()
    programs = {
        "ring": functools.partial(ring, x, w),
        "collective": functools.partial(collective, x, w),
    }
    times = _interleaved(programs, calls, turns)
    return times["ring"], times["collective"]


def sliced_site_times(
    n: int, group: str, shape: tuple[int, int, int], calls: int
) -> tuple[float, float]:
    """The sliced site of ``shape`` on ``group`` of n ranks: (as ``slicing`` lowers it in
    ``SLICED_SITE_CHUNKS`` chunks, its matmul alone on the gathered rows)."""
    from ..api import apply

    trace, x, w = _gather_site(n, group, shape)
    sliced = apply(trace(), schedule="slicing", slices=SLICED_SITE_CHUNKS)
    programs = {
        "slicing": functools.partial(sliced, x, w),
        "matmul": functools.partial(torch.mm, torch.cat([x] * n), w),
    }
    times = _interleaved(programs, calls, [True])
    return times["slicing"], times["matmul"]


def issue_s(group: dist.ProcessGroup, n: int, calls: int) -> float:
    """The compute thread's time to start an all-gather of the smallest curve block on
    ``group`` of n ranks (its call, before its wait): the median of ``calls``."""
    c10d = torch.ops._c10d_functional
    block = torch.randn(CURVE_BLOCK_BYTES[0] // 4)
    starts = []
    for _ in range(calls):
        dist.barrier(group)
        start = time.perf_counter()
        gathered = c10d.all_gather_into_tensor(block, n, group.group_name)
        starts.append(time.perf_counter() - start)
        c10d.wait_tensor(gathered)
    return statistics.median(starts)
