"""All-to-all -> experts -> all-to-all: a dropless MoE layer with expert parallelism
(torchtitan's token dispatcher), one site for both all-to-alls. The tokens peer j sends
are run through the experts as soon as they arrive and sent straight back to j, while
the next peer's arrive; this rank's own tokens, which travel nowhere, run in two halves,
under the first transfer and under the last (``schedules/round_trip.py``).

What the graph holds (the splits are the graph's own sizes, from ``.tolist()``):
    recv = wait(all_to_all_single(x, out_splits, in_splits))    # dispatch, uneven
    xp = recv[perm]                                               # rows sorted by expert
    ... _grouped_mm(., W, offs), pointwise ops, casts ...         # the experts
    y = new_empty(...).index_put([perm], out)                     # rows put back
    wait(all_to_all_single(y, in_splits, out_splits))            # combine

Every op between ``xp`` and ``out`` computes a row from that row alone (a grouped
matmul with its group's weight: group g holds rows offs[g-1] to offs[g]), so row i of
``recv`` goes through expert ``g(i) = bucketize(pinv[i], offs, right=True)``, ``pinv``
inverting ``perm``: a property of the program, not of how ``perm`` was built. Each
peer's block of ``recv`` is sorted by g, run through the experts with its own offsets,
and unsorted. ``perm`` must be a permutation of the rows: it has their count, and the
program's ``index_put`` would leave rows unwritten otherwise.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.fx import Graph, Node, map_arg

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule, Transfer, round_trip
from .. import dims
from ..declines import Declined, decline
from ..graph import (
    ALL_TO_ALL,
    ALLOCATE_LIKE,
    CONVERT,
    SIZE_READERS,
    cast_to,
    check_tensor,
    data_users,
    in_graph_order,
    is_transpose_2d,
    node_arg,
    numel,
    op_name,
    position,
    the_wait,
    val,
)
from ..rewrite import Rewrite, Taken
from ..ring import replace_collective, start_transfers, wait_transfers
from ..site import Site
from ..site_kind import SiteKind

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

GROUPED_MM = aten._grouped_mm.default


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeSite(Site):
    kind: ClassVar[str] = "moe"
    dispatch: Node
    combine: Node | None = None
    dispatch_wait: Node | None = None
    combine_wait: Node | None = None
    permuted: Node | None = None  # recv[perm]
    perm: Node | None = None
    offs: Node | None = None
    experts: tuple[Node, ...] = ()  # from ``permuted`` to the value put back, graph order
    put_back: Node | None = None  # the index_put of the experts' output into ``buffer``
    buffer: Node | None = None
    saved: tuple[Node, ...] = ()  # expert values read whole (saved for the backward)
    paired: tuple[Node, ...] = ()  # tensors whose row q goes with the experts' row q
    # grouped matmuls summing over the rows, per group (weight gradients), and the
    # transposes of rows they read
    sums: tuple[Node, ...] = ()
    transposes: tuple[Node, ...] = ()

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.dispatch,) if self.combine is None else (self.dispatch, self.combine)

    def replaced(self) -> list[Node]:
        nodes = (
            self.dispatch,
            self.dispatch_wait,
            self.permuted,
            *self.experts,
            *self.transposes,
            *self.sums,
            self.put_back,
            self.buffer,
            self.combine,
            self.combine_wait,
        )
        return [node for node in nodes if node is not None]

    @property
    def grouped(self) -> list[Node]:
        return [node for node in (*self.experts, *self.sums) if node.target is GROUPED_MM]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [c.name for c in self.collectives],
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [node.name for node in self.grouped],
            "experts": len(self.experts),
            "saved": [node.name for node in self.saved],
            "summed": [node.name for node in self.sums],
            "exchanged_shape": dims.as_json(val(self.dispatch).shape),
        }


class Moe(SiteKind[MoeSite]):
    name = "moe"
    direction = Direction.EXCHANGE_IN
    nests = False

    def find(self, graph: Graph) -> list[MoeSite]:
        found = map(_match, graph.find_nodes(op="call_function", target=ALL_TO_ALL))
        return [site for site in found if site is not None]

    def rematch(self, site: MoeSite, taken: Taken) -> MoeSite | None:
        return _match(site.dispatch)

    def without(self, site: MoeSite, disabled: frozenset[str]) -> MoeSite:
        return site  # one fused computation: nothing to leave out but the whole site

    def work(self, site: MoeSite, n: int) -> Work:
        """The grouped matmuls' FLOPs and both all-to-alls' bytes. The rows received are
        known only at run time (torch hints each unbacked split at thousands): they are
        taken as many as this rank sends where that is a static count (the tokens it
        routed: balanced routing), at the hints otherwise."""
        assert site.dispatch_wait is not None
        received = val(site.dispatch_wait).shape[0]
        sent = val(node_arg(site.dispatch, 0, "input")).shape[0]
        scale = sent / dims.hint(received) if isinstance(sent, int) else 1.0
        flops = sum(_flops(mm) for mm in site.grouped) * scale
        collectives = [site.dispatch, *([site.combine] if site.combine is not None else [])]
        message = sum(numel(c) * val(c).element_size() for c in collectives) * scale
        return Work(self.direction, n, flops / n, message / n, len(site.grouped))

    def start(self, site: MoeSite, taken: Taken) -> tuple[MoeSite, Node]:
        assert site.permuted is not None, "a matched site has its permuted read"
        return site, site.permuted

    def lower(
        self, rw: Rewrite, site: MoeSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        _lower(rw, site, group)


KIND = Moe()


def _flops(mm: Node) -> float:
    """A grouped matmul's: rows by a weight per group ([rows, N] from K), or a sum over
    the rows per group ([groups, K, N]: each row in one group's sum)."""
    a = node_arg(mm, 0, "self")
    assert isinstance(a, Node)
    out = val(mm)
    per_group = out.shape[0] if out.dim() == 3 else 1
    return 2 * numel(mm) / dims.hint(per_group) * dims.hint(val(a).shape[-1])


# ----------------------------------------------------------------------------------------
# find


def _match(dispatch: Node) -> MoeSite | None:
    """The site of ``dispatch`` if its tokens are read through a permutation into grouped
    matmuls (else None: another kind's, or no site's, see ``unclaimed``)."""
    wait = the_wait(dispatch)
    readers = data_users(wait) if wait is not None else []
    if wait is None or wait.target is not c10d.wait_tensor.default or len(readers) != 1:
        return None
    permuted = readers[0]
    perm = _permutation(permuted, wait)
    if perm is None or not any(n.target is GROUPED_MM for n in _reached(permuted)):
        return None
    n = len(node_arg(dispatch, 1, "output_split_sizes"))
    site = MoeSite(
        dispatch=dispatch,
        dispatch_wait=wait,
        permuted=permuted,
        perm=perm,
        group_name=str(node_arg(dispatch, 3, "group_name")),
        group_size=n,
    )
    try:
        if n < 2:
            raise decline("site.group_of_one")
        check_tensor(wait, "dispatched tokens")
        return _with_experts(site)
    except Declined as why:
        return _declined(site, why)


def _permutation(read: Node, wait: Node) -> Node | None:
    """The index tensor of ``read`` if it reorders the rows of ``wait`` (all of them,
    once each by the count: ``recv[perm]``, ``index_select(recv, 0, perm)``)."""
    if read.target is aten.index.Tensor and read.args[0] is wait:
        indices = node_arg(read, 1, "indices")
        perm = indices[0] if len(indices) == 1 else None
    elif read.target is aten.index_select.default and node_arg(read, 1, "dim") == 0:
        perm = node_arg(read, 2, "index") if read.args[0] is wait else None
    else:
        return None
    if not isinstance(perm, Node):
        return None
    index = perm.meta.get("val")
    rows = val(wait).shape[0]
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
        return None
    return perm if dims.equal(index.shape[0], rows) else None


def _reached(start: Node) -> list[Node]:
    """Every node computed from ``start``, in graph order."""
    reached, stack = {start}, [start]
    while stack:
        for user in stack.pop().users:
            if user not in reached:
                reached.add(user)
                stack.append(user)
    return in_graph_order(reached)


def _with_experts(site: MoeSite) -> MoeSite:
    """``site`` with its experts (every op row-wise from the permuted tokens to the
    put-back), the put-back and the combine, or declined with the op that is not."""
    assert site.permuted is not None and site.dispatch_wait is not None
    rows = val(site.dispatch_wait).shape[0]
    reached = _reached(site.permuted)
    walk = _Walk(rows, [site.permuted], set(reached))
    put_back: Node | None = None
    writes: list[Node] = []  # in-place ops on what comes from the tokens (non-functional graphs)
    for node in reached[1:]:
        inside = [arg for arg in node.all_input_nodes if arg in walk.experts]
        if _writes(node):
            writes.append(node)
            walk.saved += inside  # after the site, on the values put back together
            continue
        if not inside and not set(node.all_input_nodes) & set(walk.transposes):
            continue
        if node.op == "output":
            walk.saved += inside
        elif node.target in SIZE_READERS or (
            node.target in ALLOCATE_LIKE and set(node.users) <= set(_put_backs(node))
        ):
            continue  # a size (the lowering's to replace), or the put-back's buffer
        elif _puts_back(node, site.perm, walk.experts) and put_back is None:
            put_back = node
        elif node.target is GROUPED_MM:
            walk.grouped(node)
        elif is_transpose_2d(node) and all(u.target is GROUPED_MM for u in node.users):
            walk.transposes.append(node)  # an operand of a sum over the rows
        elif _row_wise(node, walk):
            walk.experts.append(node)
        elif node.is_impure():
            raise decline("moe.side_effect", node=node.name, op=op_name(node))
        else:  # reads whole values (a transpose saved for the backward): rebuilt for it
            walk.saved += inside
    if put_back is None:  # (an in-place op may have taken the experts' output)
        if not writes:
            raise decline("moe.no_put_back")
        back = [n for n in reached if n.target is ALL_TO_ALL and _reverses(n, site.dispatch)]
        site = dataclasses.replace(site, combine=next(iter(back), None))
        return _declined(
            site, decline("moe.side_effect", node=writes[0].name, op=op_name(writes[0]))
        )
    buffer = node_arg(put_back, 0, "self")
    combine = next(iter(data_users(put_back)), None)
    if (
        len(data_users(put_back)) != 1
        or combine is None
        or combine.target is not ALL_TO_ALL
        or not _reverses(combine, site.dispatch)
    ):
        raise decline("moe.no_combine", node=put_back.name)
    site = dataclasses.replace(site, combine=combine)  # its record names both collectives
    combine_wait = the_wait(combine)
    if combine_wait is None or combine_wait.target is not c10d.wait_tensor.default:
        return _declined(site, decline("site.wait", node=combine.name))
    for node in writes:  # one before the combine may change what the blocks compute
        if position(node) < position(combine_wait):
            return _declined(site, decline("moe.side_effect", node=node.name, op=op_name(node)))
    return dataclasses.replace(
        site,
        combine_wait=combine_wait,
        offs=walk.offs,
        experts=tuple(walk.experts[1:]),
        put_back=put_back,
        buffer=buffer if buffer.target in BUFFERS else None,
        saved=tuple(dict.fromkeys(walk.saved)),
        sums=tuple(walk.sums),
        transposes=tuple(walk.transposes),
        paired=tuple(in_graph_order(walk.paired)),
    )


@dataclasses.dataclass
class _Walk:
    """What the walk from the permuted tokens found: ``experts``, the values computed row
    by row from them; ``reached``, everything computed from them. A tensor of as many
    rows that is not (a saved activation, in the backward) pairs its row q with the
    experts' row q, the way the program pairs them: a block takes those rows of it."""

    rows: Any
    experts: list[Node]
    reached: set[Node]
    saved: list[Node] = dataclasses.field(default_factory=list)
    sums: list[Node] = dataclasses.field(default_factory=list)
    transposes: list[Node] = dataclasses.field(default_factory=list)
    offs: Node | None = None

    paired: set[Node] = dataclasses.field(default_factory=set)

    def aligned(self, node: Node) -> bool:
        """Rows of its own paired with the experts' rows: computed row-wise from the
        tokens, or independent of them with as many rows (``paired``)."""
        if node in self.experts:
            return True
        value = node.meta.get("val")
        independent = (
            node not in self.reached
            and isinstance(value, torch.Tensor)
            and value.dim() >= 1
            and dims.equal(value.shape[0], self.rows)
        )
        if independent:
            self.paired.add(node)
        return independent

    def grouped(self, mm: Node) -> None:
        """``mm`` as a grouped matmul of the experts: rows by a weight per group (an
        expert row), or the transpose of rows by rows, summed per group (a weight's
        gradient); else declined."""
        a, b = node_arg(mm, 0, "self"), node_arg(mm, 1, "mat2")
        offs, bias = node_arg(mm, 2, "offs"), node_arg(mm, 3, "bias")
        if bias is not None or not isinstance(offs, Node) or offs is not (self.offs or offs):
            raise decline("moe.grouped_form", node=mm.name)
        self.offs = offs
        if a in self.experts and b not in self.reached and val(b).dim() == 3:
            self.experts.append(mm)
        elif self._transposed_rows(a) and self.aligned(b):
            self.sums.append(mm)  # over every row at once, after the last block
            self.saved += [node for node in (*a.args[:1], b) if node in self.experts]
        else:
            raise decline("moe.grouped_form", node=mm.name)

    def _transposed_rows(self, a: Node) -> bool:
        """Is ``a`` [K, rows], the transpose of rows paired with the experts' (of the
        experts' own, or independent of the tokens: a saved activation's transpose)?"""
        if is_transpose_2d(a) and self.aligned(a.args[0]):  # type: ignore[arg-type]
            return True
        value = a.meta.get("val")
        if a in self.reached or not isinstance(value, torch.Tensor) or value.dim() != 2:
            return False
        return dims.equal(value.shape[1], self.rows)


# the buffers an expert output is put back into: each row is written once
BUFFERS = ALLOCATE_LIKE | {aten.empty.memory_format, aten.zeros.default, aten.full.default}


def _declined(site: MoeSite, why: Declined) -> MoeSite:
    return dataclasses.replace(site, declined=why.kept())


def _writes(node: Node) -> bool:
    """Does ``node`` write into one of its arguments (an in-place op)?"""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and any(
        a.alias_info is not None and a.alias_info.is_write for a in getattr(schema, "arguments", ())
    )


def _put_backs(buffer: Node) -> list[Node]:
    return [
        u for u in buffer.users if u.target in (aten.index_put.default, aten.index_copy.default)
    ]


def _puts_back(node: Node, perm: Node | None, experts: Sequence[Node]) -> bool:
    """``buffer.index_put([perm], value)`` (or ``index_copy(buffer, 0, perm, value)``)
    of an expert value into a buffer of its own (every row written once)."""
    if node.target is aten.index_put.default:
        buffer, indices, value = (node_arg(node, i, name) for i, name in _PUT_ARGS)
        # accumulating into zeros (an index's gradient) writes each row once, too
        adds = node_arg(node, 3, "accumulate", False)
        zeros = buffer.target in (
            aten.new_zeros.default,
            aten.zeros_like.default,
            aten.zeros.default,
        ) or (buffer.target is aten.full.default and node_arg(buffer, 1, "fill_value") == 0)
        ok = list(indices) == [perm] and (not adds or zeros)
    elif node.target is aten.index_copy.default:
        buffer, value = node_arg(node, 0, "self"), node_arg(node, 3, "source")
        ok = node_arg(node, 1, "dim") == 0 and node_arg(node, 2, "index") is perm
    else:
        return False
    return ok and value in experts and buffer not in experts


_PUT_ARGS = ((0, "self"), (1, "indices"), (2, "values"))


def _row_wise(node: Node, walk: _Walk) -> bool:
    """Does ``node`` compute each row of its result from that row of its inputs alone (a
    cast, or an element-wise op whose other operands are scalars, broadcast over the
    rows, or rows paired with the experts' rows)?"""
    if cast_to(node) is not None:
        return True
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return False
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not dims.equal(value.shape[0], walk.rows):
        return False
    for arg in node.all_input_nodes:
        other = arg.meta.get("val")
        if not isinstance(other, torch.Tensor):
            continue
        if other.dim() == value.dim() and walk.aligned(arg):
            continue  # row q with row q
        if arg in walk.reached:
            return False  # computed from the tokens, not row by row
        if other.dim() == value.dim() and not dims.equal(other.shape[0], 1):
            return False  # rows of another count
    return True


def _reverses(combine: Node, dispatch: Node) -> bool:
    """Does ``combine`` send back what ``dispatch`` received (splits swapped, one group)?"""
    same_group = node_arg(combine, 3, "group_name") == node_arg(dispatch, 3, "group_name")
    swapped = list(node_arg(combine, 1, "")) == list(node_arg(dispatch, 2, "")) and list(
        node_arg(combine, 2, "")
    ) == list(node_arg(dispatch, 1, ""))
    return same_group and swapped


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: MoeSite, group: Group) -> None:
    """``round_trip``'s steps: each starts one P2P batch (the next block's dispatch, the
    last result's combine), runs the experts on the block at hand (this rank's own in two
    halves: the first and the last step), then waits it."""
    assert site.combine is not None and site.combine_wait is not None
    em, n, r = rw.emit, group.size, group.rank
    blocks = _Blocks(rw, site, r)
    arrived: dict[int, Node] = {}  # dispatched tokens, by source rank
    results: dict[int, Node] = {}  # the experts' output, by source rank
    returned: dict[int, Node] = {}  # this rank's tokens as the experts left them, by rank
    own = blocks.own_halves()
    halves: list[Node] = []  # the experts' output for this rank's own tokens
    for s, step in enumerate(round_trip.steps(n)):
        sends, buffers = list[Transfer](), dict[int, Node]()
        recvs: list[tuple[Transfer, Node, dict[int, Node], int]] = []
        if step.dispatch is not None:
            t = step.dispatch
            buffers[0] = blocks.sent((r + t) % n)
            sends.append(Transfer(0, t))
            recvs.append((Transfer(0, -t), blocks.like_received((r - t) % n), arrived, (r - t) % n))
        if step.combine is not None:
            t = step.combine
            buffers[1] = results[(r - t) % n]
            sends.append(Transfer(1, -t))
            like = blocks.like_returned((r + t) % n, halves[0])
            recvs.append((Transfer(1, t), like, returned, (r + t) % n))
        likes = [like for _, like, _, _ in recvs]
        pending = start_transfers(rw, group, s, sends, [t for t, *_ in recvs], buffers, likes)
        if step.half is not None:
            halves.append(blocks.experts(*own[step.half], s))
        else:
            source = (r - step.compute) % n
            results[source] = blocks.experts(*blocks.received(arrived[source], source), s)
        if s == n:  # under the last result's way back, after the last rows
            blocks.wholes(s)
        waits, received = wait_transfers(rw, s, pending)
        for (_, _, into, key), node in zip(recvs, received, strict=True):
            into[key] = node
        rw.add_step(pending[0], s, waits)
    returned[r] = em(aten.cat.default, (halves, 0), step=n, lane="compute")
    out = em(aten.cat.default, ([returned[j] for j in range(n)], 0), step=n, lane="comm")
    blocks.finish(out, n)
    replace_collective(rw, [site.combine], [site.combine_wait], out)


def peers(group: Group) -> list[tuple[list[int], list[int]]]:
    """(send peers, receive peers) of each P2P batch ``_lower`` emits, in order."""
    batches = []
    for step in round_trip.steps(group.size):
        sends, recvs = [], []
        if step.dispatch is not None:
            sends.append(group.peer(step.dispatch))
            recvs.append(group.peer(-step.dispatch))
        if step.combine is not None:
            sends.append(group.peer(-step.combine))
            recvs.append(group.peer(step.combine))
        if sends:
            batches.append((sends, recvs))
    return batches


class _Blocks:
    """What one peer's block of the dispatched tokens needs: its rows of the tokens sent
    and received (the graph's split sizes), the expert of each of its rows, and the
    experts' ops replayed on it."""

    def __init__(self, rw: Rewrite, site: MoeSite, rank: int) -> None:
        assert site.perm is not None and site.offs is not None and site.put_back is not None
        self.rw, self.site, self.rank, em = rw, site, rank, rw.emit
        dispatch = site.dispatch
        self.tokens = node_arg(dispatch, 0, "input")
        self.out_splits = list(node_arg(dispatch, 1, "output_split_sizes"))
        self.in_splits = list(node_arg(dispatch, 2, "input_split_sizes"))
        self.width = val(self.tokens).shape[1:]
        value = (
            node_arg(site.put_back, 2, "values")
            if site.put_back.target is aten.index_put.default
            else node_arg(site.put_back, 3, "source")
        )
        self.value: Node = value
        step = 0
        perm = site.perm
        rows = self.rows = em(aten.sym_size.int, (perm, 0), step=step, lane="compute")
        index_dtype = val(perm).dtype
        positions = self._iota(rows, index_dtype, step)
        empty = em(aten.new_empty.default, (perm, [rows]), step=step, lane="compute")
        # where each received row stands in the permuted order, and so its expert
        self.inverse = em(
            aten.index_put.default, (empty, [perm], positions), step=step, lane="compute"
        )
        offs = em(CONVERT, (site.offs, index_dtype), step=step, lane="compute")
        expert = em(
            aten.bucketize.Tensor, (self.inverse, offs), {"right": True}, step=step, lane="compute"
        )
        self.groups = val(site.offs).shape[0]
        self.group_ids = self._iota(self.groups, index_dtype, step)
        self.expert_of = self._split(expert, self.out_splits, step)
        # where each received row stands in the permuted order: read only to put the
        # values saved back together or to take a paired tensor's rows (not in inference)
        paired = set(site.paired)
        reads_paired = any(set(node.all_input_nodes) & paired for node in site.experts)
        self.placed = bool(site.saved) or reads_paired
        self.place_of = self._split(self.inverse, self.out_splits, step) if self.placed else []
        self.tokens_for = self._split(self.tokens, self.in_splits, step)
        self.saved: dict[Node, list[Node]] = {node: [] for node in site.saved}
        self.places: list[Node] = []

    def _iota(self, length: Any, dtype: torch.dtype, step: int) -> Node:
        """0 .. length - 1 (``arange`` as the graphs Inductor compiles spell it)."""
        assert self.site.perm is not None
        kwargs = {"start": 0, "step": 1, "dtype": dtype, "device": val(self.site.perm).device}
        return self.rw.emit(
            torch.ops.prims.iota.default, (length,), {**kwargs, "requires_grad": False},
            step=step, lane="compute",
        )  # fmt: skip

    def _split(self, node: Node, sizes: list[Any], step: int) -> list[Node]:
        em = self.rw.emit
        parts = em(aten.split_with_sizes.default, (node, sizes), step=step, lane="compute")
        return [
            em(operator.getitem, (parts, j), step=step, lane="compute") for j in range(len(sizes))
        ]

    def received(self, block: Node, source: int) -> tuple[Node, Node, Node | None, Any]:
        """What ``experts`` takes for the block from ``source``: its tokens, the expert
        and the place in the permuted order of each of its rows, and its row count."""
        place_of = self.place_of[source] if self.placed else None
        return block, self.expert_of[source], place_of, self.out_splits[source]

    def own_halves(self) -> list[tuple[Node, Node, Node | None, Any]]:
        """``received``'s for the two halves of this rank's own tokens. Their count is
        both what it sends itself and what it receives from itself, two sizes the graph
        names apart (equal when it runs): each tensor is cut by its own."""
        r = self.rank
        tokens, sent = self.cut(self.tokens_for[r], self.in_splits[r])
        experts, _ = self.cut(self.expert_of[r], self.out_splits[r])
        places = self.cut(self.place_of[r], self.out_splits[r])[0] if self.placed else [None] * 2
        return [(tokens[h], experts[h], places[h], sent[h]) for h in (0, 1)]

    def cut(self, node: Node, rows: Any) -> tuple[list[Node], list[Any]]:
        """``node`` (``rows`` rows, an int or a size node) in two halves, and their rows."""
        em = self.rw.emit
        if isinstance(rows, Node):
            half = em(operator.floordiv, (rows, 2), step=0, lane="compute")
            sizes = [half, em(operator.sub, (rows, half), step=0, lane="compute")]
        else:
            sizes = [rows // 2, rows - rows // 2]
        return self._split(node, sizes, 0), sizes

    def sent(self, peer: int) -> Node:
        """This rank's tokens for ``peer``'s experts."""
        return self.tokens_for[peer]

    def like_received(self, source: int) -> Node:
        em = self.rw.emit
        shape = [self.out_splits[source], *self.width]
        return em(aten.new_empty.default, (self.tokens, shape), step=0, lane="comm")

    def like_returned(self, peer: int, result: Node) -> Node:
        """A buffer for this rank's tokens as ``peer``'s experts return them, like
        ``result`` (the experts' output for a block here)."""
        em = self.rw.emit
        shape = [self.in_splits[peer], *val(result).shape[1:]]
        return em(aten.new_empty.default, (result, shape), step=0, lane="comm")

    def experts(
        self, block: Node, expert_of: Node, place_of: Node | None, rows: Any, step: int
    ) -> Node:
        """The experts' output for a block (``received``'s), in its rows' order: the
        rows sorted by expert, the experts' ops with the block's offsets (the tensors
        paired with the experts' rows, at the rows' places), unsorted."""
        em, site = self.rw.emit, self.site
        assert site.permuted is not None and site.offs is not None

        def emit(target: Any, *args: Any, **kwargs: Any) -> Node:
            return em(target, args, kwargs, step=step, lane="compute")

        sort = emit(aten.sort.stable, expert_of, stable=True)
        experts_sorted, order = emit(operator.getitem, sort, 0), emit(operator.getitem, sort, 1)
        offs = emit(
            aten.searchsorted.Tensor, experts_sorted, self.group_ids, out_int32=True, right=True
        )
        places = None if place_of is None else emit(aten.index.Tensor, place_of, [order])
        env: dict[Node, Any] = {site.permuted: emit(aten.index.Tensor, block, [order])}
        env[site.offs] = offs
        paired = set(site.paired)

        def value(arg: Node) -> Any:
            """The block's value of ``arg``: its rows of a paired tensor, at their places."""
            if arg in paired and arg not in env:
                env[arg] = emit(aten.index.Tensor, arg, [places])
            return env.get(arg, arg)

        for node in site.experts:
            args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
            env[node] = em(node.target, args, kwargs, step=step, lane="compute")  # type: ignore[arg-type]
        if self.saved:  # (and the sums' operands)
            assert places is not None
            self.places.append(places)
            for node, pieces in self.saved.items():
                pieces.append(env[node])
        out = env[self.value]
        empty = emit(aten.new_empty.default, out, [rows, *val(out).shape[1:]])
        return emit(aten.index_put.default, empty, [order], out)

    def wholes(self, step: int) -> None:
        """After the last block: the expert values read whole, each row at its place in
        the permuted order, and the weight gradients (sums over every row per group)
        from them, by the program's own grouped matmuls: the same numbers."""
        em, site = self.rw.emit, self.site
        whole: dict[Node, Node] = {}
        if self.saved:
            places = em(aten.cat.default, (self.places, 0), step=step, lane="compute")
            for node, pieces in self.saved.items():
                rows = em(aten.cat.default, (pieces, 0), step=step, lane="compute")
                shape = [self.rows, *(em.size(d, step) for d in val(node).shape[1:])]
                empty = em(aten.new_empty.default, (rows, shape), step=step, lane="compute")
                whole[node] = em(
                    aten.index_put.default, (empty, [places], rows), step=step, lane="compute"
                )
                self.rw.replaces(node, whole[node])
        for mm in site.sums:
            a, b = node_arg(mm, 0, "self"), node_arg(mm, 1, "mat2")
            if a in site.transposes:  # of an expert value: of it, whole
                source = whole[a.args[0]]
                a = em(a.target, (source, *a.args[1:]), a.kwargs, step=step, lane="compute")
            args = (a, whole.get(b, b), *mm.args[2:])
            self.rw.replaces(mm, em(GROUPED_MM, args, mm.kwargs, step=step, lane="compute"))

    def finish(self, out: Node, step: int) -> None:
        """The sizes read off the replaced nodes (the combine's: of ``out``, which
        replaces it)."""
        for node in self.site.replaced():
            for user in node.users:
                if user.target is aten.sym_size.int:
                    self.rw.replaces(user, self._size(user, out, step))

    def _size(self, reader: Node, out: Node, step: int) -> Node:
        source, dim = reader.args[0], node_arg(reader, 1, "dim")
        if dim != 0:
            raise decline("moe.size", node=reader.name)
        em, site = self.rw.emit, self.site
        like = out if source in (site.combine, site.combine_wait) else site.perm
        return em(aten.sym_size.int, (like, 0), step=step, lane="compute")
