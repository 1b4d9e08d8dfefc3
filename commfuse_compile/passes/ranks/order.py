"""Keep the order the pass wrote through Inductor: inside a step, and between all
transfers of the graph.

Inductor's scheduler is free to reorder nodes within their data dependencies, and does
so differently on different ranks (a rank's own block sits at another offset, so its
fusions differ). Two orders matter:

* Inside a step: a wait can move up to right after its transfer (its readers get fused
  with earlier kernels), and a step's matmul can move before the transfer it should
  hide. Either serializes the step again. Each step's matmuls follow its transfer, and
  its waits follow its matmuls.
* Between transfers: if one rank starts the ring of site A before that of site B, and
  its peer starts B before A, each can wait for a message the other has not sent yet:
  the job hangs. Every transfer start (each P2P op, each functional collective left in
  the graph or emitted by the slicing schedule, the rings nested in a 2-D window) follows
  the previous start in graph order, which is the same on every rank. Starts never
  block, so with one order of starts on every rank no cycle of waits can form: a rank
  blocked on a transfer waits for a peer that has started fewer transfers, and that
  peer, if blocked, for one that has started fewer still.

What the chain costs: a start can no longer move above an earlier start, which in graph
order it does not need to; a start that Inductor would have issued early (its inputs
ready) waits for the previous start's inputs. Within a site the steps were already in
this order; between independent sites it fixes which ring starts first, never what a
matmul overlaps.

Both orders become Inductor's own ``control_deps`` (the ones its overlap scheduler
uses). The program check reports any step whose overlap is lost all the same
(``exposed_steps``), and checks the order every rank's generated program kept
(``sequence``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.fx import Graph, Node
from torch.utils._ordered_set import OrderedSet

from ..fx.collectives import is_transfer_start
from ..kit.rewrite import Step


def keep_order(graph: Graph, steps: Iterable[Step]) -> None:
    """Make each step's matmuls follow its transfer and its waits follow its matmuls;
    make every transfer start follow the one before it in graph order."""
    after: dict[Node, OrderedSet[Node]] = {}
    waits: dict[Node, OrderedSet[Node]] = {}
    for step in steps:
        if step.issue is None or not step.compute:
            continue
        for node in step.compute:
            after.setdefault(node, OrderedSet()).add(step.issue)
        for node in step.waits:
            waits.setdefault(node, OrderedSet()).update(step.compute)
    starts = transfer_starts(graph)
    for previous, start in zip(starts, starts[1:], strict=False):
        after.setdefault(start, OrderedSet()).add(previous)
    after.update(waits)  # matmuls first: the waits' dependencies refer to wrapped matmuls
    preserve_node_ordering(graph, after)


def transfer_starts(graph: Graph) -> list[Node]:
    """Every node that starts a transfer, in graph order."""
    return [node for node in graph.nodes if is_transfer_start(node)]
