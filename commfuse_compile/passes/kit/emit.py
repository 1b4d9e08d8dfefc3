"""Emitting nodes: each new node gets its fake value, and a rewrite's its site, step and lane.

Every node an ``Emitter`` creates is recorded, so that a rewrite that fails before its
commit takes them all back (``discard``) and leaves the graph as it was.

Under dynamic shapes a size may be a SymInt, which an FX argument cannot hold: it is
computed in the graph from the symbols' sources (SymInt inputs, sizes of tensor inputs)
with ``sym_size``/``operator`` nodes, and a view with one symbolic size takes -1.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch.fx import Graph, Node
from torch.fx.proxy import GraphAppendingTracer, Proxy
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from ...runtime.p2p import p2p_fake  # (importing it registers commfuse::p2p)
from ..fx import dims
from ..fx.collectives import P2P
from ..fx.declines import decline
from ..fx.matmuls import MATMUL_OPS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# ops that only view their input: one such node per (input, arguments) and rewrite
VIEW_OPS = frozenset({aten.view.default, aten.permute.default, aten.slice.Tensor})
# what AOTAutograd's partitioner and activation checkpointing read off a joint graph's
# nodes: which half a node runs in, and whether it is saved or recomputed
JOINT_MARKS = ("partitioner_tag", "recompute", "ac_graph_id")


class Emitter:
    """New nodes before ``before`` (or a node given per call), with their fake values;
    for a site's rewrite (``site_id``), each marked with its site, step and lane. With
    ``inherit`` (meta keys), a new node takes those marks of the node it stands for
    (``like``; else the one it stands before): on a joint graph, the half it runs in and
    its checkpointing policy."""

    def __init__(
        self,
        graph: Graph,
        before: Node,
        fake_mode: Any,
        site_id: str = "",
        inherit: tuple[str, ...] = (),
    ) -> None:
        self.graph, self.before, self.fake_mode, self.site_id = graph, before, fake_mode, site_id
        self.inherit = inherit
        self.created: list[Node] = []
        # size readers recomputed before their own place, not at ``before``
        self.moved: list[Node] = []
        self._size_nodes: dict[tuple[Any, Node], int | Node] = {}
        self._views: dict[tuple[Any, ...], Node] = {}
        self._matmuls: dict[int, list[Node]] = {}  # by step, in the order emitted

    def add_node(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        before: Node | None = None,
        like: Node | None = None,
    ) -> Node:
        """A new node with its fake value (no site marks: a graph-wide rewrite's node)."""
        with self.graph.inserting_before(before or self.before):
            node = self.graph.call_function(target, args, kwargs or {})
        self._record(node, before, like)
        return node

    def __call__(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        step: int,
        lane: str,
        before: Node | None = None,
    ) -> Node:
        """A new node of the site's ``step`` on ``lane``. A view of a value this emitter
        already viewed the same way, at the same place, is reused."""
        key = (target, _hashable(args), _hashable(kwargs)) if target in VIEW_OPS else None
        if key is not None and before is None and key in self._views:
            return self._views[key]
        node = self.add_node(target, args, kwargs, before)
        node.meta["commfuse"] = {"site": self.site_id, "step": step, "lane": lane}
        if target in MATMUL_OPS or target is aten._grouped_mm.default:
            self._matmuls.setdefault(step, []).append(node)
        if key is not None and before is None:
            self._views[key] = node
        return node

    def _record(self, node: Node, before: Node | None, like: Node | None = None) -> None:
        self.created.append(node)
        if before is not None and before is not self.before:
            self.moved.append(node)
        marks = (like or before or self.before).meta
        node.meta.update((key, marks[key]) for key in self.inherit if key in marks)
        node.meta["val"] = fake_eval(self.fake_mode, node.target, node.args, node.kwargs)  # type: ignore[arg-type]

    def matmuls(self, step: int) -> list[Node]:
        """The matmuls of ``step``, in the order they were emitted."""
        return list(self._matmuls.get(step, ()))

    def discard(self) -> None:
        """Erase every node this emitter created."""
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()
        self._matmuls.clear()

    def compute_size(self, size: dims.Size, step: int, before: Node | None = None) -> int | Node:
        """``size`` as an FX argument: the int, or a node computing the symbolic size."""
        if not isinstance(size, torch.SymInt) or size.node.maybe_as_int() is not None:
            return int(size)
        return self._compute_expr(size.node.expr, step, before or self.before)

    def compute_shape(self, shape: Sequence[dims.Size], step: int) -> list[int | Node]:
        """A view's shape argument: -1 stands for the one symbolic size, if only one is."""
        sizes = dims.sizes(shape)
        if [isinstance(s, torch.SymInt) for s in sizes].count(True) == 1:
            return [s if isinstance(s, int) else -1 for s in sizes]
        return [self.compute_size(s, step) for s in sizes]

    def _compute_expr(self, expr: sympy.Expr, step: int, before: Node) -> int | Node:
        if expr.is_Integer:
            return int(expr)
        key = (expr, before)
        if key not in self._size_nodes:
            self._size_nodes[key] = self._build_expr(expr, step, before)
        return self._size_nodes[key]

    def _build_expr(self, expr: sympy.Expr, step: int, before: Node) -> int | Node:
        """Nodes computing ``expr`` from the graph's inputs, built by torch's own sympy
        interpreter on FX proxies, then recorded like emitted nodes."""
        tracer = GraphAppendingTracer(self.graph)
        existing = set(self.graph.nodes)
        with self.graph.inserting_before(before):
            env = {}
            for symbol in expr.free_symbols:
                node, dim = _symbol_source(self.graph, symbol)
                if dim is not None:
                    node = self.graph.call_function(aten.sym_size.int, (node, dim))
                env[symbol] = Proxy(node, tracer)
            try:
                result = sympy_interp(PythonReferenceAnalysis, env, expr)
            except Exception as err:  # noqa: BLE001 - any expression it cannot build
                new = [node for node in self.graph.nodes if node not in existing]
                for node in reversed(new):
                    self.graph.erase_node(node)
                raise decline("size.expression", expr=expr) from err
        for node in [node for node in self.graph.nodes if node not in existing]:
            self._record(node, before)
            node.meta["commfuse"] = {"site": self.site_id, "step": step, "lane": "compute"}
        return result.node if isinstance(result, Proxy) else int(result)


def _symbol_source(graph: Graph, symbol: sympy.Symbol) -> tuple[Node, int | None]:
    """A graph input that holds ``symbol``: a SymInt input, or (tensor input, its dim)."""
    if graph not in _SYMBOL_SOURCES:
        sources: dict[sympy.Symbol, tuple[Node, int | None]] = {}
        for node in graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt):
                sources.setdefault(value.node.expr, (node, None))
            elif isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        sources.setdefault(size.node.expr, (node, dim))
        _SYMBOL_SOURCES[graph] = sources
    if symbol not in _SYMBOL_SOURCES[graph]:
        raise decline("size.no_source", symbol=symbol)
    return _SYMBOL_SOURCES[graph][symbol]


# the inputs of a graph, read once per graph (they do not change during the pass)
_SYMBOL_SOURCES: weakref.WeakKeyDictionary[Graph, dict[sympy.Symbol, tuple[Node, int | None]]]
_SYMBOL_SOURCES = weakref.WeakKeyDictionary()


def fake_eval(
    fake_mode: Any, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The node's value on fake tensors, from its inputs' ``meta['val']``. Unpacking an
    output and waiting a tensor (which returns it) need no fake dispatch."""
    values = tuple(_value(a) for a in args)
    if target is operator.getitem:
        return values[0][values[1]]
    if target is c10d.wait_tensor.default:
        return values[0]
    with fake_mode:
        if target is P2P:  # its fake implementation, without the custom op's dispatch
            return p2p_fake(*values)
        return target(*values, **{k: _value(v) for k, v in kwargs.items()})


def _value(arg: Any) -> Any:
    """An FX argument with every node replaced by its ``meta['val']``."""
    if isinstance(arg, Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_value(a) for a in arg)
    return arg


def _hashable(arg: Any) -> Any:
    if isinstance(arg, (list, tuple)):
        return tuple(_hashable(a) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in arg.items()))
    return arg
