"""Decomposition schedules: pure descriptions of who sends which block when.

A schedule is a module with a steps function per ``Direction`` it supports:
``gather_steps(rank, n)`` (all-gather then matmul), ``reduce_steps(rank, n)`` (matmul
then reduce-scatter), ``exchange_in_steps``/``exchange_out_steps`` (all-to-all then
matmul, and back); ``slicing``'s take the chunk count instead, and ``Schedule.steps``
gives them one signature. Steps name blocks and ring
offsets only, so the same description drives the graph lowering, the simulator that
checks it against an unfused reference, and every rank's view of the exchange.
"""

from __future__ import annotations

import dataclasses
import enum
from types import ModuleType
from typing import Any


class Direction(enum.StrEnum):
    """Which way a site's data flows between its collective and its matmul: the steps a
    schedule gives it, how the cost model times it, and what a received message holds."""

    GATHER = "gather"  # all-gather -> matmul
    REDUCE = "reduce"  # matmul -> reduce-scatter
    EXCHANGE_IN = "exchange_in"  # all-to-all -> matmul
    EXCHANGE_OUT = "exchange_out"  # matmul -> all-to-all
    # all-to-all -> matmuls -> all-to-all back (an MoE layer's dispatch, experts, combine):
    # one program, ``round_trip``
    ROUND_TRIP = "round_trip"

    @property
    def collects_first(self) -> bool:
        """Does the collective run before the matmul (blocks arrive, then are multiplied)?"""
        return self in (Direction.GATHER, Direction.EXCHANGE_IN, Direction.ROUND_TRIP)

    @property
    def collective(self) -> str:
        """The collective the site replaces, as the machine profiles name it."""
        return _COLLECTIVES[self]

    def source(self, transfer: Transfer, rank: int, n: int) -> int:
        """The block a received ``transfer`` holds: the one it names (a ring forwards
        blocks), or under an all-to-all the sender's (each message carries the block of
        the sender's tensor meant for its receiver, ``Transfer.block``)."""
        if self in (Direction.EXCHANGE_IN, Direction.EXCHANGE_OUT, Direction.ROUND_TRIP):
            return (rank + transfer.peer) % n
        return transfer.block


@dataclasses.dataclass(frozen=True)
class Transfer:
    block: int  # whose data travels (the block index along the collective's dim)
    peer: int  # ring offset of the other side: +1 = next rank, -1 = previous rank


@dataclasses.dataclass(frozen=True)
class GatherStep:
    """Start ``sends``/``recvs``, multiply the held ``compute`` blocks, then wait."""

    compute: tuple[int, ...]
    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReduceStep:
    """Multiply ``blocks``; to each, add the partials received earlier from the peers in
    ``adds`` (``Transfer(block, peer)``); then send the sums in ``sends`` and start the
    receives in ``recvs``, which later steps add. A rank's last step holds its own block."""

    blocks: tuple[int, ...]
    adds: tuple[Transfer, ...] = ()
    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule as the stages use it: one rank's steps, whatever they are made of."""

    name: str
    module: ModuleType  # gather_steps / reduce_steps of (rank, n), or of (k) if sliced
    sliced: bool  # k collectives on chunks (``slicing.SliceStep``), not P2P steps

    def supports(self, direction: Direction) -> bool:
        """Has it steps for ``direction``?"""
        return hasattr(self.module, _STEPS[direction])

    def steps(self, direction: Direction, rank: int, n: int, slices: int) -> list[Any]:
        """``direction`` steps of ``rank`` of ``n``; ``slices`` is the chunk count of a
        sliced schedule."""
        make = getattr(self.module, _STEPS[direction])
        return list(make(slices) if self.sliced else make(rank, n))


_STEPS = {d: f"{d.value}_steps" for d in Direction}  # a schedule module's function per direction
_COLLECTIVES = {
    Direction.GATHER: "all_gather",
    Direction.REDUCE: "reduce_scatter",
    Direction.EXCHANGE_IN: "all_to_all",
    Direction.EXCHANGE_OUT: "all_to_all",
    Direction.ROUND_TRIP: "all_to_all",
}
NAMES = ("ring", "bidir", "push", "slicing")  # every schedule, in the order reports list them


def by_name(name: str) -> Schedule:
    """The schedule called ``name`` (one of ``NAMES``, or ``round_trip``: what a round
    trip runs, ``running``)."""
    from . import bidir, push, ring, round_trip, slicing

    modules = {
        "ring": ring,
        "bidir": bidir,
        "push": push,
        "slicing": slicing,
        "round_trip": round_trip,
    }
    return Schedule(name, modules[name], sliced=name == "slicing")


def running(name: str, direction: Direction) -> str:
    """The schedule that runs where ``name`` is asked for (an option's value, or a name in
    ``disable``) on a site of ``direction``: a round trip has one program, in the ring's
    pairwise order, which ``ring`` asks for; every other name runs itself."""
    return "round_trip" if direction is Direction.ROUND_TRIP and name == "ring" else name
