"""Verify stage: structural checks on a rewrite before and after it is committed."""

from __future__ import annotations

import functools
import operator
from types import ModuleType

import torch

from ..groups import Group
from ..report import decline
from ..schedules import simulate, slicing
from . import dims
from .lower import P2P, Rewrite
from .match import AgMmSite, val

c10d = torch.ops._c10d_functional
COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)


def check_emitted(rw: Rewrite) -> None:
    """Before commit: every received tensor is waited exactly once, every buffer sent is
    waited after its P2P op (its send is registered on it, see ``p2p.py``), every chunk
    collective is waited once, and each replacement has the value (shape, dtype) of what
    it replaces."""
    position = {node: i for i, node in enumerate(rw.created)}
    waits: dict[object, list[int]] = {}
    for node in rw.created:
        if node.target is c10d.wait_tensor.default:
            waits.setdefault(node.args[0], []).append(position[node])
    for node in rw.created:
        if node.target is not P2P:
            continue
        sends, recvs = node.args[0], node.args[2]
        outs = sorted(node.users, key=lambda u: u.args[1])  # type: ignore[arg-type, return-value]
        if [o.target for o in outs] != [operator.getitem] * len(recvs):  # type: ignore[arg-type]
            raise decline(f"internal: {node.name} outputs are not all unpacked")
        if any(len(waits.get(out, [])) != 1 for out in outs):
            raise decline(f"internal: a tensor {node.name} receives is not waited exactly once")
        if any(max(waits.get(buf, [-1])) < position[node] for buf in sends):  # type: ignore[union-attr]
            raise decline(f"internal: a buffer {node.name} sends is not waited after it")
    for node in rw.created:
        if node.target in COLLECTIVES and len(waits.get(node, [])) != 1:
            raise decline(f"internal: {node.name} is not waited exactly once")
    for old, new in rw.replace.items():
        if not _same_value(old.meta.get("val"), new.meta.get("val")):
            raise decline(f"internal: replacement of {old.name} changes its value's shape/dtype")


def _same_value(a: object, b: object) -> bool:
    """Same shape, dtype and device (tensors), or the same size (a recomputed SymInt)."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return dims.equal(a, b)
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and dims.same_shape(a.shape, b.shape)
        and a.dtype == b.dtype
        and a.device == b.device
    )


def check_committed(rw: Rewrite) -> None:
    """After commit: the site's collectives are gone and every new node is read (the
    whole graph is linted once, after its last site)."""
    site = rw.site
    anchors = getattr(site, "gathers", None) or [getattr(site, "reduce_scatter", None)]
    if any(node is not None and not node._erased for node in anchors):
        raise decline("internal: a rewritten site still has its collective")
    dead = [n.name for n in rw.created if not n.users and n.target is not c10d.wait_tensor.default]
    if dead:
        raise decline(f"internal: the rewrite computes values nothing reads: {dead}")


def check_exchange(rw: Rewrite, group: Group, schedule: ModuleType, slices: int = 2) -> None:
    """Cross-rank check: the graph's P2P ops are exactly this rank's steps of ``schedule``,
    and the schedule, run for every rank of the group, matches each receive with the
    peer's send of the same block in the same step (so no rank waits for a message that
    is never sent) and leaves every rank with the right blocks. Tensors are the same
    shape on every rank (SPMD), so each received buffer has the shape of what is sent.
    Under slicing, every rank runs the same k collectives on the site's group in the
    same order, each chunk collected before use."""
    if schedule is slicing:
        _check_sliced(rw, group, slices)
        return
    n = group.size
    gather = isinstance(rw.site, AgMmSite)
    steps = schedule.gather_steps(group.rank, n) if gather else schedule.reduce_steps(group.rank, n)
    expected = [
        ([group.peer(t.peer) for t in st.sends], [group.peer(t.peer) for t in st.recvs])
        for st in steps
        if st.sends or st.recvs
    ]
    p2p = [node for node in rw.created if node.target is P2P]
    emitted = [(list(node.args[1]), list(node.args[3])) for node in p2p]  # type: ignore[arg-type]
    if emitted != expected:
        raise decline(f"internal: P2P peers {emitted} are not the schedule's {expected}")
    for node in p2p:
        buffers = (*node.args[0], *node.args[2])  # type: ignore[misc]
        shapes = {tuple(dims.as_json(val(t).shape)) for t in buffers}
        if len(shapes) != 1:
            raise decline(f"internal: {node.name} sends and receives different shapes {shapes}")
    _check_schedule_all_ranks(schedule, n, gather)


@functools.cache
def _check_schedule_all_ranks(schedule: ModuleType, n: int, gather: bool) -> None:
    try:
        if gather:
            held = simulate.gather(schedule, list(range(n)), lambda b, x: x)
            if any(sorted(h) != list(range(n)) for h in held):
                raise simulate.ScheduleError("a rank does not multiply every block")
        else:
            sums = simulate.reduce(schedule, n, lambda r, b: {(r, b)}, lambda x, y: x | y)
            if sums != [{(r, b) for r in range(n)} for b in range(n)]:
                raise simulate.ScheduleError("a block does not sum every rank's partial")
    except simulate.ScheduleError as err:
        raise decline(f"internal: schedule {schedule.__name__} on {n} ranks: {err}") from None


def _check_sliced(rw: Rewrite, group: Group, k: int) -> None:
    collectives = [node for node in rw.created if node.target in COLLECTIVES]
    if len(collectives) != k or any(
        node.args[-2:] != (group.size, group.name) for node in collectives
    ):
        raise decline(
            f"internal: slicing emitted {len(collectives)} collectives, not {k} on the group"
        )
    gather = isinstance(rw.site, AgMmSite)
    try:
        slicing.check(slicing.gather_steps(k) if gather else slicing.reduce_steps(k), k, gather)
    except simulate.ScheduleError as err:
        raise decline(f"internal: slicing with {k} chunks: {err}") from None
