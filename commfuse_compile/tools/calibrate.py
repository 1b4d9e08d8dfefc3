"""``commfuse calibrate``: measure this machine and process group, write a profile.

On n local gloo ranks (or the ranks of a running job): matmul time by shape (fitted as
call latency + FLOPs / throughput, all ranks computing at once as in training, and how
fast a few-row matmul reads its weight beyond that), P2P
time by message size (a ring exchange, fitted as alpha + bytes/beta), an element-wise
add, the backend's own all-gather, reduce-scatter, all-to-all (``all_to_all_single``,
even splits) and all-reduce by block size on every group size from 2 to n (fitted per
collective and size: the model times the collective with these curves, not with a ring
formula), how much a matmul slows while a transfer is in flight, and the fixed cost of
one P2P step of a rewritten graph, from a decode-sized all-gather -> matmul site run both
ways (these two fixed costs: the median over every rank, ``FixedCostProbe``, whose rounds
also time each collective's smallest block: the curves take those, so that a decode
step's collective and a ring's steps are priced from one machine state), and a
collective's start and its stall under matmuls, from a larger site run sliced
(``SlicedProbe``; the sites are ``site_probes``'). The fits are ``profile_fit``'s.
The result loads with ``options={"profile": path}``.

Under a multi-node torchrun launch it measures every level: the above on each node's
ranks (all nodes at once), and the link, the collectives and the fixed costs between
nodes on the ranks of each local rank across the nodes (``run_launched``), into one
profile with both.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..cost.profile_checks import COLLECTIVES
from ..cost.profiles import CURVE_BLOCK_BYTES, Level, Profile
from ..cost.timeline import slowdown_of
from ..passes.fx.matmuls import rate_class
from ..runtime import topology
from . import call_times
from .profile_fit import (
    STEP_SITE,
    FixedCostProbe,
    Measurements,
    SlicedProbe,
    fit_line,
    fitted_curve,
    fitted_curves,
    profile_from,
    sliced_site_shape,
    step_costs,
    with_small_calls,
)
from .site_probes import issue_s, linear_operands, sliced_site_times, step_site_times

MATMUL_SHAPES = ((64, 64, 64), (256, 256, 256), (512, 512, 512), (1024, 1024, 512))
# a decode step's: few rows, a whole weight read per call (``Profile.matmul_bytes_per_s``)
SKINNY_SHAPES = ((2, 1024, 1024), (4, 1024, 1024), (8, 1024, 1024), (16, 1024, 1024))
# the matmul classes measured besides float32 (``Profile.matmul_rates``): (dtype, grouped)
RATE_CLASSES = ((torch.bfloat16, False), (torch.bfloat16, True))
MESSAGE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
# the slowdown's probe: a span of these matmuls with a transfer of about half its time
# under it, and without
OVERLAP_MATMUL = (1024, 1024, 1024)
OVERLAP_MATMULS = 8
OVERLAP_MESSAGE_BYTES = 16 << 20  # the probe of the transfer's rate
MIN_OVERLAP_MESSAGE_BYTES = 256 << 10
MAX_OVERLAP_MESSAGE_BYTES = 512 << 20
# Calls of less than this many bytes take a few milliseconds or less and have the
# heaviest tails (a 4 KiB gloo all-reduce on the CI machine: median 0.3 ms, one call in
# ten 3-8 ms; a median of 3 once came out 3.5 ms and ``auto`` then split a decode step's
# all-reduce): timed ``SMALL_CALL_REPS`` times as often, at little cost.
SMALL_CALL_BYTES = 1 << 20
SMALL_CALL_REPS = 4
OP_CALLS = 64  # the ops of ``_op_calls``'s graph (about)
FIXED_COST_ROUNDS = 3  # the fixed costs' probes, each on every rank (``FixedCostProbe``)


Rings = Sequence[Sequence[int]]  # the job's ranks split into rings of one level, alike


def one_ring(world_size: int) -> Rings:
    """One node: every rank on one ring."""
    return [range(world_size)]


def node_rings(world_size: int, ranks_per_node: int) -> tuple[Rings, Rings]:
    """(each node's ranks, the ranks of one local rank on every node): the rings inside
    the nodes and across them, as torchrun numbers the ranks."""
    nodes = world_size // ranks_per_node
    inside = [range(k * ranks_per_node, (k + 1) * ranks_per_node) for k in range(nodes)]
    across = [range(local, world_size, ranks_per_node) for local in range(ranks_per_node)]
    return inside, across


def _mine(rank: int, rings: Rings) -> list[int]:
    return next(list(ring) for ring in rings if rank in ring)


def _peers(rank: int, rings: Rings) -> tuple[int, int]:
    """The next and the previous rank on this rank's ring."""
    ring = _mine(rank, rings)
    at = ring.index(rank)
    return ring[(at + 1) % len(ring)], ring[(at - 1) % len(ring)]


def measure(rank: int, world_size: int, reps: int, rings: Rings | None = None) -> Measurements:
    """Run on every rank of the default group (a ``RankPool`` job, or a launched one);
    the link, the collectives and the site on ``rings`` (default: one ring of all), every
    ring at once."""
    rings = rings or one_ring(world_size)
    torch.manual_seed(rank)
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    op_calls, ops = _op_calls()
    classes = [(rate_class(dtype, grouped), dtype, grouped) for dtype, grouped in RATE_CLASSES]
    calls: dict[tuple[Any, ...], tuple[Callable[[], object], int]] = {
        ("add",): (functools.partial(torch.add, x, y), reps),
        ("ops",): (op_calls, reps * SMALL_CALL_REPS),
        **{(None, s): (_matmul_call(*s), reps) for s in (*MATMUL_SHAPES, *SKINNY_SHAPES)},
        **{(c, s): (_matmul_call(*s, d, g), reps) for c, d, g in classes for s in MATMUL_SHAPES},
    }
    t = call_times.in_rounds(calls)
    matmul = [(2.0 * m * k * n, t[None, (m, k, n)]) for m, k, n in MATMUL_SHAPES]
    skinny = [(2.0 * m * k * n, 4.0 * k * n, t[None, (m, k, n)]) for m, k, n in SKINNY_SHAPES]
    rated = {
        c: [(2.0 * m * k * n, t[c, (m, k, n)]) for m, k, n in MATMUL_SHAPES] for c, _, _ in classes
    }
    message = link_points(rank, rings, reps)
    curves, group = collective_curves(rank, rings, reps)
    return Measurements(
        matmul,
        skinny,
        message,
        3 * x.numel() * 4 / t[("add",)],
        curves,
        probe_fixed_costs(rank, rings, group, reps),
        rated,
        t[("ops",)] / ops,
        probe_sliced(rank, rings, group, reps, _sliced_shape(rank, rings, matmul, curves)),
    )


def _op_calls() -> tuple[Callable[[], object], int]:
    """A traced graph of about ``OP_CALLS`` ops on a few rows (an index, a cast, an add,
    a concatenation, as a dropless MoE's routing runs them), and its op calls: its time
    per call is one op's call in a traced graph (``Profile.op_call_s``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def ops(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        for _ in range(OP_CALLS // 4):
            x = torch.cat([x[order].to(torch.float64).add(1).to(torch.float32)[:1], x[1:]])
        return x

    x, order = torch.randn(16, 8), torch.randperm(16)
    gm = make_fx(ops)(x, order)
    calls = sum(1 for node in gm.graph.nodes if node.op == "call_function")
    return functools.partial(gm, x, order), calls


def _matmul_call(
    m: int, k: int, n: int, dtype: torch.dtype = torch.float32, grouped: bool = False
) -> Callable[[], torch.Tensor]:
    """One x @ w call of ``linear_operands`` (``grouped``: two groups of m/2 rows, as an
    MoE's ``_grouped_mm`` runs two experts)."""
    x, w = linear_operands(m, k, n, dtype, 2 if grouped else 0)
    if grouped:
        offs = torch.tensor([m // 2, m], dtype=torch.int32)
        return functools.partial(torch._grouped_mm, x, w, offs=offs)
    return functools.partial(torch.mm, x, w)


def probe_fixed_costs(
    rank: int, rings: Rings, group: str, reps: int, one_at_a_time: bool = False
) -> FixedCostProbe:
    """The step site (every ring at once, or ``one_at_a_time``) and the slowdown (every
    ring at once) on ``rings`` (``group``: this rank's), each the median over
    ``FIXED_COST_ROUNDS`` rounds on every rank of the job."""
    rounds = []
    n = len(_mine(rank, rings))
    made = dist.distributed_c10d._resolve_process_group(group)  # type: ignore[arg-type]
    turns = [rank in ring for ring in rings] if one_at_a_time else [True]
    calls = _reps(4 * STEP_SITE[0] * STEP_SITE[1], reps)
    for _ in range(FIXED_COST_ROUNDS):
        ring, collective = step_site_times(n, group, calls, turns)
        small = [_collective_s(c, CURVE_BLOCK_BYTES[0], n, made, reps) for c in COLLECTIVES]
        rounds.append([ring, collective, _overlap_slowdown(rank, rings, reps), *small])
    ring, collective, slowdown, *small = call_times.median_over_ranks(rounds)
    return FixedCostProbe(ring, collective, slowdown, tuple(small))


def probe_sliced(
    rank: int, rings: Rings, group: str, reps: int, shape: tuple[int, int, int]
) -> SlicedProbe:
    """The sliced site of ``shape`` and its matmul alone, and a collective's start, on
    ``rings`` (``group``: this rank's), every ring at once, each the median over
    ``FIXED_COST_ROUNDS`` rounds on every rank of the job."""
    rounds = []
    n = len(_mine(rank, rings))
    made = dist.distributed_c10d._resolve_process_group(group)  # type: ignore[arg-type]
    calls = _reps(4 * shape[0] * shape[1], reps)
    for _ in range(FIXED_COST_ROUNDS):
        site, matmul = sliced_site_times(n, group, shape, calls)
        rounds.append([site, matmul, issue_s(made, n, _reps(CURVE_BLOCK_BYTES[0], reps))])
    return SlicedProbe(shape, *call_times.median_over_ranks(rounds))


def _sliced_shape(
    rank: int,
    rings: Rings,
    matmul: list[tuple[float, float]],
    curves: dict[str, dict[int, list[tuple[float, float]]]],
) -> tuple[int, int, int]:
    """``sliced_site_shape`` on rank 0's measurements, for every rank (they run one site)."""
    n = len(_mine(rank, rings))
    latency, s_per_flop = fit_line(matmul)
    gather = fitted_curve(curves["all_gather"][n])
    shape = torch.tensor(sliced_site_shape(gather, latency, 1 / s_per_flop, n))
    dist.broadcast(shape, 0)
    rows, k, cols = shape.tolist()
    return rows, k, cols


def link_points(rank: int, rings: Rings, reps: int) -> list[tuple[float, float]]:
    """(bytes, seconds) of ring exchanges on ``rings``, every ring at once."""
    peers = _peers(rank, rings)
    return [(float(size), _one_way(peers, size, reps)) for size in MESSAGE_BYTES]


def collective_curves(
    rank: int, rings: Rings, reps: int, smallest: int = 2
) -> tuple[dict[str, dict[int, list[tuple[float, float]]]], str]:
    """The backend's collectives (``COLLECTIVES``), timed by block size on the groups of
    the first g ranks of every ring at once, for every g from ``smallest`` to the ring's
    size (the others wait); and the group name of this rank's whole ring. Each point's
    calls are spread over ``CURVE_ROUNDS`` rounds of every point, its time their median
    (each call's at its slowest rank, ``_collective_times``)."""
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {k: {} for k in COLLECTIVES}
    mine = _mine(rank, rings)
    whole = dist.group.WORLD
    for g in range(smallest, len(mine) + 1):
        for ring in rings:  # every rank makes every group, in one order
            members = list(ring)[:g]
            made = whole if len(members) == dist.get_world_size() else dist.new_group(members)
            if rank in members:
                group = made
        timed_on = group if rank in mine[:g] else None  # the others only wait
        times = call_times.rounds(
            {
                (c, nbytes): (
                    functools.partial(_timed_or_wait, c, nbytes, g, timed_on),
                    _reps(nbytes, reps),
                )
                for c in COLLECTIVES
                for nbytes in CURVE_BLOCK_BYTES
            }
        )
        if timed_on is not None:
            for collective, by_size in curves.items():
                by_size[g] = [
                    (float(nbytes), statistics.median(times[collective, nbytes]))
                    for nbytes in CURVE_BLOCK_BYTES
                ]
    return curves, group.group_name  # type: ignore[union-attr]


def _timed_or_wait(
    collective: str, nbytes: int, g: int, group: Any, calls: int, warm_up: bool
) -> list[float]:
    """``_collective_times`` on ``group`` (None: a rank outside it, which new_group gave no
    group: it only waits), then every rank of the job meets."""
    seconds = (
        [] if group is None else _collective_times(collective, nbytes, g, group, calls, warm_up)
    )
    dist.barrier()
    return seconds


def _collective_s(collective: str, block_bytes: int, g: int, group: Any, reps: int) -> float:
    """One call's median time, over ``_reps`` calls of ``_collective_times``."""
    calls = _reps(block_bytes, reps)
    return statistics.median(_collective_times(collective, block_bytes, g, group, calls))


def _collective_times(
    collective: str, block_bytes: int, g: int, group: Any, calls: int, warm_up: bool = True
) -> list[float]:
    """``calls`` timed calls of one all-gather of ``block_bytes`` blocks (or the
    reduce-scatter down to them, the all-to-all of one such block to each rank, the
    all-reduce of g of them) on ``group`` of ``g`` ranks, as the functional collectives
    run it; each call's time its slowest rank's (``call_times.slowest_rank``), on every
    rank of ``group``: the curves' points and the small calls beside the step site alike
    (4 KiB calls on 2 ranks at 400 Mbit/s: the slowest rank's median 0-26 % over rank
    0's own, in five rounds of each collective)."""
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
    seconds = call_times.times(lambda: c10d.wait_tensor(call()), calls, warm_up)
    return call_times.slowest_rank(seconds, group)


def _overlap_slowdown(rank: int, rings: Rings, reps: int) -> float:
    """How much slower a matmul runs while a ring exchange is in flight, from the core
    time the exchange takes: ``OVERLAP_MATMULS`` matmuls back to back on every rank at
    once, with an exchange of about half their span started just before them and
    without, the two alternating; the exchange's share of the core it runs beside is
    (their time with it - without) / its time alone, and a matmul beside it runs at
    1 - that share. A span of matmuls, not each one's time: the exchange takes its core
    time in bursts, and the median matmul under it read 0.10 on the bench's 1 Gbit/s
    link where its cells lost 3 ms of matmul per MiB moved (0.38 of the transfer's
    time), at every rate. Both sides share the cores alike: on 2 nodes x 2 ranks
    sharing 2 cores, a matmul timed alone on one rank while its peers waited took half
    what every rank at once took (their compute, already in the matmul rate)."""
    m, k, n = OVERLAP_MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    alone = call_times.median(functools.partial(torch.mm, a, b), reps)  # sizes the exchange
    peers = _peers(rank, rings)
    probe = _one_way(peers, OVERLAP_MESSAGE_BYTES, reps)
    wanted = torch.tensor([OVERLAP_MESSAGE_BYTES * OVERLAP_MATMULS * alone / probe / 2])
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # every rank sends the same size
    nbytes = int(min(max(MIN_OVERLAP_MESSAGE_BYTES, wanted.item()), MAX_OVERLAP_MESSAGE_BYTES))
    nbytes -= nbytes % 4
    exchange_s = _one_way(peers, nbytes, reps)
    send, recv = torch.empty(nbytes // 4), torch.empty(nbytes // 4)

    def matmuls_s() -> float:
        began = time.perf_counter()
        for _ in range(OVERLAP_MATMULS):
            torch.mm(a, b)
        return time.perf_counter() - began

    quiet: list[float] = []
    under: list[float] = []
    for _ in range(reps):
        dist.barrier()
        quiet.append(matmuls_s())
        dist.barrier()
        ops = [dist.P2POp(dist.irecv, recv, peers[1]), dist.P2POp(dist.isend, send, peers[0])]
        works = dist.batch_isend_irecv(ops)
        under.append(matmuls_s())
        for work in works:
            work.wait()
    return slowdown_of((statistics.median(under) - statistics.median(quiet)) / exchange_s)


def _reps(nbytes: int, reps: int) -> int:
    return reps * SMALL_CALL_REPS if nbytes < SMALL_CALL_BYTES else reps


def _one_way(peers: tuple[int, int], nbytes: int, reps: int) -> float:
    """One ring exchange of ``nbytes``: every rank sends to the next and receives from
    the previous (``peers``) at once, as a ring step does (the batch's time = one message),
    each exchange at its slowest rank (every rank of the job calls this at once). A ring
    step is done when its last rank is, and ranks sharing a NIC do not finish together:
    on 2 nodes x 2 ranks rank 0's own median read the NIC at 1158 Mbit/s behind a 1000
    Mbit/s bucket (317 behind 250), which priced rings across the nodes 1.27x too cheap
    at a cell's 195 Mbit/s, and ``auto`` took an MoE layer's ring that ran 5 % slower
    than its all-to-alls."""
    send, recv = torch.empty(nbytes // 4), torch.empty(nbytes // 4)

    def exchange() -> None:
        # receive first, as commfuse::p2p does (see there why)
        ops = [dist.P2POp(dist.irecv, recv, peers[1]), dist.P2POp(dist.isend, send, peers[0])]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    dist.barrier()
    seconds = call_times.times(exchange, _reps(nbytes, reps))
    return statistics.median(call_times.slowest_rank(seconds, dist.group.WORLD))


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


class CalibrationError(RuntimeError):
    """A launched job whose ranks cannot be calibrated by level."""


def run_launched(out: str, reps: int, ranks_per_nic: int | None = None) -> Profile | None:
    """Calibrate on the ranks of a torchrun job of ``LOCAL_WORLD_SIZE`` ranks per node
    (``measure_levels``); rank 0 writes the profile to ``out`` and returns it."""
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        per_node = topology.from_launcher().ranks_per_node or world_size
        profile = measure_levels(rank, world_size, reps, per_node, ranks_per_nic)
        if profile is not None:
            from ..cost.profiles import save

            save(profile, out)
        return profile
    finally:
        dist.destroy_process_group()


def measure_levels(
    rank: int, world_size: int, reps: int, per_node: int, ranks_per_nic: int | None = None
) -> Profile | None:
    """On every rank of a job of ``per_node`` ranks per node, numbered node by node (its
    default group up): the link inside a node on each node's ranks, the NIC between nodes
    on the ranks of each local rank across them (every node's ranks sending at once, as a
    data-parallel group's copies do), the collectives across nodes on those and on groups
    of several ranks per node; ``ranks_per_nic``: how many of a node's ranks share
    one NIC (None: all of them). Rank 0 returns one profile with both levels."""
    if per_node < 2 or world_size % per_node:
        raise CalibrationError(
            f"{world_size} ranks of {per_node} per node: calibrate needs 2 or more "
            "ranks per node, the same on every node"
        )
    inside, across = node_rings(world_size, per_node)
    m = measure(rank, world_size, reps, inside)
    nodes = world_size // per_node
    if nodes > 1:
        link = link_points(rank, across, reps)
        curves, group = collective_curves(rank, across, reps)
        # the step site one ring at a time: with every local rank's ring at once their
        # messages share the NIC unevenly, and the model's even share over-prices them
        # (on 2 nodes x 2 ranks, a 512 KiB step took 10.4-11.2 ms, predicted 12.6): what
        # the site lacks then shrinks with its bytes and goes negative. Alone, a step's
        # bytes are the NIC's, and what it lacks is its fixed cost (0.37-0.44 ms on the
        # 8-row site, 0.5-0.9 ms with every ring at once, in two runs each)
        fixed = probe_fixed_costs(rank, across, group, reps, one_at_a_time=True)
        # groups of several ranks per node that span nodes (TP across nodes): the job's
        # first g ranks, node by node, for every g beyond one node (where a size is
        # measured both ways, one rank per node is kept)
        spanning, _ = collective_curves(rank, one_ring(world_size), reps, per_node + 1)
        for collective, by_size in spanning.items():
            for g, points in by_size.items():
                curves[collective].setdefault(g, points)
    dist.barrier()
    if rank != 0:
        return None
    source = (
        f"measured by `commfuse calibrate` on {nodes} node(s) of {per_node} gloo ranks "
        f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {reps} reps)"
    )
    profile = profile_from(m, per_node, f"calibrated-gloo-{nodes}x{per_node}", source)
    if nodes > 1:
        # every rank of a node sent at once: a NIC carried its sharers' messages
        sharing = min(ranks_per_nic or per_node, per_node)
        alpha, s_per_byte = fit_line(link)
        nic = Level(alpha, sharing / s_per_byte, True, ranks_per_nic or per_node)
        nic = dataclasses.replace(
            nic, collectives=fitted_curves(with_small_calls(curves, fixed, nodes))
        )
        profile = dataclasses.replace(profile, across_nodes=nic, ranks_per_node=per_node)
        # the ring of one local rank across the nodes, alone on its NIC
        crossing = dataclasses.replace(profile.across(1), overlap_slowdown=fixed.overlap_slowdown)
        alpha, step = step_costs(fixed, nodes, crossing)
        nic = dataclasses.replace(
            nic, alpha_s=alpha, step_overhead_s=step, overlap_slowdown=fixed.overlap_slowdown
        )
        profile = dataclasses.replace(profile, across_nodes=nic)
    return profile
