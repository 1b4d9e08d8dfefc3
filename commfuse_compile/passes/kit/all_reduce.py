"""An all-reduce of a product (or of a sum of products of one shape), matched as a site:
what ``mm_ar`` rewrites, and what the token-sharding rewrite splits into sequence
parallelism (``prepare/shard_tokens``). Every all-reduce is a site, so none goes
unreported: one whose operand is not a matmul behind views and casts is declined
(``ar.not_matmul``), which the token-sharding rewrite still splits (an embedding's
lookup)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch.fx import Graph, Node

from ...runtime.groups import ranks_of
from ..fx import dims
from ..fx.collectives import the_wait
from ..fx.declines import Declined, decline
from ..fx.graph import node_arg, op_name, val, view_sources
from ..fx.matmuls import Matmul, is_matmul
from .reduced import REDUCE_OPS, ReducedProductSite, check_blocks, check_terms, find_product
from .rewrite import Taken

c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceSite(ReducedProductSite):
    """all_reduce(sum of ``terms``), reduced by blocks of the product's rows, then
    gathered."""

    kind: ClassVar[str] = "mm_ar"

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "then": "all_gather"}


def all_reduces(graph: Graph) -> list[AllReduceSite]:
    """Every all-reduce of the graph as a site, matched or declined."""
    nodes = graph.find_nodes(op="call_function", target=c10d.all_reduce.default)
    return [match_all_reduce(n, Taken()) for n in nodes]


def match_all_reduce(ar: Node, taken: Taken) -> AllReduceSite:
    inp, reduce_op, group_name = (node_arg(ar, i, "") for i in range(3))
    n = len(ranks_of(str(group_name)))
    wait = the_wait(ar)
    chain: list[Node] = []
    # (a batched or grouped product, or one behind copies and permutes: the rows of the
    # all-reduce's value followed to it)
    found = find_product(inp, 0, n, chain, follow=n > 1)
    terms, between, product, laid = found.terms, found.between, found.product, found.laid
    fields: dict[str, Any] = {}
    declined = None
    try:
        if laid is not None and laid.lost is not None:
            stop, mm = laid.lost
            raise decline("site.blocks_lost", node=stop.name, op=op_name(stop), mm=mm.name)
        laid_terms = laid is not None and bool(laid.terms)
        fields = _check(
            ar, wait, str(reduce_op), n, product, terms, taken.window(product), laid_terms
        )
        if laid is not None and laid.terms:
            columns = check_blocks(terms, laid.product_dim, "ar.batch_blocks")
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
    return AllReduceSite(
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


def _check(
    ar: Node,
    wait: Node | None,
    reduce_op: str,
    n: int,
    product: Node,
    terms: list[Matmul],
    window: tuple[str, int] | None,
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
