"""Decomposition schedules: pure descriptions of who sends which block when.

A schedule is a module with ``gather_steps(rank, n)`` (all-gather then matmul) and
``reduce_steps(rank, n)`` (matmul then reduce-scatter). Steps name blocks and ring
offsets only, so the same description drives the graph lowering, the simulator that
checks it against an unfused reference, and every rank's view of the exchange.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType


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


P2P_SCHEDULES = ("ring", "bidir", "push")  # step lists of point-to-point transfers
# ``slicing`` (k collectives on chunks) is described by ``slicing.gather_steps(k)``.


def by_name(name: str) -> ModuleType:
    from . import bidir, push, ring, slicing

    return {"ring": ring, "bidir": bidir, "push": push, "slicing": slicing}[name]
