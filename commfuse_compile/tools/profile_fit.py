"""From ``commfuse calibrate``'s measurements to a profile: what was measured
(``Measurements``, ``FixedCostProbe``), the fits (Theil-Sen lines, the skinny matmuls'
weight rate, the fixed costs a step site shows beyond the simulation, a collective's
stall that a sliced site shows beyond it), and the small collectives taken from the step
site's rounds. Pure functions: no process group."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence

from ..cost.profile_checks import COLLECTIVES
from ..cost.profiles import CURVE_BLOCK_BYTES, Curve, MatmulRate, Profile, at_compute_speed
from ..cost.simulator import Work, matmuls_s, simulate
from ..schedules import Direction

# Shard rows, K, N of the site that measures the fixed costs: a decode step's matmul. A
# ring's P2P wait costs more while a real matmul runs beside it than on a bare site (2
# gloo ranks on the CI machine: 0.26 ms per step on a 2x8x8 site, 0.6-0.9 ms on 2, 8 and
# 32 rows of a 1024x1024 weight), and it is inside programs that the model prices it.
STEP_SITE = (8, 1024, 1024)
# The site whose sliced form (in ``SLICED_SITE_CHUNKS`` chunks) shows a collective's stall
# under matmuls (``Profile.collective_stall_s``): a shard of ``SLICED_SITE_ROWS`` rows, K
# and N chosen on the machine (``sliced_site_shape``).
SLICED_SITE_ROWS = 256
SLICED_SITE_CHUNKS = 2
SLICED_SITE_COMM_S = 8e-3  # a chunk's all-gather about this long, where the K allowed reach
SLICED_SITE_K = (1024, 2048, 4096, 8192, 16384)


@dataclasses.dataclass(frozen=True)
class FixedCostProbe:
    """What a level's fixed costs are read from, measured on every ring of the level at
    once, each the median over the job's ranks. One rank's own view is noise where ranks
    share cores: on 2 nodes x 2 ranks on this project's 2-core CI machine, rank 0's
    slowdown came out 0 to 3.9 and its step site's excess 0.8 to 3.2 ms, run to run."""

    ring_site_s: float  # ``STEP_SITE``'s all-gather -> matmul, rewritten as a ring
    collective_site_s: float  # the same site with its collective
    overlap_slowdown: float  # matmul under a transfer / matmul alone - 1
    # each of ``COLLECTIVES`` at the smallest curve block on the whole ring, timed in the
    # same rounds as the step site (``with_small_calls``); empty: not probed
    small_calls_s: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class SlicedProbe:
    """What ``Profile.collective_issue_s`` and ``collective_stall_s`` are read from, each
    the median over the job's ranks and rounds: the sliced site as ``slicing`` lowers it
    and the site's matmul alone, timed interleaved (the site is priced at the compute
    speed its matmul ran at: the CI machine's drifts by 1.5x within seconds), and the
    compute thread's time to start one all-gather (its call, before its wait)."""

    shape: tuple[int, int, int]  # rows, K, N (``sliced_site_shape``)
    site_s: float
    matmul_s: float
    issue_s: float


@dataclasses.dataclass(frozen=True)
class Measurements:
    matmul: list[tuple[float, float]]  # (FLOPs, seconds)
    skinny: list[tuple[float, float, float]]  # (FLOPs, bytes of B, seconds)
    message: list[tuple[float, float]]  # (bytes, seconds one way)
    add_bytes_per_s: float
    # collective -> group size -> [(block bytes, seconds)] of the backend's own collective
    collectives: dict[str, dict[int, list[tuple[float, float]]]]
    fixed: FixedCostProbe
    # (FLOPs, seconds) of the other matmul classes (``Profile.matmul_rates``), by class
    rated: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    op_call_s: float = 0.0  # one op's call in a traced graph (``Profile.op_call_s``)
    sliced: SlicedProbe | None = None  # None: not probed (the collective's stall is 0)


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


def fitted_curve(points: Sequence[tuple[float, float]]) -> Curve:
    """A collective's measured (block bytes, seconds) points, and the line fitted on them."""
    return Curve(*fit_line(points), tuple(points))


def fitted_curves(
    measured: dict[str, dict[int, list[tuple[float, float]]]],
) -> dict[str, dict[int, Curve]]:
    return {
        name: {size: fitted_curve(points) for size, points in by_n.items()}
        for name, by_n in measured.items()
    }


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
        overlap_slowdown=m.fixed.overlap_slowdown,
        matmul_bytes_per_s=_weight_rate(m.skinny, matmul_latency, s_per_flop),
        collectives=fitted_curves(with_small_calls(m.collectives, m.fixed, n)),
        op_call_s=m.op_call_s,
        matmul_rates={rate_class: _rate(points) for rate_class, points in m.rated.items()},
    )
    # The fixed costs are what the simulation of the step site lacks without them: the
    # collective pays its overhead once (the call overhead of the ring formula, used for
    # group sizes without a curve).
    formula = dataclasses.replace(measured, collectives={})
    site = gather_site_work(STEP_SITE, n)
    collective = m.fixed.collective_site_s - simulate(site, "collective", formula).end_s
    alpha, step = step_costs(m.fixed, n, measured)
    fitted = dataclasses.replace(
        measured,
        link_alpha_s=alpha,
        step_overhead_s=step,
        collective_overhead_s=max(collective, 0.0),
    )
    # ... and, where the site's all-gather has its curve, what the site as the model
    # prices it (the curve's call, timed back to back, then the matmul) lacks: the cost
    # of a measured collective between computations
    if fitted.curve(site.direction.collective, n) is not None:
        resume = m.fixed.collective_site_s - simulate(site, "collective", fitted).end_s
        fitted = dataclasses.replace(fitted, collective_resume_s=max(resume, 0.0))
    if m.sliced is None:
        return fitted
    return dataclasses.replace(
        fitted,
        collective_issue_s=m.sliced.issue_s,
        collective_stall_s=collective_stall_s(m.sliced, n, fitted),
    )


def collective_stall_s(probe: SlicedProbe, n: int, p: Profile) -> float:
    """What the simulation of ``probe``'s sliced site on ``p`` lacks (at the compute
    speed its matmul alone ran at, each collective's start paid), per chunk collective
    that ran under matmuls: how much later such a collective ends. At most the matmuls'
    time under it: the model stalls a collective no longer than that, so the site shows
    no more of a stall, and what it shows beyond is the machine's noise (three served
    runs' calibrations fitted 0.41, 7.0 and 14.4 ms, where the chunk matmuls are chosen
    at half of ``SLICED_SITE_COMM_S``, 4 ms; a prefill slicing row priced with the 7.0
    came out 41 % over its median)."""
    site = gather_site_work(probe.shape, n)
    at_speed = at_compute_speed(p, probe.matmul_s / matmuls_s(site, p))
    at_speed = dataclasses.replace(at_speed, collective_issue_s=probe.issue_s)

    def sliced_s(stall_s: float) -> float:
        stalled = dataclasses.replace(at_speed, collective_stall_s=stall_s)
        return simulate(site, "slicing", stalled, SLICED_SITE_CHUNKS).end_s

    without, held = sliced_s(0.0), sliced_s(math.inf)
    return (min(max(probe.site_s, without), held) - without) / (SLICED_SITE_CHUNKS - 1)


def sliced_site_shape(
    gather: Curve, matmul_latency_s: float, matmul_flops: float, n: int
) -> tuple[int, int, int]:
    """(rows, K, N) of the sliced site on n ranks, by the all-gather's ``gather`` curve
    and the matmul's fitted line: K (of ``SLICED_SITE_K``) for a chunk's all-gather of
    about ``SLICED_SITE_COMM_S``, and N for a chunk's matmuls of half that (at least 8
    columns). The collective outlasts matmuls that outlast its stall: under matmuls
    that outlast the collective the stall hides, and the site shows nothing of it."""
    rows = SLICED_SITE_ROWS // SLICED_SITE_CHUNKS  # of a chunk

    def chunk_comm_s(k: int) -> float:
        return gather.seconds(4.0 * rows * k)

    k = next((k for k in SLICED_SITE_K if chunk_comm_s(k) >= SLICED_SITE_COMM_S), SLICED_SITE_K[-1])
    cols = (chunk_comm_s(k) / 2 - matmul_latency_s) * matmul_flops / (2.0 * n * rows * k)
    return SLICED_SITE_ROWS, k, max(8, int(cols))


def step_costs(probe: FixedCostProbe, n: int, link: Profile) -> tuple[float, float]:
    """(message latency, step overhead) of ``link``: a step of ``probe``'s ring site on
    ``n`` ranks pays both. What the simulation without a step overhead lacks, over its
    n-1 steps, is the step overhead; where it has too much, the latency fitted from the
    ring exchanges is the one too high (a fit of five sizes: on 2 nodes x 2 ranks sharing
    2 cores, 0 to 2.8 ms inside a node, run to run) and gives the excess back."""
    site = gather_site_work(STEP_SITE, n)
    link = dataclasses.replace(link, step_overhead_s=0.0)
    lacks = (probe.ring_site_s - simulate(site, "ring", link).end_s) / (n - 1)
    return max(link.link_alpha_s + min(lacks, 0.0), 0.0), max(lacks, 0.0)


def gather_site_work(shape: tuple[int, int, int], n: int) -> Work:
    """A float32 shard of ``shape`` (rows, K, N) all-gathered into a matmul on n ranks
    (``STEP_SITE``, ``sliced_site_shape``), as the cost model sees it (its n blocks' products
    concatenated)."""
    rows, k, cols = shape
    return Work(
        Direction.GATHER, n, 2.0 * rows * k * cols, 4.0 * rows * k, whole_bytes=4.0 * k * cols,
        product_bytes=4.0 * n * rows * cols,
    )  # fmt: skip


def _rate(points: Sequence[tuple[float, float]]) -> MatmulRate:
    """A matmul class's rate from its (FLOPs, seconds) points: the fitted line."""
    latency, s_per_flop = fit_line(points)
    return MatmulRate(latency, 1 / s_per_flop)


def _weight_rate(
    skinny: Sequence[tuple[float, float, float]], latency: float, s_per_flop: float
) -> float:
    """How fast the skinny matmuls read their weight: the median of (weight bytes / what
    their time has beyond the fitted line); 0 (not modelled) where the line accounts for
    them (within 5 %: a GPU's launch cost hides the read)."""
    rates = [
        nbytes / beyond
        for flops, nbytes, seconds in skinny
        if (beyond := seconds - latency - flops * s_per_flop) > 0.05 * seconds
    ]
    return statistics.median(rates) if len(rates) > len(skinny) // 2 else 0.0


def with_small_calls(
    curves: dict[str, dict[int, list[tuple[float, float]]]], probe: FixedCostProbe, n: int
) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """``curves`` with each collective's smallest block on ``n`` ranks as ``probe`` timed
    it, beside the step site: a decode step's all-reduce against a ring's P2P steps is
    decided on these two, and measured minutes apart they saw different machines (a
    calibration in a slow spell had the 4 KiB all-reduce at 3.14 ms, 7x its usual, while
    its step site ran fast: ``auto`` split every decode step and ran it 1.55x slower)."""
    if not probe.small_calls_s:
        return curves
    out = {c: dict(by_n) for c, by_n in curves.items()}
    for collective, seconds in zip(COLLECTIVES, probe.small_calls_s, strict=True):
        points = out.get(collective, {}).get(n)
        if points:
            out[collective][n] = [
                (x, seconds if x == CURVE_BLOCK_BYTES[0] else y) for x, y in points
            ]
    return out
