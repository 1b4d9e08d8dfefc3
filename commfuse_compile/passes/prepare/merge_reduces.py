"""All-reduced values added together become one all-reduce of their sum.

A plain-TP backward all-reduces each column-parallel input's gradient on its own (q, k
and v's; gate's and up's), then adds them: three times the bytes of one all-reduce of the
sum, which is what sequence parallelism's backward sends (its reduce-scatter of the
gathered input's gradient). A reduction over ranks is linear, so

    # before                                  # after
    gq = wait(all_reduce(dq @ w_q, "sum"))     g = wait(all_reduce(dq @ w_q + dk @ w_k, "sum"))
    gk = wait(all_reduce(dk @ w_k, "sum"))
    g = gq + gk

gives the same value up to the order of the summation; split (``shard_tokens``), the
sum of matmuls is then one ``mm_rs`` site instead of two, and the backward sends the
bytes hand-written sequence parallelism sends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node

from ..fx.graph import VIEWS, val
from ..kit.emit import JOINT_MARKS, Emitter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
LINEAR_OPS = ("sum", "avg")


def merge_summed(graph: Graph, waits: set[Node], before_change: Callable[[], None]) -> set[Node]:
    """Rewrite every ``wait(all_reduce(a)) + wait(all_reduce(b))`` of two of ``waits``
    (one group, one op, one shape and dtype, each waited value read by the add alone)
    into one all-reduce of ``a + b``, in graph order, so that a chain of adds merges into
    one; returns the waits as they are then."""
    waits = set(waits)
    for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        pair = _reduced_pair(add, waits)
        if pair is None:
            continue
        before_change()
        waits -= {wait for reduce in pair for wait in reduce.users}
        waits.add(_merge(graph, add, *pair))
    return waits


def _reduced(node: object, waits: set[Node]) -> Node | None:
    """The all-reduce whose waited value (one of ``waits``) ``node`` is, or views of (an
    in-place ``dist.all_reduce`` in Megatron's autograd functions is read through the
    views of its buffer), each read by the next alone."""
    while isinstance(node, Node) and node.target in VIEWS and len(node.users) == 1:
        node = node.args[0]
    if not isinstance(node, Node) or node not in waits:
        return None
    reduce = node.args[0]
    if not isinstance(reduce, Node) or reduce.target is not c10d.all_reduce.default:
        return None
    if len(node.users) != 1 or len(reduce.users) != 1 or reduce.args[1] not in LINEAR_OPS:
        return None
    return reduce


def _reduced_pair(add: Node, waits: set[Node]) -> tuple[Node, Node] | None:
    if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    first, second = (_reduced(a, waits) for a in add.args)
    if first is None or second is None or first is second:
        return None
    a, b, out = (val(n) for n in (first.args[0], second.args[0], add))  # type: ignore[arg-type]
    same = first.args[1:] == second.args[1:] and a.dtype == b.dtype == out.dtype
    if not same or a.numel() != out.numel() or b.numel() != out.numel():
        return None
    return first, second


def _merge(graph: Graph, add: Node, first: Node, second: Node) -> Node:
    """One all-reduce of the operands' sum (in the add's shape) where the later
    all-reduce started; its wait (returned) where the add was."""
    later = max(first, second, key=lambda n: n._sort_key)
    em = Emitter(graph, later, detect_fake_mode([val(add)]), inherit=JOINT_MARKS)
    shape = em.compute_shape(val(add).shape, 0)
    a, b = (em.add_node(aten.reshape.default, (r.args[0], shape)) for r in (first, second))
    reducing = em.add_node(
        c10d.all_reduce.default, (em.add_node(aten.add.Tensor, (a, b)), *later.args[1:])
    )
    waited = em.add_node(c10d.wait_tensor.default, (reducing,), before=add)
    add.replace_all_uses_with(waited)
    graph.erase_node(add)
    for reduce in (first, second):
        node = next(iter(reduce.users))
        chain = [node]
        while node.users:  # the wait's views, down to the erased add
            node = next(iter(node.users))
            chain.append(node)
        for dead in reversed(chain):
            graph.erase_node(dead)
        graph.erase_node(reduce)
    return waited
