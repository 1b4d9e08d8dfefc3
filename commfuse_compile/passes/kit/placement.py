"""Placement: which computations may move above a rewrite's first node, and which must.

A rewrite goes where the collective's first reader stood; the weights and biases its
matmuls read may be computed later in the graph (a transpose next to its matmul). Pure
computations are moved up at commit; anything else there declines the site.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx.declines import decline
from ..fx.graph import position

c10d = torch.ops._c10d_functional


def _movable(node: Node) -> bool:
    """A pure computation, free to move (not an input, a wait or a side effect)."""
    return (
        node.op == "call_function"
        and not node.is_impure()
        and node.target is not c10d.wait_tensor.default
    )


def hoistable(node: Node, before: Node) -> bool:
    """Can ``node`` be computed before ``before``: it stands there already, or it is a
    pure computation (a weight's transpose, a bias view) of such nodes?"""
    start, stack, seen = position(before), [node], set()
    while stack:
        current = stack.pop()
        if current in seen or position(current) < start:
            continue
        seen.add(current)
        if not _movable(current):
            return False
        stack += current.all_input_nodes
    return True


def inputs_to_hoist(created: list[Node]) -> tuple[Node, list[Node]]:
    """(the first new node, the pure producers (weights, biases) of new nodes that sit
    after it, in the order to move them before it)."""
    first = min(created, key=position)
    new, moves = set(created), dict[Node, None]()

    def visit(node: Node) -> None:
        if node in new or node in moves or position(node) < position(first):
            return
        if not _movable(node):
            raise decline("lower.late_input", node=node.name)
        for arg in node.all_input_nodes:
            visit(arg)
        moves[node] = None

    for node in created:
        for arg in node.all_input_nodes:
            visit(arg)
    return first, list(moves)
