"""Where an all-gather -> matmul ring goes, and which matmuls it must leave out
to go there: before anything reads the gathered tensor or a product of the site,
after what its matmuls read, inside the window of a 2-D matmul split by another ring."""

from __future__ import annotations

import torch
from torch.fx import Node

from ...fx.declines import decline
from ...fx.graph import data_users, position
from ...kit.placement import hoistable
from ...kit.rewrite import Taken
from .site import AgMmSite, GatherUse

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


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


def placed(site: AgMmSite, taken: Taken) -> tuple[AgMmSite, Node]:
    """The site as its ring can run, and the node the ring goes before."""
    site = _nested_in_one_window(site, taken)
    site = site.without_own_result(_first_reader(site))
    site = _without_uses_read_too_late(site, taken)
    return site, _ring_place(site, taken)
