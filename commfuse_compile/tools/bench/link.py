"""``commfuse bench``'s link: the rate each cell runs at, and the cost model's profile of it.

A cell's link rate is chosen from the measured matmul time so that the collective alone
takes ``ratio`` times the matmul alone. ``auto`` gets the profile a user would calibrate
on this link: ``commfuse calibrate``'s measurement run on the benchmark's ranks at a
reference rate and unthrottled, its per-byte costs scaled to each cell's rate.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...cost.profiles import Curve
from ...cost.timeline import core_share, slowdown_of
from . import figures
from .cells import site_alone
from .config import Progress, SiteShape

REFERENCE_RATE = 1e9  # bit/s of the link while calibrating the profile ``auto`` uses
RATE_TOLERANCE = 0.08  # accept a link rate whose comm-alone time is this close to target
MAX_RATE_TRIES = 5  # the first one measures the matmul unthrottled
# Past this the link is as good as unthrottled (a veth here carries ~20 Gbit/s); a cell
# whose collective is all fixed cost asks for more, and tc refuses a tbf whose 1 ms burst
# passes 4 GiB (one run asked for 97 Tbit/s)
MAX_RATE_BITS = 400e9


def calibrate_link(rank: int, n: int, reps: int) -> Any:
    """Job: ``commfuse calibrate``'s measurement, on this (throttled) link."""
    from ..calibrate import measure

    return measure(rank, n, reps)


@dataclasses.dataclass(frozen=True)
class LinkProfiles:
    """``commfuse calibrate``'s measurement at the reference rate and unthrottled, so that
    each cell's rate gets its own profile: a time on the link at a rate is the larger of
    the machine's own (unthrottled) and the reference's scaled by the rate (a
    collective's call cost, its smallest block's time, not scaled), not their sum. gloo
    overlaps its own work with the wire: the all-reduce of 2 MiB took 3.83 ms at 4,595
    Mbit/s, its time unthrottled (3.82), where the sum said 6.94. Over the collectives
    alone of a full run's 30 dense and all-to-all cells (414 to 4,595 Mbit/s), the larger
    was off by a median 2 % (at most 25 %), the sum by 6 % (at most 81 %; the record's
    run: 5 and 9 %); the P2P exchanges alone, whose own part is small, by 2-5 % either
    way."""

    reference: Any  # Profile at REFERENCE_RATE
    free: Any  # Profile without the tbf

    def at(self, rate: float) -> Any:
        """The profile of the link at ``rate``; a profile by level (a job of several
        nodes): only its link across nodes, the one behind the token bucket (the ranks of
        a node talk over the node's own address, at memory speed)."""
        if not math.isfinite(rate):
            return self.free

        def at_rate(reference_s: float, free_s: float, call_s: float = 0.0) -> float:
            return max(free_s, call_s + (reference_s - call_s) * REFERENCE_RATE / rate)

        def curves(reference: Any, free: Any) -> dict[str, dict[int, Curve]]:
            return {
                kind: {
                    n: _scaled(c, free[kind][n], at_rate)
                    for n, c in by_n.items()
                    if n in free.get(kind, {})
                }
                for kind, by_n in reference.items()
            }

        ref, free = self.reference, self.free
        named = dataclasses.replace(
            ref,
            name=f"bench link {rate / 1e6:.0f} Mbit/s",
            source=ref.source + f"; per-byte costs scaled to {rate / 1e6:.0f} Mbit/s from "
            f"{REFERENCE_RATE / 1e6:.0f} Mbit/s, never below unthrottled",
        )
        nic, free_nic = ref.across_nodes, free.across_nodes
        if nic is not None and free_nic is not None:
            nic_rate = 1 / at_rate(1 / nic.bytes_per_s, 1 / free_nic.bytes_per_s)
            return dataclasses.replace(
                named,
                across_nodes=dataclasses.replace(
                    nic,
                    bytes_per_s=nic_rate,
                    collectives=curves(nic.collectives, free_nic.collectives),
                    overlap_slowdown=nic.overlap_slowdown
                    if nic.overlap_slowdown is None
                    else slowdown_at(nic.overlap_slowdown, nic_rate / nic.bytes_per_s),
                ),
            )
        link_rate = 1 / at_rate(1 / ref.link_bytes_per_s, 1 / free.link_bytes_per_s)
        return dataclasses.replace(
            named,
            link_bytes_per_s=link_rate,
            collectives=curves(ref.collectives, free.collectives),
            overlap_slowdown=slowdown_at(ref.overlap_slowdown, link_rate / ref.link_bytes_per_s),
        )

    def file(self, rate: float, path: Path) -> str:
        from ...cost.profiles import save

        path.parent.mkdir(parents=True, exist_ok=True)
        save(self.at(rate), path)
        return str(path)


def slowdown_at(slowdown: float, rate_ratio: float) -> float:
    """``Profile.overlap_slowdown`` measured on a link, on one ``rate_ratio`` times as
    fast: a transfer takes the same core time per byte at any rate (the full preset's
    cells lost about 3 ms of matmul per MiB moved from 445 to 3,439 Mbit/s), so its share
    of the core it runs beside scales with its bytes per second (``timeline.core_share``,
    capped)."""
    return slowdown_of(core_share(slowdown) * rate_ratio)


def _scaled(reference: Curve, free: Curve, at_rate: Callable[..., float]) -> Curve:
    """``reference``'s curve at another rate: each measured point (against the
    unthrottled one's at the same block size, its smallest point's time the call's cost)
    and the fitted per-byte cost, by ``at_rate``; the fitted fixed cost stays."""
    call_s = reference.points[0][1] if reference.points else 0.0
    points = tuple(
        (x, at_rate(reference_s, free_s, call_s))
        for (x, reference_s), (_, free_s) in zip(reference.points, free.points, strict=True)
    )
    spb = at_rate(reference.seconds_per_byte, free.seconds_per_byte)
    return Curve(reference.latency_s, spb, points)


def choose_rate(
    network: Any, ranks: Any, kind: str, shape: SiteShape, ratio: float, reps: int
) -> tuple[float, list[dict[str, float]]]:
    """A link rate under which the collective alone takes ``ratio`` times the matmul
    alone: start from the bytes sent, then correct by measured times (fixed costs make
    the collective slower than bytes / rate; the matmul time is re-measured each try)."""
    rate, tries = None, []
    for _ in range(MAX_RATE_TRIES):
        network.set_rate(rate)
        per_rank = ranks.run(site_alone, kind, shape, reps)
        times = figures.slowest([r["times"] for r in per_rank])
        matmul, comm = statistics.median(times["matmul"]), statistics.median(times["comm"])
        tries.append({"rate_bits_per_s": rate or math.inf, "matmul_s": matmul, "comm_s": comm})
        target = ratio * matmul
        if rate is None:  # unthrottled: the first guess from the bytes alone
            rate = min(8 * per_rank[0]["sent_bytes"] / target, MAX_RATE_BITS)
            continue
        if abs(comm / target - 1) <= RATE_TOLERANCE:
            break
        rate = min(rate * comm / target, MAX_RATE_BITS)
    assert rate is not None
    network.set_rate(rate)
    return rate, tries


def calibrated(
    network: Any,
    ranks: Any,
    description: str,
    reps: int,
    progress: Progress,
    per_node: int | None = None,
) -> LinkProfiles:
    """``commfuse calibrate``'s measurement on these ranks, at the reference rate and
    unthrottled; ``per_node``: the ranks of a job of nodes of that many, measured by level
    (``calibrate.measure_levels``, as under a multi-node launch)."""
    from ..calibrate import measure_levels
    from ..profile_fit import profile_from

    progress.stage(
        f"calibrating the cost model's profile on {ranks.world_size} ranks"
        + (f" by level ({per_node} per node)" if per_node else "")
        + f" at {REFERENCE_RATE / 1e6:.0f} Mbit/s and unthrottled"
    )
    calibrated = []
    for rate in (REFERENCE_RATE, None):
        network.set_rate(rate)
        where = f"{rate / 1e6:.0f} Mbit/s" if rate else "unthrottled"
        source = (
            f"`commfuse calibrate` measurement inside the benchmark's namespaces "
            f"({description}) at {where}"
        )
        if per_node:
            levels = ranks.run(measure_levels, reps, per_node)[0]
            calibrated.append(dataclasses.replace(levels, name="bench link", source=source))
            continue
        measured = ranks.run(calibrate_link, reps)[0]
        calibrated.append(profile_from(measured, ranks.world_size, "bench link", source))
    return LinkProfiles(*calibrated)
