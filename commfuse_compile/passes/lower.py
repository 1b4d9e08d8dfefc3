"""Lower stage: a site's kind emits its schedule as P2P steps, one partial matmul per
step (``kinds/`` on the ring core, ``ring.py``); what every kind needs around that
(where the new nodes go, their fake mode, the sizes dynamic shapes read) is here."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node

from ..runtime.groups import Group
from ..schedules import Schedule
from .fx.declines import decline
from .fx.graph import SIZE_READERS, in_graph_order, val
from .kinds import of
from .kit.emit import Emitter
from .kit.rewrite import Rewrite, Taken
from .kit.site import Site


def start(
    site: Site, site_id: str, tag: int, graph: Graph, taken: Taken, timed: bool = False
) -> Rewrite:
    """An empty rewrite of ``site``: where its nodes go, and the fake mode of their values.
    The kind may leave some of the site's matmuls out (``rw.site`` says which are in)."""
    site, before = of(site).start(site, taken)
    fake_mode = detect_fake_mode([val(site.anchor.args[0])])  # type: ignore[arg-type]
    if fake_mode is None:
        raise decline("lower.not_fake")
    return Rewrite(site, site_id, tag, Emitter(graph, before, fake_mode, site_id), timed)


def lower(rw: Rewrite, group: Group, schedule: Schedule, slices: int = 2) -> None:
    """Emit ``rw.site`` as ``schedule`` for this rank of ``group``."""
    of(rw.site).lower(rw, rw.site, group, schedule, slices)
    _keep_size_readers(rw, rw.site.replaced())


def _keep_size_readers(rw: Rewrite, nodes: Sequence[Node]) -> None:
    """Dynamic-shape graphs read sizes of the nodes the commit erases (``sym_size``): a
    size computation that only feeds erased nodes goes with them; a size reader that
    something else uses is recomputed from the graph's inputs, where it stands (unless
    the kind replaced it: a size no input holds, from ``.tolist()``). Only the sizes next
    to the erased nodes are looked at."""
    erased: set[Node] = set()
    for node in reversed(in_graph_order(nodes)):
        if node in rw.replace or all(u in erased or _is_size(u) for u in node.users):
            erased.add(node)
    replaced = set(rw.replace)  # their readers follow the replacement, of the same shape
    for node in reversed(in_graph_order(_sizes_around(erased))):
        if node in erased or node in rw.replace or node.op != "call_function":
            continue
        reads = set(node.all_input_nodes) & erased
        if all(u in erased for u in node.users) and (node.users or reads):
            erased.add(node)
            rw.erases(node)
        elif reads - replaced:
            if node.target not in SIZE_READERS:
                raise decline("size.computed", node=node.name)
            value = node.meta["val"]
            if not isinstance(value, torch.SymInt):
                raise decline("size.not_symint", node=node.name)
            new = rw.emit.compute_size(value, step=0, before=node)
            if not isinstance(new, Node):
                raise decline("size.constant", node=node.name)
            rw.replaces(node, new)


def _sizes_around(erased: set[Node]) -> set[Node]:
    """Size computations that read an erased node, and those feeding erased nodes only
    (transitively: a size whose every reader is such a size)."""
    found = {u for node in erased for u in node.users if u not in erased and _is_size(u)}
    stack = [i for node in erased for i in node.all_input_nodes if _is_size(i)]
    while stack:
        node = stack.pop()
        if node in found or node in erased:
            continue
        if all(u in erased or u in found for u in node.users):
            found.add(node)
            stack += [i for i in node.all_input_nodes if _is_size(i)]
    return found


def _is_size(node: Node) -> bool:
    """Does ``node`` compute a size (an int or SymInt), not a tensor?"""
    value = node.meta.get("val")
    return isinstance(value, int | torch.SymInt | torch.SymBool) and not node.is_impure()
