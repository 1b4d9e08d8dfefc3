"""Which node each rank runs on, and what that makes of a group: the level of its
links (inside one node, or across nodes), its ring order, and how many ranks send through
one NIC at once.

The topology comes from the option ``topology`` (ranks per node, or the node of every
rank), else from the launcher: torchrun numbers a node's ranks together (``RANK`` =
``GROUP_RANK`` x ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``), so ``LOCAL_WORLD_SIZE`` is the
ranks per node. Without either, the job is one node. Every rank decides from it, so the
ranks' agreement compares it (``describe``) as it compares the profile.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

INSIDE, ACROSS = "node", "nodes"  # a group's level


@dataclasses.dataclass(frozen=True)
class Topology:
    ranks_per_node: int = 0  # nodes of this many consecutive ranks; 0: see ``nodes``
    nodes: tuple[int, ...] = ()  # the node of every global rank; (): one node

    def node(self, rank: int) -> int:
        if self.ranks_per_node:
            return rank // self.ranks_per_node
        if not self.nodes:
            return 0
        if rank >= len(self.nodes):
            raise TopologyError(
                f"the topology names the node of {len(self.nodes)} ranks ({self.describe()}); "
                f"rank {rank} is not in it: give the node of every rank of the job"
            )
        return self.nodes[rank]

    def describe(self) -> str:
        if self.ranks_per_node:
            return f"{self.ranks_per_node} ranks per node"
        return f"nodes {','.join(map(str, self.nodes))}" if self.nodes else "one node"

    def level(self, ranks: Sequence[int]) -> str:
        """``INSIDE`` where the ranks share one node, else ``ACROSS``."""
        return INSIDE if len({self.node(r) for r in ranks}) <= 1 else ACROSS

    def ring_order(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The group's positions (group ranks) in ring order: a node's members adjacent,
        nodes in the order of their first member, members in group-rank order, so that
        the ring crosses between nodes once per node; a pure function of the agreed
        topology and the group, hence the same on every rank."""
        first: dict[int, int] = {}
        for position, rank in enumerate(ranks):
            first.setdefault(self.node(rank), position)
        return tuple(sorted(range(len(ranks)), key=lambda p: (first[self.node(ranks[p])], p)))

    def crossings(self, ranks: Sequence[int], order: Sequence[int]) -> int:
        """Ring hops (one direction) between members on different nodes."""
        nodes = [self.node(ranks[p]) for p in order]
        return sum(a != b for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True))

    def senders_per_nic(
        self, ranks: Sequence[int], order: Sequence[int], ranks_per_nic: int, all_pairs: bool
    ) -> int:
        """How many ranks send across nodes through one NIC at once while this group's
        site runs: of the ``ranks_per_nic`` ranks sharing a NIC, those in a copy of this
        group (every rank of a node runs the site, in this group or a sibling) that send
        to another node: a ring's members whose next member is on another node, or,
        exchanging with every member (``all_pairs``), all of them."""
        nodes = [self.node(ranks[p]) for p in order]
        hops = list(zip(nodes, nodes[1:] + nodes[:1], strict=True))
        worst = 1
        for node in set(nodes):
            members = nodes.count(node)
            crossing = members if all_pairs else sum(a == node != b for a, b in hops)
            sharing = min(ranks_per_nic, self.ranks_on(node) or members)
            worst = max(worst, math.ceil(sharing * crossing / members))
        return worst

    def ranks_on(self, node: int) -> int:
        """Ranks of the job on ``node`` (0: not known, one node)."""
        return self.ranks_per_node or self.nodes.count(node)


class TopologyError(ValueError):
    """A topology option or launcher environment that cannot be used."""


def parse(value: object) -> Topology | None:
    """``topology`` as an option gives it: ranks per node (an integer, or its digits), or
    the node of every rank (a list of integers, or the digits comma separated)."""
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            raise TopologyError(f"must be ranks per node or the node of every rank, got {value!r}")
        value = int(parts[0]) if len(parts) == 1 else [int(p) for p in parts]
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return Topology(ranks_per_node=value)
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    ):
        return Topology(nodes=tuple(value))
    raise TopologyError(
        f"must be ranks per node (> 0) or the node of every rank (integers >= 0), got {value!r}"
    )


def from_launcher() -> Topology:
    """torchrun's: ``LOCAL_WORLD_SIZE`` ranks per node; one node without it."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return Topology(ranks_per_node=int(local)) if local.isdigit() and int(local) > 0 else Topology()


def current(option: Topology | None) -> Topology:
    """The option's topology, else the launcher's."""
    return option if option is not None else from_launcher()
