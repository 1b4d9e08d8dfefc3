"""Matmul -> all-to-all (Ulysses: the q/k/v projections; in the backward, the gradient
through the output projection): block j of the all-to-all's input goes to rank j, and
is a row or a column block of the product, so each is computed, then sent while the
next is computed; this rank's own block is computed last, under the final transfer.
Same FLOPs and bytes as the matmul and the collective.

``all_to_all_single`` splits dim 0 into n equal blocks. That dim is followed back
through the views, permutes and copies between the product and the collective (its
outermost n-way split must stay the outermost n-way split of one dim at every step) to
a dim of the 2-D product: its rows or its columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch.fx import Graph, Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Schedule
from .. import dims
from ..declines import Declined, decline
from ..graph import (
    ALL_TO_ALL,
    LAYOUT_OPS,
    Matmul,
    bias_is_row_broadcast,
    check_tensor,
    comes_from_matmul,
    data_users,
    equal_splits,
    has_zero_size_dim,
    node_arg,
    numel,
    op_name,
    reaches_matmul,
    saved_unwaited,
    scales_problem,
    split_dim_in_input,
    the_wait,
    val,
)
from ..rewrite import (
    Pending,
    Rewrite,
    Step,
    column_block,
    contiguous,
    matmul,
    new_tag,
    replay,
    row_block,
    start_transfers,
    wait_transfers,
)
from ..site import Direction, Site, matched

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class MmA2aSite(Site):
    kind: ClassVar[str] = "mm_a2a"
    all_to_all: Node
    wait: Node
    product: Matmul | None  # None where the blocks lead to no matmul (declined)
    product_dim: int  # 0: block j is rows of the product; 1: its columns
    chain: tuple[tuple[Node, int], ...] = ()  # product -> collective, with the block dim

    @property
    def anchor(self) -> Node:
        return self.all_to_all

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.all_to_all.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [self.product.node.name] if self.product else [],
            "blocks": "columns" if self.product_dim else "rows",
            "exchanged_shape": dims.as_json(val(self.all_to_all).shape),
        }


class MmA2a:
    name = "mm_a2a"
    direction: Direction = "exchange_out"
    nests = False

    def find(self, graph: Graph) -> list[Site]:
        return matched(graph.find_nodes(op="call_function", target=ALL_TO_ALL), _match)

    def rematch(self, site: Site) -> Site | None:
        assert isinstance(site, MmA2aSite)
        return _match(site.all_to_all)

    def without(self, site: Site, disabled: frozenset[str]) -> Site:
        return site  # one product: nothing to leave out but the whole site

    def work(self, site: Site, n: int) -> Work:
        assert isinstance(site, MmA2aSite)
        mm = site.product
        assert mm is not None
        flops = 2 * numel(mm.node) * dims.hint(val(mm.a).shape[1])
        message = numel(site.all_to_all) * val(site.all_to_all).element_size()
        return Work("exchange_out", n, flops / n, message / n)

    def start(self, site: Site) -> tuple[Site, Node]:
        assert isinstance(site, MmA2aSite)
        return site, site.all_to_all

    def lower(self, rw: Rewrite, group: Group, schedule: Schedule, slices: int) -> None:
        assert isinstance(rw.site, MmA2aSite)
        _lower(rw, rw.site, group, schedule)

    def replaced(self, site: Site) -> Sequence[Node]:
        assert isinstance(site, MmA2aSite)
        chain = [node for node, _ in site.chain]
        product = [site.product.node] if site.product is not None else []  # None: declined
        return [site.all_to_all, site.wait, *chain, *product]

    def collectives(self, site: Site) -> Sequence[Node]:
        assert isinstance(site, MmA2aSite)
        return (site.all_to_all,)


KIND = MmA2a()


# ----------------------------------------------------------------------------------------
# find


def _match(a2a: Node) -> MmA2aSite | None:
    inp, group_name = node_arg(a2a, 0, "input"), node_arg(a2a, 3, "group_name")
    n = len(node_arg(a2a, 1, "output_split_sizes"))
    wait = the_wait(a2a) or a2a
    if not comes_from_matmul(inp) or reaches_matmul(wait):
        return None  # feeding a matmul too: the all-to-all -> matmul site (a2a_mm) reports it
    chain: list[tuple[Node, int]] = []
    node, dim, stop = inp, 0, None
    while node.target in LAYOUT_OPS and len(data_users(node)) == 1 and stop is None:
        source_dim = split_dim_in_input(node, dim, n)
        if source_dim is None:
            stop = node
            break
        chain.append((node, dim))
        node, dim = node_arg(node, 0, "self"), source_dim
    chain.reverse()
    mm = Matmul.of(node)
    declined = None
    try:
        if wait is a2a or wait.target is not c10d.wait_tensor.default:
            raise decline("site.wait", node=a2a.name)
        if not wait.users and not saved_unwaited(a2a):  # the rewrite would compute nothing
            raise decline("rs.unread", node=a2a.name)
        if n < 2:
            raise decline("site.group_of_one")
        if equal_splits(a2a) is None:
            raise decline("a2a.uneven", node=a2a.name, splits=list(node_arg(a2a, 1, "")))
        if stop is not None or mm is None:
            at = stop or node
            raise decline("a2a.not_a_block", node=at.name, op=op_name(at))
        if len(data_users(mm.node)) != 1:
            raise decline("a2a.product_shared", node=mm.node.name)
        check_tensor(mm.node, "matmul output")
        if has_zero_size_dim(mm):
            raise decline("rs.empty", node=mm.node.name)
        if dim == 0 and mm.bias is not None and not bias_is_row_broadcast(mm.bias):
            raise decline("a2a.bias_rows", node=mm.node.name)
        if problem := scales_problem(mm):
            raise decline("rs.scales", node=mm.node.name, problem=problem)
    except Declined as why:
        declined = why.kept()
    return MmA2aSite(
        all_to_all=a2a,
        wait=wait,
        product=mm,
        product_dim=dim,
        chain=tuple(chain),
        group_name=str(group_name),
        group_size=n,
        declined=declined,
    )


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: MmA2aSite, group: Group, schedule: Schedule) -> None:
    """Each step: compute the block for the step's peer, wait the step before's transfer,
    then send the block (and receive the peer's block for this rank) under the next."""
    n, tag = group.size, new_tag()
    pending: Pending = (None, [], [])
    received: dict[tuple[int, int], Node] = {}  # (block, peer) -> the peer's block
    blocks: dict[int, Node] = {}  # the all-to-all's output, by source rank
    for s, step in enumerate(schedule.steps("exchange_out", group.rank, n, 0)):
        computed = {b: _input_block(rw, site, b, n, s) for b in step.blocks}
        started, recvs, sent = pending
        waits = wait_transfers(rw, s, recvs, sent, received, by_peer=True)
        rw.steps.append(Step(started, rw.matmuls.get(s, []), waits))
        for block, peer in list(received):
            blocks[(group.rank + peer) % n] = received.pop((block, peer))
        if group.rank in computed:
            blocks[group.rank] = computed[group.rank]
        like = next(iter(computed.values()))
        pending = start_transfers(
            rw, group, tag, s, step.sends, step.recvs, computed, recv_like=like
        )
    assert not pending[1] and not pending[2] and len(blocks) == n
    out = rw.emit(aten.cat.default, ([blocks[b] for b in range(n)], 0), step=n, lane="comm")
    rw.replace[site.wait] = out
    if saved_unwaited(site.all_to_all):
        rw.replace[site.all_to_all] = out


def _input_block(rw: Rewrite, site: MmA2aSite, j: int, n: int, step: int) -> Node:
    """Block j of the all-to-all's input: that block of the product, laid out as the
    collective reads it, in its own contiguous buffer (it is sent as it is)."""
    mm = site.product
    assert mm is not None
    rows, cols = val(mm.node).shape
    if site.product_dim == 0:
        cut = row_block(rw, j, rows // n, step)
        part = matmul(rw, mm, cut(mm.a), mm.b, step, rows=cut)
    else:
        w = column_block(rw, mm.b, j, cols // n, step)
        part = matmul(rw, mm, mm.a, w, step, cols=(j, cols // n))
    return contiguous(rw, replay(rw, part, site.chain, n, step, "compute"), step)
