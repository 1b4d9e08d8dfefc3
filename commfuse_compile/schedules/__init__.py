"""Decomposition schedules: pure descriptions of who sends which block when.

A schedule is a module with ``gather_steps(rank, n)`` (all-gather then matmul) and
``reduce_steps(rank, n)`` (matmul then reduce-scatter); ``slicing``'s take the chunk
count instead, and ``Schedule.steps`` gives both one signature. Steps name blocks and ring
offsets only, so the same description drives the graph lowering, the simulator that
checks it against an unfused reference, and every rank's view of the exchange.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any


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

    def supports(self, direction: str) -> bool:
        """Has it steps for ``direction`` ("gather", "reduce", "exchange_in" (all-to-all
        then matmul), "exchange_out" (matmul then all-to-all))?"""
        return hasattr(self.module, f"{direction}_steps")

    def steps(self, direction: str, rank: int, n: int, slices: int) -> list[Any]:
        """``direction`` steps of ``rank`` of ``n``; ``slices`` is the chunk count of a
        sliced schedule."""
        make = getattr(self.module, f"{direction}_steps")
        return list(make(slices) if self.sliced else make(rank, n))


NAMES = ("ring", "bidir", "push", "slicing")  # every schedule, in the order reports list them


def by_name(name: str) -> Schedule:
    from . import bidir, push, ring, slicing

    modules = {"ring": ring, "bidir": bidir, "push": push, "slicing": slicing}
    return Schedule(name, modules[name], sliced=name == "slicing")
