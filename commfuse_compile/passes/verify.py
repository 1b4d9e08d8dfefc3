"""Verify stage: structural checks on a rewrite before and after it is committed."""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph

from ..report import decline
from .lower import P2P, Rewrite

c10d = torch.ops._c10d_functional


def check_emitted(rw: Rewrite) -> None:
    """Before commit: every P2P output is waited exactly once, every send buffer waited,
    and each replacement has the value (shape, dtype) of what it replaces."""
    waited: dict[object, int] = {}
    for node in rw.created:
        if node.target is c10d.wait_tensor.default:
            waited[node.args[0]] = waited.get(node.args[0], 0) + 1
    for node in rw.created:
        if node.target is not P2P:
            continue
        sends, recvs = node.args[0], node.args[2]
        outs = sorted(node.users, key=lambda u: u.args[1])  # type: ignore[arg-type, return-value]
        if [o.target for o in outs] != [operator.getitem] * (len(sends) + len(recvs)):  # type: ignore[arg-type]
            raise decline(f"internal: {node.name} outputs are not all unpacked")
        if any(waited.get(out) != 1 for out in outs):
            raise decline(f"internal: an output of {node.name} is not waited exactly once")
        if any(waited.get(buf, 0) < 1 for buf in sends):  # type: ignore[union-attr]
            raise decline(f"internal: a send buffer of {node.name} is released before its wait")
    for old, new in rw.replace.items():
        a, b = old.meta.get("val"), new.meta.get("val")
        if (
            not isinstance(a, torch.Tensor)
            or not isinstance(b, torch.Tensor)
            or (a.shape != b.shape or a.dtype != b.dtype or a.device != b.device)
        ):
            raise decline(f"internal: replacement of {old.name} changes its value's shape/dtype")


def check_committed(rw: Rewrite, graph: Graph) -> None:
    """After commit: the graph is well formed and the site's collectives are gone."""
    graph.lint()
    site = rw.site
    anchors = getattr(site, "gathers", None) or [getattr(site, "reduce_scatter", None)]
    if any(node is not None and not node._erased for node in anchors):
        raise decline("internal: a rewritten site still has its collective")
    dead = [n.name for n in rw.created if not n.users and n.target is not c10d.wait_tensor.default]
    if dead:
        raise decline(f"internal: the rewrite computes values nothing reads: {dead}")
