"""All-to-all -> matmul (Ulysses: the output projection; in the backward, the gradients
of the q/k/v projections' input and weights): block j of the all-to-all's output comes
from rank j, so each block is multiplied as soon as it arrives, this rank's own block
first, under the first transfer. Partial products are never sent.

    # before                          # after (rank r of n)
    g = wait(all_to_all(x))           y_[r] = x[block r] @ w      # own block: under the first
    y = g @ w                         for s in range(1, n):
                                          blk = wait(p2p(send x[block r+s] to r+s, recv from r-s))
                                          y_[r - s] = blk @ w
                                      y = cat(y_)                # (rows; other roles: columns, K)

``all_to_all_single`` stacks the n received blocks on dim 0. That dim is followed
through the views, permutes and copies to each matmul operand that reads it, where the
blocks are rows or columns of the 2-D operand G; where G sits decides what a block
computes (``ExchangedUse.role``):
``rows``:          ``G @ W``: a block of the product's rows.
``contract``:      ``G @ W`` with the blocks along K (heads into the output projection):
                   adds ``G_j @ W[K_j]``.
``columns``:       ``X @ G``: a block of the product's columns (a weight gradient).
``contract_left``: ``X @ G`` with the blocks along K: adds ``X[:, K_j] @ G_j``.
A batched matmul (an MoE's experts, ``torch.bmm``) takes the same roles in each of its
batch entries: the blocks along its M, K or N.

The blocks may be uneven (``dims.Split``: a head count or a sequence the group does not
divide): block j is then ``out[j]`` of the output's rows (of ``sum(out)``), and the
same share of every dim it is followed to, a span of the operand's rows, K or columns;
this rank sends blocks of the input's split sizes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.fx import Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule, Transfer
from ..fx import dims
from ..fx.collectives import ALL_TO_ALL, check_own_block, exchange_splits, split_sizes, the_wait
from ..fx.declines import Declined, decline
from ..fx.graph import (
    LAYOUT_OPS,
    between_note,
    check_tensor,
    node_arg,
    numel,
    position,
    split_dim_in_output,
    val,
)
from ..fx.matmuls import (
    Matmul,
    bias_is_row_broadcast,
    has_zero_size_dim,
    reaches_matmul,
    scales_problem,
    sums_problem,
)
from ..kit import paths
from ..kit.blocks import make_contiguous, replay, slice_span
from ..kit.rewrite import Rewrite, Taken
from ..kit.ring import Products, collect_then_compute, replace_collective
from ..kit.site_kind import AtCollective
from ..kit.uses import Use, UsesSite, check_read_only, without_read_twice

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangedUse(Use):
    """A matmul reading the all-to-all's output through ``path`` (layout ops, each with
    the dim of its output that holds the n blocks)."""

    path: tuple[tuple[Node, int], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class A2aMmSite(UsesSite):
    kind: ClassVar[str] = "a2a_mm"
    LEFT_OUT: ClassVar[str] = "a2a.matmuls_left_out"
    all_to_all: Node
    wait: Node
    uses: tuple[ExchangedUse, ...] = ()
    received: dims.Split | None = None  # the output's blocks (None: declined before)
    sent: dims.Split | None = None  # the input's

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.all_to_all,)

    @property
    def uneven(self) -> bool:
        return any(split and split.sizes for split in (self.received, self.sent))

    @property
    def results(self) -> tuple[Node, ...]:
        return (self.wait,)

    @property
    def chain(self) -> tuple[Node, ...]:
        return tuple(dict.fromkeys(node for use in self.uses for node, _ in use.path))

    def replaced(self) -> list[Node]:
        return [self.all_to_all, self.wait, *self.chain, *(u.mm.node for u in self.uses)]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.all_to_all.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [u.mm.node.name for u in self.uses],
            "roles": {u.mm.node.name: u.role for u in self.uses},
            "exchanged_shape": dims.as_json(val(self.all_to_all).shape),
            "unmatched": list(self.unmatched),
            **split_sizes(self.all_to_all, self.uneven),
        }


class A2aMm(AtCollective[A2aMmSite]):
    name = "a2a_mm"
    roles = ("rows", "contract", "columns", "contract_left")
    direction = Direction.EXCHANGE_IN
    collective = ALL_TO_ALL

    def match(self, collective: Node, taken: Taken) -> A2aMmSite | None:
        return _match(collective)

    def without(self, site: A2aMmSite, disabled: frozenset[str]) -> A2aMmSite:
        return site.without_roles(disabled)

    def work(self, site: A2aMmSite, n: int) -> Work:
        flops = sum(2 * numel(u.mm.node) * dims.hint(u.mm.contracted) for u in site.uses)
        message = numel(site.all_to_all) * val(site.all_to_all).element_size()
        products, rebuilt = site.concatenated(message)
        return Work(
            self.direction, n, flops / n, message / n, len(site.uses),
            whole_bytes=site.whole_bytes(), matmul_class=site.uses[0].mm.rate_class,
            product_bytes=products, rebuilt_bytes=rebuilt,
        )  # fmt: skip

    def start(self, site: A2aMmSite, taken: Taken) -> tuple[A2aMmSite, Node]:
        readers = list(site.wait.users)
        if not readers:  # pragma: no cover - matched sites have one
            raise decline("site.no_reader")
        before = min(readers, key=position)
        return site.without_own_result(before), before

    def lower(
        self, rw: Rewrite, site: A2aMmSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        _lower(rw, site, group, schedule)

    def alike_from(self, site: A2aMmSite) -> int | None:
        return int(site.uneven)  # uneven blocks differ in their rows only


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
    declined, received, sent = None, None, None
    try:
        if wait is a2a or wait.target is not c10d.wait_tensor.default:
            raise decline("site.wait", node=a2a.name)
        if n < 2:
            raise decline("site.group_of_one")
        received, sent = exchange_splits(a2a)
        check_tensor(wait, "exchanged tensor")
        _collect_uses(wait, received, uses, unmatched)
        own = {wait, *(node for use in uses for node, _ in use.path)}
        uses[:], twice = without_read_twice(uses, own, "exchanged")
        unmatched += twice
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
        received=received,
        sent=sent,
        group_name=str(group_name),
        group_size=n,
        declined=declined,
    )


def _collect_uses(
    wait: Node, split: dims.Split, uses: list[ExchangedUse], unmatched: list[str]
) -> None:
    """Follow the layout users of the exchanged tensor, with the dim that holds its
    blocks of ``split``, to the matmuls that read it."""
    frontier: list[tuple[Node, int, tuple[tuple[Node, int], ...]]] = [(wait, 0, ())]
    while frontier:
        node, dim, path = frontier.pop()
        for user in node.users:
            check_read_only(user, node)
            mm = Matmul.of(user, batched=True)
            if mm is not None:
                _add_use(mm, node, dim, path, uses, unmatched)
            elif user.target in LAYOUT_OPS and user.args[0] is node:
                moved = split_dim_in_output(user, dim, split)
                if moved is not None:
                    frontier.append((user, moved, (*path, (user, moved))))
                elif reaches_matmul(user):
                    unmatched.append(f"{user.name}: the all-to-all's blocks do not stay blocks")
            elif reaches_matmul(user):
                unmatched.append(between_note(user, "exchanged"))


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
    if dim < mm.lead:
        unmatched.append(f"{mm.node.name}: the blocks run along a batched matmul's batch")
        return
    role = {(True, 0): "rows", (True, 1): "contract", (False, 1): "columns"}.get(
        (mm.a is operand, dim - mm.lead), "contract_left"
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
    assert site.received is not None and site.sent is not None, "a matched site has its splits"
    em, n, r = rw.emit, group.size, group.rank
    received, sent = site.received, site.sent
    source = node_arg(site.all_to_all, 0, "input")
    rows, out_rows = val(source).shape[0], val(site.all_to_all).shape[0]
    check_own_block(site.all_to_all, sent.width(rows, r), received.width(out_rows, r))
    products = Products(rw, [(u.mm, u.role) for u in site.uses])

    def send(t: Transfer, s: int) -> Node:
        return make_contiguous(
            em, slice_span(em, source, 0, sent.bounds(rows, t.block), s, "comm"), s
        )

    def compute(b: int, block: Node, s: int) -> None:
        for i, use in enumerate(site.uses):
            _compute(rw, products, i, use, block, b, received, s)

    own = slice_span(em, source, 0, sent.bounds(rows, r), 0, "compute")
    held = {r: own}  # output blocks by source
    widths = (lambda j: received.width(out_rows, j)) if site.uneven else None
    held = collect_then_compute(
        rw, group, schedule, Direction.EXCHANGE_IN, held, send, compute, widths
    )
    last = len(rw.steps)
    products.finish(n, last, rows_dim=0)
    if site.outlives():
        rebuilt = em(aten.cat.default, ([held[b] for b in range(n)], 0), step=last, lane="comm")
        replace_collective(rw, [site.all_to_all], [site.wait], rebuilt)


def _compute(
    rw: Rewrite,
    products: Products,
    i: int,
    use: ExchangedUse,
    block: Node,
    b: int,
    split: dims.Split,
    s: int,
) -> None:
    """What ``use``'s matmul computes from block ``b`` of the exchanged tensor."""
    em = rw.emit
    g = replay(em, block, use.path, split, b, s, "compute")  # the operand's block b
    paths.compute_block(em, products, i, use.mm, use.role, g, b, split, s)
