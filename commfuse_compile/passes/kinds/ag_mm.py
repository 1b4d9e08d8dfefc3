"""All-gather -> matmul: a matmul reads the gathered tensor, so each block of it can be
multiplied as soon as it arrives.

The collective's dim is followed through the reassembly DTensor emits (split + cat) and
through view/reshape into the matmul's rows, where any block of rows is an independent
piece of the product; transposed uses (weight gradients, gathered weights) contract or
fill columns block by block (``GatherUse.role``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch._prims_common import is_contiguous_or_false
from torch.fx import Graph, Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule
from ...site_kinds import ROLES
from .. import dims
from ..blocks import (
    chunk_width,
    column_block,
    contiguous,
    matmul,
    packed,
    rows_of_block,
    slice_block,
    transposed,
    unpacked,
    viewed,
)
from ..declines import Declined, decline
from ..emit import Emitter
from ..graph import (
    VIEWS,
    Matmul,
    between_note,
    bias_is_row_broadcast,
    check_tensor,
    data_users,
    has_zero_size_dim,
    is_full_slice,
    is_mutating,
    is_transpose_2d,
    node_arg,
    normalized_dim,
    numel,
    ordered_getitems,
    position,
    reaches_matmul,
    same_data,
    saved_unwaited,
    scales_problem,
    sums_problem,
    the_wait,
    val,
    varies_by_row,
)
from ..placement import hoistable
from ..rewrite import Rewrite, Taken
from ..ring import Products, collect_then_compute, replace_collective, sliced
from ..site_kind import SiteKind
from ..uses import U, Use, UsesSite, without_read_twice

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherUse(Use):
    """A matmul reading the gathered tensor G, viewed 2-D with the gathered dim in its rows.

    Where G2d sits decides what a block of it computes (``role``):
    ``rows``:      ``G2d @ W``    (column-parallel input): a block of the product's rows.
    ``contract``:  ``G2d^T @ X``  (weight gradient): adds ``G2d_b^T @ X_b``.
    ``columns``:   ``X @ G2d^T``  (a gathered weight, FSDP): a block of the product's columns.
    ``contract_left``: ``Y @ G2d`` (input gradient of a gathered weight): adds ``Y_b @ G2d_b``.
    ``contract_k``: ``G2d @ W`` with the gathered dim in G2d's columns (an activation
    gathered on its last dim): adds ``G2d_b @ W[K_b]``.
    """

    row_dims: int  # the gathered tensor's dims [:row_dims] fold into G2d's rows


@dataclasses.dataclass(frozen=True)
class Beside:
    """A per-row scale of A gathered on its own, beside A (its shard's rows' scales, on
    the same group and dim), read only as the scale of the site's row-block matmuls: its
    collective joins the site, its shard travels in A's messages (``rewrite.packed``)."""

    gather: Node
    wait: Node
    shard: Node
    chain: tuple[Node, ...]  # its reassembly and views, up to the matmuls' scale_a
    readers: frozenset[Node]  # those matmuls


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgMmSite(UsesSite):
    kind: ClassVar[str] = "ag_mm"
    LEFT_OUT: ClassVar[str] = "ag.matmuls_left_out"
    gathers: tuple[Node, ...]  # all-gathers of one shard on one group (merged: one ring)
    waits: tuple[Node, ...]
    shard: Node
    gather_dim: int  # dim of the logical gathered tensor the shards are concatenated on
    gathered_shape: tuple[dims.Size, ...] = ()
    uses: tuple[GatherUse, ...] = ()
    chain: tuple[Node, ...] = ()  # nodes between the waits and the matmuls
    beside: Beside | None = None

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (*self.gathers, *((self.beside.gather,) if self.beside else ()))

    @property
    def results(self) -> tuple[Node, ...]:
        return self.waits

    def replaced(self) -> list[Node]:
        beside = (self.beside.gather, self.beside.wait, *self.beside.chain) if self.beside else ()
        return [*self.gathers, *self.waits, *self.chain, *(u.mm.node for u in self.uses), *beside]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [n.name for n in self.collectives],
            "scale_beside": self.beside.gather.name if self.beside else None,
            "group": self.group_name,
            "group_size": self.group_size,
            "gather_dim": self.gather_dim,
            "gathered_shape": dims.as_json(self.gathered_shape),
            "matmuls": [u.mm.node.name for u in self.uses],
            "roles": {u.mm.node.name: u.role for u in self.uses},
            "unmatched": list(self.unmatched),
        }

    def leaving_out(self, left: Mapping[U, str]) -> AgMmSite:
        """As ``UsesSite.leaving_out``; the scales gathered beside A stay gathered on
        their own if a matmul left out reads them."""
        site = super().leaving_out(left)
        beside = site.beside
        if beside is not None and not beside.readers <= {u.mm.node for u in site.uses}:
            site = dataclasses.replace(site, beside=None)
        return site


class AgMm(SiteKind[AgMmSite]):
    name = "ag_mm"
    direction = Direction.GATHER
    roles = ROLES[name]
    nests = True

    def find(self, graph: Graph) -> list[AgMmSite]:
        found = (_match(*item) for item in _gathers_by_shard(graph).items())
        sites = [site for site in found if site is not None]
        beside = {s.beside.gather for s in sites if s.beside}
        return [s for s in sites if not beside & set(s.gathers)]

    def rematch(self, site: AgMmSite, taken: Taken) -> AgMmSite | None:
        gathers = [g for g in site.gathers if not g._erased]
        shard, n, group_name = gathers[0].args[:3]
        return _match((shard, int(n), str(group_name)), gathers)  # type: ignore[arg-type]

    def without(self, site: AgMmSite, disabled: frozenset[str]) -> AgMmSite:
        return site.without_roles(disabled)

    def work(self, site: AgMmSite, n: int) -> Work:
        flops = sum(2 * numel(u.mm.node) * dims.hint(val(u.mm.a).shape[1]) for u in site.uses)
        shards = (site.shard, *((site.beside.shard,) if site.beside else ()))
        shard_bytes = sum(numel(shard) * val(shard).element_size() for shard in shards)
        return Work(self.direction, n, flops / n, shard_bytes, len(site.uses))

    def start(self, site: AgMmSite, taken: Taken) -> tuple[AgMmSite, Node]:
        site = _nested_in_one_window(site, taken)
        site = site.without_own_result(_first_reader(site))
        site = _without_uses_read_too_late(site, taken)
        return site, _ring_place(site, taken)

    def lower(
        self, rw: Rewrite, site: AgMmSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        if schedule.sliced:
            _lower_sliced(rw, site, group, schedule, slices)
        else:
            _lower(rw, site, group, schedule)


KIND = AgMm()


# ----------------------------------------------------------------------------------------
# find


def _gathers_by_shard(graph: Graph) -> dict[tuple[Node, int, str], list[Node]]:
    """Gathers of one shard on one group compute one value: DTensor emits one per consumer."""
    groups: dict[tuple[Node, int, str], list[Node]] = {}
    for node in graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default):
        if "commfuse" in node.meta:  # the slicing schedule's own chunk collectives
            continue
        shard, size, name = node.args[:3]
        groups.setdefault((shard, int(size), str(name)), []).append(node)  # type: ignore[arg-type]
    return groups


@dataclasses.dataclass
class _Uses:
    """What following the gathered tensor found (frozen into the site at the end)."""

    gathered_shape: tuple[dims.Size, ...]
    gather_dim: int
    n: int
    chain: list[Node] = dataclasses.field(default_factory=list)
    uses: list[GatherUse] = dataclasses.field(default_factory=list)
    unmatched: list[str] = dataclasses.field(default_factory=list)


def _match(key: tuple[Node, int, str], gathers: list[Node]) -> AgMmSite | None:
    shard, n, group_name = key
    waits: list[Node] = []
    gathered: list[tuple[Node, int, list[Node]]] = []
    problem = None
    for ag in gathers:
        wait = the_wait(ag)
        if wait is None:
            problem = ag.name
            continue
        waits.append(wait)
        gathered.append(_reassembled(wait, n))
    if not any(reaches_matmul(g) for g, _, _ in gathered) and not any(
        reaches_matmul(user) for ag in gathers for user in ag.users
    ):
        return None
    g_dims = {g for _, g, _ in gathered}
    found = _Uses(gathered_shape=(), gather_dim=min(g_dims) if g_dims else 0, n=n)
    declined = None
    try:
        if problem:
            raise decline("site.wait", node=problem)
        if len(g_dims) != 1:
            raise decline("ag.dims_differ", shard=shard.name)
        check_tensor(shard, "gathered shard")
        if n < 2:
            raise decline("site.group_of_one")
        found.gathered_shape = dims.sizes(val(gathered[0][0]).shape)
        for node, _, chain in gathered:
            found.chain += chain
            _collect_uses(found, node)
        found.uses, twice = without_read_twice(found.uses, {*waits, *found.chain}, "gathered")
        found.unmatched += twice
        if not found.uses and found.unmatched:
            raise decline("ag.matmuls_left_out", unmatched="; ".join(found.unmatched))
        if not found.uses:
            raise decline("ag.no_matmul")
        beside = _scale_beside(found, shard, group_name)
    except Declined as why:
        declined, beside = why.kept(), None
    return AgMmSite(
        gathers=tuple(gathers),
        waits=tuple(waits),
        shard=shard,
        group_name=group_name,
        group_size=n,
        gather_dim=found.gather_dim,
        gathered_shape=found.gathered_shape,
        uses=tuple(found.uses),
        chain=tuple(found.chain),
        unmatched=tuple(found.unmatched),
        beside=beside,
        declined=declined,
    )


def _scale_beside(found: _Uses, shard: Node, group_name: str) -> Beside | None:
    """The all-gather of A's per-row scale beside A's (``Beside``), if every row-block
    scaled matmul with a per-row scale reads the same one, only they read it, and A's
    shard is a multiple of 16 bytes (the scale's bytes follow it, aligned)."""
    readers = [u.mm for u in found.uses if u.role == "rows" and _per_row_scale(u.mm)]
    sources: set[Node] = set()
    views: set[Node] = set()
    for mm in readers:
        node: Node = mm.scale_a  # type: ignore[assignment]
        while node.target in VIEWS:
            views.add(node)
            node = node_arg(node, 0, "self")
        sources.add(node)
    source = sources.pop() if len(sources) == 1 else None
    wait = _wait_before(source) if source is not None else None
    if wait is None or not dims.divisible(math.prod(val(shard).shape), 16):
        return None
    gather = node_arg(wait, 0, "input")
    scale_shard, n, name = gather.args[:3]
    value, (gathered, g, chain) = val(scale_shard), _reassembled(wait, found.n)
    if (
        gathered is not source
        or the_wait(gather) is not wait
        or saved_unwaited(gather)
        or (n, name) != (found.n, group_name)
        or g != found.gather_dim
        or value.dtype != torch.float32
        or not dims.same_shape(value.shape, (*val(shard).shape[:-1], 1))
    ):
        return None
    own = {wait, *chain, *views}
    inside = own | {mm.node for mm in readers}
    if any(u not in inside for node in own for u in data_users(node)):
        return None
    return Beside(gather, wait, scale_shard, (*chain, *views), frozenset(m.node for m in readers))


def _per_row_scale(mm: Matmul) -> bool:
    return mm.scale_a is not None and varies_by_row(mm.scale_a)


def _wait_before(node: Node) -> Node | None:
    """The wait_tensor of the all-gather whose (reassembled) value ``node`` is."""
    if node.target is aten.cat.default:
        parts = node_arg(node, 0, "tensors")
        if parts and parts[0].target is operator.getitem:
            node = node_arg(parts[0], 0, "self")  # the split
            node = node_arg(node, 0, "self") if node.target is aten.split.Tensor else node
    if node.target is not c10d.wait_tensor.default:
        return None
    gather = node_arg(node, 0, "input")
    return node if gather.target is c10d.all_gather_into_tensor.default else None


def _reassembled(wait: Node, n: int) -> tuple[Node, int, list[Node]]:
    """(logical gathered tensor, gather dim, reassembly nodes) after a gather's wait.

    all_gather_into_tensor concatenates on dim 0; DTensor gathers any other dim g by
    ``cat(split(out, s0), dim=g)``. Longest form first; otherwise the gather dim is 0.
    """
    users, before = data_users(wait), []
    while len(users) == 1 and same_data(users[0]):  # float8 data gathered as bytes
        before.append(users[0])
        users = data_users(users[0])
    if len(users) == 1 and users[0].target is aten.split.Tensor:
        split = users[0]
        parts = ordered_getitems(split, n)
        dim = node_arg(split, 2, "dim", 0)
        if parts is not None and dim == 0:
            cats = {u for p in parts for u in data_users(p)}
            if len(cats) == 1:
                cat = cats.pop()
                if cat.target is aten.cat.default and list(node_arg(cat, 0, "tensors")) == parts:
                    g = normalized_dim(cat, node_arg(cat, 1, "dim", 0))
                    return cat, g, [*before, split, *parts, cat]
    return wait, 0, []


def _collect_uses(site: _Uses, gathered: Node) -> None:
    """Follow view/reshape users of the gathered tensor to the matmuls that read its rows."""
    frontier = [gathered]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and is_mutating(user):
                raise decline("site.mutated", node=user.name)
            mm = Matmul.of(user)
            if (user.target in VIEWS or is_full_slice(user) or same_data(user)) and (
                user.args[0] is node
            ):
                site.chain.append(user)
                frontier.append(user)
            elif mm is not None and node not in (mm.a, mm.b):
                what = mm.reads_as(node)
                site.unmatched.append(f"{mm.node.name}: the gathered tensor is its {what}")
            elif mm is not None:
                _add_use(site, node, mm, "rows" if mm.a is node else "contract_left")
            elif is_transpose_2d(user) and user.args[0] is node:
                site.chain.append(user)
                for consumer in user.users:
                    mm = Matmul.of(consumer)
                    if mm is not None:
                        _add_use(site, node, mm, "contract" if mm.a is user else "columns")
                    elif is_transpose_2d(consumer):  # t(t(G)) is G
                        site.chain.append(consumer)
                        frontier.append(consumer)
                    elif reaches_matmul(consumer):
                        site.unmatched.append(between_note(consumer))
            elif reaches_matmul(user):
                site.unmatched.append(between_note(user))


def _add_use(site: _Uses, g2d: Node, mm: Matmul, role: str) -> None:
    """Record ``mm`` as a use if the gathered dim lands in the rows of ``g2d``."""
    rows, cols = dims.sizes(val(g2d).shape)
    j = dims.row_split(site.gathered_shape, rows, cols)
    contiguous = dims.equal(math.prod(site.gathered_shape[: site.gather_dim]), 1)
    if role == "rows" and j is not None and site.gather_dim >= j:
        in_columns = dims.outer_split(site.gathered_shape, site.gather_dim, (rows, cols), site.n)
        role = "contract_k" if in_columns == 1 else role
    problem = None
    if not mm.node.users:
        problem = "its product is never read"
    elif has_zero_size_dim(mm):
        problem = "a zero-size dim: nothing to overlap"
    elif role != "contract_k" and (j is None or site.gather_dim >= j):
        problem = (
            f"gathered dim {site.gather_dim} of {list(site.gathered_shape)} does not fold "
            f"into the rows of [{rows}, {cols}]"
        )
    elif role == "columns" and not contiguous:
        problem = f"gathered dim {site.gather_dim} is not the outermost: blocks not contiguous"
    elif role.startswith("contract") and mm.bias is not None:
        problem = "a bias on a contracted product"
    elif role == "rows" and mm.bias is not None and not bias_is_row_broadcast(mm.bias):
        problem = "bias has a row dim"
    elif role == "contract" and not dims.equal(val(mm.b).shape[0], rows):
        problem = f"its other operand does not have {rows} rows"
    elif scales := scales_problem(mm):
        problem = scales
    elif role.startswith("contract") and (sums := sums_problem(mm)):
        problem = sums
    if problem:
        site.unmatched.append(f"{mm.node.name} ({role}): {problem}")
        return
    check_tensor(mm.node, "matmul output")
    assert j is not None
    site.uses.append(GatherUse(mm=mm, row_dims=j, role=role))


# ----------------------------------------------------------------------------------------
# lower


class _GatherBlocks:
    """What every use of the gathered tensor computes from one piece of it.

    A piece is block ``index`` of ``count`` equal blocks along the gathered dim (a shard,
    or a chunk of a shard under slicing); rows/columns uses keep a product block per
    piece, contracting uses add the piece's partial product to a running sum."""

    def __init__(self, rw: Rewrite, site: AgMmSite) -> None:
        self.em, self.site = rw.emit, site
        self.products = Products(rw, [(u.mm, u.role) for u in site.uses])
        self.others: dict[int, Node] = {}  # contract: the other operand viewed like G

    def add(
        self, piece: Node, scale: Node | None, index: int, shape: Sequence[dims.Size], s: int
    ) -> None:
        """``scale``: the piece's rows' scales, where they came beside it (``Beside``)."""
        em, site = self.em, self.site
        views: dict[tuple[object, ...], Node] = {}  # one 2-D view of the piece per shape
        for i, use in enumerate(site.uses):
            shape2d = (math.prod(shape[: use.row_dims]), math.prod(shape[use.row_dims :]))
            dtype = val(use.operands[0]).dtype  # float8 data may travel as bytes
            key = (*dims.as_json(shape2d), dtype)
            if key not in views:
                data = piece
                if val(piece).dtype != dtype:
                    data = em(aten.view.dtype, (piece, dtype), step=s, lane="compute")
                views[key] = em(
                    aten.view.default, (data, em.shape(shape2d, s)), step=s, lane="compute"
                )
            self._compute(i, use, views[key], scale, index, shape, s)

    def _compute(
        self,
        i: int,
        use: GatherUse,
        g2d: Node,
        scale: Node | None,
        index: int,
        shape: Sequence[dims.Size],
        s: int,
    ) -> None:
        """What ``use``'s matmul computes from piece ``index`` (of ``shape``) viewed 2-D
        (``g2d``)."""
        em, site, mm = self.em, self.site, use.mm
        width, lead = shape[site.gather_dim], shape[: use.row_dims]
        shape2d = (math.prod(lead), math.prod(shape[use.row_dims :]))
        if use.role == "rows":
            rows = functools.partial(self._rows_of, use, index, width, s)
            if scale is not None and site.beside and mm.node in site.beside.readers:
                rows = functools.partial(_as_rows, em, scale, shape2d[0], s)
            part = matmul(em, mm, g2d, mm.b, s, rows=rows)
            self.products.put(i, index, viewed(em, part, [*lead, val(part).shape[1]], s))
        elif use.role == "columns":
            g_t = transposed(em, g2d, s)
            self.products.put(i, index, matmul(em, mm, mm.a, g_t, s, cols=(index, shape2d[0])))
        elif use.role == "contract":
            if i not in self.others:
                k = val(mm.b).shape[1]
                self.others[i] = viewed(em, mm.b, [*site.gathered_shape[: use.row_dims], k], s)
            x_b = rows_of_block(em, self.others[i], site.gather_dim, index, width, s)
            self.products.add(i, transposed(em, g2d, s), x_b, s)
        elif use.role == "contract_k":
            w_b = slice_block(em, mm.b, 0, index, shape2d[1], s, "compute")
            self.products.add(i, g2d, w_b, s)
        else:  # contract_left
            y_b = self._columns_meeting(i, use, index, width, shape2d[0], s)
            self.products.add(i, y_b, g2d, s)

    def _rows_of(self, use: GatherUse, index: int, width: dims.Size, s: int, x: Node) -> Node:
        """Piece ``index``'s rows of ``x``, laid out like the rows of the gathered tensor
        viewed 2-D (a per-row scale of A: the rows the piece holds, in its order)."""
        em, site = self.em, self.site
        lead = [*site.gathered_shape[: use.row_dims], val(x).shape[-1]]
        return rows_of_block(em, viewed(em, x, lead, s), site.gather_dim, index, width, s)

    def _columns_meeting(
        self, i: int, use: GatherUse, index: int, width: dims.Size, rows: dims.Size, s: int
    ) -> Node:
        """The columns of Y (in ``Y @ G2d``) that meet block ``index`` of G2d's rows: a
        column block where the gathered dim is outermost; otherwise (the sequence of
        [batch, seq, dim], a weight gradient's t(dY) @ X) Y viewed with G's leading
        dims, sliced on the gathered dim and copied into 2-D."""
        em, site, y = self.em, self.site, use.mm.a
        if dims.equal(math.prod(site.gathered_shape[: site.gather_dim]), 1):
            return column_block(em, y, index, rows, s)
        m = val(y).shape[0]
        if i not in self.others:
            self.others[i] = viewed(em, y, [m, *site.gathered_shape[: use.row_dims]], s)
        part = slice_block(em, self.others[i], 1 + site.gather_dim, index, width, s, "compute")
        return viewed(em, contiguous(em, part, s), [m, rows], s)

    def finish(self, count: int, step: int) -> None:
        """Assemble the ``count`` pieces' products into each matmul's replacement."""
        self.products.finish(count, step, self.site.gather_dim)


def _as_rows(em: Emitter, scale: Node, rows: dims.Size, s: int, _: Node) -> Node:
    """A piece's per-row scales (that came beside it), as its [rows, 1] scale_a."""
    return viewed(em, scale, [rows, 1], s)


def _lower(rw: Rewrite, site: AgMmSite, group: Group, schedule: Schedule) -> None:
    """The ring of messages: a shard, or a shard and its rows' scales packed (``Beside``);
    each block's matmuls read it as it arrives (this rank's own block first, unpacked)."""
    em, n = rw.emit, group.size
    shard_shape = dims.sizes(val(site.shard).shape)
    local = _local_shard(em, site)
    scale = site.beside.shard if site.beside else None
    pieces: dict[int, tuple[Node, Node | None]] = {group.rank: (local, scale)}
    held: dict[int, Node] = {group.rank: packed(em, local, scale, 0) if scale else local}
    products = _GatherBlocks(rw, site)

    def compute(b: int, message: Node, s: int) -> None:
        if b not in pieces:
            pieces[b] = _piece(em, message, local, scale, s)
        products.add(*pieces[b], b, shard_shape, s)

    collect_then_compute(
        rw, group, schedule, Direction.GATHER, held, lambda t, _: held[t.block], compute
    )
    last = len(rw.steps)
    products.finish(n, last)
    _rebuild_gathered(rw, site, [pieces[b][0] for b in range(n)], last)


def _lower_sliced(rw: Rewrite, site: AgMmSite, group: Group, schedule: Schedule, k: int) -> None:
    """k all-gathers of shard chunks along the gathered dim, chunk i-1's matmuls under
    chunk i's all-gather; piece (b, i) is block b*k + i of the gathered dim."""
    em, n, dim = rw.emit, group.size, site.gather_dim
    shard_shape = dims.sizes(val(site.shard).shape)
    width = chunk_width(shard_shape[dim], k, f"the shard's dim {dim}")
    chunk_shape = [*shard_shape[:dim], width, *shard_shape[dim + 1 :]]
    chunks: dict[int, tuple[Node, Node | None]] = {}  # this rank's chunk i (and its scales)
    pieces: dict[tuple[int, int], tuple[Node, Node | None]] = {}  # (block, chunk) -> piece
    products = _GatherBlocks(rw, site)

    def issue(i: int, s: int) -> Node:
        chunks[i] = chunk, scale = _chunk(em, site, i, width, s)
        message = packed(em, chunk, scale, s) if scale else chunk
        gather = c10d.all_gather_into_tensor.default
        return em(gather, (message, n, group.name), step=s, lane="comm")

    def compute(i: int, s: int) -> None:
        for b in range(n):
            products.add(*pieces[b, i], b * k + i, chunk_shape, s)

    def collected(i: int, gathered: Node, s: int) -> None:
        chunk, scale = chunks[i]
        length = val(gathered).shape[0] // n
        for b in range(n):
            part = slice_block(em, gathered, 0, b, length, s, "comm")
            pieces[b, i] = _piece(em, part, chunk, scale, s)

    sliced(rw, schedule, Direction.GATHER, k, issue, compute, collected)
    last = len(rw.steps)
    products.finish(n * k, last)
    if site.outlives():
        shards = [
            em(aten.cat.default, ([pieces[b, i][0] for i in range(k)], dim), step=last, lane="comm")
            for b in range(n)
        ]
        _rebuild_gathered(rw, site, shards, last)


def _piece(
    em: Emitter, message: Node, data: Node, scale: Node | None, s: int
) -> tuple[Node, Node | None]:
    """A received (or gathered) block: the data and its rows' scales, if packed with it."""
    return unpacked(em, message, data, scale, s) if scale is not None else (message, None)


def _chunk(
    em: Emitter, site: AgMmSite, i: int, width: dims.Size, s: int
) -> tuple[Node, Node | None]:
    """This rank's chunk ``i`` along the gathered dim, and its rows' scales if they come
    beside it (then the chunk's bytes must keep them aligned: a multiple of 16)."""
    dim = site.gather_dim
    chunk = contiguous(em, slice_block(em, site.shard, dim, i, width, s, "comm"), s)
    if site.beside is None:
        return chunk, None
    size = math.prod(val(chunk).shape)
    if not dims.divisible(size, 16):
        raise decline("lower.scale_beside", node=site.shard.name, size=size)
    scale = slice_block(em, site.beside.shard, dim, i, width, s, "comm")
    return chunk, contiguous(em, scale, s)


def _local_shard(em: Emitter, site: AgMmSite) -> Node:
    """The shard as the ring sends it and every block is viewed (2-D rows): the data it
    holds (float8 data viewed as bytes for the collective travels as itself: P2P moves
    any dtype, and a view is no buffer of its own), copied once if it is neither
    contiguous nor 2-D already (received blocks always are contiguous)."""
    node = site.shard
    while same_data(node) and dims.same_shape(val(node.args[0]).shape, val(node).shape):  # type: ignore[arg-type]
        node = node.args[0]  # type: ignore[assignment]
    shard = val(node)
    if shard.dim() == 2 or is_contiguous_or_false(shard):
        return node
    return contiguous(em, node, 0)


def _rebuild_gathered(rw: Rewrite, site: AgMmSite, shards: list[Node], step: int) -> None:
    """all_gather_into_tensor's value, rebuilt from the shards: never gather twice."""
    if not site.outlives():
        return
    rebuilt = rw.emit(aten.cat.default, (shards, 0), step=step, lane="comm")
    dtype = val(site.waits[0]).dtype  # the collective's (bytes, for float8 data)
    if val(rebuilt).dtype != dtype:
        rebuilt = rw.emit(aten.view.dtype, (rebuilt, dtype), step=step, lane="comm")
    replace_collective(rw, site.gathers, site.waits, rebuilt)


def _first_reader(site: AgMmSite) -> Node:
    """Earliest node that reads a gathered value, where the collective stood."""
    readers = [u for wait in site.waits for u in wait.users]
    if not readers:  # pragma: no cover - matched sites have one
        raise decline("site.no_reader")
    return min(readers, key=position)


def _outside_readers(site: AgMmSite) -> list[Node]:
    """Nodes that read the gathered tensor other than the site's own views and matmuls:
    they read the tensor the ring rebuilds, so the ring must be done before them."""
    inside = {*site.chain, *(u.mm.node for u in site.uses)}
    nodes = (*site.waits, *site.chain)
    return [r for node in nodes for r in data_users(node) if r not in inside]


def _late_inputs(use: GatherUse, site: AgMmSite) -> list[Node]:
    """What ``use``'s matmul reads besides the gathered tensor (and the scales gathered
    beside it: their shard instead) that cannot be computed before the collective's first
    reader (a pure one, a weight's transpose, is hoisted there at commit instead)."""
    own, first = {*site.waits, *site.chain}, _first_reader(site)
    inputs = use.mm.node.all_input_nodes
    if site.beside and use.mm.node in site.beside.readers:
        own |= {site.beside.wait, *site.beside.chain}
        inputs = [*inputs, site.beside.shard]
    return [a for a in inputs if a not in own and not hoistable(a, first)]


def _start_point(use: GatherUse, site: AgMmSite, taken: Taken) -> Node | None:
    """The earliest node the ring may go before for ``use``'s sake, if later than the
    collective's first reader: after the inputs of its matmul that cannot be computed
    earlier (a recomputed activation under checkpointing), and, for a matmul another
    ring emitted (a 2-D matmul, ``_nested_in_one_window``), right at it, inside that
    ring's window."""
    points = [a.next for a in _late_inputs(use, site)]
    if taken.window(use.mm.node) is not None:
        points.append(use.mm.node)
    return max(points, key=position, default=None)


def _without_uses_read_too_late(site: AgMmSite, taken: Taken) -> AgMmSite:
    """The ring must be done before anything reads the gathered tensor or a product of
    the site: a matmul that would make it start later than that keeps reading the
    rebuilt tensor instead (the earliest such starts are kept first)."""
    points = {u: p for u in site.uses if (p := _start_point(u, site, taken)) is not None}
    readers = [*_outside_readers(site)]
    readers += [r for u in site.uses if u not in points for r in data_users(u.mm.node)]
    left = {}
    for use, point in sorted(points.items(), key=lambda item: position(item[1])):
        if readers and position(point) > position(min(readers, key=position)):
            left[use] = "it could only start after the site's results are first read"
        else:
            readers += data_users(use.mm.node)
    return site.leaving_out(left) if left else site


def _ring_place(site: AgMmSite, taken: Taken) -> Node:
    """Where the ring goes: where the collective's first reader stood, or later where a
    matmul needs it (``_start_point``). The views the ring leaves behind follow the tensor
    it rebuilds (``Rewrite.commit`` sorts them after it); nothing reads the gathered
    tensor or the site's products before that place (``_without_uses_read_too_late``)."""
    points = [p for u in site.uses if (p := _start_point(u, site, taken)) is not None]
    return max(points, key=position) if points else _first_reader(site)


def _nested_in_one_window(site: AgMmSite, taken: Taken) -> AgMmSite:
    """A matmul whose other operand is gathered too (2-D: a data-parallel weight gather
    and a tensor-parallel activation gather) was split by the site rewritten first, one
    partial matmul per step of its ring. This ring runs inside that ring's first window,
    under its transfer, where its other operand is already there; the matmuls of the
    other windows read the gathered tensor this ring rebuilds, each hiding its own
    window's transfer."""
    windows = {u: w for u in site.uses if (w := taken.window(u.mm.node)) is not None}
    if not windows:
        return site
    first = windows[min(windows, key=lambda u: position(u.mm.node))]
    left = {
        u: "in another window of site {}, step {}: reads the rebuilt gathered tensor".format(*w)
        for u, w in windows.items()
        if w != first
    }
    return site.leaving_out(left) if left else site
