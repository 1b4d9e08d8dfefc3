"""A product summed over ranks, block by block: what matmul -> reduce-scatter (``mm_rs``)
and matmul -> all-reduce (``mm_ar``) share. Not a site kind itself.

Both collectives sum one product (or a sum of products of one shape) over the ranks of a
group. Cut into n blocks (rows or columns of the product), each block's partial is sent
on while the next is computed, and each rank ends with its own block summed over every
rank: a reduce-scatter's result, and an all-reduce's first half. Matching walks back from
the collective to the product through views, transpose pairs and dtype casts (all of
which commute with the blocks); lowering runs the reduce ring (or the sliced schedule)
of the ring core over the product's blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch
from torch.fx import Node

from ...runtime.groups import Group
from ...schedules import Direction, Schedule
from ..fx import dims
from ..fx.declines import decline
from ..fx.graph import (
    CONVERT,
    FLOAT8_DTYPES,
    VIEWS,
    cast_to,
    check_tensor,
    data_users,
    is_transpose_2d,
    node_arg,
    numel,
    val,
)
from ..fx.matmuls import Matmul, bias_is_row_broadcast, has_zero_size_dim, scales_problem
from . import paths
from .blocks import (
    chunk_width,
    make_contiguous,
    multiply,
    replay,
    slice_block,
    slice_column_block,
    slice_rows_of_block,
    view,
)
from .emit import Emitter
from .rewrite import Rewrite
from .ring import compute_then_send, lower_sliced_steps
from .site import Site

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# "avg" is the sum divided by the group size (``Partial("avg")``, hand-written functional
# code): the blocks are summed as for "sum" and this rank's block is scaled once.
REDUCE_OPS = ("sum", "avg")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReducedProductSite(Site):
    """A ``collective`` that sums ``terms`` (one matmul, or several with one shape: the
    backward of an input shared by several linears, e.g. gate and up) over the group,
    read through ``wait``; the collective has the dtype the partial sums are added in."""

    kind: ClassVar[str]
    collective: Node
    wait: Node
    terms: tuple[Matmul, ...]
    scatter_dim: int  # dim of the product's (viewed) shape cut into blocks
    product_shape: tuple[dims.Size, ...] = ()  # the product as the collective sees it
    columns: bool = False  # the blocks are the product's last (N) dim
    reduce_op: str = "sum"  # or "avg": the sum, scaled by 1/n once, on this rank's block
    chain: tuple[Node, ...] = ()
    # the terms' blocks followed through layout ops and casts (``paths``: a batched or
    # grouped product): the dim of the terms' product that holds them, and the ops from
    # it to the collective, each with its dim that does (None: the views' 2-D blocks)
    product_dim: int | None = None
    path: paths.Path = ()

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.collective,)

    def replaced(self) -> list[Node]:
        return [self.collective, self.wait, *self.chain, *(t.node for t in self.terms)]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.collective.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "product_shape": dims.as_json(self.product_shape),
            "matmuls": [t.node.name for t in self.terms],
            "blocks": "columns" if self.columns else "rows",
            "reduce_op": self.reduce_op,
        }

    def whole_bytes(self) -> float:
        """What every block's terms read whole (``Work.whole_bytes``): B where the blocks
        are the product's rows, A where its columns."""
        return sum(t.whole_bytes(self.columns) for t in self.terms)

    def product_bytes(self) -> int:
        """The bytes of the whole product in the collective's dtype."""
        return numel(self.terms[0].node) * val(self.collective).element_size()


def flops(site: ReducedProductSite) -> float:
    """The FLOPs of the site's whole product (every term)."""
    return sum(t.flops() for t in site.terms)


# ----------------------------------------------------------------------------------------
# find


def through_views(node: Node, chain: list[Node], casts: bool = False) -> Node:
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
            node = through_casts(node, chain)
        elif is_transpose_2d(node):
            between: list[Node] = []
            inner = through_casts(source, between) if casts else source
            if not is_transpose_2d(inner) or len(data_users(inner)) != 1:
                break
            chain += [node, *between, inner]
            node = node_arg(inner, 0, "self")
        else:
            break
    return node


def through_casts(node: Node, chain: list[Node]) -> Node:
    """The input of ``node`` behind single-user dtype casts, added to ``chain``."""
    while cast_to(node) is not None and len(data_users(node)) == 1:
        chain.append(node)
        node = node_arg(node, 0, "self")
    return node


def sum_of_matmuls(node: Node, every_form: bool = False) -> tuple[list[Matmul], list[Node]]:
    """(matmul terms, add/view nodes between) if ``node`` is a matmul or a sum of them
    (of 2-D matmuls; with ``every_form`` batched and grouped ones too)."""
    mm = Matmul.of(node, batched=every_form, grouped=every_form)
    if mm is not None:
        return [mm], []
    plain_add = node.target is aten.add.Tensor and node_arg(node, 2, "alpha", 1) == 1
    if not plain_add or not all(isinstance(a, Node) for a in node.args[:2]):
        return [], []
    terms, between = [], [node]
    for arg in node.args[:2]:
        source = through_views(arg, between)  # type: ignore[arg-type]
        single = len(data_users(source)) == 1
        sub_terms, sub_between = sum_of_matmuls(source, every_form) if single else ([], [])
        if not sub_terms:
            return [], []
        terms += sub_terms
        between += sub_between
    return terms, between


def check_terms(terms: list[Matmul], shared: str) -> None:
    """Each term can be cut into blocks and summed block by block, or the first reason
    it cannot; ``shared``: the code of a product read by more than the collective."""
    shape = terms[0].out_shape
    for term in terms:
        name = term.node.name
        if len(data_users(term.node)) != 1:
            raise decline(shared, node=name)
        check_tensor(term.node, "matmul output")
        if has_zero_size_dim(term):
            raise decline("site.empty", node=name)
        if not dims.same_shape(term.out_shape, shape):
            raise decline("rs.shapes_differ", node=name)
        grouped_bias = term.bias is not None and term.form.offs is not None
        if grouped_bias or term.bias is not None and not bias_is_row_broadcast(term.bias):
            raise decline("rs.bias_rows", node=name)
        if problem := scales_problem(term):
            raise decline("site.scales", node=name, problem=problem)
        if val(term.node).dtype in FLOAT8_DTYPES:
            raise decline("rs.scaled_sum", node=name, dtype=val(term.node).dtype)


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """A product whose blocks a collective's dim holds through layout ops and casts
    (``paths.producer``): its terms and the adds between, the dim of it, the path."""

    product: Node
    terms: list[Matmul]
    between: list[Node]
    product_dim: int
    path: paths.Path
    # where the blocks stopped being blocks, and the matmul behind it
    lost: tuple[Node, Node] | None = None


def laid_out(node: Node, dim: int, n: int) -> LaidOut:
    """``dim`` of ``node`` followed back to the product whose blocks it holds (no terms
    where the blocks stop being blocks, ``lost`` if a matmul is behind, or no matmul
    computes them)."""
    product, product_dim, path, stop = paths.producer(node, dim, dims.Split(n))
    if stop is not None:
        behind = paths.matmul_behind(stop)
        lost = None if behind is None else (stop, behind)
        return LaidOut(product, [], [], product_dim, path, lost)
    terms, between = sum_of_matmuls(product, every_form=True)
    if any(not dims.same_shape(t.out_shape, val(product).shape) for t in terms):
        terms, between = [], []  # (views between the terms: not one layout)
    return LaidOut(product, terms, between, product_dim, path)


@dataclasses.dataclass(frozen=True)
class Product:
    """What a collective sums, found from its operand: the matmul terms and the adds
    between, the product node, and the blocks followed through layout ops (``laid``:
    None where the terms were found behind views and casts alone)."""

    terms: list[Matmul]
    between: list[Node]
    product: Node
    laid: LaidOut | None


def find_product(value: Node, dim: int, n: int, chain: list[Node], follow: bool) -> Product:
    """The product ``value`` sums, behind views and casts (added to ``chain``), or with
    ``follow`` its blocks along ``dim`` followed to a batched or grouped product, or one
    behind copies and permutes (the path's nodes added to ``chain``)."""
    product = through_views(value, chain, casts=True)
    terms, between = sum_of_matmuls(product)
    laid = None
    if not terms and follow:
        laid = laid_out(value, dim, n)
        if laid.terms:
            terms, between, product = laid.terms, laid.between, laid.product
            chain += [node for node, _ in laid.path]
    return Product(terms, between, product, laid)


def check_blocks(terms: list[Matmul], product_dim: int, code: str) -> bool:
    """The product's blocks along ``product_dim`` are rows or columns of every batch
    entry or group (``code``: the decline if they are the batch's or the groups'): True
    for columns."""
    layout = terms[0].layout
    if layout is None or product_dim not in layout.out:
        raise decline(code, node=terms[0].node.name)
    return product_dim == layout.out[1]


# ----------------------------------------------------------------------------------------
# lower


def reduce_block(
    rw: Rewrite, site: ReducedProductSite, group: Group, schedule: Schedule, slices: int
) -> tuple[Node, int]:
    """This rank's block of the product summed over the group (divided by n under
    "avg"), and the step after the schedule's last, where what reads it goes."""
    if schedule.sliced:
        block, last = _lower_sliced(rw, site, group, schedule, slices)
    else:
        block, last = _lower_ring(rw, site, group, schedule), group.size
    if site.reduce_op == "avg":
        # the chunks are reduced with "sum": gloo has no "avg", and one division of the
        # whole block is what the collective computes
        block = rw.emit(aten.div.Tensor, (block, group.size), step=last, lane="compute")
    return block, last


def _lower_ring(rw: Rewrite, site: ReducedProductSite, group: Group, schedule: Schedule) -> Node:
    """Each step computes one block's partial, adds the partial sums received for it and
    sends it on; this rank's own block comes last and is its result."""
    width = site.product_shape[site.scatter_dim] // group.size

    def compute(b: int, s: int) -> Node:
        return _reduce_part(rw.emit, site, b, width, s, group.size)

    held = compute_then_send(rw, group, schedule, Direction.REDUCE, compute)
    assert list(held) == [group.rank], "every partial sum received was added"
    return held[group.rank]


def _lower_sliced(
    rw: Rewrite, site: ReducedProductSite, group: Group, schedule: Schedule, k: int
) -> tuple[Node, int]:
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
            parts[b, i] = _reduce_part(em, site, b * k + i, width, s, n * k)

    def collected(i: int, reduced: Node, s: int) -> None:
        own[i] = reduced

    lower_sliced_steps(rw, schedule, Direction.REDUCE, k, issue, compute, collected)
    last = len(rw.steps)
    if site.product_dim is not None:  # chunks laid out as the collective's blocks
        chunks, cat_dim = [own[i] for i in range(k)], dim
    elif site.columns:
        chunks, cat_dim = [own[i] for i in range(k)], 1
    else:
        shape = [*site.product_shape[:dim], width, *site.product_shape[dim + 1 :]]
        chunks, cat_dim = [view(em, own[i], shape, last) for i in range(k)], dim
    return em(aten.cat.default, (chunks, cat_dim), step=last, lane="compute"), last


def _reduce_part(
    em: Emitter, site: ReducedProductSite, b: int, width: dims.Size, step: int, count: int
) -> Node:
    """This rank's partial of block ``b`` (of ``count``) of the product: the sum over the
    site's terms, laid out as the collective's blocks where a path leads there, cast to
    the collective's dtype where a cast stood before it (so the partial sums are added
    in that dtype, as the collective adds them)."""
    part = None
    for term in site.terms:
        if site.product_dim is None:
            term_part = _reduce_block(em, site, term, b, width, step)
        else:
            term_part = _slice_laid_out_block(em, site, term, b, count, step)
        part = (
            term_part
            if part is None
            else em(aten.add.Tensor, (part, term_part), step=step, lane="compute")
        )
    assert part is not None
    if site.product_dim is not None:
        split = dims.Split(count)
        path = paths.along(site.path, site.product_dim, split)
        if path is None:
            what = f"the blocks on the way from {site.terms[0].node.name}"
            raise decline("lower.slices", k=count // site.group_size, provably="", what=what,
                          size=val(site.terms[0].node).shape[site.product_dim])  # fmt: skip
        part = make_contiguous(em, replay(em, part, path, split, b, step, "compute"), step)
    dtype = val(site.anchor).dtype
    if val(part).dtype != dtype:
        part = em(CONVERT, (part, dtype), step=step, lane="compute")
    return part


def _reduce_block(
    em: Emitter, site: ReducedProductSite, mm: Matmul, b: int, width: dims.Size, step: int
) -> Node:
    """This rank's partial of block ``b`` of the product ``mm``."""
    if site.columns:
        w = slice_column_block(em, mm.b, b, width, step)
        return multiply(em, mm, mm.a, w, step, cols=(b, width))
    rows = functools.partial(_slice_block_rows, em, site, b, width, step)
    if len(site.product_shape) == 2 and is_transpose_2d(mm.a):
        # rows of t(Z) are columns of Z: slice Z and transpose the block, no copy
        cols = slice_block(em, mm.a.args[0], 1, b, width, step, "compute")  # type: ignore[arg-type]
        a = em(aten.permute.default, (cols, [1, 0]), step=step, lane="compute")
    else:
        a = rows(mm.a)
    return multiply(em, mm, a, mm.b, step, rows=rows)


def _slice_laid_out_block(
    em: Emitter, site: ReducedProductSite, mm: Matmul, b: int, count: int, step: int
) -> Node:
    """Block ``b`` of ``count`` along ``site.product_dim`` of the product ``mm`` (rows or
    columns of every batch entry or group; a grouped matmul's rows with their offsets)."""
    assert site.product_dim is not None
    span = dims.Split(count).bounds(val(mm.node).shape[site.product_dim], b)
    return paths.compute_product_block(em, mm, site.columns, span, step)


def _slice_block_rows(
    em: Emitter, site: ReducedProductSite, b: int, width: dims.Size, step: int, x: Node
) -> Node:
    """Block ``b``'s rows of ``x``, laid out like the product's rows ([M, c]: A, or a
    per-row scale of A), as contiguous 2-D rows."""
    lead = [*site.product_shape[:-1], val(x).shape[1]]
    return slice_rows_of_block(em, view(em, x, lead, step), site.scatter_dim, b, width, step)
