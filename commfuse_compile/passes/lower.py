"""Lower stage: emit a site's schedule as P2P steps with one partial matmul per step.

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
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import sympy
import torch
from torch._guards import detect_fake_mode
from torch._prims_common import is_contiguous_or_false
from torch.fx import Graph, Node
from torch.fx.proxy import GraphAppendingTracer, Proxy
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from ..groups import Group
from ..p2p import p2p_fake  # (importing it registers commfuse::p2p)
from ..report import decline
from ..schedules import Transfer, slicing
from . import dims
from .match import (
    SIZE_READERS,
    AgMmSite,
    Matmul,
    MmRsSite,
    Site,
    data_users,
    is_transpose_2d,
    val,
)

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
        node.meta["val"] = _fake_eval(self.fake_mode, node.target, node.args, node.kwargs)  # type: ignore[arg-type]
        node.meta["commfuse"] = {"site": self.site_id, "step": step, "lane": lane}
        if node.target in (aten.mm.default, aten.addmm.default):
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
                raise decline(f"cannot compute the symbolic size {expr} in the graph") from err
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
        for node in reversed(_in_graph_order(erased)):
            if not node.users:
                self.graph.erase_node(node)
        for old, new in self.replace.items():
            if old._erased:
                new.name = old.name


def start(site: Site, site_id: int, graph: Graph) -> Rewrite:
    """An empty rewrite of ``site``: where its nodes go, and the fake mode of their values."""
    if isinstance(site, AgMmSite):
        before, anchor = _first_consumer(site), site.shard
        _drop_uses_needing_own_result(site, before)
    else:
        before, anchor = site.reduce_scatter, site.terms[0].node
    fake_mode = detect_fake_mode([val(anchor)])
    if fake_mode is None:
        raise decline("graph values are not fake tensors; cannot compute new node metadata")
    return Rewrite(site, site_id, graph, before=before, fake_mode=fake_mode)


def lower(rw: Rewrite, group: Group, schedule: ModuleType, slices: int = 2) -> None:
    """Emit ``rw.site`` as ``schedule`` for this rank of ``group``."""
    sliced = schedule is slicing
    if isinstance(rw.site, AgMmSite):
        (_lower_gather_sliced if sliced else _lower_gather)(rw, rw.site, group, schedule, slices)
    else:
        (_lower_reduce_sliced if sliced else _lower_reduce)(rw, rw.site, group, schedule, slices)
    _keep_size_readers(rw, site_nodes(rw.site))


def site_nodes(site: Site) -> list[Node]:
    """The nodes a rewrite of ``site`` replaces: erased at commit once nothing reads them."""
    if isinstance(site, AgMmSite):
        return [*site.gathers, *site.waits, *site.chain, *(u.mm.node for u in site.uses)]
    return [site.reduce_scatter, site.wait, *site.chain, *(t.node for t in site.terms)]


def _keep_size_readers(rw: Rewrite, nodes: Sequence[Node]) -> None:
    """Dynamic-shape graphs read sizes of the nodes the commit erases (``sym_size``): a
    size computation that only feeds erased nodes goes with them; a size reader that
    something else uses is recomputed from the graph's inputs, where it stands. Only the
    sizes next to the erased nodes are looked at."""
    erased: set[Node] = set()
    for node in reversed(_in_graph_order(nodes)):
        if node in rw.replace or all(u in erased or _is_size(u) for u in node.users):
            erased.add(node)
    replaced = set(rw.replace)  # their readers follow the replacement, of the same shape
    for node in reversed(_in_graph_order(_sizes_around(erased))):
        if node in erased or node.op != "call_function":
            continue
        reads = set(node.all_input_nodes) & erased
        if all(u in erased for u in node.users) and (node.users or reads):
            erased.add(node)
            rw.erased_sizes.append(node)
        elif reads - replaced:
            if node.target not in SIZE_READERS:
                raise decline(f"size {node.name} is computed from a replaced tensor")
            value = node.meta["val"]
            if not isinstance(value, torch.SymInt):
                raise decline(f"size {node.name} of a replaced tensor is not a SymInt")
            new = rw.size(value, step=0, before=node)
            if not isinstance(new, Node):
                raise decline(f"size {node.name} of a replaced tensor is a constant")
            rw.replace[node] = new


def _sizes_around(erased: set[Node]) -> set[Node]:
    """Size computations that read an erased node, and those feeding erased nodes only
    (transitively: a size whose every reader is such a size)."""
    found = {u for node in erased for u in node.users if u not in erased and _is_size(u)}
    stack = [i for node in erased for i in node.all_input_nodes if _is_size(i)]
    while stack:
        node = stack.pop()
        if node in found or node in erased:
            continue
        if all(u in erased or u in found for u in node.users):
            found.add(node)
            stack += [i for i in node.all_input_nodes if _is_size(i)]
    return found


def _is_size(node: Node) -> bool:
    """Does ``node`` compute a size (an int or SymInt), not a tensor?"""
    value = node.meta.get("val")
    return isinstance(value, int | torch.SymInt | torch.SymBool) and not node.is_impure()


# ----------------------------------------------------------------------------------------


class _GatherProducts:
    """What every use of the gathered tensor computes from one piece of it.

    A piece is block ``index`` of ``count`` equal blocks along the gathered dim (a shard,
    or a chunk of a shard under slicing); rows/columns uses keep a product block per
    piece, contracting uses add the piece's partial product to a running sum."""

    def __init__(self, rw: Rewrite, site: AgMmSite) -> None:
        self.rw, self.site = rw, site
        self.blocks: list[dict[int, Node]] = [{} for _ in site.uses]
        self.sums: list[Node | None] = [None for _ in site.uses]
        self.others: dict[int, Node] = {}  # contract: the other operand viewed like G

    def add(self, piece: Node, index: int, shape: Sequence[dims.Size], s: int) -> None:
        rw, site = self.rw, self.site
        width = shape[site.gather_dim]
        views: dict[tuple[int | str, ...], Node] = {}  # one 2-D view of the piece per shape
        for i, use in enumerate(site.uses):
            mm, lead = use.mm, shape[: use.row_dims]
            shape2d = (math.prod(lead), math.prod(shape[use.row_dims :]))
            key = tuple(dims.as_json(shape2d))
            if key not in views:
                views[key] = rw.emit(
                    aten.view.default, (piece, rw.shape(shape2d, s)), step=s, lane="compute"
                )
            g2d = views[key]
            if use.role == "rows":
                part = _matmul(rw, mm, g2d, mm.b, mm.bias, s)
                self.blocks[i][index] = _viewed(rw, part, [*lead, val(part).shape[1]], s)
            elif use.role == "columns":
                bias = mm.bias and _column_block(rw, mm.bias, index, shape2d[0], s)
                self.blocks[i][index] = _matmul(rw, mm, mm.a, _transposed(rw, g2d, s), bias, s)
            elif use.role == "contract":
                if i not in self.others:
                    k = val(mm.b).shape[1]
                    self.others[i] = _viewed(rw, mm.b, [*site.gathered_shape[: use.row_dims], k], s)
                x_b = _rows_of_block(rw, self.others[i], site.gather_dim, index, width, s)
                self.sums[i] = _accumulate(rw, self.sums[i], _transposed(rw, g2d, s), x_b, s)
            else:  # contract_left
                y_b = _column_block(rw, mm.a, index, shape2d[0], s)
                self.sums[i] = _accumulate(rw, self.sums[i], y_b, g2d, s)

    def finish(self, count: int, step: int) -> None:
        """Assemble the ``count`` pieces' products into each matmul's replacement."""
        rw, site = self.rw, self.site
        for i, use in enumerate(site.uses):
            total = self.sums[i]
            if total is not None:
                rw.replace[use.mm.node] = _finish_sum(rw, total, use.mm.node, step)
                continue
            dim = site.gather_dim if use.role == "rows" else 1
            pieces = [self.blocks[i][b] for b in range(count)]
            full = rw.emit(aten.cat.default, (pieces, dim), step=step, lane="compute")
            rw.replace[use.mm.node] = _viewed(rw, full, list(val(use.mm.node).shape), step)


def _lower_gather(
    rw: Rewrite, site: AgMmSite, group: Group, schedule: ModuleType, slices: int
) -> None:
    n, tag = group.size, next(_tags)
    shard_shape = dims.sizes(val(site.shard).shape)
    held: dict[int, Node] = {group.rank: _local_shard(rw, site)}
    products = _GatherProducts(rw, site)
    for s, step in enumerate(schedule.gather_steps(group.rank, n)):
        issue, recvs, sent = _issue(
            rw, group, tag, s, step.sends, step.recvs, held, recv_like=site.shard
        )
        for b in step.compute:
            products.add(held[b], b, shard_shape, s)
        waits = _wait_all(rw, s, recvs, sent, held)
        rw.steps.append(Step(issue, rw.matmuls.get(s, []), waits))
    last = len(rw.steps)
    products.finish(n, last)
    _rebuild_gathered(rw, site, [held[b] for b in range(n)], last)


def _lower_gather_sliced(
    rw: Rewrite, site: AgMmSite, group: Group, schedule: ModuleType, k: int
) -> None:
    """k all-gathers of shard chunks along the gathered dim, chunk i-1's matmuls under
    chunk i's all-gather; piece (b, i) is block b*k + i of the gathered dim."""
    n, dim = group.size, site.gather_dim
    shard_shape = dims.sizes(val(site.shard).shape)
    width = _chunk_width(shard_shape[dim], k, f"the shard's dim {dim}")
    chunk_shape = [*shard_shape[:dim], width, *shard_shape[dim + 1 :]]
    gathering: dict[int, Node] = {}
    pieces: dict[tuple[int, int], Node] = {}  # (block, chunk) -> gathered piece
    products = _GatherProducts(rw, site)
    for s, step in enumerate(schedule.gather_steps(k)):
        issue = None
        if step.issue is not None:
            chunk = _contiguous(rw, _slice(rw, site.shard, dim, step.issue, width, s, "comm"), s)
            issue = gathering[step.issue] = rw.emit(
                c10d.all_gather_into_tensor.default, (chunk, n, group.name), step=s, lane="comm"
            )
        if step.compute is not None:
            for b in range(n):
                index = b * k + step.compute
                products.add(pieces[b, step.compute], index, chunk_shape, s)
        waits = []
        if step.wait is not None:
            gathered = rw.emit(
                c10d.wait_tensor.default, (gathering[step.wait],), step=s, lane="comm"
            )
            waits.append(gathered)
            for b in range(n):
                pieces[b, step.wait] = _slice(rw, gathered, 0, b, chunk_shape[0], s, "comm")
        rw.steps.append(Step(issue, rw.matmuls.get(s, []), waits))
    last = len(rw.steps)
    products.finish(n * k, last)
    if _gathered_outlives(site):
        shards = [
            rw.emit(
                aten.cat.default, ([pieces[b, i] for i in range(k)], dim), step=last, lane="comm"
            )
            for b in range(n)
        ]
        _rebuild_gathered(rw, site, shards, last)


def _local_shard(rw: Rewrite, site: AgMmSite) -> Node:
    """The shard as every block is viewed (2-D rows): copied once if it is neither
    contiguous nor 2-D already (received blocks always are contiguous)."""
    shard = val(site.shard)
    if shard.dim() == 2 or is_contiguous_or_false(shard):
        return site.shard
    return _contiguous(rw, site.shard, 0)


def _rebuild_gathered(rw: Rewrite, site: AgMmSite, shards: list[Node], step: int) -> None:
    """all_gather_into_tensor's value, rebuilt from the shards: never gather twice."""
    if _gathered_outlives(site):
        rebuilt = rw.emit(aten.cat.default, (shards, 0), step=step, lane="comm")
        for wait in site.waits:
            rw.replace[wait] = rebuilt


def _chunk_width(width: dims.Size, k: int, what: str) -> dims.Size:
    if not dims.divisible(width, k):
        provably = " provably" if dims.is_symbolic([width]) else ""
        raise decline(f"slicing: {k} chunks do not{provably} divide {what} of size {width}")
    return width // k


def _slice(
    rw: Rewrite, node: Node, dim: int, index: int, width: dims.Size, step: int, lane: str
) -> Node:
    bounds = (rw.size(index * width, step), rw.size((index + 1) * width, step))
    return rw.emit(aten.slice.Tensor, (node, dim, *bounds), step=step, lane=lane)


def _contiguous(rw: Rewrite, node: Node, step: int) -> Node:
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


def _transposed(rw: Rewrite, node: Node, step: int) -> Node:
    # permute, not t: the graphs Inductor compiles have t decomposed
    return rw.emit(aten.permute.default, (node, [1, 0]), step=step, lane="compute")


def _column_block(rw: Rewrite, node: Node, b: int, width: dims.Size, step: int) -> Node:
    """Columns [b*width, (b+1)*width) of ``node`` (kept whole if broadcast along them)."""
    if val(node).dim() == 0 or dims.equal(val(node).shape[-1], 1):
        return node
    return _slice(rw, node, -1, b, width, step, "compute")


def _accumulate(rw: Rewrite, total: Node | None, a: Node, b: Node, step: int) -> Node:
    """``total + a @ b``: one addmm in float32/64; half-precision partials are summed in
    float32 (as one matmul would accumulate them), see ``_finish_sum``."""
    if val(a).dtype in (torch.float32, torch.float64):
        if total is None:
            return rw.emit(aten.mm.default, (a, b), step=step, lane="compute")
        return rw.emit(aten.addmm.default, (total, a, b), step=step, lane="compute")
    part = rw.emit(aten.mm.default, (a, b), step=step, lane="compute")
    part = rw.emit(CONVERT, (part, torch.float32), step=step, lane="compute")
    if total is None:
        return part
    return rw.emit(aten.add.Tensor, (total, part), step=step, lane="compute")


def _finish_sum(rw: Rewrite, total: Node, like: Node, step: int) -> Node:
    if val(total).dtype == val(like).dtype:
        return total
    return rw.emit(CONVERT, (total, val(like).dtype), step=step, lane="compute")


def _viewed(rw: Rewrite, node: Node, shape: Sequence[dims.Size], step: int) -> Node:
    if dims.same_shape(val(node).shape, shape):
        return node
    return rw.emit(aten.view.default, (node, rw.shape(shape, step)), step=step, lane="compute")


def _rows_of_block(rw: Rewrite, x: Node, dim: int, b: int, width: dims.Size, step: int) -> Node:
    """Block ``b`` along ``dim`` of ``x`` (shaped lead + [K]), as contiguous 2-D rows."""
    rows = _contiguous(rw, _slice(rw, x, dim, b, width, step, "compute"), step)
    k = val(rows).shape[-1]
    return _viewed(rw, rows, [val(rows).numel() // k, k], step)


def _gathered_outlives(site: AgMmSite) -> bool:
    """Is the gathered value read by anything other than the rewritten matmuls?"""
    inside = set(site.chain) | {u.mm.node for u in site.uses}
    nodes = (*site.waits, *site.chain)
    return any(user not in inside for node in nodes for user in data_users(node))


# ----------------------------------------------------------------------------------------


def _lower_reduce(
    rw: Rewrite, site: MmRsSite, group: Group, schedule: ModuleType, slices: int
) -> None:
    n, tag = group.size, next(_tags)
    width = site.product_shape[site.scatter_dim] // n
    pending: Pending = (None, [], [])
    received: dict[tuple[int, int], Node] = {}  # (block, peer) -> partial sum from that peer
    sums: dict[int, Node] = {}
    for s, step in enumerate(schedule.reduce_steps(group.rank, n)):
        parts = {b: _reduce_part(rw, site, b, width, s) for b in step.blocks}
        issue, recvs, sent = pending
        waits = _wait_all(rw, s, recvs, sent, received, by_peer=True)
        rw.steps.append(Step(issue, rw.matmuls.get(s, []), waits))
        sums = dict(parts)
        for t in step.adds:
            sums[t.block] = rw.emit(
                aten.add.Tensor,
                (sums[t.block], received.pop((t.block, t.peer))),
                step=s,
                lane="compute",
            )
        like = next(iter(parts.values()))
        pending = _issue(rw, group, tag, s, step.sends, step.recvs, sums, recv_like=like)
    assert not pending[1] and not pending[2] and not received
    out_shape = rw.shape(val(site.wait).shape, n)
    rw.replace[site.wait] = rw.emit(
        aten.view.default, (sums[group.rank], out_shape), step=n, lane="compute"
    )


def _lower_reduce_sliced(
    rw: Rewrite, site: MmRsSite, group: Group, schedule: ModuleType, k: int
) -> None:
    """Chunk i of every block is computed, stacked and reduce-scattered while chunk i+1
    is computed; this rank's k reduced chunks are its block."""
    n, dim = group.size, site.scatter_dim
    width = _chunk_width(site.product_shape[dim] // n, k, f"a block's dim {dim}")
    parts: dict[tuple[int, int], Node] = {}  # (block, chunk) -> this rank's partial
    reducing: dict[int, Node] = {}
    own: dict[int, Node] = {}
    for s, step in enumerate(schedule.reduce_steps(k)):
        issue = None
        if step.issue is not None:
            stacked = rw.emit(
                aten.cat.default,
                ([parts[b, step.issue] for b in range(n)], 0),
                step=s,
                lane="comm",
            )
            issue = reducing[step.issue] = rw.emit(
                c10d.reduce_scatter_tensor.default,
                (stacked, "sum", n, group.name),
                step=s,
                lane="comm",
            )
        if step.compute is not None:
            for b in range(n):
                parts[b, step.compute] = _reduce_part(rw, site, b * k + step.compute, width, s)
        waits = []
        if step.wait is not None:
            own[step.wait] = rw.emit(
                c10d.wait_tensor.default, (reducing[step.wait],), step=s, lane="comm"
            )
            waits.append(own[step.wait])
        rw.steps.append(Step(issue, rw.matmuls.get(s, []), waits))
    last = len(rw.steps)
    if site.columns:
        chunks, cat_dim = [own[i] for i in range(k)], 1
    else:
        shape = [*site.product_shape[:dim], width, *site.product_shape[dim + 1 :]]
        chunks, cat_dim = [_viewed(rw, own[i], shape, last) for i in range(k)], dim
    block = rw.emit(aten.cat.default, (chunks, cat_dim), step=last, lane="compute")
    rw.replace[site.wait] = _viewed(rw, block, val(site.wait).shape, last)


def _reduce_part(rw: Rewrite, site: MmRsSite, b: int, width: dims.Size, step: int) -> Node:
    """This rank's partial of block ``b`` of the product: the sum over the site's terms."""
    part = None
    for term in site.terms:
        term_part = _reduce_block(rw, site, term, b, width, step)
        part = (
            term_part
            if part is None
            else rw.emit(aten.add.Tensor, (part, term_part), step=step, lane="compute")
        )
    assert part is not None
    return part


def _reduce_block(
    rw: Rewrite, site: MmRsSite, mm: Matmul, b: int, width: dims.Size, step: int
) -> Node:
    """This rank's partial of block ``b`` of the product ``mm``."""
    if site.columns:
        w = _column_block(rw, mm.b, b, width, step)
        bias = mm.bias and _column_block(rw, mm.bias, b, width, step)
        return _matmul(rw, mm, mm.a, w, bias, step)
    if len(site.product_shape) == 2 and is_transpose_2d(mm.a):
        # rows of t(Z) are columns of Z: slice Z and transpose the block, no copy
        cols = _slice(rw, mm.a.args[0], 1, b, width, step, "compute")  # type: ignore[arg-type]
        rows = rw.emit(aten.permute.default, (cols, [1, 0]), step=step, lane="compute")
    else:
        k = val(mm.a).shape[1]
        a = _viewed(rw, mm.a, [*site.product_shape[:-1], k], step)
        rows = _rows_of_block(rw, a, site.scatter_dim, b, width, step)
    return _matmul(rw, mm, rows, mm.b, mm.bias, step)


# ----------------------------------------------------------------------------------------


Pending = tuple[Node | None, list[tuple[Transfer, Node]], list[Node]]


def _issue(
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


def _wait_all(
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


def _matmul(rw: Rewrite, mm: Matmul, a: Node, b: Node, bias: Node | None, step: int) -> Node:
    if bias is None:
        return rw.emit(aten.mm.default, (a, b), step=step, lane="compute")
    return rw.emit(
        aten.addmm.default, (bias, a, b), dict(mm.node.kwargs), step=step, lane="compute"
    )


def _first_consumer(site: AgMmSite) -> Node:
    """Earliest node that reads a gathered value: the ring must be done by then."""
    readers = [u for wait in site.waits for u in wait.users]
    if not readers:  # pragma: no cover - matched sites have one
        raise decline("gathered value has no reader")
    return min(readers, key=_position)


def _position(node: Node) -> Any:
    """Where ``node`` stands in its graph, comparable in O(1) (FX keeps these keys in
    graph order as nodes are inserted): no walk over the graph per site."""
    return node._sort_key


def _drop_uses_needing_own_result(site: AgMmSite, before: Node) -> None:
    """A matmul whose other operand is computed from this site's own result (a consumer
    reached again later, e.g. dX = dY @ W where dY comes from W's recomputed forward)
    cannot share the ring: it keeps reading the (rebuilt) gathered tensor instead."""
    own = {*site.waits, *site.chain, *(u.mm.node for u in site.uses)}
    start = _position(before)

    def depends(node: Node) -> bool:
        stack, seen = [node], set()
        while stack:
            current = stack.pop()
            if current in own:
                return True
            if _position(current) >= start and current not in seen:
                seen.add(current)
                stack += current.all_input_nodes
        return False

    kept = []
    for use in site.uses:
        operands = [use.mm.a, use.mm.b] + ([use.mm.bias] if use.mm.bias is not None else [])
        others = [op for op in operands if op not in own]
        if any(depends(op) for op in others):
            site.unmatched.append(
                f"{use.mm.node.name} ({use.role}): its other operand is "
                "computed from this site's own result"
            )
        else:
            kept.append(use)
    if not kept:
        raise decline("; ".join(site.unmatched))
    site.uses = kept


def _inputs_to_hoist(created: list[Node]) -> tuple[Node, list[Node]]:
    """Pure producers (weights, biases) that sit after the first new node, to move before it."""
    first = min(created, key=_position)
    new, moves = set(created), dict[Node, None]()

    def visit(node: Node) -> None:
        if node in new or node in moves or _position(node) < _position(first):
            return
        if (
            node.op != "call_function"
            or node.is_impure()
            or node.target is c10d.wait_tensor.default
        ):
            raise decline(f"input {node.name} is computed after the site and cannot move")
        for arg in node.all_input_nodes:
            visit(arg)
        moves[node] = None

    for node in created:
        for arg in node.all_input_nodes:
            visit(arg)
    return first, list(moves)


def _in_graph_order(nodes: Iterable[Node]) -> list[Node]:
    return sorted(set(nodes), key=_position)


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
        raise decline(f"no graph input holds the symbolic size {symbol}")
    return _SYMBOL_SOURCES[graph][symbol]


# the inputs of a graph, read once per graph (they do not change during the pass)
_SYMBOL_SOURCES: weakref.WeakKeyDictionary[Graph, dict[sympy.Symbol, tuple[Node, int | None]]]
_SYMBOL_SOURCES = weakref.WeakKeyDictionary()


def _fake_eval(
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
