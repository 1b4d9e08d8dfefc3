"""Keep the overlap order (start transfer -> partial matmul -> wait) through Inductor.

Inductor's scheduler is free to reorder nodes within their data dependencies: a wait
can move up to right after its transfer (its readers get fused with earlier kernels),
and a step's matmul can move before the transfer it should hide. Either serializes the
step again. Inductor's own ``control_deps`` ordering (the one its overlap scheduler
uses) turns "after" into dependencies it must respect: each step's matmuls follow its
transfer, and its waits follow its matmuls. The program check reports any step whose
overlap is lost all the same (``exposed_steps`` in the report).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.fx import Graph, Node
from torch.utils._ordered_set import OrderedSet

from .rewrite import Step


def keep_overlap_order(graph: Graph, steps: Iterable[Step]) -> None:
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
