"""Lowering a ``moe`` site: ``round_trip``'s steps, each peer's block of the dispatched
tokens through the experts' ops (sorted by expert, with its own offsets) and back."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.fx import Node, map_arg

from ....runtime.groups import Group
from ....schedules import Transfer, round_trip
from ...fx import dims
from ...fx.declines import decline
from ...fx.graph import CONVERT, node_arg, val
from ...kit.rewrite import Rewrite
from ...kit.ring import replace_collective, start_transfers, wait_transfers
from .padding import ALLOCATE_NEW
from .site import GROUPED_MM, MoeSite

aten = torch.ops.aten


def lower(rw: Rewrite, site: MoeSite, group: Group) -> None:
    """``round_trip``'s steps: each starts one P2P batch (the next block's dispatch, the
    last result's combine), runs the experts on the block at hand (this rank's own in two
    halves: the first and the last step), then waits it."""
    assert site.combine is not None and site.combine_wait is not None
    em, n, r = rw.emit, group.size, group.rank
    blocks = _Blocks(rw, site, r)
    arrived: dict[int, Node] = {}  # dispatched tokens, by source rank
    results: dict[int, Node] = {}  # the experts' output, by source rank
    returned: dict[int, Node] = {}  # this rank's tokens as the experts left them, by rank
    own = blocks.cut_own_halves()
    halves: list[Node] = []  # the experts' output for this rank's own tokens
    for s, step in enumerate(round_trip.steps(n)):
        sends, buffers = list[Transfer](), dict[int, Node]()
        recvs: list[tuple[Transfer, Node, dict[int, Node], int]] = []
        if step.dispatch is not None:
            t = step.dispatch
            buffers[0] = blocks.sent((r + t) % n)
            sends.append(Transfer(0, t))
            recvs.append(
                (Transfer(0, -t), blocks.allocate_received((r - t) % n), arrived, (r - t) % n)
            )
        if step.combine is not None:
            t = step.combine
            buffers[1] = results[(r - t) % n]
            sends.append(Transfer(1, -t))
            like = blocks.allocate_returned((r + t) % n, halves[0])
            recvs.append((Transfer(1, t), like, returned, (r + t) % n))
        likes = [like for _, like, _, _ in recvs]
        pending = start_transfers(rw, group, s, sends, [t for t, *_ in recvs], buffers, likes)
        if step.half is not None:
            halves.append(blocks.run_experts(*own[step.half], s))
        else:
            source = (r - step.compute) % n
            results[source] = blocks.run_experts(*blocks.received(arrived[source], source), s)
        if s == n:  # under the last result's way back, after the last rows
            blocks.run_appended(s)
            blocks.assemble_wholes(s)
        waits, received = wait_transfers(rw, s, pending)
        for (_, _, into, key), node in zip(recvs, received, strict=True):
            into[key] = node
        rw.add_step(pending[0], s, waits)
    returned[r] = em(aten.cat.default, (halves, 0), step=n, lane="compute")
    out = em(aten.cat.default, ([returned[j] for j in range(n)], 0), step=n, lane="comm")
    blocks.finish(out, n)
    replace_collective(rw, [site.combine], [site.combine_wait], out)


def peers(group: Group) -> list[tuple[list[int], list[int]]]:
    """(send peers, receive peers) of each P2P batch ``lower`` emits, in order."""
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
        # the rows received (perm's count, unpadded) and with the appended ones
        # (``padding``): the rows perm reads
        self.received_rows: Any = rows
        self.source_rows: Any = rows
        if site.pad is not None:
            self.received_rows = self._sum(self.out_splits)
            self.source_rows = self._add(self.received_rows, site.pad.rows)
        index_dtype = val(perm).dtype
        positions = self._emit_iota(rows, index_dtype, step)
        empty = em(aten.new_empty.default, (perm, [self.source_rows]), step=step, lane="compute")
        # the slot of each row perm reads, and so (for a received row) its expert
        self.inverse = em(
            aten.index_put.default, (empty, [perm], positions), step=step, lane="compute"
        )
        if site.pad is not None:
            bounds = (0, self.received_rows)
            self.inverse = em(
                aten.slice.Tensor, (self.inverse, 0, *bounds), step=step, lane="compute"
            )
        offs = em(CONVERT, (site.offs, index_dtype), step=step, lane="compute")
        self.offs = offs
        expert = em(
            aten.bucketize.Tensor, (self.inverse, offs), {"right": True}, step=step, lane="compute"
        )
        self.groups = val(site.offs).shape[0]
        self.group_ids = self._emit_iota(self.groups, index_dtype, step)
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

    def _sum(self, sizes: list[Any]) -> Any:
        total: Any = 0
        for size in sizes:
            total = self._add(total, size)
        return total

    def _add(self, a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            return a + b
        if isinstance(a, int) and a == 0:
            return b
        return self.rw.emit(operator.add, (a, b), step=0, lane="compute")

    def _emit_iota(self, length: Any, dtype: torch.dtype, step: int) -> Node:
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
        """What ``run_experts`` takes for the block from ``source``: its tokens, the expert
        and the place in the permuted order of each of its rows, and its row count."""
        place_of = self.place_of[source] if self.placed else None
        return block, self.expert_of[source], place_of, self.out_splits[source]

    def cut_own_halves(self) -> list[tuple[Node, Node, Node | None, Any]]:
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

    def allocate_received(self, source: int) -> Node:
        em = self.rw.emit
        shape = [self.out_splits[source], *self.width]
        return em(aten.new_empty.default, (self.tokens, shape), step=0, lane="comm")

    def allocate_returned(self, peer: int, result: Node) -> Node:
        """A buffer for this rank's tokens as ``peer``'s experts return them, like
        ``result`` (the experts' output for a block here)."""
        em = self.rw.emit
        shape = [self.in_splits[peer], *val(result).shape[1:]]
        return em(aten.new_empty.default, (result, shape), step=0, lane="comm")

    def run_experts(
        self, block: Node, expert_of: Node, place_of: Node | None, rows: Any, step: int
    ) -> Node:
        """The experts' output for a block (``received``'s), in its rows' order: the
        rows sorted by expert, the experts' ops with the block's offsets (the tensors
        paired with the experts' rows, at the rows' places), unsorted."""
        env, order = self._run_sorted(block, expert_of, place_of, step)
        out = env[self.value]
        em = self.rw.emit
        shape = [rows, *val(out).shape[1:]]
        empty = em(aten.new_empty.default, (out, shape), step=step, lane="compute")
        return em(aten.index_put.default, (empty, [order], out), step=step, lane="compute")

    def _run_sorted(
        self, block: Node, expert_of: Node, place_of: Node | None, step: int, whole: bool = False
    ) -> tuple[dict[Node, Any], Node]:
        """The experts' ops on a block's rows sorted by expert (and the order they were
        sorted in); the values read whole kept, with the rows' places (``whole``: only
        the ops those values need)."""
        em, site = self.rw.emit, self.site
        assert site.permuted is not None and site.offs is not None

        def emit(target: Any, *args: Any, **kwargs: Any) -> Node:
            return em(target, args, kwargs, step=step, lane="compute")

        sort = emit(aten.sort.stable, expert_of, stable=True)
        order = emit(operator.getitem, sort, 1)
        places = None if place_of is None else emit(aten.index.Tensor, place_of, [order])
        env: dict[Node, Any] = {site.permuted: emit(aten.index.Tensor, block, [order])}
        paired = set(site.paired)

        def value(arg: Node) -> Any:
            """The block's value of ``arg``: its offsets, its rows of a paired tensor at
            their places."""
            if arg is site.offs and arg not in env:
                experts_sorted = emit(operator.getitem, sort, 0)
                env[arg] = emit(
                    aten.searchsorted.Tensor, experts_sorted, self.group_ids, out_int32=True,
                    right=True,
                )  # fmt: skip
            if arg in paired and arg not in env:
                env[arg] = emit(aten.index.Tensor, arg, [places])
            return env.get(arg, arg)

        needed = _needed(site.experts, self.saved) if whole else set(site.experts)
        for node in site.experts:
            if node not in needed:
                continue
            args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
            env[node] = em(node.target, args, kwargs, step=step, lane="compute")  # type: ignore[arg-type]
        if self.saved:  # (and the sums' operands)
            assert places is not None
            self.places.append(places)
            for node, pieces in self.saved.items():
                pieces.append(env[node])
        return env, order

    def run_appended(self, step: int) -> None:
        """The slots that read a row appended after the received ones (``padding``),
        through the experts as one more block: their values go only into the expert
        values read whole (in the program they are put back into rows it drops)."""
        pad, perm = self.site.pad, self.site.perm
        if pad is None or not self.saved:
            return
        assert perm is not None
        em = self.rw.emit

        def emit(target: Any, *args: Any, **kwargs: Any) -> Node:
            return em(target, args, kwargs, step=step, lane="compute")

        # perm's entries as rows of the padded tensor (-1: its last)
        wrapped = emit(
            aten.where.self,
            emit(aten.lt.Scalar, perm, 0),
            emit(aten.add.Tensor, perm, self.source_rows),
            perm,
        )
        reads_appended = emit(aten.ge.Scalar, wrapped, self.received_rows)
        order = emit(aten.sort.stable, emit(CONVERT, reads_appended, torch.int8), stable=True)
        # the slots of the received rows first (one each), then the others
        slots = emit(aten.slice.Tensor, emit(operator.getitem, order, 1), 0, self.received_rows)
        which = emit(aten.sub.Tensor, emit(aten.index.Tensor, wrapped, [slots]), self.received_rows)
        block = emit(aten.index.Tensor, self._make_appended_rows(step), [which])
        expert_of = emit(aten.bucketize.Tensor, slots, self.offs, right=True)
        self._run_sorted(block, expert_of, slots, step, whole=True)

    def _make_appended_rows(self, step: int) -> Node:
        """The rows appended after the received ones."""
        pad = self.site.pad
        assert pad is not None
        em = self.rw.emit
        if pad.extra is None:  # a gradient laid into zeros
            shape = [pad.rows, *(em.compute_size(d, step) for d in self.width)]
            dtype = val(pad.node).dtype
            return em(
                aten.new_zeros.default, (self.tokens, shape), {"dtype": dtype},
                step=step, lane="compute",
            )  # fmt: skip
        if pad.node.target is aten.cat.default:
            return pad.extra
        bounds = (self.received_rows, self.source_rows)  # of the buffer laid under the rows
        return em(aten.slice.Tensor, (pad.extra, 0, *bounds), step=step, lane="compute")

    def assemble_wholes(self, step: int) -> None:
        """After the last block: the expert values read whole, each row at its place in
        the permuted order, and the weight gradients (sums over every row per group)
        from them, by the program's own grouped matmuls: the same numbers."""
        em, site = self.rw.emit, self.site
        whole: dict[Node, Node] = {}
        if self.saved:
            places = em(aten.cat.default, (self.places, 0), step=step, lane="compute")
            for node, pieces in self.saved.items():
                rows = em(aten.cat.default, (pieces, 0), step=step, lane="compute")
                shape = [self.rows, *(em.compute_size(d, step) for d in val(node).shape[1:])]
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
        replaces it), and the allocations that read the received tokens' dtype and
        device (the appended zero row's): of the tokens sent, which have them."""
        site = self.site
        for node in site.replaced():
            for user in node.users:
                if user.target is aten.sym_size.int:
                    self.rw.replaces(user, self._recompute_size(user, out, step))
                elif user.target in ALLOCATE_NEW and node in (site.dispatch, site.dispatch_wait):
                    args = (self.tokens, *user.args[1:])
                    new = self.rw.emit(user.target, args, user.kwargs, step=0, lane="compute")  # type: ignore[arg-type]
                    self.rw.replaces(user, new)

    def _recompute_size(self, reader: Node, out: Node, step: int) -> Node:
        """A row count of a replaced tensor: the tokens returned (``out``'s), or the
        slots (perm's), the rows received, or those with the appended ones."""
        source, value = reader.args[0], reader.meta.get("val")
        if node_arg(reader, 1, "dim") != 0 or not isinstance(value, int | torch.SymInt):
            raise decline("moe.size", node=reader.name)
        if source in (self.site.combine, self.site.combine_wait):
            return self.rw.emit(aten.sym_size.int, (out, 0), step=step, lane="compute")
        for size in (self.rows, self.received_rows, self.source_rows):
            if isinstance(size, Node) and dims.equal(size.meta["val"], value):
                return size
        raise decline("moe.size", node=reader.name)


def _needed(experts: Sequence[Node], values: Iterable[Node]) -> set[Node]:
    """The expert ops that ``values`` are computed from (themselves included)."""
    inside, needed = set(experts), set()
    stack = [node for node in values if node in inside]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack += [a for a in node.all_input_nodes if a in inside]
    return needed
