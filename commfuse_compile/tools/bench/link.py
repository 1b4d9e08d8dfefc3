"""``commfuse bench``'s link: the rate each cell runs at, and the cost model's profile of it.

A cell's link rate is chosen from the measured matmul time so that the collective alone
takes ``ratio`` times the matmul alone. ``auto`` gets the profile a user would calibrate
on this link: ``commfuse calibrate``'s measurement run on the benchmark's ranks at two
reference rates and unthrottled, its link times taken to each cell's rate.
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
from .config import LOW_RATE, REFERENCE_RATE, Progress, SiteShape

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
    """``commfuse calibrate``'s measurement at the two reference rates and unthrottled,
    so that each cell's rate gets its own profile: a time on the link is affine in
    1 / rate through its times at the two rates (the wire's part scales with the rate, a
    call's own cost does not), and never below the machine's own (unthrottled), not the
    sum of the two. gloo overlaps its own work with the wire: the all-reduce of 2 MiB
    took 3.83 ms at 4,595 Mbit/s, its time unthrottled (3.82), where the sum said 6.94.
    Scaled from one rate with a call's cost (its smallest block's time) fixed, two
    256 KiB all-to-alls came out 15.2 ms at 308 Mbit/s against 19.5 measured."""

    reference: Any  # Profile at REFERENCE_RATE
    low: Any  # Profile at LOW_RATE
    free: Any  # Profile without the tbf

    def at(self, rate: float) -> Any:
        """The profile of the link at ``rate``; a profile by level (a job of several
        nodes): only its link across nodes, the one behind the token bucket (the ranks of
        a node talk over the node's own address, at memory speed)."""
        if not math.isfinite(rate):
            return self.free
        toward_low = (1 / rate - 1 / REFERENCE_RATE) / (1 / LOW_RATE - 1 / REFERENCE_RATE)

        def at_rate(reference_s: float, low_s: float, free_s: float) -> float:
            return max(free_s, reference_s + (low_s - reference_s) * toward_low)

        def curves(
            reference: dict[str, dict[int, Curve]],
            low: dict[str, dict[int, Curve]],
            free: dict[str, dict[int, Curve]],
        ) -> dict[str, dict[int, Curve]]:
            return {
                kind: {
                    n: _scaled(c, low[kind][n], free[kind][n], at_rate)
                    for n, c in by_n.items()
                    if n in low.get(kind, {}) and n in free.get(kind, {})
                }
                for kind, by_n in reference.items()
            }

        ref, low, free = self.reference, self.low, self.free
        named = dataclasses.replace(
            ref,
            name=f"bench link {rate / 1e6:.0f} Mbit/s",
            source=ref.source + f"; link times taken to {rate / 1e6:.0f} Mbit/s from "
            f"{REFERENCE_RATE / 1e6:.0f} and {LOW_RATE / 1e6:.0f} Mbit/s, never below "
            "unthrottled",
        )
        nics = (ref.across_nodes, low.across_nodes, free.across_nodes)
        if None not in nics:
            nic = nics[0]
            nic_rate = 1 / at_rate(*(1 / level.bytes_per_s for level in nics))
            return dataclasses.replace(
                named,
                across_nodes=dataclasses.replace(
                    nic,
                    bytes_per_s=nic_rate,
                    collectives=curves(*(level.collectives for level in nics)),
                    overlap_slowdown=nic.overlap_slowdown
                    if nic.overlap_slowdown is None
                    else slowdown_at(nic.overlap_slowdown, nic_rate / nic.bytes_per_s),
                ),
            )
        link_rate = 1 / at_rate(*(1 / p.link_bytes_per_s for p in (ref, low, free)))
        return dataclasses.replace(
            named,
            link_bytes_per_s=link_rate,
            collectives=curves(ref.collectives, low.collectives, free.collectives),
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


def _scaled(
    reference: Curve, low: Curve, free: Curve, at_rate: Callable[[float, float, float], float]
) -> Curve:
    """``reference``'s curve at another rate: each measured point and the fitted per-byte
    cost by ``at_rate`` from the three measurements' (at the same block sizes); the
    fitted fixed cost stays."""
    points = tuple(
        (x, at_rate(reference_s, low_s, free_s))
        for (x, reference_s), (_, low_s), (_, free_s) in zip(
            reference.points, low.points, free.points, strict=True
        )
    )
    spb = at_rate(reference.seconds_per_byte, low.seconds_per_byte, free.seconds_per_byte)
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
    """``commfuse calibrate``'s measurement on these ranks, at the two reference rates and
    unthrottled; ``per_node``: the ranks of a job of nodes of that many, measured by level
    (``calibrate.measure_levels``, as under a multi-node launch)."""
    from ..calibrate import measure_levels
    from ..profile_fit import profile_from

    progress.stage(
        f"calibrating the cost model's profile on {ranks.world_size} ranks"
        + (f" by level ({per_node} per node)" if per_node else "")
        + f" at {REFERENCE_RATE / 1e6:.0f} and {LOW_RATE / 1e6:.0f} Mbit/s and unthrottled"
    )
    calibrated = []
    for rate in (REFERENCE_RATE, LOW_RATE, None):
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
