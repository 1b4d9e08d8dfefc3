"""``commfuse calibrate``: measure this machine and process group, write a profile.

On n local gloo ranks (or the ranks of a running job): matmul time by shape (fitted as
call latency + FLOPs / throughput, all ranks computing at once as in training), P2P
time by message size (a ring exchange, fitted as alpha + bytes/beta), an element-wise
add, the backend's own all-gather, reduce-scatter, all-to-all (``all_to_all_single``,
even splits) and all-reduce by block size on every group size from 2 to n (fitted per
collective and size: the model times the collective with these curves, not with a ring
formula), how much a matmul slows while a transfer is in flight, and the fixed cost of
one P2P step of a rewritten graph, from a tiny all-gather -> matmul site run both ways.
The result loads with ``options={"profile": path}``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..cost.profiles import COLLECTIVES, CURVE_BLOCK_BYTES, Curve, Profile
from ..cost.simulator import Work, simulate
from ..schedules import Direction

MATMUL_SHAPES = ((64, 64, 64), (256, 256, 256), (512, 512, 512), (1024, 1024, 512))
MESSAGE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
TINY_SITE = (2, 8, 8)  # shard rows, K, N of the site that measures the fixed costs
# the matmul timed alone and under a transfer that outlasts it (the slowdown's probe)
OVERLAP_MATMUL = (1024, 1024, 1024)
OVERLAP_MESSAGE_BYTES = 16 << 20  # the probe of the transfer's rate
MAX_OVERLAP_MESSAGE_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class Measurements:
    matmul: list[tuple[float, float]]  # (FLOPs, seconds)
    message: list[tuple[float, float]]  # (bytes, seconds one way)
    add_bytes_per_s: float
    ring_site_s: float  # tiny all-gather -> matmul, rewritten as a ring
    collective_site_s: float  # the same site with its collective
    # collective -> group size -> [(block bytes, seconds)] of the backend's own collective
    collectives: dict[str, dict[int, list[tuple[float, float]]]]
    overlap_slowdown: float  # matmul under a transfer / matmul alone - 1


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``y = a + b x`` by Theil-Sen (the median slope over every pair of points, then the
    median intercept), both kept >= 0: one slow point (the first small message of a TCP
    connection takes milliseconds) does not tilt the rate, as it did a least-squares fit."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for (x1, y1), (x2, y2) in itertools.combinations(sorted(points), 2)
        if x2 > x1
    ]
    b = max(statistics.median(slopes), 1e-30)
    a = statistics.median(y - b * x for x, y in points)
    return max(a, 0.0), b


def profile_from(m: Measurements, n: int, name: str, source: str) -> Profile:
    """The profile whose model reproduces the measurements."""
    matmul_latency, s_per_flop = fit_line(m.matmul)
    alpha, s_per_byte = fit_line(m.message)
    measured = Profile(
        name=name,
        source=source,
        matmul_flops=1 / s_per_flop,
        matmul_latency_s=matmul_latency,
        memory_bytes_per_s=m.add_bytes_per_s,
        link_alpha_s=alpha,
        link_bytes_per_s=1 / s_per_byte,
        step_overhead_s=0.0,
        collective_overhead_s=0.0,
        overlap_slowdown=m.overlap_slowdown,
        collectives={
            name: {size: Curve(*fit_line(points), tuple(points)) for size, points in by_n.items()}
            for name, by_n in m.collectives.items()
        },
    )
    # The fixed costs are what the simulation of the tiny site lacks without them: the
    # ring pays the step overhead once per step (n-1), the collective its overhead once.
    rows, k, cols = TINY_SITE
    tiny = Work(Direction.GATHER, n, block_flops=2.0 * rows * k * cols, block_bytes=4.0 * rows * k)
    step = (m.ring_site_s - simulate(tiny, "ring", measured).end_s) / (n - 1)
    # the call overhead of the ring formula, used for group sizes without a curve
    formula = dataclasses.replace(measured, collectives={})
    collective = m.collective_site_s - simulate(tiny, "collective", formula).end_s
    return dataclasses.replace(
        measured, step_overhead_s=max(step, 0.0), collective_overhead_s=max(collective, 0.0)
    )


def measure(rank: int, world_size: int, reps: int) -> Measurements:
    """Run on every rank of the default group (a ``RankPool`` job)."""
    torch.manual_seed(rank)
    matmul = []
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        matmul.append((2.0 * m * k * n, _median(functools.partial(torch.mm, a, b), reps)))
    message = [(float(size), _one_way(rank, world_size, size, reps)) for size in MESSAGE_BYTES]
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    add_s = _median(lambda: torch.add(x, y), reps)
    ring, collective = _tiny_site_times(world_size, reps)
    return Measurements(
        matmul,
        message,
        3 * x.numel() * 4 / add_s,
        ring,
        collective,
        _collective_curves(rank, world_size, reps),
        _overlap_slowdown(rank, world_size, reps),
    )


def _collective_curves(
    rank: int, world_size: int, reps: int
) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """The backend's collectives (``COLLECTIVES``), timed by block size on the groups
    of ranks 0..g-1 for every g from 2 to the world size (the others wait)."""
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {k: {} for k in COLLECTIVES}
    for g in range(2, world_size + 1):
        group = dist.new_group(list(range(g))) if g < world_size else dist.group.WORLD
        for collective, by_size in curves.items():
            points = []
            for nbytes in CURVE_BLOCK_BYTES:
                if rank < g:  # the others only wait (new_group gives them no group)
                    seconds = _collective_s(collective, nbytes, g, group, reps)
                    points.append((float(nbytes), seconds))
                dist.barrier()
            if rank < g:
                by_size[g] = points
    return curves


def _collective_s(collective: str, block_bytes: int, g: int, group: Any, reps: int) -> float:
    """The median time of one all-gather of ``block_bytes`` blocks (or the reduce-scatter
    down to them, the all-to-all of one such block to each rank, the all-reduce of g of
    them) on ``group`` of ``g`` ranks, as the functional collectives run it."""
    c10d = torch.ops._c10d_functional
    block = torch.randn(block_bytes // 4)
    whole = torch.randn(g * block.numel())
    call: Callable[[], torch.Tensor]
    if collective == "all_gather":
        call = functools.partial(c10d.all_gather_into_tensor, block, g, group.group_name)
    elif collective == "reduce_scatter":
        call = functools.partial(c10d.reduce_scatter_tensor, whole, "sum", g, group.group_name)
    elif collective == "all_reduce":  # of g blocks: the product a ``mm_ar`` site sums
        call = functools.partial(c10d.all_reduce, whole, "sum", group.group_name)
    else:  # all_to_all: even splits, as the Ulysses sites run it
        splits = [block.numel()] * g
        call = functools.partial(c10d.all_to_all_single, whole, splits, splits, group.group_name)
    dist.barrier(group)
    return _median(lambda: c10d.wait_tensor(call()), reps)


def _overlap_slowdown(rank: int, world_size: int, reps: int) -> float:
    """How much slower a matmul runs while a ring exchange is in flight: the matmul timed
    alone, then back to back during the first half of an exchange sized to outlast 8 of
    them (its time alone is measured first: gloo's works cannot be polled)."""
    m, k, n = OVERLAP_MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    alone = _median(functools.partial(torch.mm, a, b), reps)
    probe = _one_way(rank, world_size, OVERLAP_MESSAGE_BYTES, reps)
    wanted = torch.tensor([OVERLAP_MESSAGE_BYTES * 8 * alone / probe])
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # every rank sends the same size
    nbytes = int(min(max(OVERLAP_MESSAGE_BYTES, wanted.item()), MAX_OVERLAP_MESSAGE_BYTES))
    nbytes -= nbytes % 4
    transfer = probe * nbytes / OVERLAP_MESSAGE_BYTES
    send, recv = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    peers = ((rank + 1) % world_size, (rank - 1) % world_size)
    under: list[float] = []
    for _ in range(reps):
        dist.barrier()
        ops = [dist.P2POp(dist.irecv, recv, peers[1]), dist.P2POp(dist.isend, send, peers[0])]
        works = dist.batch_isend_irecv(ops)
        issued = time.perf_counter()
        while time.perf_counter() - issued < transfer / 2:
            start = time.perf_counter()
            torch.mm(a, b)
            under.append(time.perf_counter() - start)
        for work in works:
            work.wait()
    return max(statistics.median(under) / alone - 1, 0.0)


def _median(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _one_way(rank: int, world_size: int, nbytes: int, reps: int) -> float:
    """One ring exchange of ``nbytes``: every rank sends to the next and receives from
    the previous at once, as a ring step does (the batch's time = one message)."""
    send, recv = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    peers = ((rank + 1) % world_size, (rank - 1) % world_size)

    def exchange() -> None:
        # receive first, as commfuse::p2p does (see there why)
        ops = [dist.P2POp(dist.irecv, recv, peers[1]), dist.P2POp(dist.isend, send, peers[0])]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    dist.barrier()
    return _median(exchange, reps)


def _tiny_site_times(n: int, reps: int) -> tuple[float, float]:
    """A float32 ``TINY_SITE`` shard all-gathered into a matmul: (as a ring, with its
    collective)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..api import apply

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name  # type: ignore[union-attr]

    def site(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group)), w)

    rows, k, cols = TINY_SITE
    x, w = torch.randn(rows, k), torch.randn(k, cols)
    ring = apply(make_fx(site, tracing_mode="fake")(x, w), schedule="ring")
    collective = make_fx(site, tracing_mode="fake")(x, w)
    times: dict[str, list[float]] = {"ring": [], "collective": []}
    for _ in range(reps + 1):  # interleaved, so that both see the same machine
        for name, gm in (("ring", ring), ("collective", collective)):
            dist.barrier()
            start = time.perf_counter()
            gm(x, w)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["ring"][1:]), statistics.median(times["collective"][1:])


def run(world_size: int, out: str, reps: int) -> Profile:
    """Calibrate on ``world_size`` local gloo ranks and write the profile to ``out``."""
    from ..cost.profiles import save
    from .ranks import RankPool

    with RankPool(world_size) as pool:
        per_rank = pool.run(measure, reps)
    m = per_rank[0]
    source = (
        f"measured by `commfuse calibrate` on {world_size} local gloo ranks "
        f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {reps} reps)"
    )
    profile = profile_from(m, world_size, f"calibrated-gloo-{world_size}", source)
    save(profile, out)
    return profile
