"""Collectives no site kind claims: each one a site of its own, declined where it stands,
so that every collective of a graph has its record (none is skipped in silence).

A kind matches only collectives next to a matmul; the rest (an MoE's token-count
exchange, tokens reordered by index before a grouped matmul, a gather into a buffer no
matmul reads, a reduce-scatter of gradients no matmul computes) get the reason here,
under the kind their collective would have (``collective`` for ops no kind rewrites).
A framework's custom op that takes a process group (``custom_ops.group_argument``) and
that the canonical stage did not read as a functional collective is one too: an op the
pass does not know, or a known one whose call does not fit what it computes.
Never rewritten: the pipeline reports the decline before anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.fx import Graph, Node

from ...runtime.groups import ranks_of
from ..fx import custom_ops
from ..fx.collectives import ALL_TO_ALL
from ..fx.declines import Declined, decline
from ..fx.graph import PASS_THROUGH, check_tensor, node_arg, op_name
from ..fx.graph import value_readers as readers
from ..fx.matmuls import is_matmul
from ..kit.site import Site

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_OPS = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_out",
    "all_reduce",
    "all_reduce_",
    "all_reduce_coalesced",
    "all_reduce_coalesced_",
    "all_to_all_single",
    "broadcast",
    "broadcast_",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_out",
)
COLLECTIVES = frozenset(getattr(c10d, op).default for op in _OPS if hasattr(c10d, op))
GATHER, SCATTER = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default
# reorder rows by an index tensor: which rows a block holds is known only at run time
PERMUTING = frozenset(
    {
        aten.index.Tensor,
        aten._unsafe_index.Tensor,
        aten.index_select.default,
        aten.gather.default,
        aten.index_put.default,
        aten.index_put_.default,
        aten._unsafe_index_put.default,
        aten.index_add.default,
        aten.scatter.src,
        aten.scatter_add.default,
    }
)
GROUPED = frozenset({aten._grouped_mm.default, aten._scaled_grouped_mm.default})
THROUGH = PASS_THROUGH | PERMUTING | {c10d.wait_tensor.default}
NO_MATMUL = {GATHER: "ag.no_matmul", SCATTER: "rs.no_matmul", ALL_TO_ALL: "a2a.no_matmul"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnclaimedSite(Site):
    """One collective, declined: ``declined`` is always set."""

    kind: ClassVar[str] = "collective"
    collective: Node

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.collective,)

    def replaced(self) -> list[Node]:
        return [self.collective]

    def describe(self) -> dict[str, Any]:
        return {
            "collectives": [self.collective.name],
            "op": op_name(self.collective),
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [],
        }


class _Gather(UnclaimedSite):
    kind: ClassVar[str] = "ag_mm"


class _Scatter(UnclaimedSite):
    kind: ClassVar[str] = "mm_rs"


class _Exchange(UnclaimedSite):
    kind: ClassVar[str] = "a2a_mm"


class _ExchangeOut(UnclaimedSite):
    kind: ClassVar[str] = "mm_a2a"


def declined_sites(graph: Graph, claimed: set[Node]) -> list[UnclaimedSite]:
    """A declined site per collective of ``graph`` not in ``claimed`` (not the slicing
    schedule's own chunk collectives), and per framework op that takes a process group."""
    sites = []
    for node in (n for n in graph.nodes if n.op == "call_function"):
        if node.target in COLLECTIVES and node not in claimed and "commfuse" not in node.meta:
            sites.append(_declined(node))
        elif custom_ops.group_argument(node.target) is not None:
            sites.append(_custom(node))
    return sites


def _custom(node: Node) -> UnclaimedSite:
    """A framework op that takes a process group, left as it is: why."""
    argument = custom_ops.group_argument(node.target)
    assert argument is not None
    group = custom_ops.argument(node, argument)
    name = group if isinstance(group, str) else str(getattr(group, "group_name", ""))
    entry = custom_ops.collective_of(node.target)
    problem = custom_ops.functional(entry, node) if entry is not None else None
    if entry is not None and isinstance(problem, str):
        why = decline("site.custom_op_unfit", node=node.name, op=entry.op, problem=problem)
    else:
        op = node.target.name()  # type: ignore[union-attr]
        why = decline("site.custom_op", node=node.name, op=op, argument=argument)
    return UnclaimedSite(
        collective=node, group_name=name, group_size=len(ranks_of(name)), declined=why.kept()
    )


def _declined(node: Node) -> UnclaimedSite:
    group_name = str(_arg(node, "group_name"))
    if node.target is ALL_TO_ALL:
        n = len(node_arg(node, 1, "output_split_sizes"))
    else:
        n = _arg(node, "group_size") or len(ranks_of(group_name))
    after = _matmul_beyond(readers(node), readers)
    before = _matmul_beyond(node.all_input_nodes, lambda x: x.all_input_nodes)
    cls = _class_of(node, after is not None or before is None)
    why = _reason(node, after, before)
    return cls(collective=node, group_name=group_name, group_size=int(n), declined=why.kept())


Found = tuple[Node, Node | None]  # a matmul, and the first op reordering rows on the way


def _reason(node: Node, after: Found | None, before: Found | None) -> Declined:
    """Why ``node`` is no site of its kind; ``after``/``before``: a matmul its value
    reaches / comes from, past an index or as a grouped matmul (which no kind follows),
    or on the side of the collective no kind rewrites (a matmul -> all-gather)."""
    if node.target not in NO_MATMUL:
        return decline("site.no_kind", pattern=op_name(node))
    inp = node_arg(node, 0, "input")
    try:
        check_tensor(inp, f"the input of {node.name}")
    except Declined as why:
        return why
    found = after or before
    if found is None:
        return decline(NO_MATMUL[node.target], node=inp.name, op=op_name(inp))  # type: ignore[index]
    mm, permuting = found
    if permuting is not None:
        return decline("site.permuted", node=permuting.name, op=op_name(permuting), mm=mm.name)
    if mm.target in GROUPED:
        return decline("site.grouped_mm", node=mm.name, op=op_name(mm))
    matmul = f"{mm.name} ({op_name(mm)})"
    pattern = f"{op_name(node)} -> {matmul}" if after else f"{matmul} -> {op_name(node)}"
    return decline("site.no_kind", pattern=pattern)


def _class_of(node: Node, after: bool) -> type[UnclaimedSite]:
    """The kind a site of ``node`` would have (an all-to-all's: by the side its matmul
    is on, ``after`` if on neither)."""
    if node.target is GATHER:
        return _Gather
    if node.target is SCATTER:
        return _Scatter
    if node.target is ALL_TO_ALL:
        return _Exchange if after else _ExchangeOut
    return UnclaimedSite


def _matmul_beyond(
    start: Iterable[Node], neighbours: Callable[[Node], Iterable[Node]]
) -> tuple[Node, Node | None] | None:
    """The first matmul (grouped too) reached from ``start`` through pass-through ops, the
    collective's wait and ops that reorder rows by index; with the first of those on the
    way (None if none)."""
    frontier: list[tuple[Node, Node | None]] = [(node, None) for node in start]
    seen: set[Node] = set()
    while frontier:
        node, permuting = frontier.pop()
        if is_matmul(node) or node.target in GROUPED:
            return node, permuting
        if node.target in THROUGH and node not in seen:
            seen.add(node)
            permuting = permuting or (node if node.target in PERMUTING else None)
            frontier += [(user, permuting) for user in neighbours(node)]
    return None


def _arg(node: Node, name: str) -> Any:
    """The argument ``name`` of a collective, by its schema (None if it has none)."""
    schema = node.target._schema  # type: ignore[union-attr]
    for i, argument in enumerate(schema.arguments):
        if argument.name == name:
            return node_arg(node, i, name)
    return None
