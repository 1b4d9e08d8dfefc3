"""Find stage: every all-gather -> matmul and matmul -> reduce-scatter site of a graph.

Nothing here changes the graph. A found site either carries what the lowering needs,
or the reason it cannot be rewritten (``declined``); sites that touch no matmul are
not sites at all. The collective's dim is followed through the reassembly DTensor emits
(split + cat) and through view/reshape into the matmul's rows, where any block of rows
is an independent piece of the product.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.fx import Graph, Node

from ..report import Declined, decline
from . import dims

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
# read a tensor's metadata, not its data (dynamic-shape graphs take sizes with these)
SIZE_READERS = frozenset(
    {
        aten.sym_size.int,
        aten.sym_stride.int,
        aten.sym_numel.default,
        aten.sym_storage_offset.default,
    }
)
TRANSPOSES = frozenset({aten.t.default, aten.permute.default, aten.transpose.int})
PASS_THROUGH = (
    VIEWS
    | TRANSPOSES
    | {
        aten.split.Tensor,
        operator.getitem,
        aten.cat.default,
        aten.clone.default,
        aten._to_copy.default,
        aten.contiguous.default,
        aten.slice.Tensor,  # DTensor unpads an uneven gather with a slice ...
        aten.constant_pad_nd.default,  # ... and pads an uneven reduce-scatter
    }
)
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclasses.dataclass(frozen=True)
class MatmulForm:
    """Where the operands of a matmul op sit in its args (patterns as data)."""

    a: int
    b: int
    bias: int | None


MATMULS = {
    aten.addmm.default: MatmulForm(a=1, b=2, bias=0),
    aten.mm.default: MatmulForm(a=0, b=1, bias=None),
}
OTHER_MATMULS = frozenset({aten.bmm.default, aten.baddbmm.default, aten.matmul.default})


@dataclasses.dataclass(frozen=True)
class Matmul:
    node: Node
    a: Node
    b: Node
    bias: Node | None

    @staticmethod
    def of(node: Node) -> Matmul | None:
        form = MATMULS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
        if form is None:
            return None
        bias = _arg(node, form.bias, "self") if form.bias is not None else None
        return Matmul(node, _arg(node, form.a, "mat1"), _arg(node, form.b, "mat2"), bias)

    @property
    def out_shape(self) -> tuple[dims.Size, ...]:
        return dims.sizes(val(self.node).shape)


def val(node: Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise decline(f"node {node.name} has no tensor metadata (meta['val'])")
    return value


def is_matmul(node: Node) -> bool:
    return node.op == "call_function" and (node.target in MATMULS or node.target in OTHER_MATMULS)


def data_users(node: Node) -> list[Node]:
    """The users that read ``node``'s values, not only its sizes."""
    return [user for user in node.users if user.target not in SIZE_READERS]


@dataclasses.dataclass
class GatherUse:
    """A matmul reading the gathered tensor G, viewed 2-D with the gathered dim in its rows.

    Where G2d sits decides what a block of it computes (``role``):
    ``rows``:      ``G2d @ W``    (column-parallel input): a block of the product's rows.
    ``contract``:  ``G2d^T @ X``  (weight gradient): adds ``G2d_b^T @ X_b``.
    ``columns``:   ``X @ G2d^T``  (a gathered weight, FSDP): a block of the product's columns.
    ``contract_left``: ``Y @ G2d`` (input gradient of a gathered weight): adds ``Y_b @ G2d_b``.
    """

    mm: Matmul
    row_dims: int  # the gathered tensor's dims [:row_dims] fold into G2d's rows
    role: str = "rows"


@dataclasses.dataclass
class AgMmSite:
    kind: ClassVar[str] = "ag_mm"
    gathers: list[Node]  # all-gathers of the same shard on the same group (merged: one ring)
    waits: list[Node]
    shard: Node
    group_name: str
    group_size: int
    gather_dim: int  # dim of the logical gathered tensor the shards are concatenated on
    gathered_shape: tuple[dims.Size, ...]
    uses: list[GatherUse]
    chain: list[Node]  # nodes between the waits and the matmuls
    unmatched: list[str]  # matmul users left on the gathered tensor, and why
    declined: str | None = None

    @property
    def anchor(self) -> Node:
        return self.gathers[0]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [n.name for n in self.gathers],
            "group": self.group_name,
            "group_size": self.group_size,
            "gather_dim": self.gather_dim,
            "gathered_shape": dims.as_json(self.gathered_shape),
            "matmuls": [u.mm.node.name for u in self.uses],
            "roles": {u.mm.node.name: u.role for u in self.uses},
            "unmatched": list(self.unmatched),
        }


@dataclasses.dataclass
class MmRsSite:
    """reduce_scatter(sum of ``terms``): one matmul, or the sum of several with one shape
    (the backward of an input shared by several linears, e.g. gate and up)."""

    kind: ClassVar[str] = "mm_rs"
    reduce_scatter: Node
    wait: Node
    terms: list[Matmul]
    group_name: str
    group_size: int
    scatter_dim: int  # dim of the product's (viewed) shape that is scattered
    product_shape: tuple[dims.Size, ...]  # the product as the reduce-scatter sees it
    columns: bool  # scatter dim is the product's last (N) dim
    chain: list[Node]
    declined: str | None = None

    @property
    def anchor(self) -> Node:
        return self.reduce_scatter

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [self.reduce_scatter.name],
            "group": self.group_name,
            "group_size": self.group_size,
            "scatter_dim": self.scatter_dim,
            "product_shape": dims.as_json(self.product_shape),
            "matmuls": [t.node.name for t in self.terms],
            "blocks": "columns" if self.columns else "rows",
        }


Site = AgMmSite | MmRsSite


def find_sites(graph: Graph) -> list[Site]:
    """Every site of the graph, in graph order; all matched before anything is rewritten.
    Each site is matched from its collective, looking only at the nodes around it."""
    found: list[Site] = []
    for shard, gathers in _gathers_by_shard(graph).items():
        site = _match_gather(shard, gathers)
        if site is not None:
            found.append(site)
    for node in graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default):
        if "commfuse" in node.meta:  # the slicing schedule's own chunk collectives
            continue
        rs_site = _match_reduce_scatter(node)
        if rs_site is not None:
            found.append(rs_site)
    return sorted(found, key=lambda s: s.anchor._sort_key)


def rematch(site: Site) -> Site:
    """``site`` matched again where it stands, after other sites were rewritten (their
    results may now be its operands, or its matmul may be one they took)."""
    if isinstance(site, AgMmSite):
        gathers = [g for g in site.gathers if not g._erased]
        shard, n, group_name = gathers[0].args[:3]
        again: Site | None = _match_gather((shard, int(n), str(group_name)), gathers)  # type: ignore[arg-type]
    else:
        again = _match_reduce_scatter(site.reduce_scatter)
    if again is None:  # pragma: no cover - a site's collective keeps its matmul neighbour
        return dataclasses.replace(site, declined="no longer next to a matmul")
    return again


# ----------------------------------------------------------------------------------------
# all-gather -> matmul


def _gathers_by_shard(graph: Graph) -> dict[tuple[Node, int, str], list[Node]]:
    """Gathers of one shard on one group compute one value: DTensor emits one per consumer."""
    groups: dict[tuple[Node, int, str], list[Node]] = {}
    for node in graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default):
        if "commfuse" in node.meta:  # the slicing schedule's own chunk collectives
            continue
        shard, size, name = node.args[:3]
        groups.setdefault((shard, int(size), str(name)), []).append(node)
    return groups


def _match_gather(key: tuple[Node, int, str], gathers: list[Node]) -> AgMmSite | None:
    shard, n, group_name = key
    waits: list[Node] = []
    gathered: list[tuple[Node, int, list[Node]]] = []
    problem = None
    for ag in gathers:
        users = data_users(ag)
        if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
            problem = f"{ag.name} is used without exactly one wait_tensor"
            continue
        waits.append(users[0])
        gathered.append(_reassembled(users[0], n))
    if not any(_reaches_matmul(g) for g, _, _ in gathered) and not any(
        _reaches_matmul(user) for ag in gathers for user in ag.users
    ):
        return None
    g_dims = {g for _, g, _ in gathered}
    site = AgMmSite(
        gathers=gathers,
        waits=waits,
        shard=shard,
        group_name=group_name,
        group_size=n,
        gather_dim=min(g_dims) if g_dims else 0,
        gathered_shape=(),
        uses=[],
        chain=[],
        unmatched=[],
    )
    try:
        if problem:
            raise decline(problem)
        if len(g_dims) != 1:
            raise decline(f"the gathers of {shard.name} are reassembled along different dims")
        _check_tensor(shard, "gathered shard")
        if n < 2:
            raise decline("group of size 1: nothing to communicate")
        site.gathered_shape = dims.sizes(val(gathered[0][0]).shape)
        for node, _, chain in gathered:
            site.chain += chain
            _collect_uses(site, node)
        _drop_matmuls_reading_it_twice(site)
        if not site.uses:
            raise decline("; ".join(site.unmatched) or "no matmul consumes the gathered rows")
    except Declined as why:
        site.declined = why.reason
    return site


def _reassembled(wait: Node, n: int) -> tuple[Node, int, list[Node]]:
    """(logical gathered tensor, gather dim, reassembly nodes) after a gather's wait.

    all_gather_into_tensor concatenates on dim 0; DTensor gathers any other dim g by
    ``cat(split(out, s0), dim=g)``. Longest form first; otherwise the gather dim is 0.
    """
    users = data_users(wait)
    if len(users) == 1 and users[0].target is aten.split.Tensor:
        split = users[0]
        parts = _ordered_getitems(split, n)
        dim = _arg(split, 2, "dim", 0)
        if parts is not None and dim == 0:
            cats = {u for p in parts for u in data_users(p)}
            if len(cats) == 1:
                cat = cats.pop()
                if cat.target is aten.cat.default and list(_arg(cat, 0, "tensors")) == parts:
                    g = _dim(cat, _arg(cat, 1, "dim", 0))
                    return cat, g, [split, *parts, cat]
    return wait, 0, []


def _ordered_getitems(split: Node, n: int) -> list[Node] | None:
    parts: dict[int, Node] = {}
    for u in split.users:
        if u.target is not operator.getitem or len(data_users(u)) != 1:
            return None
        parts[_arg(u, 1, "index")] = u
    if sorted(parts) != list(range(n)):
        return None
    return [parts[i] for i in range(n)]


def _collect_uses(site: AgMmSite, gathered: Node) -> None:
    """Follow view/reshape users of the gathered tensor to the matmuls that read its rows."""
    frontier = [gathered]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and _is_mutating(user):
                raise decline(f"gathered tensor is mutated in place by {user.name}")
            mm = Matmul.of(user)
            if (user.target in VIEWS or is_full_slice(user)) and user.args[0] is node:
                site.chain.append(user)
                frontier.append(user)
            elif mm is not None and node not in (mm.a, mm.b):
                site.unmatched.append(f"{mm.node.name}: the gathered tensor is its bias")
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
                    elif _reaches_matmul(consumer):
                        site.unmatched.append(_between(consumer))
            elif _reaches_matmul(user):
                site.unmatched.append(_between(user))


def _drop_matmuls_reading_it_twice(site: AgMmSite) -> None:
    """``G @ G^T`` (the gathered tensor as both operands) is not a sum or a concatenation
    of products of one operand's blocks: such a matmul keeps reading G."""
    own = {*site.waits, *site.chain}
    twice = {u.mm.node for u in site.uses if _other_operand(u) in own}
    site.unmatched += [
        f"{node.name}: reads the gathered tensor as both operands"
        for node in dict.fromkeys(u.mm.node for u in site.uses if u.mm.node in twice)
    ]
    site.uses = [u for u in site.uses if u.mm.node not in twice]


def _other_operand(use: GatherUse) -> Node:
    """The matmul operand that is not (a view or transpose of) the gathered tensor."""
    return use.mm.b if use.role in ("rows", "contract") else use.mm.a


def _add_use(site: AgMmSite, g2d: Node, mm: Matmul, role: str) -> None:
    """Record ``mm`` as a use if the gathered dim lands in the rows of ``g2d``."""
    rows, cols = dims.sizes(val(g2d).shape)
    j = dims.row_split(site.gathered_shape, rows, cols)
    contiguous = dims.equal(math.prod(site.gathered_shape[: site.gather_dim]), 1)
    problem = None
    if not mm.node.users:
        problem = "its product is never read"
    elif _has_zero_size_dim(mm):
        problem = "a zero-size dim: nothing to overlap"
    elif j is None or site.gather_dim >= j:
        problem = (
            f"gathered dim {site.gather_dim} of {list(site.gathered_shape)} does not fold "
            f"into the rows of [{rows}, {cols}]"
        )
    elif role in ("columns", "contract_left") and not contiguous:
        problem = f"gathered dim {site.gather_dim} is not the outermost: blocks not contiguous"
    elif role in ("contract", "contract_left") and mm.bias is not None:
        problem = "a bias on a contracted product"
    elif role == "rows" and mm.bias is not None and not _bias_is_row_broadcast(mm.bias):
        problem = "bias has a row dim"
    elif role == "contract" and not dims.equal(val(mm.b).shape[0], rows):
        problem = f"its other operand does not have {rows} rows"
    if problem:
        site.unmatched.append(f"{mm.node.name} ({role}): {problem}")
        return
    _check_tensor(mm.node, "matmul output")
    assert j is not None
    site.uses.append(GatherUse(mm=mm, row_dims=j, role=role))


def is_full_slice(node: Node) -> bool:
    """``x[:, 0:size]``, the whole of a dim: DTensor's unpadding of a gather whose size
    it cannot prove even (dynamic shapes) when the size is, after all, the whole dim."""
    if node.target is not aten.slice.Tensor or not isinstance(node.args[0], Node):
        return False
    dim, start, end, step = (_arg(node, i, name, d) for i, name, d in SLICE_ARGS)
    if start not in (None, 0) or step != 1:
        return False
    size = val(node.args[0]).shape[dim]
    end_value = end.meta.get("val") if isinstance(end, Node) else end
    return (
        end_value is None
        or dims.equal(end_value, size)
        or (isinstance(end_value, int) and isinstance(size, int) and end_value >= size)
    )


SLICE_ARGS = ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1))


def is_transpose_2d(node: Node) -> bool:
    if node.target is aten.t.default:
        return True
    if node.target is aten.permute.default:
        return list(_arg(node, 1, "dims")) == [1, 0]
    if node.target is aten.transpose.int:
        return sorted(int(_arg(node, i, "")) % 2 for i in (1, 2)) == [0, 1]
    return False


def _between(user: Node) -> str:
    return f"{user.name} ({_op_name(user)}) sits between the gathered tensor and a matmul"


# ----------------------------------------------------------------------------------------
# matmul -> reduce-scatter


def _match_reduce_scatter(rs: Node) -> MmRsSite | None:
    inp, reduce_op, n, group_name = (_arg(rs, i, "") for i in range(4))
    users = list(rs.users)
    wait = users[0] if len(users) == 1 else None
    scattered, g, chain = _scattered(inp, int(n))
    product = _through_views(scattered, chain)
    terms, between = _sum_of_matmuls(product)
    rewritten = "commfuse" in product.meta  # a matmul an all-gather site already rewrote
    from_matmul = _comes_from_matmul(inp) or any(is_matmul(a) for a in _view_sources(product))
    if not terms and not from_matmul and not rewritten:
        return None
    site = MmRsSite(
        reduce_scatter=rs,
        wait=wait or rs,
        terms=terms,
        group_name=str(group_name),
        group_size=int(n),
        scatter_dim=g,
        product_shape=(),
        columns=False,
        chain=chain + between,
    )
    try:
        if wait is None or wait.target is not c10d.wait_tensor.default:
            raise decline(f"{rs.name} is used without exactly one wait_tensor")
        if not wait.users:
            raise decline(f"the result of {rs.name} is never read")
        if rewritten:
            site_id = product.meta["commfuse"]["site"]
            raise decline(f"its matmul was rewritten by all-gather site {site_id}")
        if any(a.target is aten.constant_pad_nd.default for a in (inp, *inp.all_input_nodes)):
            raise decline("uneven shards: the product is padded to a multiple of the group size")
        if not terms:
            raise decline(
                f"reduce-scatter input is {product.name} ({_op_name(product)}) of a matmul, "
                "not a matmul or a sum of matmuls"
            )
        if reduce_op != "sum":
            raise decline(f"reduce op {reduce_op!r} is not 'sum'")
        if site.group_size < 2:
            raise decline("group of size 1: nothing to communicate")
        shape = site.product_shape = dims.sizes(val(scattered).shape)
        if not dims.divisible(shape[g], site.group_size):
            if dims.is_symbolic(shape[g : g + 1]):
                raise decline(
                    f"scattered dim {g} of symbolic size {shape[g]} is not provably "
                    f"divisible by {n} (no guard is added)"
                )
            raise decline(f"scattered dim {g} of size {shape[g]} is not divisible by {n}")
        rows, cols = terms[0].out_shape
        for term in terms:
            if len(data_users(term.node)) != 1:
                raise decline(f"product {term.node.name} is also used outside the reduce-scatter")
            _check_tensor(term.node, "matmul output")
            if _has_zero_size_dim(term):
                raise decline(f"{term.node.name} has a zero-size dim: nothing to overlap")
            if not dims.same_shape(term.out_shape, (rows, cols)):
                raise decline(f"the summed matmuls have different shapes ({term.node.name})")
            if term.bias is not None and not _bias_is_row_broadcast(term.bias):
                raise decline(f"bias of {term.node.name} has a row dim")
        site.columns = g == len(shape) - 1 and dims.equal(shape[-1], cols)
        rows_match = dims.equal(shape[-1], cols) and dims.equal(math.prod(shape[:-1]), rows)
        if not site.columns and not rows_match:
            raise decline(
                f"scattered dim {g} of {list(shape)} is neither a row block nor the column "
                f"dim of the [{rows}, {cols}] product"
            )
    except Declined as why:
        site.declined = why.reason
    return site


def _through_views(node: Node, chain: list[Node]) -> Node:
    """The producer of ``node`` behind single-user views and transposes that cancel in
    pairs (AOTAutograd writes a weight gradient as ``t(t(mm(...)))``), added to ``chain``."""
    while len(data_users(node)) == 1:
        source = _arg(node, 0, "self")
        if node.target in VIEWS:
            chain.append(node)
            node = source
        elif is_transpose_2d(node) and is_transpose_2d(source) and len(data_users(source)) == 1:
            chain += [node, source]
            node = _arg(source, 0, "self")
        else:
            break
    return node


def _sum_of_matmuls(node: Node) -> tuple[list[Matmul], list[Node]]:
    """(matmul terms, add/view nodes between) if ``node`` is a matmul or a sum of them."""
    mm = Matmul.of(node)
    if mm is not None:
        return [mm], []
    plain_add = node.target is aten.add.Tensor and _arg(node, 2, "alpha", 1) == 1
    if not plain_add or not all(isinstance(a, Node) for a in node.args[:2]):
        return [], []
    terms, between = [], [node]
    for arg in node.args[:2]:
        source = _through_views(arg, between)  # type: ignore[arg-type]
        single = len(data_users(source)) == 1
        sub_terms, sub_between = _sum_of_matmuls(source) if single else ([], [])
        if not sub_terms:
            return [], []
        terms += sub_terms
        between += sub_between
    return terms, between


def _scattered(inp: Node, n: int) -> tuple[Node, int, list[Node]]:
    """(product as scattered, scatter dim, nodes): DTensor scatters dim g via split + cat."""
    if inp.target is aten.cat.default:
        parts: list[Node] = list(_arg(inp, 0, "tensors"))
        sources = {_arg(p, 0, "self") for p in parts if p.target is operator.getitem}
        if _arg(inp, 1, "dim", 0) == 0 and len(sources) == 1 and len(parts) == n:
            split: Node = sources.pop()
            if split.target is aten.split.Tensor and _ordered_getitems(split, n) == parts:
                product: Node = _arg(split, 0, "self")
                g = _dim(product, _arg(split, 2, "dim", 0))
                return product, g, [inp, split, *parts]
    return inp, 0, []


# ----------------------------------------------------------------------------------------
# shared helpers


def _reaches_matmul(node: Node) -> bool:
    """Does the value flow into a matmul through layout, copy or reassembly ops only?

    With ``_comes_from_matmul``, decides what counts as "next to a matmul", so that every
    such collective is reported (rewritten or declined with a reason), never silently
    skipped, however long the chain.
    """
    return _matmul_through_pass_through(list(node.users), lambda n: list(n.users))


def _comes_from_matmul(node: Node) -> bool:
    """Is ``node`` (a reduce-scatter's input) a matmul, or computed from one through layout,
    copy or reassembly ops only (a cast and a transpose, say)?"""
    return _matmul_through_pass_through([node], lambda n: n.all_input_nodes)


def _matmul_through_pass_through(
    frontier: list[Node], neighbours: Callable[[Node], list[Node]]
) -> bool:
    """Is a matmul in ``frontier`` or beyond it, following ``neighbours`` (users or inputs)
    through ``PASS_THROUGH`` ops only?"""
    seen: set[Node] = set()
    while frontier:
        node = frontier.pop()
        if is_matmul(node):
            return True
        if node.target in PASS_THROUGH and node not in seen:
            seen.add(node)
            frontier += neighbours(node)
    return False


def _view_sources(node: Node) -> Iterable[Node]:
    """Producers of ``node``'s inputs, looking through views (one level of a sum of matmuls)."""
    for arg in node.all_input_nodes:
        while arg.target in VIEWS:
            arg = _arg(arg, 0, "self")
        yield arg


def _bias_is_row_broadcast(bias: Node) -> bool:
    shape = val(bias).shape
    return len(shape) < 2 or dims.equal(shape[0], 1)


def _has_zero_size_dim(mm: Matmul) -> bool:
    """An empty operand or product: no work to hide a transfer behind (and no blocks).
    Symbolic sizes are never 0 (torch specializes sizes 0 and 1)."""
    shapes = (val(node).shape for node in (mm.node, mm.a, mm.b))
    return any(isinstance(size, int) and size == 0 for shape in shapes for size in shape)


def _check_tensor(node: Node, what: str) -> None:
    value = val(node)
    if value.dtype not in FLOAT_DTYPES:
        raise decline(f"{what} has dtype {value.dtype}; only floating point is decomposed")


def _is_mutating(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _dim(node: Node, dim: int) -> int:
    """``dim`` of ``node``'s value made non-negative (kept as is when the rank is unknown)."""
    value = node.meta.get("val")
    return int(dim) % value.dim() if isinstance(value, torch.Tensor) else int(dim)


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (or keyword ``name``) of a call node, untyped like FX args are."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _op_name(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op
