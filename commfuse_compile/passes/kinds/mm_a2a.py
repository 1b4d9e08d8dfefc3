"""Matmul -> all-to-all (Ulysses: the q/k/v projections; in the backward, the gradient
through the output projection): block j of the all-to-all's input goes to rank j, and
is a row or a column block of the product, so each is computed, then sent while the
next is computed; this rank's own block is computed last, under the final transfer.
Same FLOPs and bytes as the matmul and the collective.

    # before                          # after (rank r of n)
    p = x @ w                         for s in range(1, n):
    y = wait(all_to_all(p))               blk = x[block r+s] @ w      # while the last travels
                                          y_[r - s] = wait(p2p(send blk to r+s, recv from r-s))
                                      y_[r] = x[block r] @ w      # own block: under the last
                                      y = cat(y_)

``all_to_all_single`` splits dim 0 into n equal blocks. That dim is followed back
through the views, permutes and copies between the product and the collective (its
outermost n-way split must stay the outermost n-way split of one dim at every step) to
a dim of the 2-D product: its rows or its columns.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.fx import Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule
from ..fx import dims
from ..fx.collectives import (
    ALL_TO_ALL,
    check_own_block,
    exchange_splits,
    saved_unwaited,
    split_sizes,
    the_wait,
)
from ..fx.declines import Declined, decline
from ..fx.graph import (
    LAYOUT_OPS,
    check_tensor,
    data_users,
    node_arg,
    numel,
    op_name,
    split_dim_in_input,
    val,
)
from ..fx.matmuls import (
    Matmul,
    bias_is_row_broadcast,
    comes_from_matmul,
    has_zero_size_dim,
    reaches_matmul,
    scales_problem,
)
from ..kit import paths
from ..kit.blocks import make_contiguous, replay
from ..kit.emit import Emitter
from ..kit.rewrite import Rewrite, Taken
from ..kit.ring import compute_then_send, replace_collective
from ..kit.site import Site
from ..kit.site_kind import AtCollective

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class MmA2aSite(Site):
    kind: ClassVar[str] = "mm_a2a"
    all_to_all: Node
    wait: Node
    product: Matmul | None  # None where the blocks lead to no matmul (declined)
    product_dim: int  # 0: block j is rows of the product; 1: its columns (of each batch entry)
    chain: tuple[tuple[Node, int], ...] = ()  # product -> collective, with the block dim
    received: dims.Split | None = None  # the output's blocks (None: declined before)
    sent: dims.Split | None = None  # the input's: blocks of the product

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.all_to_all,)

    @property
    def uneven(self) -> bool:
        return any(split and split.sizes for split in (self.received, self.sent))

    def replaced(self) -> list[Node]:
        chain = [node for node, _ in self.chain]
        product = [self.product.node] if self.product is not None else []  # None: declined
        return [self.all_to_all, self.wait, *chain, *product]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.all_to_all.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [self.product.node.name] if self.product else [],
            "blocks": "columns" if self.product_dim else "rows",
            "exchanged_shape": dims.as_json(val(self.all_to_all).shape),
            **split_sizes(self.all_to_all, self.uneven),
        }


class MmA2a(AtCollective[MmA2aSite]):
    name = "mm_a2a"
    direction = Direction.EXCHANGE_OUT
    collective = ALL_TO_ALL

    def match(self, collective: Node, taken: Taken) -> MmA2aSite | None:
        return _match(collective)

    def work(self, site: MmA2aSite, n: int) -> Work:
        mm = site.product
        assert mm is not None, "a matched site has its product"
        flops = 2 * numel(mm.node) * dims.hint(mm.contracted)
        message = numel(site.all_to_all) * val(site.all_to_all).element_size()
        whole = mm.whole_bytes(site.product_dim == 1)
        return Work(
            self.direction, n, flops / n, message / n, whole_bytes=whole, matmul_class=mm.rate_class
        )

    def lower(
        self, rw: Rewrite, site: MmA2aSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        _lower(rw, site, group, schedule)

    def alike_from(self, site: MmA2aSite) -> int | None:
        return int(site.uneven)  # uneven blocks differ in their rows only


KIND = MmA2a()


# ----------------------------------------------------------------------------------------
# find


def _match(a2a: Node) -> MmA2aSite | None:
    inp, group_name = node_arg(a2a, 0, "input"), node_arg(a2a, 3, "group_name")
    n = len(node_arg(a2a, 1, "output_split_sizes"))
    wait = the_wait(a2a) or a2a
    if not comes_from_matmul(inp) or reaches_matmul(wait):
        return None  # feeding a matmul too: the all-to-all -> matmul site (a2a_mm) reports it
    chain: tuple[tuple[Node, int], ...] = ()
    mm, dim, declined, received, sent = None, 0, None, None, None
    try:
        if wait is a2a or wait.target is not c10d.wait_tensor.default:
            raise decline("site.wait", node=a2a.name)
        if not wait.users and not saved_unwaited(a2a):  # the rewrite would compute nothing
            raise decline("site.unread", node=a2a.name)
        if n < 2:
            raise decline("site.group_of_one")
        received, sent = exchange_splits(a2a)
        chain, node, dim = _traced(inp, sent)
        mm = Matmul.of(node, batched=True)
        if mm is None:
            raise decline("a2a.not_a_block", node=node.name, op=op_name(node))
        if dim < mm.lead:
            raise decline("a2a.batch_blocks", node=mm.node.name)
        dim -= mm.lead
        if len(data_users(mm.node)) != 1:
            raise decline("a2a.product_shared", node=mm.node.name)
        check_tensor(mm.node, "matmul output")
        if has_zero_size_dim(mm):
            raise decline("site.empty", node=mm.node.name)
        if dim == 0 and mm.bias is not None and not bias_is_row_broadcast(mm.bias):
            raise decline("a2a.bias_rows", node=mm.node.name)
        if problem := scales_problem(mm):
            raise decline("site.scales", node=mm.node.name, problem=problem)
    except Declined as why:
        declined = why.kept()
    return MmA2aSite(
        all_to_all=a2a,
        wait=wait,
        product=mm,
        product_dim=dim,
        chain=chain,
        received=received,
        sent=sent,
        group_name=str(group_name),
        group_size=n,
        declined=declined,
    )


def _traced(inp: Node, split: dims.Split) -> tuple[tuple[tuple[Node, int], ...], Node, int]:
    """The layout ops from the product to the all-to-all's input (each with the dim that
    holds the blocks of ``split``), where they start (the product, or the op whose
    input's blocks are no dim's) and the dim that holds them there."""
    chain: list[tuple[Node, int]] = []
    node, dim = inp, 0
    while node.target in LAYOUT_OPS and len(data_users(node)) == 1:
        source_dim = split_dim_in_input(node, dim, split)
        if source_dim is None:
            break
        chain.append((node, dim))
        node, dim = node_arg(node, 0, "self"), source_dim
    return tuple(reversed(chain)), node, dim


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: MmA2aSite, group: Group, schedule: Schedule) -> None:
    """Each step: compute the block for the step's peer, wait the step before's transfer,
    then send the block (and receive the peer's block for this rank) under the next."""
    assert site.received is not None and site.sent is not None, "a matched site has its splits"
    n, r, received = group.size, group.rank, site.received
    rows, out_rows = val(node_arg(site.all_to_all, 0, "input")).shape[0], val(site.wait).shape[0]
    check_own_block(site.all_to_all, site.sent.width(rows, r), received.width(out_rows, r))

    def compute(b: int, s: int) -> Node:
        return _compute_input_block(rw.emit, site, b, s)

    widths = (lambda j: received.width(out_rows, j)) if site.uneven else None
    blocks = compute_then_send(rw, group, schedule, Direction.EXCHANGE_OUT, compute, widths)
    assert len(blocks) == n, "a block from every rank"
    out = rw.emit(aten.cat.default, ([blocks[b] for b in range(n)], 0), step=n, lane="comm")
    replace_collective(rw, [site.all_to_all], [site.wait], out)


def _compute_input_block(em: Emitter, site: MmA2aSite, j: int, step: int) -> Node:
    """Block j of the all-to-all's input: that block of the product, laid out as the
    collective reads it, in its own contiguous buffer (it is sent as it is)."""
    mm, split = site.product, site.sent
    assert mm is not None and split is not None
    span = split.bounds(val(mm.node).shape[mm.lead + site.product_dim], j)
    part = paths.compute_product_block(em, mm, site.product_dim == 1, span, step)
    return make_contiguous(em, replay(em, part, site.chain, split, j, step, "compute"), step)
