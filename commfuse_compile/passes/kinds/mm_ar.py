"""Matmul -> all-reduce: plain tensor parallelism's row-parallel output (DTensor's
``RowwiseParallel`` with its replicated output, Hugging Face's ``tp_plan="auto"``,
Megatron without sequence parallelism) and the column-parallel input's gradient.

An all-reduce is a reduce-scatter then an all-gather. The reduce-scatter half runs as
``mm_rs`` runs it (``reduced_product``): the product is cut into n blocks of its rows
(the tokens), each block's partial sent on while the next is computed; each rank then
holds its block summed over the group, and one all-gather of those blocks (the
all-reduce's second half, the same bytes) gives every rank the whole sum. Every
all-reduce is a site, so none goes unreported: one whose operand is not a matmul (or a
sum of matmuls) behind views and casts is declined (``ar.not_matmul``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch.fx import Graph, Node

from ...cost.simulator import Work
from ...runtime.groups import Group, ranks_of
from ...schedules import Direction, Schedule
from .. import dims
from ..blocks import contiguous, viewed
from ..declines import Declined, decline
from ..graph import Matmul, is_matmul, node_arg, op_name, the_wait, val, view_sources
from ..rewrite import Rewrite, Taken
from ..ring import replace_collective
from ..site_kind import SiteKind
from . import reduced_product
from .reduced_product import (
    REDUCE_OPS,
    ReducedProductSite,
    check_terms,
    flops,
    reduced_block,
    sum_of_matmuls,
    through_views,
)

c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class MmArSite(ReducedProductSite):
    """all_reduce(sum of ``terms``), reduced by blocks of the product's rows, then
    gathered."""

    kind: ClassVar[str] = "mm_ar"

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "then": "all_gather"}


class MmAr(SiteKind[MmArSite]):
    name = "mm_ar"
    direction = Direction.REDUCE  # the steps are the reduce-scatter half's
    nests = False

    def find(self, graph: Graph) -> list[MmArSite]:
        nodes = graph.find_nodes(op="call_function", target=c10d.all_reduce.default)
        return [_match(n, Taken()) for n in nodes]

    def rematch(self, site: MmArSite, taken: Taken) -> MmArSite | None:
        return _match(site.collective, taken)

    def without(self, site: MmArSite, disabled: frozenset[str]) -> MmArSite:
        return site  # one product: nothing to leave out but the whole site

    def work(self, site: MmArSite, n: int) -> Work:
        bytes_per_block = site.product_bytes() / n
        return Work(
            self.direction, n, flops(site) / n, bytes_per_block, len(site.terms), then_gather=True
        )

    def start(self, site: MmArSite, taken: Taken) -> tuple[MmArSite, Node]:
        return site, site.collective

    def lower(
        self, rw: Rewrite, site: MmArSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        _lower(rw, site, group, schedule, slices)


KIND = MmAr()


# ----------------------------------------------------------------------------------------
# find


def _match(ar: Node, taken: Taken) -> MmArSite:
    inp, reduce_op, group_name = (node_arg(ar, i, "") for i in range(3))
    n = len(ranks_of(str(group_name)))
    wait = the_wait(ar)
    chain: list[Node] = []
    product = through_views(inp, chain, casts=True)
    terms, between = sum_of_matmuls(product)
    laid = None
    if not terms and n > 1:
        # a batched or grouped product, or one behind copies and permutes: the rows of
        # the all-reduce's value followed to it
        laid = reduced_product.laid_out(inp, 0, n)
        if laid.terms:
            terms, between, product = laid.terms, laid.between, laid.product
            chain += [node for node, _ in laid.path]
    fields: dict[str, Any] = {}
    declined = None
    try:
        if laid is not None and laid.lost is not None:
            stop, mm = laid.lost
            raise decline("site.blocks_lost", node=stop.name, op=op_name(stop), mm=mm.name)
        laid_terms = laid is not None and bool(laid.terms)
        fields = _checked(
            ar, wait, str(reduce_op), n, product, terms, taken.window(product), laid_terms
        )
        if laid is not None and laid.terms:
            columns = reduced_product.check_blocks(terms, laid.product_dim, "ar.batch_blocks")
            shape = dims.sizes(val(inp).shape)
            if not dims.divisible(shape[0], n):
                code = (
                    "ar.not_provably_divisible" if dims.is_symbolic(shape[:1]) else "ar.indivisible"
                )
                raise decline(code, size=shape[0], n=n)
            fields = {"product_shape": shape, "product_dim": laid.product_dim,
                      "path": laid.path, "columns": columns}  # fmt: skip
    except Declined as why:
        declined = why.kept()
    return MmArSite(
        collective=ar,
        wait=wait or ar,
        terms=tuple(terms),
        group_name=str(group_name),
        group_size=n,
        scatter_dim=0,
        reduce_op=str(reduce_op),
        chain=tuple(chain + between),
        declined=declined,
        **fields,
    )


def _checked(
    ar: Node,
    wait: Node | None,
    reduce_op: str,
    n: int,
    product: Node,
    terms: list[Matmul],
    window: tuple[int, int] | None,
    laid: bool = False,
) -> dict[str, Any]:
    """The product's shape, or the first reason the site cannot be rewritten (in the
    order a user would fix them). ``window``: the rewrite window that emitted the
    product, if another site's rewrite did; ``laid``: its rows followed to a batched or
    grouped product (``laid_out``: proven a multiple of n on the way)."""
    if not terms:
        (source,) = view_sources(ar)
        if is_matmul(source):  # behind a view or cast that something else reads too
            raise decline("ar.product_shared", node=source.name)
        raise decline("ar.not_matmul", node=source.name, op=op_name(source))
    if wait is None or wait.target is not c10d.wait_tensor.default:
        raise decline("site.wait", node=ar.name)
    if not wait.users:
        raise decline("site.unread", node=ar.name)
    if window is not None:
        raise decline("rs.taken", site=window[0])
    if reduce_op not in REDUCE_OPS:
        raise decline("ar.not_sum", op=reduce_op)
    if n == 0:
        raise decline("site.group", error=f"process group {ar.args[2]!r} is unknown here")
    if n < 2:
        raise decline("site.group_of_one")
    check_terms(terms, shared="ar.product_shared")
    if laid:
        return {}
    rows, cols = terms[0].out_shape
    if not dims.divisible(rows, n):
        symbolic = dims.is_symbolic([rows])
        code = "ar.not_provably_divisible" if symbolic else "ar.indivisible"
        raise decline(code, size=rows, n=n)
    return {"product_shape": (rows, cols)}


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: MmArSite, group: Group, schedule: Schedule, slices: int) -> None:
    """The reduce-scatter half on the ring; then one all-gather of this rank's reduced
    rows, the all-reduce's second half as it was."""
    em = rw.emit
    block, last = reduced_block(rw, site, group, schedule, slices)
    block = contiguous(em, block, last)
    gather = c10d.all_gather_into_tensor.default
    gathering = em(gather, (block, group.size, group.name), step=last, lane="comm")
    gathered = em(c10d.wait_tensor.default, (gathering,), step=last, lane="comm")
    result = viewed(em, gathered, val(site.wait).shape, last)
    replace_collective(rw, [site.collective], [site.wait], result)
