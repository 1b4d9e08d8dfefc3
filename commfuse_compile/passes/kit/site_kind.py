"""What every site kind provides to the pipeline (``SiteKind``), with the defaults most
kinds share, so that a kind writes only what is its own.

A site kind is one module (or package) in ``kinds/``: it finds its sites in a graph,
says what they cost, and computes one block of a site; the ring core (``kit/ring.py``)
runs the schedule around that. The stages only talk to this interface, so a new pattern
is one new module plus its entry in ``kinds.KINDS``. A kind whose sites start at one op
(``collective``) matches each of its nodes (``match``); what verify holds a rewrite to
defaults to the schedule's own steps, and a kind that runs steps of its own (``moe``)
says what they are.
"""

from __future__ import annotations

import abc
from typing import Any, Generic, TypeVar

from torch.fx import Graph, Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule, exchange
from .rewrite import Rewrite, Taken
from .site import Site

S = TypeVar("S", bound=Site)


Peers = tuple[list[int], list[int]]  # one P2P op's (ranks sent to, ranks received from)


class SiteKind(abc.ABC, Generic[S]):
    name: str
    # the matmul roles this kind gives its uses, which the ``disable`` option can leave
    # out of a site (``kinds.DISABLEABLE``)
    roles: tuple[str, ...] = ()
    direction: Direction  # which steps of a schedule run it (``Schedule.steps``)
    # can run inside one window of a site that shares its matmul and is rewritten first
    # (``match.find_sites`` orders such sites so)
    nests: bool = False

    @abc.abstractmethod
    def find(self, graph: Graph) -> list[S]:
        """Every site of this kind in the graph, matched or declined (nothing rewritten)."""

    @abc.abstractmethod
    def rematch(self, site: S, taken: Taken) -> S | None:
        """``site`` matched again where it stands after other sites were rewritten (what
        they emitted: ``taken``)."""

    def without(self, site: S, disabled: frozenset[str]) -> S:
        """``site`` less the parts the ``disable`` option names (declines if none is left);
        by default one computation: nothing to leave out but the whole site."""
        return site

    @abc.abstractmethod
    def work(self, site: S, n: int) -> Work:
        """Per-block matmul FLOPs and message bytes, for the cost model."""

    def start(self, site: S, taken: Taken) -> tuple[S, Node]:
        """The site as it will be lowered, and the node its new nodes go before (by
        default, its collective)."""
        return site, site.anchor

    @abc.abstractmethod
    def lower(self, rw: Rewrite, site: S, group: Group, schedule: Schedule, slices: int) -> None:
        """Emit ``site`` as ``schedule``'s steps for this rank of ``group``."""

    def expected_peers(self, site: S, group: Group, schedule: Schedule, slices: int) -> list[Peers]:
        """This rank's P2P ops as the rewrite must emit them, in order: the schedule's
        steps in the kind's direction, those that send or receive."""
        steps = schedule.steps(self.direction, group.position, group.size, slices)
        return [
            ([group.peer(t.peer) for t in st.sends], [group.peer(t.peer) for t in st.recvs])
            for st in steps
            if st.sends or st.recvs
        ]

    def check_schedule(self, schedule: Schedule, n: int) -> None:
        """Raise ``exchange.ScheduleError`` unless the steps, run for all n ranks, leave
        every rank with the right blocks."""
        exchange.check(schedule.module, n, self.direction)

    def alike_from(self, site: S) -> int | None:
        """The dim from which every buffer of one P2P op has the same shape (blocks of
        an uneven all-to-all differ in their rows: 1); None: not checked (a kind whose
        blocks have the graph's own sizes)."""
        return 0


class AtCollective(SiteKind[S]):
    """A kind whose every site starts at one node of ``collective``: it writes only
    ``match``, the site there, and finds and rematches through it."""

    collective: Any  # the op its sites start at

    @abc.abstractmethod
    def match(self, collective: Node, taken: Taken) -> S | None:
        """The site at ``collective`` (a node of ``self.collective``), matched or declined;
        None where it is no site of this kind."""

    def find(self, graph: Graph) -> list[S]:
        """Not at the collectives a rewrite emitted (the slicing schedule's chunks)."""
        nodes = graph.find_nodes(op="call_function", target=self.collective)
        found = (self.match(node, Taken()) for node in nodes if "commfuse" not in node.meta)
        return [site for site in found if site is not None]

    def rematch(self, site: S, taken: Taken) -> S | None:
        return self.match(site.anchor, taken)
