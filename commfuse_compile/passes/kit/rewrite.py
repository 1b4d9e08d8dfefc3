"""One site's rewrite as a transaction: nodes are added (``emit.py``) until ``commit``
swaps the results in and erases the collective; anything that fails before that is
undone by ``discard``, which leaves the graph as it was.

``Rewrite.steps`` records, per overlap window, which transfer starts before which
matmuls and which waits follow them (the order ``order.py`` keeps through Inductor).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from ..fx.collectives import P2P, is_transfer_start
from ..fx.graph import in_graph_order, position
from ..fx.matmuls import is_matmul
from .emit import Emitter
from .placement import inputs_to_hoist
from .site import Site

# P2P tags start high up, so that a user's own send/recv on the same group (small tags)
# never matches ours; each graph has its own range, each site its own tag in it.
TAG_BASE = 0x43460000
SITES_PER_GRAPH = 1 << 12
GRAPH_TAGS = 1 << 16  # graph ranges: TAG_BASE + 2**28 stays below 2**31


def tag_of(transfers_digest: int, ordinal: int) -> int:
    """The P2P tag of the graph's ``ordinal``-th site: what every rank agrees on (the
    graph's transfers and matmuls, the site's place among its sites), not how many graphs
    this process compiled before. A graph recompiled on one rank with the same transfers
    (a constant that became an input) tags alike, so it runs with its peers' graph."""
    return TAG_BASE + (transfers_digest % GRAPH_TAGS) * SITES_PER_GRAPH + ordinal % SITES_PER_GRAPH


def graph_digest(graph: Graph) -> int:
    """A number for the graph's ops in order and the shapes and dtypes of their values:
    the same on every rank of an SPMD program (not the arguments: a rank's own offsets
    may differ there); the ranks compare it to know they compiled the same graph."""
    return _digest(graph.nodes)


def transfers_digest(graph: Graph) -> int:
    """``graph_digest`` of the graph's collectives and matmuls only: different for two
    models of different sizes, so that their sites never share a tag."""
    return _digest(n for n in graph.nodes if is_transfer_start(n) or is_matmul(n))


def _digest(nodes: Iterable[Node]) -> int:
    text = "\n".join(f"{node.op} {_target(node)} {_layout(node)}" for node in nodes)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _target(node: Node) -> str:
    """A node's target by name, the same in every process (a Python function's default
    string holds its address: ``torch.sym_sum`` after ``.tolist()`` sizes, say)."""
    target = node.target
    if callable(target) and not isinstance(target, torch._ops.OpOverload):
        return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"
    return str(target)


def _layout(node: Node) -> str:
    """A node's value as the digest sees it: dtype and sizes, a symbolic size as "?"."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return ""
    return f"{value.dtype} {[s if isinstance(s, int) else '?' for s in value.shape]}"


class Taken:
    """What the graph's earlier rewrites emitted, each node with its window (site id,
    step): the relation a later site that shared a matmul with one of them is matched
    against. A reduce-scatter whose product one took is declined (``rs.taken``); an
    all-gather feeding a matmul one split runs nested in that matmul's window
    (``kinds/ag_mm``). The pipeline adds each rewrite once it is committed."""

    def __init__(self) -> None:
        self._windows: dict[Node, tuple[str, int]] = {}

    def add(self, rw: Rewrite) -> None:
        for node in rw.created:
            self._windows[node] = (rw.site_id, node.meta["commfuse"]["step"])

    def window(self, node: Node) -> tuple[str, int] | None:
        """(site id, step) of the rewrite window that emitted ``node``; None: the graph's."""
        return self._windows.get(node)


@dataclasses.dataclass
class Step:
    """One overlap window: ``issue`` starts, ``compute`` (every matmul of the window) runs,
    then ``waits`` complete."""

    issue: Node | None
    compute: list[Node]
    waits: list[Node]


class Rewrite:
    """The rewrite of ``site`` (report id ``site_id``, P2P ``tag``), emitting through
    ``emit`` before ``before``; ``timed``: its P2P ops record their spans."""

    def __init__(
        self, site: Site, site_id: str, tag: int, emit: Emitter, timed: bool = False
    ) -> None:
        self.site, self.site_id, self.tag, self.emit, self.timed = site, site_id, tag, emit, timed
        self.steps: list[Step] = []
        self._replace: dict[Node, Node] = {}
        # size computations of the old graph that only fed the site's erased nodes
        self._erased_sizes: list[Node] = []
        self.committing = False  # past this point the graph cannot be restored site by site

    @property
    def graph(self) -> Graph:
        return self.emit.graph

    @property
    def created(self) -> Sequence[Node]:
        return self.emit.created

    @property
    def replace(self) -> Mapping[Node, Node]:
        """Old node -> the node that takes its place at commit."""
        return self._replace

    @property
    def p2p_ops(self) -> int:
        return sum(node.target is P2P for node in self.created)

    def label(self, step: int) -> str:
        """What a P2P op of ``step`` is called in traces, errors and the program check."""
        return f"site {self.site_id} step {step} ({self.site.kind})"

    def replaces(self, old: Node, new: Node) -> None:
        self._replace[old] = new

    def erases(self, size: Node) -> None:
        """A size computation that goes with the site's erased nodes."""
        self._erased_sizes.append(size)

    def add_step(self, issue: Node | None, step: int, waits: list[Node]) -> None:
        """Window ``step``: ``issue`` starts before its matmuls, ``waits`` follow them."""
        self.steps.append(Step(issue, self.emit.matmuls(step), waits))

    def nest(self, inner: Rewrite) -> None:
        """Where ``inner`` replaced a matmul of one of this rewrite's windows (a nested
        ring, ``kinds/ag_mm``), that window now computes ``inner``'s whole ring: the order
        kept through Inductor holds its transfer open over all of it. A ring that had to
        go before the window's transfer is only dropped from it."""
        replaced = inner.replace
        ring: list[Node] | None = None  # inner's nodes, read only where a window was taken
        for window in self.steps:
            taken = [n for n in window.compute if n in replaced]
            if not taken:
                continue
            if ring is None:
                ring = [n for s in inner.steps for n in ([s.issue] if s.issue else []) + s.compute]
                first = min(inner.created, key=position)
            window.compute = [n for n in window.compute if n not in replaced]
            if window.issue is not None and position(window.issue) < position(first):
                window.compute += [*ring, *(replaced[n] for n in taken)]

    def discard(self) -> None:
        self.emit.discard()

    def commit(self, dead: Sequence[Node]) -> None:
        """Swap the results in, erase what became dead, keep the replaced nodes' names."""
        moved = set(self.emit.moved)
        first, moves = inputs_to_hoist([node for node in self.created if node not in moved])
        self.committing = True
        for node in moves:
            first.prepend(node)
        for old, new in self._replace.items():
            old.replace_all_uses_with(new)
        erased = [*dead, *self._erased_sizes, *self._replace]
        for node in reversed(in_graph_order(erased)):
            if not node.users:
                self.graph.erase_node(node)
        for old, new in self._replace.items():
            if old._erased:
                new.name = old.name
        if any(position(u) < position(new) for new in self._replace.values() for u in new.users):
            # a ring nested in a later window: the views that read the tensor it rebuilds
            # stood where the collective was, and now follow it (nothing else moves)
            stable_topological_sort(self.graph)
