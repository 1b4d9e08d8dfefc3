"""Keep the overlap order (start transfer -> partial matmul -> wait) through Inductor.

Inductor's scheduler is free to move a wait up to right after its collective, which
would serialize every step again. Inductor's own ``control_deps`` ordering (the one its
overlap scheduler uses) turns "after" into a dependency it must respect.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.fx import Graph, Node
from torch.utils._ordered_set import OrderedSet

from .lower import Step


def keep_overlap_order(graph: Graph, steps: Iterable[Step]) -> int:
    """Make each step's matmuls follow its transfer and its waits follow its matmuls."""
    after: dict[Node, OrderedSet[Node]] = {}
    waits: dict[Node, OrderedSet[Node]] = {}
    for step in steps:
        if step.issue is None or not step.compute:
            continue
        for node in step.compute:
            after.setdefault(node, OrderedSet()).add(step.issue)
        for node in step.waits:
            waits.setdefault(node, OrderedSet()).update(step.compute)
    after.update(waits)  # matmuls first: the waits' dependencies refer to wrapped matmuls
    preserve_node_ordering(graph, after)
    return len(after)
