"""Finding all-gather -> matmul sites: the gathered dim followed through the
reassembly DTensor emits (split + cat) and through views into the matmuls' rows."""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch.fx import Graph, Node

from ...fx import dims
from ...fx.collectives import saved_unwaited, the_wait
from ...fx.declines import Declined, decline
from ...fx.graph import (
    LAYOUT_OPS,
    SLICE_SCATTER,
    VIEWS,
    between_note,
    cast_to,
    check_tensor,
    data_users,
    is_full_slice,
    is_transpose_2d,
    node_arg,
    normalized_dim,
    ordered_getitems,
    region,
    same_data,
    val,
)
from ...fx.matmuls import (
    ANY_MATMUL,
    Matmul,
    bias_is_row_broadcast,
    has_zero_size_dim,
    reaches_matmul,
    read_back,
    scales_problem,
    sums_problem,
    varies_by_row,
)
from ...kit import paths
from ...kit.uses import check_read_only, without_read_twice
from .site import AgMmSite, Beside, GatherUse

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def gathers_by_shard(graph: Graph) -> dict[tuple[Node, int, str], list[Node]]:
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


def match(key: tuple[Node, int, str], gathers: list[Node]) -> AgMmSite | None:
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
    if not any(reaches_matmul(g, ANY_MATMUL) for g, _, _ in gathered) and not any(
        reaches_matmul(user, ANY_MATMUL) for ag in gathers for user in ag.users
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
    """Follow view/reshape users of the gathered tensor to the matmuls that read its rows,
    and its dtype casts (element by element: each block is cast as the whole was); and,
    while the n blocks stay blocks of one dim (``paths``), its other layout ops to the
    batched and grouped matmuls that read them (and the 2-D ones behind such ops)."""
    frontier: list[_Reached] = [_Reached(gathered, None, site.gather_dim, ())]
    while frontier:
        reached = frontier.pop()
        node, cast = reached.node, reached.cast
        for user in node.users:
            check_read_only(user, node)
            mm, any_form = Matmul.of(user), Matmul.of(user, batched=True, grouped=True)
            if user.args[0] is node and (
                user.target in VIEWS or is_full_slice(user) or same_data(user)
            ):
                site.chain.append(user)
                frontier.append(reached.then(user, cast, site.n))
            elif cast_to(user) is not None and user.args[0] is node:
                site.chain.append(user)
                frontier.append(reached.then(user, cast_to(user), site.n))
            elif user.target is SLICE_SCATTER and node_arg(user, 1, "src") is node:
                _check_read_back(user)
            elif any_form is not None and (mm is None or not reached.plain):
                _add_path_use(site, reached, any_form)
            elif mm is not None and node not in (mm.a, mm.b):
                what = mm.reads_as(node)
                site.unmatched.append(f"{mm.node.name}: the gathered tensor is its {what}")
            elif mm is not None:
                _add_use(site, node, mm, "rows" if mm.a is node else "contract_left", cast)
            elif is_transpose_2d(user) and user.args[0] is node and val(user).dim() == 2:
                site.chain.append(user)
                for consumer in user.users:
                    mm = Matmul.of(consumer)
                    if mm is not None:
                        role = "contract" if mm.a is user else "columns"
                        _add_use(site, node, mm, role, cast)
                    elif is_transpose_2d(consumer):  # t(t(G)) is G
                        site.chain.append(consumer)
                        frontier.append(_Reached(consumer, cast, None, ()))
                    elif reaches_matmul(consumer, ANY_MATMUL):
                        site.unmatched.append(between_note(consumer))
            elif user.target in LAYOUT_OPS and user.args[0] is node and reached.dim is not None:
                then = reached.then(user, cast, site.n)
                if then.dim is not None:
                    site.chain.append(user)
                    frontier.append(then)
                elif reaches_matmul(user, ANY_MATMUL):
                    site.unmatched.append(f"{user.name}: the gathered blocks do not stay blocks")
            elif reaches_matmul(user, ANY_MATMUL):
                site.unmatched.append(between_note(user))


@dataclasses.dataclass(frozen=True)
class _Reached:
    """A node the walk reached: the dtype the gathered values were cast to on the way,
    the dim of its value that holds the n gathered blocks (None: not one dim's outermost
    split) and the path of layout ops and casts to it (``plain``: views and casts only,
    the 2-D uses' way)."""

    node: Node
    cast: torch.dtype | None
    dim: int | None
    path: paths.Path
    plain: bool = True
    lost: Node | None = None  # the op after which the blocks are not one dim's

    def then(self, user: Node, cast: torch.dtype | None, n: int) -> _Reached:
        """The walk one op further: ``user``, its input this node."""
        if is_full_slice(user) or same_data(user):  # the same values: no step of the path
            return dataclasses.replace(self, node=user)
        dim = None if self.dim is None else paths.dim_after(user, self.dim, dims.Split(n))
        plain = self.plain and (user.target in VIEWS or cast_to(user) is not None)
        step = ((user, dim),) if dim is not None else ()
        lost = self.lost or (user if dim is None else None)
        return _Reached(user, cast, dim, (*self.path, *step), plain, lost)


def _add_path_use(site: _Uses, reached: _Reached, mm: Matmul) -> None:
    """Record the batched or grouped ``mm`` (or a 2-D one behind copies and permutes)
    reading the gathered blocks along ``reached.dim`` of its operand ``reached.node``."""
    node = reached.node
    if node not in (mm.a, mm.b) or mm.a is mm.b:
        site.unmatched.append(f"{mm.node.name}: the gathered tensor is its {mm.reads_as(node)}")
        return
    role = None if reached.dim is None else paths.role(mm, node, reached.dim, reached.path)
    problem = None
    if reached.lost is not None:
        problem = f"the gathered blocks do not stay blocks of one dim through {reached.lost.name}"
    elif role is None:
        problem = "the gathered blocks are along its batch or groups"
    elif not mm.node.users:
        problem = "its product is never read"
    elif has_zero_size_dim(mm):
        problem = "a zero-size dim: nothing to overlap"
    elif mm.bias is not None:
        problem = "a bias"
    elif mm.scaled:
        problem = "a scaled matmul"
    if problem or role is None:
        site.unmatched.append(f"{mm.node.name} ({role or 'no role'}): {problem}")
        return
    check_tensor(mm.node, "matmul output")
    site.uses.append(GatherUse(mm=mm, row_dims=0, role=role, laid_out=True, path=reached.path))


def _check_read_back(scatter: Node) -> None:
    """The gathered tensor written into a buffer (``slice_scatter``) is one more reader,
    rebuilt for it; a matmul reading back exactly the region written reads the gathered
    tensor (``canonical.py``), but one reading another region that overlaps it reads
    parts of the buffer's old values with the gathered ones: declined."""
    for reader in read_back(scatter):
        read = region(reader) if reader.target is aten.slice.Tensor else None
        raise decline(
            "ag.buffer_region",
            node=reader.name,
            read=read or "all",
            written=region(scatter) or "a region",
        )


def _add_use(site: _Uses, g2d: Node, mm: Matmul, role: str, cast: torch.dtype | None) -> None:
    """Record ``mm`` as a use if the gathered dim lands in the rows of ``g2d`` (the
    gathered values cast to ``cast`` on the way, if not None)."""
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
    site.uses.append(GatherUse(mm=mm, row_dims=j, role=role, cast=cast))


# ----------------------------------------------------------------------------------------
