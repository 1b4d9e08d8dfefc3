"""Matmul -> reduce-scatter: the reduce-scatter sums a product (or a sum of products of
one shape) over ranks, so each block of it can be sent on while the next is computed.

The scattered dim is followed back through the split + cat DTensor emits and through
views to the product, where it is a block of its rows or of its columns. A dtype cast on
the way (mixed precision: a bfloat16 weight gradient reduced in float32) is element by
element, so it commutes with all of that: each block's partial is cast as the
collective's operand was, and the partial sums are added in the collective's dtype.

    # before                          # after (ring, rank r of n)
    p = x @ w                         acc = x[block b_0] @ w
    y = wait(reduce_scatter(p))       for s in range(1, n):
                                          got = p2p(send acc to r-1, recv from r+1)
                                          part = x[block b_s] @ w     # while acc travels
                                          acc = part + wait(got)
                                      y = acc                    # block r, summed over the group
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, ClassVar

import torch
from torch.fx import Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule
from ..fx import dims
from ..fx.collectives import the_wait
from ..fx.declines import Declined, decline
from ..fx.graph import node_arg, normalized_dim, op_name, ordered_getitems, val, view_sources
from ..fx.matmuls import ANY_MATMUL, Matmul, comes_from_matmul, is_matmul
from ..kit.blocks import view
from ..kit.reduced import (
    REDUCE_OPS,
    LaidOut,
    ReducedProductSite,
    check_blocks,
    check_terms,
    find_product,
    flops,
    reduce_block,
    through_casts,
)
from ..kit.rewrite import Rewrite, Taken
from ..kit.ring import replace_collective
from ..kit.site_kind import AtCollective

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class MmRsSite(ReducedProductSite):
    """reduce_scatter(sum of ``terms``), scattered along ``scatter_dim``."""

    kind: ClassVar[str] = "mm_rs"

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "scatter_dim": self.scatter_dim}


class MmRs(AtCollective[MmRsSite]):
    name = "mm_rs"
    direction = Direction.REDUCE
    collective = c10d.reduce_scatter_tensor.default

    def match(self, collective: Node, taken: Taken) -> MmRsSite | None:
        return _match(collective, taken)

    def work(self, site: MmRsSite, n: int) -> Work:
        block = site.product_bytes() / n
        terms = len(site.terms)
        return Work(
            self.direction, n, flops(site) / n, block, terms,
            whole_bytes=site.whole_bytes(), matmul_class=site.terms[0].rate_class,
        )  # fmt: skip

    def lower(
        self, rw: Rewrite, site: MmRsSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        _lower(rw, site, group, schedule, slices)


KIND = MmRs()


# ----------------------------------------------------------------------------------------
# find


def _match(rs: Node, taken: Taken) -> MmRsSite | None:
    inp, reduce_op, n, group_name = (node_arg(rs, i, "") for i in range(4))
    wait = the_wait(rs)
    casts: list[Node] = []
    scattered, g, chain = _scattered(through_casts(inp, casts), int(n))
    chain += casts
    # (a batched or grouped product, or one behind copies and permutes)
    found = find_product(scattered, g, int(n), chain, follow=True)
    terms, between, product, laid = found.terms, found.between, found.product, found.laid
    window = taken.window(product)  # of an all-gather site that rewrote its matmul
    from_matmul = (
        comes_from_matmul(inp, ANY_MATMUL)
        or any(is_matmul(a) for a in view_sources(product))
        or (laid is not None and laid.lost is not None)
    )
    if not terms and not from_matmul and window is None:
        return None
    fields: dict[str, Any] = {}
    declined = None
    try:
        fields = _check(
            rs, wait, inp, reduce_op, int(n), scattered, g, product, terms, window, laid
        )
        if laid is not None and laid.terms:
            columns = check_blocks(terms, laid.product_dim, "rs.batch_blocks")
            fields.update(product_dim=laid.product_dim, path=laid.path, columns=columns)
    except Declined as why:
        declined = why.kept()
    return MmRsSite(
        collective=rs,
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


def _check(
    rs: Node,
    wait: Node | None,
    inp: Node,
    reduce_op: str,
    n: int,
    scattered: Node,
    g: int,
    product: Node,
    terms: list[Matmul],
    window: tuple[str, int] | None,
    laid: LaidOut | None,
) -> dict[str, Any]:
    """The site's product shape and block layout, or the first reason it cannot be
    rewritten (in the order a user would fix them). ``window``: the rewrite window that
    emitted the product, if another site's rewrite did; ``laid``: the blocks followed to
    the product through layout ops (its block layout: ``check_blocks``)."""
    if wait is None or wait.target is not c10d.wait_tensor.default:
        raise decline("site.wait", node=rs.name)
    if not wait.users:
        raise decline("site.unread", node=rs.name)
    if window is not None:
        raise decline("rs.taken", site=window[0])
    if any(a.target is aten.constant_pad_nd.default for a in (inp, *inp.all_input_nodes)):
        raise decline("rs.padded")
    if laid is not None and laid.lost is not None:
        stop, mm = laid.lost
        raise decline("site.blocks_lost", node=stop.name, op=op_name(stop), mm=mm.name)
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
    check_terms(terms, shared="rs.product_shared")
    if laid is not None:  # the blocks followed to the product (``laid_out``)
        return {"product_shape": shape}
    rows, cols = terms[0].out_shape
    columns = g == len(shape) - 1 and dims.equal(shape[-1], cols)
    rows_match = dims.equal(shape[-1], cols) and dims.equal(math.prod(shape[:-1]), rows)
    if not columns and not rows_match:
        raise decline("rs.not_a_block", dim=g, shape=list(shape), rows=rows, cols=cols)
    return {"product_shape": shape, "columns": columns}


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


def _lower(rw: Rewrite, site: MmRsSite, group: Group, schedule: Schedule, slices: int) -> None:
    """This rank's reduced block, as the reduce-scatter returns it."""
    block, last = reduce_block(rw, site, group, schedule, slices)
    result = view(rw.emit, block, val(site.wait).shape, last)
    replace_collective(rw, [site.collective], [site.wait], result)
