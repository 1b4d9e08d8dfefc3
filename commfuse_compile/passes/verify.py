"""Verify stage: structural checks on a rewrite before and after it is committed."""

from __future__ import annotations

import operator

import torch

from ..runtime.groups import Group
from ..schedules import Direction, Schedule, exchange, slicing
from .fx import dims
from .fx.collectives import P2P
from .fx.declines import decline
from .fx.graph import val
from .kinds import of
from .kit.rewrite import Rewrite

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
            raise decline("internal.unpacked", node=node.name)
        if any(len(waits.get(out, [])) != 1 for out in outs):
            raise decline("internal.recv_wait", node=node.name)
        if any(max(waits.get(buf, [-1])) < position[node] for buf in sends):  # type: ignore[union-attr]
            raise decline("internal.send_wait", node=node.name)
    for node in rw.created:
        if node.target in COLLECTIVES and len(waits.get(node, [])) != 1:
            raise decline("internal.collective_wait", node=node.name)
    for old, new in rw.replace.items():
        if not _same_value(old.meta.get("val"), new.meta.get("val")):
            raise decline("internal.replacement", node=old.name)


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
    if any(not node._erased for node in rw.site.collectives):
        raise decline("internal.collective_left")
    dead = [n.name for n in rw.created if not n.users and n.target is not c10d.wait_tensor.default]
    if dead:
        raise decline("internal.dead", nodes=dead)


def check_exchange(rw: Rewrite, group: Group, schedule: Schedule, slices: int = 2) -> None:
    """Cross-rank check: the graph's P2P ops are exactly this rank's steps (the kind's
    ``expected_peers``: the schedule's, or the kind's own), and the steps, run for every
    rank of the group, match each receive with the peer's send of the same block in the
    same step (so no rank waits for a message that is never sent) and leave every rank
    with the right blocks (``check_schedule``). Tensors are the same shape on every rank
    (SPMD), so each received buffer has the shape of what is sent (``alike_from``: an
    uneven all-to-all's blocks, but for their rows). Under slicing, every rank runs the
    same k collectives on the site's group in the same order, each chunk collected
    before use."""
    kind = of(rw.site)
    if schedule.sliced:
        _check_sliced(rw, group, slices, kind.direction)
        return
    p2p = [node for node in rw.created if node.target is P2P]
    emitted = [(list(node.args[1]), list(node.args[3])) for node in p2p]  # type: ignore[arg-type]
    expected = kind.expected_peers(rw.site, group, schedule, slices)
    if emitted != expected:
        raise decline("internal.peers", emitted=emitted, expected=expected)
    alike_from = kind.alike_from(rw.site)
    for node in p2p if alike_from is not None else ():
        buffers = (*node.args[0], *node.args[2])  # type: ignore[misc]
        shapes = {tuple(dims.as_json(val(t).shape)[alike_from:]) for t in buffers}
        if len(shapes) != 1:
            raise decline("internal.shapes", node=node.name, shapes=shapes)
    try:
        kind.check_schedule(schedule, group.size)
    except exchange.ScheduleError as err:
        raise decline(
            "internal.schedule", schedule=schedule.name, n=group.size, error=err
        ) from None


def _check_sliced(rw: Rewrite, group: Group, k: int, direction: Direction) -> None:
    gather = direction.collects_first
    chunk = COLLECTIVES[0] if gather else COLLECTIVES[1]  # (an all-reduce's gather follows)
    collectives = [node for node in rw.created if node.target is chunk]
    if len(collectives) != k or any(
        node.args[-2:] != (group.size, group.name) for node in collectives
    ):
        raise decline("internal.slicing", k=k, error=f"{len(collectives)} collectives on the group")
    try:
        slicing.check(slicing.gather_steps(k) if gather else slicing.reduce_steps(k), k, gather)
    except exchange.ScheduleError as err:
        raise decline("internal.slicing", k=k, error=err) from None
