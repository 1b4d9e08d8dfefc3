"""The ring core: a schedule's steps turned into transfers, matmuls and waits, for every
site kind. A kind says what one block computes; the drivers here decide when it runs,
what travels, and which window each node belongs to, so a fix to the ring reaches every
kind.

Three drivers, one per shape of schedule:
* ``collect_then_compute`` (``Direction.collects_first``): each step starts its
  transfers, multiplies the blocks at hand, then waits; an arrived block is at hand from
  the next step on.
* ``compute_then_send``: each step computes its blocks, waits the transfers started in
  the step before, adds the partial sums received to its blocks, then sends them on.
* ``lower_sliced_steps``: k collectives on chunks, chunk i's collective under chunk i-1's matmuls.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import torch
import torch._inductor.inductor_prims  # noqa: F401 (prims.inductor_force_stride_order)
from torch.fx import Node

from ...runtime.groups import Group
from ...schedules import Direction, Schedule, Transfer
from ..fx import dims
from ..fx.collectives import P2P, saved_unwaited
from ..fx.graph import LAYOUT_OPS, val
from ..fx.matmuls import Matmul, is_matmul
from .blocks import accumulate, finish_sum, view
from .rewrite import Rewrite

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# the tensor itself if it has these strides, else a copy that has them: what Inductor
# computes once, into a buffer of its own
FORCE_STRIDES = torch.ops.prims.inductor_force_stride_order.default

# a started batch: (its p2p node, the receives with their tensors, the buffers sent)
Pending = tuple[Node | None, list[tuple[Transfer, Node]], list[Node]]
NOTHING_PENDING: Pending = (None, [], [])


def start_transfers(
    rw: Rewrite,
    group: Group,
    step: int,
    sends: Sequence[Transfer],
    recvs: Sequence[Transfer],
    held: Mapping[int, Node],
    recv_like: Node | Sequence[Node],
) -> Pending:
    """Start one batch of sends (of ``held`` blocks) and receives (into tensors like
    ``recv_like``, or each like its own: blocks of uneven sizes)."""
    if not sends and not recvs:
        return NOTHING_PENDING
    buffers = [copy_to_one_buffer(rw, held[t.block], step) for t in sends]
    likes = [recv_like] * len(recvs) if isinstance(recv_like, Node) else list(recv_like)
    p2p = rw.emit(
        P2P,
        (
            buffers,
            [group.peer(t.peer) for t in sends],
            likes,
            [group.peer(t.peer) for t in recvs],
            rw.tag,
            group.name,
            rw.label(step),
            *((True,) if rw.timed else ()),
        ),
        step=step,
        lane="comm",
    )
    received = [
        rw.emit(operator.getitem, (p2p, i), step=step, lane="comm") for i in range(len(recvs))
    ]
    return p2p, list(zip(recvs, received, strict=True)), list(dict.fromkeys(buffers))


def copy_to_one_buffer(rw: Rewrite, node: Node, step: int) -> Node:
    """``node`` as a buffer to send. Inductor computes a value that a copy, a cast or an
    element-wise op of one tensor makes (``clone`` into a block's layout) where each
    reader reads it, not once: the transfer and the wait of its buffer would get two
    buffers, and the one the transfer reads would be free to reuse before its wait.
    Such a value goes through ``inductor_force_stride_order`` (in eager, the tensor
    itself), whose result Inductor computes into one buffer; an input, a matmul's
    product, a received tensor and views of them are buffers already."""
    base = node
    while base.target in LAYOUT_OPS - {aten.clone.default} | {aten.slice.Tensor}:
        base = base.args[0]  # type: ignore[assignment]
    if base.op == "placeholder" or is_matmul(base) or base.target is operator.getitem:
        return node
    strides = [rw.emit.compute_size(stride, step) for stride in val(node).stride()]
    return rw.emit(FORCE_STRIDES, (node, strides), step=step, lane="comm")


def wait_transfers(rw: Rewrite, step: int, pending: Pending) -> tuple[list[Node], list[Node]]:
    """Wait every transfer of a started batch: each received tensor, and each buffer
    sent, on which its send is registered (see ``p2p.py``): no compiler may reuse or
    write that memory before this wait. Returns (the waits, the received tensors)."""
    _, recvs, sent = pending
    received = [
        rw.emit(c10d.wait_tensor.default, (out,), step=step, lane="comm") for _, out in recvs
    ]
    waits = [rw.emit(c10d.wait_tensor.default, (b,), step=step, lane="comm") for b in sent]
    return [*received, *waits], received


def collect_then_compute(
    rw: Rewrite,
    group: Group,
    schedule: Schedule,
    direction: Direction,
    held: dict[int, Node],
    send: Callable[[Transfer, int], Node],
    compute: Callable[[int, Node, int], None],
    rows: Callable[[int], dims.Size] | None = None,
) -> dict[int, Node]:
    """Run ``schedule``'s steps of a collect-first ``direction``: ``send(transfer, step)``
    gives a message's buffer, ``compute(block, held block, step)`` multiplies a block at
    hand. ``held`` starts with this rank's block; returns every block, as held at the end.
    A block received is like this rank's, with ``rows(block)`` rows if given (uneven).
    The schedule runs on ring places (``Group.order``); the callbacks see group ranks."""
    r, n, member = group.position, group.size, group.member
    for s, step in enumerate(schedule.steps(direction, r, n, 0)):
        buffers = {t.block: send(Transfer(member(t.block), t.peer), s) for t in step.sends}
        recv_like = _allocate_likes(rw, held[group.rank], step.recvs, direction, group, rows, s)
        pending = start_transfers(rw, group, s, step.sends, step.recvs, buffers, recv_like)
        for b in step.compute:
            compute(member(b), held[member(b)], s)
        waits, received = wait_transfers(rw, s, pending)
        for (t, _), node in zip(pending[1], received, strict=True):
            held[member(direction.source(t, r, n))] = node
        rw.add_step(pending[0], s, waits)
    return held


def compute_then_send(
    rw: Rewrite,
    group: Group,
    schedule: Schedule,
    direction: Direction,
    compute: Callable[[int, int], Node],
    rows: Callable[[int], dims.Size] | None = None,
) -> dict[int, Node]:
    """Run ``schedule``'s steps of a compute-first ``direction``: ``compute(block, step)``
    is this rank's part of a block. Returns what this rank ends with: its own block
    (summed over the ranks, where the steps add), and the blocks others sent it that
    nothing added (an all-to-all's, by sender). A block received is like the step's
    first computed one, with ``rows(block)`` rows if given (uneven blocks). The schedule
    runs on ring places (``Group.order``); the callbacks and the result see group ranks."""
    r, n, member = group.position, group.size, group.member
    pending, sums = NOTHING_PENDING, {}
    received: dict[tuple[int, int], Node] = {}  # (block, peer) -> from that peer
    for s, step in enumerate(schedule.steps(direction, r, n, 0)):
        parts = {b: compute(member(b), s) for b in step.blocks}
        waits, arrived = wait_transfers(rw, s, pending)
        for (t, _), node in zip(pending[1], arrived, strict=True):
            received[t.block, t.peer] = node
        rw.add_step(pending[0], s, waits)
        sums = dict(parts)
        for t in step.adds:
            partial = received.pop((t.block, t.peer))
            sums[t.block] = rw.emit(
                aten.add.Tensor, (sums[t.block], partial), step=s, lane="compute"
            )
        recv_like = _allocate_likes(
            rw, next(iter(parts.values())), step.recvs, direction, group, rows, s
        )
        pending = start_transfers(rw, group, s, step.sends, step.recvs, sums, recv_like)
    assert pending is NOTHING_PENDING, "a schedule's last step sends nothing"
    held = {direction.source(Transfer(b, p), r, n): node for (b, p), node in received.items()}
    return {member(p): node for p, node in {**held, r: sums[r]}.items()}


def _allocate_likes(
    rw: Rewrite,
    example: Node,
    recvs: Sequence[Transfer],
    direction: Direction,
    group: Group,
    rows: Callable[[int], dims.Size] | None,
    step: int,
) -> Node | list[Node]:
    """What the receives of a step are like: ``example`` (a block of this rank's), or, for
    uneven blocks, each a tensor like it with the rows of the block it brings."""
    if rows is None:
        return example
    rest = val(example).shape[1:]
    likes = []
    for t in recvs:
        block = group.member(direction.source(t, group.position, group.size))
        shape = [rw.emit.compute_size(size, step) for size in (rows(block), *rest)]
        likes.append(rw.emit(aten.new_empty.default, (example, shape), step=step, lane="comm"))
    return likes


def lower_sliced_steps(
    rw: Rewrite,
    schedule: Schedule,
    direction: Direction,
    chunks: int,
    issue: Callable[[int, int], Node],
    compute: Callable[[int, int], None],
    collected: Callable[[int, Node, int], None],
) -> None:
    """Run a sliced schedule: ``issue(chunk, step)`` emits a chunk's collective,
    ``compute(chunk, step)`` its matmuls, ``collected(chunk, waited, step)`` takes its
    result."""
    started: dict[int, Node] = {}
    for s, step in enumerate(schedule.steps(direction, 0, 0, chunks)):
        node = None
        if step.issue is not None:
            node = started[step.issue] = issue(step.issue, s)
        if step.compute is not None:
            compute(step.compute, s)
        waits = []
        if step.wait is not None:
            done = rw.emit(c10d.wait_tensor.default, (started[step.wait],), step=s, lane="comm")
            waits.append(done)
            collected(step.wait, done, s)
        rw.add_step(node, s, waits)


def replace_collective(
    rw: Rewrite, collectives: Sequence[Node], waits: Sequence[Node], value: Node
) -> None:
    """``value`` takes the place of the collectives' result: their waits, and the
    unwaited result where the graph saves it (for the backward)."""
    for wait in waits:
        rw.replaces(wait, value)
    for collective in collectives:
        if saved_unwaited(collective):
            rw.replaces(collective, value)


class Products:
    """What every matmul reading a collected tensor computes from its blocks: a block of
    its product per block (``put``), or, where the blocks run along the contracting dim,
    a running sum of partial products (``add``)."""

    def __init__(self, rw: Rewrite, matmuls: Sequence[tuple[Matmul, str]]) -> None:
        self.rw, self.matmuls = rw, matmuls  # (matmul, role) of each use
        self.blocks: list[dict[int, Node]] = [{} for _ in matmuls]
        self.sums: list[Node | None] = [None for _ in matmuls]
        # uses whose row blocks are concatenated on a dim of their own
        self.rows_dims: dict[int, int] = {}

    def put(self, use: int, index: int, block: Node) -> None:
        self.blocks[use][index] = block

    def add(self, use: int, a: Node, b: Node, step: int, offs: Node | None = None) -> None:
        mm = self.matmuls[use][0]
        self.sums[use] = accumulate(self.rw.emit, mm, self.sums[use], a, b, step, offs)

    def finish(self, count: int, step: int, rows_dim: int) -> None:
        """Each matmul's replacement: its sum, or its ``count`` blocks concatenated (on
        ``rows_dim`` for a block of rows, after a batched matmul's batch dims, or on the
        use's own ``rows_dims``; on the columns otherwise)."""
        em = self.rw.emit
        for i, (mm, role) in enumerate(self.matmuls):
            total = self.sums[i]
            if total is not None:
                self.rw.replaces(mm.node, finish_sum(em, total, mm.node, step))
                continue
            pieces = [self.blocks[i][b] for b in range(count)]
            dim = self.rows_dims.get(i, mm.lead + rows_dim) if role == "rows" else -1
            full = em(aten.cat.default, (pieces, dim), step=step, lane="compute")
            self.rw.replaces(mm.node, view(em, full, list(val(mm.node).shape), step))
