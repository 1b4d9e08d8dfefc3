"""All-to-all -> matmul (Ulysses: the output projection; in the backward, the gradients
of the q/k/v projections' input and weights): block j of the all-to-all's output comes
from rank j, so each block is multiplied as soon as it arrives, this rank's own block
first, under the first transfer. Partial products are never sent.

``all_to_all_single`` stacks the n received blocks on dim 0. That dim is followed
through the views, permutes and copies to each matmul operand that reads it, where the
blocks are rows or columns of the 2-D operand G; where G sits decides what a block
computes (``ExchangedUse.role``):
``rows``:          ``G @ W``: a block of the product's rows.
``contract``:      ``G @ W`` with the blocks along K (heads into the output projection):
                   adds ``G_j @ W[K_j]``.
``columns``:       ``X @ G``: a block of the product's columns (a weight gradient).
``contract_left``: ``X @ G`` with the blocks along K: adds ``X[:, K_j] @ G_j``.
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
    OWN_RESULT,
    Matmul,
    between_note,
    bias_is_row_broadcast,
    check_tensor,
    data_users,
    equal_splits,
    has_zero_size_dim,
    is_mutating,
    needs_own_result,
    node_arg,
    numel,
    position,
    reaches_matmul,
    read_twice,
    saved_unwaited,
    scales_problem,
    split_dim_in_output,
    sums_problem,
    the_wait,
    val,
)
from ..rewrite import (
    Rewrite,
    Step,
    accumulate,
    column_block,
    contiguous,
    finish_sum,
    matmul,
    new_tag,
    replay,
    row_block,
    slice_block,
    start_transfers,
    viewed,
    wait_transfers,
)
from ..site import Direction, Site, matched

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class ExchangedUse:
    """A matmul reading the all-to-all's output through ``path`` (layout ops, each with
    the dim of its output that holds the n blocks)."""

    mm: Matmul
    path: tuple[tuple[Node, int], ...]
    role: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class A2aMmSite(Site):
    kind: ClassVar[str] = "a2a_mm"
    all_to_all: Node
    wait: Node
    uses: tuple[ExchangedUse, ...] = ()
    unmatched: tuple[str, ...] = ()  # matmuls left reading the output, and why

    @property
    def anchor(self) -> Node:
        return self.all_to_all

    @property
    def chain(self) -> tuple[Node, ...]:
        return tuple(dict.fromkeys(node for use in self.uses for node, _ in use.path))

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.all_to_all.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [u.mm.node.name for u in self.uses],
            "roles": {u.mm.node.name: u.role for u in self.uses},
            "exchanged_shape": dims.as_json(val(self.all_to_all).shape),
            "unmatched": list(self.unmatched),
        }


class A2aMm:
    name = "a2a_mm"
    direction: Direction = "exchange_in"
    nests = False

    def find(self, graph: Graph) -> list[Site]:
        return matched(graph.find_nodes(op="call_function", target=ALL_TO_ALL), _match)

    def rematch(self, site: Site) -> Site | None:
        assert isinstance(site, A2aMmSite)
        return _match(site.all_to_all)

    def without(self, site: Site, disabled: frozenset[str]) -> Site:
        assert isinstance(site, A2aMmSite)
        uses = tuple(u for u in site.uses if u.role not in disabled)
        if len(uses) == len(site.uses):
            return site
        left = [f"{u.mm.node.name} ({u.role}): disabled" for u in site.uses if u not in uses]
        unmatched = (*site.unmatched, *left)
        if not uses:
            raise decline("plan.roles_disabled", unmatched="; ".join(unmatched))
        return dataclasses.replace(site, uses=uses, unmatched=unmatched)

    def work(self, site: Site, n: int) -> Work:
        assert isinstance(site, A2aMmSite)
        flops = sum(2 * numel(u.mm.node) * dims.hint(val(u.mm.a).shape[1]) for u in site.uses)
        message = numel(site.all_to_all) * val(site.all_to_all).element_size()
        return Work("exchange_in", n, flops / n, message / n, len(site.uses))

    def start(self, site: Site) -> tuple[Site, Node]:
        assert isinstance(site, A2aMmSite)
        readers = list(site.wait.users)
        if not readers:  # pragma: no cover - matched sites have one
            raise decline("ag.no_reader")
        before = min(readers, key=position)
        own = {site.wait, *site.chain, *(u.mm.node for u in site.uses)}
        late = needs_own_result([u.mm for u in site.uses], own, before)
        if not late:
            return site, before
        uses = tuple(u for u in site.uses if u.mm not in late)
        unmatched = (*site.unmatched, *(f"{mm.node.name}: {OWN_RESULT}" for mm in late))
        if not uses:
            raise decline("a2a.matmuls_left_out", unmatched="; ".join(unmatched))
        return dataclasses.replace(site, uses=uses, unmatched=unmatched), before

    def lower(self, rw: Rewrite, group: Group, schedule: Schedule, slices: int) -> None:
        assert isinstance(rw.site, A2aMmSite)
        _lower(rw, rw.site, group, schedule)

    def replaced(self, site: Site) -> Sequence[Node]:
        assert isinstance(site, A2aMmSite)
        return [site.all_to_all, site.wait, *site.chain, *(u.mm.node for u in site.uses)]

    def collectives(self, site: Site) -> Sequence[Node]:
        assert isinstance(site, A2aMmSite)
        return (site.all_to_all,)


KIND = A2aMm()


# ----------------------------------------------------------------------------------------
# find


def _match(a2a: Node) -> A2aMmSite | None:
    group_name = node_arg(a2a, 3, "group_name")
    n = len(node_arg(a2a, 1, "output_split_sizes"))
    wait = the_wait(a2a) or a2a
    if not reaches_matmul(wait):
        return None
    uses: list[ExchangedUse] = []
    unmatched: list[str] = []
    declined = None
    try:
        if wait is a2a or wait.target is not c10d.wait_tensor.default:
            raise decline("site.wait", node=a2a.name)
        if n < 2:
            raise decline("site.group_of_one")
        if equal_splits(a2a) is None:
            raise decline("a2a.uneven", node=a2a.name, splits=list(node_arg(a2a, 1, "")))
        check_tensor(wait, "exchanged tensor")
        _collect_uses(wait, n, uses, unmatched)
        _drop_matmuls_reading_it_twice(wait, uses, unmatched)
        if not uses and unmatched:
            raise decline("a2a.matmuls_left_out", unmatched="; ".join(unmatched))
        if not uses:
            raise decline("a2a.no_matmul")
    except Declined as why:
        declined = why.kept()
    return A2aMmSite(
        all_to_all=a2a,
        wait=wait,
        uses=tuple(uses),
        unmatched=tuple(unmatched),
        group_name=str(group_name),
        group_size=n,
        declined=declined,
    )


def _collect_uses(wait: Node, n: int, uses: list[ExchangedUse], unmatched: list[str]) -> None:
    """Follow the layout users of the exchanged tensor, with the dim that holds its n
    blocks, to the matmuls that read it."""
    frontier: list[tuple[Node, int, tuple[tuple[Node, int], ...]]] = [(wait, 0, ())]
    while frontier:
        node, dim, path = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and is_mutating(user):
                raise decline("ag.mutated", node=user.name)
            mm = Matmul.of(user)
            if mm is not None:
                _add_use(mm, node, dim, path, uses, unmatched)
            elif user.target in LAYOUT_OPS and user.args[0] is node:
                moved = split_dim_in_output(user, dim, n)
                if moved is not None:
                    frontier.append((user, moved, (*path, (user, moved))))
                elif reaches_matmul(user):
                    unmatched.append(f"{user.name}: the all-to-all's blocks do not stay blocks")
            elif reaches_matmul(user):
                unmatched.append(between_note(user, "exchanged"))


def _drop_matmuls_reading_it_twice(
    wait: Node, uses: list[ExchangedUse], unmatched: list[str]
) -> None:
    """``G @ G^T``, the exchanged tensor as both operands through two paths
    (``graph.read_twice``)."""
    own = {wait, *(node for use in uses for node, _ in use.path)}
    twice = read_twice(((u.mm.node, _other_operand(u)) for u in uses), own, "exchanged")
    unmatched += twice.values()
    uses[:] = [u for u in uses if u.mm.node not in twice]


def _other_operand(use: ExchangedUse) -> Node:
    """The matmul operand that is not (a layout of) the exchanged tensor."""
    return use.mm.b if use.role in ("rows", "contract") else use.mm.a


def _add_use(
    mm: Matmul,
    operand: Node,
    dim: int,
    path: tuple[tuple[Node, int], ...],
    uses: list[ExchangedUse],
    unmatched: list[str],
) -> None:
    """Record ``mm`` as a use, its role from where the blocks sit in it."""
    if mm.a is operand and mm.b is operand:
        unmatched.append(f"{mm.node.name}: reads the exchanged tensor as both operands")
        return
    if operand not in (mm.a, mm.b):
        unmatched.append(f"{mm.node.name}: the exchanged tensor is its {mm.reads_as(operand)}")
        return
    role = {(True, 0): "rows", (True, 1): "contract", (False, 1): "columns"}.get(
        (mm.a is operand, dim), "contract_left"
    )
    problem = None
    if not mm.node.users:
        problem = "its product is never read"
    elif has_zero_size_dim(mm):
        problem = "a zero-size dim: nothing to overlap"
    elif role.startswith("contract") and mm.bias is not None:
        problem = "a bias on a contracted product"
    elif role == "rows" and mm.bias is not None and not bias_is_row_broadcast(mm.bias):
        problem = "bias has a row dim"
    elif scales := scales_problem(mm):
        problem = scales
    elif role.startswith("contract") and (sums := sums_problem(mm)):
        problem = sums
    if problem:
        unmatched.append(f"{mm.node.name} ({role}): {problem}")
        return
    check_tensor(mm.node, "matmul output")
    uses.append(ExchangedUse(mm=mm, path=path, role=role))


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: A2aMmSite, group: Group, schedule: Schedule) -> None:
    """Each step: send this rank's block for the step's peer and receive the peer's block
    for this rank, multiply the block at hand (this rank's own first), then wait."""
    n, r, tag = group.size, group.rank, new_tag()
    source = node_arg(site.all_to_all, 0, "input")
    width = val(source).shape[0] // n
    held = {r: slice_block(rw, source, 0, r, width, 0, "compute")}  # output blocks by source
    received: dict[tuple[int, int], Node] = {}
    products = _Products(rw, site, n)
    for s, step in enumerate(schedule.steps("exchange_in", r, n, 0)):
        sending = {
            t.block: contiguous(rw, slice_block(rw, source, 0, t.block, width, s, "comm"), s)
            for t in step.sends
        }
        started, recvs, sent = start_transfers(
            rw, group, tag, s, step.sends, step.recvs, sending, recv_like=held[r]
        )
        for b in step.compute:
            products.add(held[b], b, s)
        waits = wait_transfers(rw, s, recvs, sent, received, by_peer=True)
        for block, peer in list(received):
            held[(r + peer) % n] = received.pop((block, peer))
        rw.steps.append(Step(started, rw.matmuls.get(s, []), waits))
    last = len(rw.steps)
    products.finish(last)
    if _outlives(site):
        rebuilt = rw.emit(
            aten.cat.default, ([held[b] for b in range(n)], 0), step=last, lane="comm"
        )
        rw.replace[site.wait] = rebuilt
        if saved_unwaited(site.all_to_all):
            rw.replace[site.all_to_all] = rebuilt


class _Products:
    """What every use computes from one block of the exchanged tensor: a block of its
    product (rows, columns) or a partial product added to a running sum (contract)."""

    def __init__(self, rw: Rewrite, site: A2aMmSite, n: int) -> None:
        self.rw, self.site, self.n = rw, site, n
        self.blocks: list[dict[int, Node]] = [{} for _ in site.uses]
        self.sums: list[Node | None] = [None for _ in site.uses]

    def add(self, block: Node, b: int, s: int) -> None:
        rw, n = self.rw, self.n
        for i, use in enumerate(self.site.uses):
            mm = use.mm
            g = replay(rw, block, use.path, n, s, "compute")  # the operand's block b
            if use.role == "rows":  # block b: A's rows [b*M/n, (b+1)*M/n)
                rows = row_block(rw, b, val(mm.a).shape[0] // n, s)
                self.blocks[i][b] = matmul(rw, mm, g, mm.b, s, rows=rows)
            elif use.role == "columns":
                cols = (b, val(mm.b).shape[1] // n)
                self.blocks[i][b] = matmul(rw, mm, mm.a, g, s, cols=cols)
            elif use.role == "contract":
                k = val(mm.a).shape[1] // n
                w = slice_block(rw, mm.b, 0, b, k, s, "compute")
                self.sums[i] = accumulate(rw, mm, self.sums[i], g, w, s)
            else:  # contract_left
                x = column_block(rw, mm.a, b, val(mm.b).shape[0] // n, s)
                self.sums[i] = accumulate(rw, mm, self.sums[i], x, g, s)

    def finish(self, step: int) -> None:
        rw = self.rw
        for i, use in enumerate(self.site.uses):
            total = self.sums[i]
            if total is not None:
                rw.replace[use.mm.node] = finish_sum(rw, total, use.mm.node, step)
                continue
            pieces = [self.blocks[i][b] for b in range(self.n)]
            dim = 0 if use.role == "rows" else 1
            full = rw.emit(aten.cat.default, (pieces, dim), step=step, lane="compute")
            rw.replace[use.mm.node] = viewed(rw, full, list(val(use.mm.node).shape), step)


def _outlives(site: A2aMmSite) -> bool:
    """Is the exchanged tensor read by anything other than the rewritten matmuls?"""
    inside = set(site.chain) | {u.mm.node for u in site.uses}
    nodes = (site.wait, *site.chain)
    readers = (user for node in nodes for user in data_users(node))
    return saved_unwaited(site.all_to_all) or any(user not in inside for user in readers)
