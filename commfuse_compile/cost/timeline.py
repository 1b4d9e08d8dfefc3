"""What the cost model returns: a site's events on every rank (``Timeline``), and how a
matmul stretches under a transfer in flight (``overlapped``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Event:
    rank: int
    lane: str  # "compute" | "comm"
    step: int
    name: str
    start_s: float
    end_s: float


@dataclasses.dataclass
class Timeline:
    schedule: str
    events: list[Event]

    @property
    def end_s(self) -> float:
        return max((e.end_s for e in self.events), default=0.0)

    def on_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def comm_calls(self, rank: int = 0) -> int:
        """The communication calls ``rank`` issues: a collective or a P2P batch each."""
        return sum(e.lane == "comm" for e in self.on_rank(rank))

    def exposed_comm_s(self, rank: int = 0) -> float:
        """Time on ``rank`` that is not spent computing."""
        busy = sum(e.end_s - e.start_s for e in self.on_rank(rank) if e.lane == "compute")
        return max((e.end_s for e in self.on_rank(rank)), default=0.0) - busy

    def as_json(self, rank: int) -> list[dict[str, object]]:
        """This rank's events in report.json's ``timeline`` format (microseconds)."""
        return [
            {
                "lane": e.lane,
                "step": e.step,
                "name": e.name,
                "start_us": round(e.start_s * 1e6, 3),
                "end_us": round(e.end_s * 1e6, 3),
            }
            for e in self.on_rank(rank)
        ]


# a transfer that takes the whole core beside it leaves a matmul no progress; the model
# keeps it finite (a slowdown of 19)
MAX_CORE_SHARE = 0.95


def core_share(slowdown: float) -> float:
    """The share of a core a transfer in flight takes from the matmul beside it, which
    then runs at 1 - that share (``Profile.overlap_slowdown`` = share / (1 - share))."""
    return slowdown / (1 + slowdown)


def slowdown_of(share: float) -> float:
    """``Profile.overlap_slowdown`` of a transfer that takes ``share`` of the core beside
    it, up to ``MAX_CORE_SHARE``."""
    share = min(max(share, 0.0), MAX_CORE_SHARE)
    return share / (1 - share)


def overlapped(compute_s: float, in_flight_s: float, slowdown: float) -> float:
    """How long ``compute_s`` of matmul takes when a transfer is in flight for the first
    ``in_flight_s`` of it, slowed by ``slowdown`` meanwhile (``Profile.overlap_slowdown``)."""
    if slowdown <= 0 or in_flight_s <= 0:
        return compute_s
    slowed = compute_s * (1 + slowdown)
    if slowed <= in_flight_s:
        return slowed
    return compute_s + in_flight_s * core_share(slowdown)
