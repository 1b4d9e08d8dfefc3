"""Matmul -> reduce-scatter: the reduce-scatter sums a product (or a sum of products of
one shape) over ranks, so each block of it can be sent on while the next is computed.

The scattered dim is followed back through the split + cat DTensor emits and through
views to the product, where it is a block of its rows or of its columns. A dtype cast on
the way (mixed precision: a bfloat16 weight gradient reduced in float32) is element by
element, so it commutes with all of that: each block's partial is cast as the
collective's operand was, and the partial sums are added in the collective's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any, ClassVar

import torch
from torch.fx import Graph, Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule
from .. import dims
from ..blocks import chunk_width, column_block, matmul, rows_of_block, slice_block, viewed
from ..declines import Declined, decline
from ..emit import Emitter
from ..graph import (
    CONVERT,
    FLOAT8_DTYPES,
    VIEWS,
    Matmul,
    bias_is_row_broadcast,
    cast_to,
    check_tensor,
    comes_from_matmul,
    data_users,
    has_zero_size_dim,
    is_matmul,
    is_transpose_2d,
    node_arg,
    normalized_dim,
    numel,
    op_name,
    ordered_getitems,
    scales_problem,
    the_wait,
    val,
    view_sources,
)
from ..rewrite import Rewrite, Taken
from ..ring import compute_then_send, replace_collective, sliced
from ..site import Site
from ..site_kind import SiteKind

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# "avg" is the sum divided by the group size (``Partial("avg")``, hand-written functional
# code): the blocks are summed as for "sum" and this rank's block is scaled once.
REDUCE_OPS = ("sum", "avg")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MmRsSite(Site):
    """reduce_scatter(sum of ``terms``): one matmul, or the sum of several with one shape
    (the backward of an input shared by several linears, e.g. gate and up)."""

    kind: ClassVar[str] = "mm_rs"
    reduce_scatter: Node
    wait: Node
    terms: tuple[Matmul, ...]
    scatter_dim: int  # dim of the product's (viewed) shape that is scattered
    product_shape: tuple[dims.Size, ...] = ()  # the product as the reduce-scatter sees it
    columns: bool = False  # scatter dim is the product's last (N) dim
    reduce_op: str = "sum"  # or "avg": the sum, scaled by 1/n once, on this rank's block
    chain: tuple[Node, ...] = ()

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.reduce_scatter,)

    def replaced(self) -> list[Node]:
        return [self.reduce_scatter, self.wait, *self.chain, *(t.node for t in self.terms)]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.reduce_scatter.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "scatter_dim": self.scatter_dim,
            "product_shape": dims.as_json(self.product_shape),
            "matmuls": [t.node.name for t in self.terms],
            "blocks": "columns" if self.columns else "rows",
            "reduce_op": self.reduce_op,
        }


class MmRs(SiteKind[MmRsSite]):
    name = "mm_rs"
    direction = Direction.REDUCE
    nests = False

    def find(self, graph: Graph) -> list[MmRsSite]:
        nodes = graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
        # (not the slicing schedule's own chunk collectives)
        found = (_match(n, Taken()) for n in nodes if "commfuse" not in n.meta)
        return [site for site in found if site is not None]

    def rematch(self, site: MmRsSite, taken: Taken) -> MmRsSite | None:
        return _match(site.reduce_scatter, taken)

    def without(self, site: MmRsSite, disabled: frozenset[str]) -> MmRsSite:
        return site  # one product: nothing to leave out but the whole site

    def work(self, site: MmRsSite, n: int) -> Work:
        out = site.terms[0].node
        flops = sum(2 * numel(out) * dims.hint(val(t.a).shape[1]) for t in site.terms)
        out_bytes = numel(out) * val(site.reduce_scatter).element_size()  # as it travels
        return Work(self.direction, n, flops / n, out_bytes / n, len(site.terms))

    def start(self, site: MmRsSite, taken: Taken) -> tuple[MmRsSite, Node]:
        return site, site.reduce_scatter

    def lower(
        self, rw: Rewrite, site: MmRsSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        if schedule.sliced:
            _lower_sliced(rw, site, group, schedule, slices)
        else:
            _lower(rw, site, group, schedule)


KIND = MmRs()


# ----------------------------------------------------------------------------------------
# find


def _match(rs: Node, taken: Taken) -> MmRsSite | None:
    inp, reduce_op, n, group_name = (node_arg(rs, i, "") for i in range(4))
    wait = the_wait(rs)
    casts: list[Node] = []
    scattered, g, chain = _scattered(_through_casts(inp, casts), int(n))
    chain += casts
    product = _through_views(scattered, chain, casts=True)
    terms, between = _sum_of_matmuls(product)
    window = taken.window(product)  # of an all-gather site that rewrote its matmul
    from_matmul = comes_from_matmul(inp) or any(is_matmul(a) for a in view_sources(product))
    if not terms and not from_matmul and window is None:
        return None
    fields: dict[str, Any] = {}
    declined = None
    try:
        fields = _checked(rs, wait, inp, reduce_op, int(n), scattered, g, product, terms, window)
    except Declined as why:
        declined = why.kept()
    return MmRsSite(
        reduce_scatter=rs,
        wait=wait or rs,
        terms=tuple(terms),
        group_name=str(group_name),
        group_size=int(n),
        scatter_dim=g,
        reduce_op=str(reduce_op),
        chain=tuple(chain + between),
        declined=declined,
        **fields,
    )


def _checked(
    rs: Node,
    wait: Node | None,
    inp: Node,
    reduce_op: str,
    n: int,
    scattered: Node,
    g: int,
    product: Node,
    terms: list[Matmul],
    window: tuple[int, int] | None,
) -> dict[str, Any]:
    """The site's product shape and block layout, or the first reason it cannot be
    rewritten (in the order a user would fix them). ``window``: the rewrite window that
    emitted the product, if another site's rewrite did."""
    if wait is None or wait.target is not c10d.wait_tensor.default:
        raise decline("site.wait", node=rs.name)
    if not wait.users:
        raise decline("site.unread", node=rs.name)
    if window is not None:
        raise decline("rs.taken", site=window[0])
    if any(a.target is aten.constant_pad_nd.default for a in (inp, *inp.all_input_nodes)):
        raise decline("rs.padded")
    if not terms:
        raise decline("rs.not_matmul", node=product.name, op=op_name(product))
    if reduce_op not in REDUCE_OPS:
        raise decline("rs.not_sum", op=reduce_op)
    if n < 2:
        raise decline("site.group_of_one")
    shape = dims.sizes(val(scattered).shape)
    if not dims.divisible(shape[g], n):
        symbolic = dims.is_symbolic(shape[g : g + 1])
        code = "rs.not_provably_divisible" if symbolic else "rs.indivisible"
        raise decline(code, dim=g, size=shape[g], n=n)
    rows, cols = terms[0].out_shape
    for term in terms:
        name = term.node.name
        if len(data_users(term.node)) != 1:
            raise decline("rs.product_shared", node=name)
        check_tensor(term.node, "matmul output")
        if has_zero_size_dim(term):
            raise decline("site.empty", node=name)
        if not dims.same_shape(term.out_shape, (rows, cols)):
            raise decline("rs.shapes_differ", node=name)
        if term.bias is not None and not bias_is_row_broadcast(term.bias):
            raise decline("rs.bias_rows", node=name)
        if problem := scales_problem(term):
            raise decline("site.scales", node=name, problem=problem)
        if val(term.node).dtype in FLOAT8_DTYPES:
            raise decline("rs.scaled_sum", node=name, dtype=val(term.node).dtype)
    columns = g == len(shape) - 1 and dims.equal(shape[-1], cols)
    rows_match = dims.equal(shape[-1], cols) and dims.equal(math.prod(shape[:-1]), rows)
    if not columns and not rows_match:
        raise decline("rs.not_a_block", dim=g, shape=list(shape), rows=rows, cols=cols)
    return {"product_shape": shape, "columns": columns}


def _through_views(node: Node, chain: list[Node], casts: bool = False) -> Node:
    """The producer of ``node`` behind single-user views and transposes that cancel in
    pairs (AOTAutograd writes a weight gradient as ``t(t(mm(...)))``), and with ``casts``
    dtype casts too (between the product and the collective, not on one summed term),
    added to ``chain``."""
    while len(data_users(node)) == 1:
        source = node_arg(node, 0, "self")
        if node.target in VIEWS:
            chain.append(node)
            node = source
        elif casts and cast_to(node) is not None:
            node = _through_casts(node, chain)
        elif is_transpose_2d(node):
            between: list[Node] = []
            inner = _through_casts(source, between) if casts else source
            if not is_transpose_2d(inner) or len(data_users(inner)) != 1:
                break
            chain += [node, *between, inner]
            node = node_arg(inner, 0, "self")
        else:
            break
    return node


def _through_casts(node: Node, chain: list[Node]) -> Node:
    """The input of ``node`` behind single-user dtype casts, added to ``chain``."""
    while cast_to(node) is not None and len(data_users(node)) == 1:
        chain.append(node)
        node = node_arg(node, 0, "self")
    return node


def _sum_of_matmuls(node: Node) -> tuple[list[Matmul], list[Node]]:
    """(matmul terms, add/view nodes between) if ``node`` is a matmul or a sum of them."""
    mm = Matmul.of(node)
    if mm is not None:
        return [mm], []
    plain_add = node.target is aten.add.Tensor and node_arg(node, 2, "alpha", 1) == 1
    if not plain_add or not all(isinstance(a, Node) for a in node.args[:2]):
        return [], []
    terms, between = [], [node]
    for arg in node.args[:2]:
        source = _through_views(arg, between)  # type: ignore[arg-type]
        single = len(data_users(source)) == 1
        sub_terms, sub_between = _sum_of_matmuls(source) if single else ([], [])
        if not sub_terms:
            return [], []
        terms += sub_terms
        between += sub_between
    return terms, between


def _scattered(inp: Node, n: int) -> tuple[Node, int, list[Node]]:
    """(product as scattered, scatter dim, nodes): DTensor scatters dim g via split + cat."""
    if inp.target is aten.cat.default:
        parts: list[Node] = list(node_arg(inp, 0, "tensors"))
        sources = {node_arg(p, 0, "self") for p in parts if p.target is operator.getitem}
        if node_arg(inp, 1, "dim", 0) == 0 and len(sources) == 1 and len(parts) == n:
            split: Node = sources.pop()
            if split.target is aten.split.Tensor and ordered_getitems(split, n) == parts:
                product: Node = node_arg(split, 0, "self")
                g = normalized_dim(product, node_arg(split, 2, "dim", 0))
                return product, g, [inp, split, *parts]
    return inp, 0, []


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: MmRsSite, group: Group, schedule: Schedule) -> None:
    """Each step computes one block's partial, adds the partial sums received for it and
    sends it on; this rank's own block comes last and is its result."""
    n = group.size
    width = site.product_shape[site.scatter_dim] // n

    def compute(b: int, s: int) -> Node:
        return _reduce_part(rw.emit, site, b, width, s)

    held = compute_then_send(rw, group, schedule, Direction.REDUCE, compute)
    assert list(held) == [group.rank], "every partial sum received was added"
    own = _averaged(rw.emit, site, held[group.rank], n, n)
    out_shape = rw.emit.shape(val(site.wait).shape, n)
    result = rw.emit(aten.view.default, (own, out_shape), step=n, lane="compute")
    replace_collective(rw, [site.reduce_scatter], [site.wait], result)


def _lower_sliced(rw: Rewrite, site: MmRsSite, group: Group, schedule: Schedule, k: int) -> None:
    """Chunk i of every block is computed, stacked and reduce-scattered while chunk i+1
    is computed; this rank's k reduced chunks are its block."""
    em, n, dim = rw.emit, group.size, site.scatter_dim
    width = chunk_width(site.product_shape[dim] // n, k, f"a block's dim {dim}")
    parts: dict[tuple[int, int], Node] = {}  # (block, chunk) -> this rank's partial
    own: dict[int, Node] = {}

    def issue(i: int, s: int) -> Node:
        stacked = em(aten.cat.default, ([parts[b, i] for b in range(n)], 0), step=s, lane="comm")
        scatter = c10d.reduce_scatter_tensor.default
        return em(scatter, (stacked, "sum", n, group.name), step=s, lane="comm")

    def compute(i: int, s: int) -> None:
        for b in range(n):
            parts[b, i] = _reduce_part(em, site, b * k + i, width, s)

    def collected(i: int, reduced: Node, s: int) -> None:
        own[i] = reduced

    sliced(rw, schedule, Direction.REDUCE, k, issue, compute, collected)
    last = len(rw.steps)
    if site.columns:
        chunks, cat_dim = [own[i] for i in range(k)], 1
    else:
        shape = [*site.product_shape[:dim], width, *site.product_shape[dim + 1 :]]
        chunks, cat_dim = [viewed(em, own[i], shape, last) for i in range(k)], dim
    whole = em(aten.cat.default, (chunks, cat_dim), step=last, lane="compute")
    block = _averaged(em, site, whole, n, last)
    result = viewed(em, block, val(site.wait).shape, last)
    replace_collective(rw, [site.reduce_scatter], [site.wait], result)


def _averaged(em: Emitter, site: MmRsSite, block: Node, n: int, step: int) -> Node:
    """This rank's reduced block as the collective returns it: under "avg", the sum over
    ranks divided by n (the chunks are reduced with "sum": gloo has no "avg", and one
    division of the whole block is what the collective computes)."""
    if site.reduce_op != "avg":
        return block
    return em(aten.div.Tensor, (block, n), step=step, lane="compute")


def _reduce_part(em: Emitter, site: MmRsSite, b: int, width: dims.Size, step: int) -> Node:
    """This rank's partial of block ``b`` of the product: the sum over the site's terms,
    cast to the collective's dtype where a cast stood before it (so the partial sums are
    added in that dtype, as the collective adds them)."""
    part = None
    for term in site.terms:
        term_part = _reduce_block(em, site, term, b, width, step)
        part = (
            term_part
            if part is None
            else em(aten.add.Tensor, (part, term_part), step=step, lane="compute")
        )
    assert part is not None
    dtype = val(site.reduce_scatter).dtype
    if val(part).dtype != dtype:
        part = em(CONVERT, (part, dtype), step=step, lane="compute")
    return part


def _reduce_block(
    em: Emitter, site: MmRsSite, mm: Matmul, b: int, width: dims.Size, step: int
) -> Node:
    """This rank's partial of block ``b`` of the product ``mm``."""
    if site.columns:
        w = column_block(em, mm.b, b, width, step)
        return matmul(em, mm, mm.a, w, step, cols=(b, width))
    rows = functools.partial(_block_rows, em, site, b, width, step)
    if len(site.product_shape) == 2 and is_transpose_2d(mm.a):
        # rows of t(Z) are columns of Z: slice Z and transpose the block, no copy
        cols = slice_block(em, mm.a.args[0], 1, b, width, step, "compute")  # type: ignore[arg-type]
        a = em(aten.permute.default, (cols, [1, 0]), step=step, lane="compute")
    else:
        a = rows(mm.a)
    return matmul(em, mm, a, mm.b, step, rows=rows)


def _block_rows(em: Emitter, site: MmRsSite, b: int, width: dims.Size, step: int, x: Node) -> Node:
    """Block ``b``'s rows of ``x``, laid out like the product's rows ([M, c]: A, or a
    per-row scale of A), as contiguous 2-D rows."""
    lead = [*site.product_shape[:-1], val(x).shape[1]]
    return rows_of_block(em, viewed(em, x, lead, step), site.scatter_dim, b, width, step)
