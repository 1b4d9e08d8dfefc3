"""What every site kind provides to the pipeline (``SiteKind``).

A site kind is one module in ``kinds/``: it finds its sites in a graph, says what they
cost, and computes one block of a site; the ring core (``ring.py``) runs the schedule
around that. The stages only talk to this interface, so a new pattern is one new module
plus its entry in ``kinds.KINDS``.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from torch.fx import Graph, Node

from ..cost.simulator import Work
from ..runtime.groups import Group
from ..schedules import Direction, Schedule
from .rewrite import Rewrite, Taken
from .site import Site

S = TypeVar("S", bound=Site)


class SiteKind(Protocol[S]):
    name: str
    direction: Direction  # which steps of a schedule run it (``Schedule.steps``)
    # can run inside one window of a site that shares its matmul and is rewritten first
    # (``match.find_sites`` orders such sites so)
    nests: bool

    def find(self, graph: Graph) -> list[S]:
        """Every site of this kind in the graph, matched or declined (nothing rewritten)."""
        ...

    def rematch(self, site: S, taken: Taken) -> S | None:
        """``site`` matched again where it stands after other sites were rewritten (what
        they emitted: ``taken``)."""
        ...

    def without(self, site: S, disabled: frozenset[str]) -> S:
        """``site`` less the parts the ``disable`` option names (declines if none is left)."""
        ...

    def work(self, site: S, n: int) -> Work:
        """Per-block matmul FLOPs and message bytes, for the cost model."""
        ...

    def start(self, site: S, taken: Taken) -> tuple[S, Node]:
        """The site as it will be lowered, and the node its new nodes go before."""
        ...

    def lower(self, rw: Rewrite, site: S, group: Group, schedule: Schedule, slices: int) -> None:
        """Emit ``site`` as ``schedule``'s steps for this rank of ``group``."""
        ...
