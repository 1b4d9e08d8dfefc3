"""Emitting a site's rewrite: new nodes with their fake values and their step and lane,
the helpers every site kind lowers with, and the commit that swaps the results in.

Lowering only adds nodes (before the site's first consumer) until ``Rewrite.commit``
swaps the results in and erases the collective; anything that fails before that is
undone by ``Rewrite.discard``, which leaves the graph as it was.

Every new node gets ``meta["val"]`` (computed on fake tensors) and
``meta["commfuse"] = {"site", "step", "lane"}``; ``Rewrite.steps`` records, per step,
which P2P op must start before which matmuls and which waits must follow them.

Under dynamic shapes a size may be a SymInt, which an FX argument cannot hold: it is
computed in the graph from the symbols' sources (SymInt inputs, sizes of tensor inputs)
with ``sym_size``/``operator`` nodes, and a view with one symbolic size takes -1.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch._prims_common import is_contiguous_or_false
from torch.fx import Graph, Node
from torch.fx.proxy import GraphAppendingTracer, Proxy
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from ..runtime.groups import Group
from ..runtime.p2p import p2p_fake  # (importing it registers commfuse::p2p)
from ..schedules import Transfer
from . import dims
from .declines import decline
from .graph import (
    MATMULS,
    VIEWS,
    Matmul,
    in_graph_order,
    position,
    split_dim_in_input,
    val,
    varies_by_row,
)
from .site import Site

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

P2P = torch.ops.commfuse.p2p.default
# ops that only view their input: one such node per (input, arguments) and rewrite
VIEW_OPS = frozenset({aten.view.default, aten.permute.default, aten.slice.Tensor})


# a dtype conversion as the graphs Inductor compiles spell it (``_to_copy`` is decomposed
# before them, and Inductor has no lowering for it)
CONVERT = torch.ops.prims.convert_element_type.default


# One tag per site, the same sequence on every rank (SPMD compile), counted from high up
# so that a user's own send/recv on the same group (small tags) never matches ours.
TAG_BASE = 0x43460000


_tags = itertools.count(TAG_BASE)


@dataclasses.dataclass
class Step:
    """One overlap window: ``issue`` starts, ``compute`` (every matmul of the window) runs,
    then ``waits`` complete."""

    issue: Node | None
    compute: list[Node]
    waits: list[Node]


@dataclasses.dataclass
class Rewrite:
    site: Site
    site_id: int
    graph: Graph
    before: Node  # new nodes are inserted before this node
    created: list[Node] = dataclasses.field(default_factory=list)
    replace: dict[Node, Node] = dataclasses.field(default_factory=dict)
    steps: list[Step] = dataclasses.field(default_factory=list)
    fake_mode: Any = None
    matmuls: dict[int, list[Node]] = dataclasses.field(default_factory=dict)  # by step
    p2p_ops: int = 0
    committing: bool = False  # past this point the graph cannot be restored site by site
    timed: bool = False  # P2P ops record the site's span (the ``measure`` option)
    # size computations of the old graph that only fed the site's erased nodes
    erased_sizes: list[Node] = dataclasses.field(default_factory=list)
    # size readers of erased nodes, recomputed before their own place (not at ``before``)
    moved_sizes: list[Node] = dataclasses.field(default_factory=list)
    _size_nodes: dict[tuple[Any, Node], int | Node] = dataclasses.field(default_factory=dict)
    _views: dict[tuple[Any, ...], Node] = dataclasses.field(default_factory=dict)

    def emit(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        step: int,
        lane: str,
        before: Node | None = None,
    ) -> Node:
        """A new node before ``before`` (default: the site's first consumer). A view of a
        value this rewrite already viewed the same way, at the same place, is reused."""
        key = (target, _hashable(args), _hashable(kwargs)) if target in VIEW_OPS else None
        if key is not None and before is None and key in self._views:
            return self._views[key]
        with self.graph.inserting_before(before or self.before):
            node = self.graph.call_function(target, args, kwargs or {})
        self._adopt(node, step, lane, before)
        if key is not None and before is None:
            self._views[key] = node
        return node

    def _adopt(self, node: Node, step: int, lane: str, before: Node | None) -> None:
        """A new node of this rewrite: its fake value, its site/step/lane, undo record."""
        self.created.append(node)
        if before is not None and before is not self.before:
            self.moved_sizes.append(node)
        node.meta["val"] = fake_eval(self.fake_mode, node.target, node.args, node.kwargs)  # type: ignore[arg-type]
        node.meta["commfuse"] = {"site": self.site_id, "step": step, "lane": lane}
        if node.target in MATMULS:
            self.matmuls.setdefault(step, []).append(node)

    def size(self, size: dims.Size, step: int, before: Node | None = None) -> int | Node:
        """``size`` as an FX argument: the int, or a node computing the symbolic size."""
        if not isinstance(size, torch.SymInt) or size.node.maybe_as_int() is not None:
            return int(size)
        return self._expr(size.node.expr, step, before or self.before)

    def shape(self, shape: Sequence[dims.Size], step: int) -> list[int | Node]:
        """A view's shape argument: -1 stands for the one symbolic size, if only one is."""
        sizes = dims.sizes(shape)
        if [isinstance(s, torch.SymInt) for s in sizes].count(True) == 1:
            return [s if isinstance(s, int) else -1 for s in sizes]
        return [self.size(s, step) for s in sizes]

    def _expr(self, expr: sympy.Expr, step: int, before: Node) -> int | Node:
        if expr.is_Integer:
            return int(expr)
        key = (expr, before)
        if key not in self._size_nodes:
            self._size_nodes[key] = self._expr_node(expr, step, before)
        return self._size_nodes[key]

    def _expr_node(self, expr: sympy.Expr, step: int, before: Node) -> int | Node:
        """Nodes computing ``expr`` from the graph's inputs, built by torch's own sympy
        interpreter on FX proxies, then adopted like emitted nodes."""
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
            self._adopt(node, step, "compute", before)
        return result.node if isinstance(result, Proxy) else int(result)

    def discard(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()

    def commit(self, dead: Sequence[Node]) -> None:
        """Swap the results in, erase what became dead, keep the replaced nodes' names."""
        moved = set(self.moved_sizes)
        at_site = [node for node in self.created if node not in moved]
        first, moves = _inputs_to_hoist(at_site)
        self.committing = True
        for node in moves:
            first.prepend(node)
        for old, new in self.replace.items():
            old.replace_all_uses_with(new)
        erased = [*dead, *self.erased_sizes, *self.replace]
        for node in reversed(in_graph_order(erased)):
            if not node.users:
                self.graph.erase_node(node)
        for old, new in self.replace.items():
            if old._erased:
                new.name = old.name
        if any(position(u) < position(new) for new in self.replace.values() for u in new.users):
            # a ring nested in a later window: the views that read the tensor it rebuilds
            # stood where the collective was, and now follow it (nothing else moves)
            stable_topological_sort(self.graph)


Pending = tuple[Node | None, list[tuple[Transfer, Node]], list[Node]]


def start_transfers(
    rw: Rewrite,
    group: Group,
    tag: int,
    step: int,
    sends: Sequence[Any],
    recvs: Sequence[Any],
    held: dict[int, Node],
    recv_like: Node,
) -> Pending:
    """Start one batch of sends and receives; returns (p2p node, pending receives, the
    buffers sent, each once)."""
    if not sends and not recvs:
        return None, [], []
    buffers = [held[t.block] for t in sends]
    p2p = rw.emit(
        P2P,
        (
            buffers,
            [group.peer(t.peer) for t in sends],
            [recv_like] * len(recvs),
            [group.peer(t.peer) for t in recvs],
            tag,
            group.name,
            f"site {rw.site_id} step {step} ({rw.site.kind})",
            *((True,) if rw.timed else ()),
        ),
        step=step,
        lane="comm",
    )
    rw.p2p_ops += 1
    received = [
        rw.emit(operator.getitem, (p2p, i), step=step, lane="comm") for i in range(len(recvs))
    ]
    return p2p, list(zip(recvs, received, strict=True)), list(dict.fromkeys(buffers))


def wait_transfers(
    rw: Rewrite,
    step: int,
    recvs: list[tuple[Transfer, Node]],
    sent: list[Node],
    held: dict[Any, Node],
    by_peer: bool = False,
) -> list[Node]:
    """Wait every transfer of a P2P batch: each received tensor, which becomes held (by
    block, or by (block, peer) where partial sums of one block arrive from both sides),
    and each buffer sent, on which its send is registered (see ``p2p.py``): no compiler
    may reuse or write that memory before this wait."""
    waits = []
    for t, out in recvs:
        key = (t.block, t.peer) if by_peer else t.block
        held[key] = rw.emit(c10d.wait_tensor.default, (out,), step=step, lane="comm")
        waits.append(held[key])
    for buffer in sent:
        waits.append(rw.emit(c10d.wait_tensor.default, (buffer,), step=step, lane="comm"))
    return waits


# a block's rows of a tensor laid out like a matmul's A (its [M, c] rows), as a site
# kind cuts them: applied to A's per-row scale the way the kind cut A
Rows = Callable[[Node], Node]


def matmul(
    rw: Rewrite,
    mm: Matmul,
    a: Node,
    b: Node,
    step: int,
    rows: Rows | None = None,
    cols: tuple[int, dims.Size] | None = None,
) -> Node:
    """One block of ``mm``'s product, by ``mm``'s own op: ``a``, the block's rows of A (cut
    by ``rows``, or all of them), times ``b``, its columns of B (block ``cols`` = (index,
    width), or all). What goes with an operand follows it: the bias and B's per-column
    scale take the block's columns, A's per-row scale its rows; a per-tensor scale and a
    row-broadcast bias are shared by every block."""
    bias, scale_a, scale_b = mm.bias, mm.scale_a, mm.scale_b
    if cols is not None:
        bias = bias and column_block(rw, bias, *cols, step)
        scale_b = scale_b and column_block(rw, scale_b, *cols, step)
    if rows is not None and scale_a is not None and varies_by_row(scale_a):
        scale_a = _per_row(rw, rows(scale_a), step)
    args, kwargs = mm.args(a, b, bias=bias, scale_a=scale_a, scale_b=scale_b)
    return _emit_matmul(rw, mm, args, kwargs, step)


def _per_row(rw: Rewrite, scale: Node, step: int) -> Node:
    """A block's per-row scale, [rows, 1], with strides (1, 1): the CPU kernel checks the
    size-1 dim's stride too, and Inductor lays a view of a copy out with stride 0 there."""
    scale = contiguous(rw, scale, step)
    sizes = [rw.size(size, step) for size in val(scale).shape]
    return rw.emit(aten.as_strided.default, (scale, sizes, [1, 1]), step=step, lane="compute")


def _emit_matmul(
    rw: Rewrite, mm: Matmul, args: tuple[Any, ...], kwargs: dict[str, Any], step: int
) -> Node:
    """The block's matmul node. A scaled matmul's kernel may refuse a block the whole
    passed (CUDA's takes only dims divisible by 16, B column-major): declined then."""
    try:
        return rw.emit(mm.node.target, args, kwargs, step=step, lane="compute")  # type: ignore[arg-type]
    except RuntimeError as err:  # torch._check's error in the op's meta function
        if not mm.scaled:
            raise
        raise decline("lower.scaled_block", node=mm.node.name, error=err) from None


def chunk_width(width: dims.Size, k: int, what: str) -> dims.Size:
    if not dims.divisible(width, k):
        provably = " provably" if dims.is_symbolic([width]) else ""
        raise decline("lower.slices", k=k, provably=provably, what=what, size=width)
    return width // k


def slice_block(
    rw: Rewrite, node: Node, dim: int, index: int, width: dims.Size, step: int, lane: str
) -> Node:
    bounds = (rw.size(index * width, step), rw.size((index + 1) * width, step))
    return rw.emit(aten.slice.Tensor, (node, dim, *bounds), step=step, lane=lane)


def packed(rw: Rewrite, data: Node, scale: Node, step: int) -> Node:
    """One message of ``data`` (one-byte elements: float8) and its ``scale`` (float32):
    their bytes, the data's first (its kernels' pointer stays aligned; the scale's stays
    aligned while the data's bytes are a multiple of 16, ``unpacked``)."""
    parts = []
    for node in (data, scale):
        node = contiguous(rw, node, step)
        if val(node).dtype != torch.uint8:
            node = rw.emit(aten.view.dtype, (node, torch.uint8), step=step, lane="comm")
        parts.append(rw.emit(aten.view.default, (node, [-1]), step=step, lane="comm"))
    return rw.emit(aten.cat.default, (parts, 0), step=step, lane="comm")


def unpacked(rw: Rewrite, message: Node, data: Node, scale: Node, step: int) -> tuple[Node, Node]:
    """A ``packed`` message, as tensors like ``data`` and ``scale``: the data a view of
    it, the scale (a few bytes) copied into its own buffer."""
    nbytes = math.prod(val(data).shape)
    end = val(message).shape[0]
    out = []
    for node, bounds in ((data, (0, nbytes)), (scale, (nbytes, end))):
        part = rw.emit(
            aten.slice.Tensor, (message, 0, *(rw.size(b, step) for b in bounds)), step=step,
            lane="compute",
        )  # fmt: skip
        dtype = val(node).dtype
        if dtype != torch.uint8:
            part = rw.emit(aten.view.dtype, (part, dtype), step=step, lane="compute")
        out.append(viewed(rw, part, val(node).shape, step))
    copy = rw.emit(aten.clone.default, (out[1],), step=step, lane="compute")
    return out[0], copy


def row_block(rw: Rewrite, index: int, width: dims.Size, step: int) -> Rows:
    """Cuts rows [index * width, (index + 1) * width) of a 2-D tensor (a block of A's
    rows, and so of its per-row scale)."""
    return functools.partial(
        slice_block, rw, dim=0, index=index, width=width, step=step, lane="compute"
    )


def contiguous(rw: Rewrite, node: Node, step: int) -> Node:
    value = val(node)
    symbolic = dims.is_symbolic([*value.shape, *value.stride()])
    if is_contiguous_or_false(value) if symbolic else value.is_contiguous():
        return node
    return rw.emit(
        aten.clone.default,
        (node,),
        {"memory_format": torch.contiguous_format},
        step=step,
        lane="compute",
    )


def transposed(rw: Rewrite, node: Node, step: int) -> Node:
    # permute, not t: the graphs Inductor compiles have t decomposed
    return rw.emit(aten.permute.default, (node, [1, 0]), step=step, lane="compute")


def column_block(rw: Rewrite, node: Node, b: int, width: dims.Size, step: int) -> Node:
    """Columns [b*width, (b+1)*width) of ``node`` (kept whole if broadcast along them)."""
    if val(node).dim() == 0 or dims.equal(val(node).shape[-1], 1):
        return node
    return slice_block(rw, node, -1, b, width, step, "compute")


def accumulate(rw: Rewrite, mm: Matmul, total: Node | None, a: Node, b: Node, step: int) -> Node:
    """``total + a @ b``, ``a @ b`` one block of ``mm``'s contracting dim: one addmm in
    float32/64; half-precision partials are summed in float32 (as one matmul would
    accumulate them), see ``finish_sum``; a scaled matmul's partial is computed in float32
    (its scales, which the contracting dim does not cut, applied) and summed so."""
    if mm.scaled:
        args, kwargs = mm.args(a, b, bias=None, scale_result=None, out_dtype=torch.float32)
        part = _emit_matmul(rw, mm, args, kwargs, step)
    elif val(a).dtype in (torch.float32, torch.float64):
        if total is None:
            return rw.emit(aten.mm.default, (a, b), step=step, lane="compute")
        return rw.emit(aten.addmm.default, (total, a, b), step=step, lane="compute")
    else:
        part = rw.emit(aten.mm.default, (a, b), step=step, lane="compute")
        part = rw.emit(CONVERT, (part, torch.float32), step=step, lane="compute")
    if total is None:
        return part
    return rw.emit(aten.add.Tensor, (total, part), step=step, lane="compute")


def finish_sum(rw: Rewrite, total: Node, like: Node, step: int) -> Node:
    if val(total).dtype == val(like).dtype:
        return total
    return rw.emit(CONVERT, (total, val(like).dtype), step=step, lane="compute")


def viewed(rw: Rewrite, node: Node, shape: Sequence[dims.Size], step: int) -> Node:
    """``node`` viewed as ``shape``, copied first where its strides forbid the view."""
    if dims.same_shape(val(node).shape, shape):
        return node
    with rw.fake_mode:
        if not can_view(val(node), shape):
            node = contiguous(rw, node, step)
    return rw.emit(aten.view.default, (node, rw.shape(shape, step)), step=step, lane="compute")


def rows_of_block(rw: Rewrite, x: Node, dim: int, b: int, width: dims.Size, step: int) -> Node:
    """Block ``b`` along ``dim`` of ``x`` (shaped lead + [K]), as contiguous 2-D rows."""
    rows = contiguous(rw, slice_block(rw, x, dim, b, width, step, "compute"), step)
    k = val(rows).shape[-1]
    return viewed(rw, rows, [val(rows).numel() // k, k], step)


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


def _inputs_to_hoist(created: list[Node]) -> tuple[Node, list[Node]]:
    """Pure producers (weights, biases) that sit after the first new node, to move before it."""
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


def replay(
    rw: Rewrite, block: Node, chain: Sequence[tuple[Node, int]], n: int, step: int, lane: str
) -> Node:
    """``chain`` (layout ops, each with the dim of its output that holds the n blocks)
    applied to one block instead of the whole tensor: the same permutes, and views with
    that dim's size divided by n (copying first where the block's strides forbid one)."""
    for node, dim in chain:
        shape = list(val(node).shape)
        if node.target in VIEWS:
            shape[dim] = shape[dim] // n
            with rw.fake_mode:
                if not can_view(val(block), shape):
                    block = contiguous(rw, block, step)
            block = rw.emit(aten.view.default, (block, rw.shape(shape, step)), step=step, lane=lane)
        elif node.target in (aten.clone.default, aten.alias.default):
            block = contiguous(rw, block, step)
        else:  # a permute or transpose, written as a permute
            perm = [split_dim_in_input(node, d, n) for d in range(len(shape))]
            block = rw.emit(aten.permute.default, (block, perm), step=step, lane=lane)
    return block


def can_view(value: torch.Tensor, shape: Sequence[Any]) -> bool:
    try:
        value.view(dims.sizes(shape))
    except (RuntimeError, ValueError):  # a fake tensor's view raises ValueError
        return False
    return True


def new_tag() -> int:
    """The next site's P2P tag (see ``TAG_BASE``)."""
    return next(_tags)
