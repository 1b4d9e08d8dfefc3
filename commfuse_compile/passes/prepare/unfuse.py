"""Fused projections, split into one matmul per part, where the parts meet all-to-alls.

A fused q/k/v projection computes one product and splits its columns among three
all-to-alls; its backward concatenates the three all-to-alls' results on a dim the
matmuls then contract (the input gradient) or keep (the weight gradient). No block of
one all-to-all is a block of such a matmul. Split along the same dims, each part is a
matmul of its own, which the all-to-all's site rewrites:

* ``split(view(X @ W), sizes, -1)[i]`` is ``view(X @ W[:, part i])``;
* ``view(cat(C_i, -1)) @ W`` is ``sum_i C_i @ W[rows of part i]`` (summed in part order);
* ``t(view(cat(C_i, -1))) @ X`` is ``cat_i(t(C_i) @ X, 0)``.

Each output element is the same dot product (a contracted one summed by parts); the FLOPs
are the same. Nothing here runs unless every part meets an all-to-all, and a graph where
no site is then rewritten is restored as it came (``pipeline._rewrite``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node

from ..fx.collectives import ALL_TO_ALL
from ..fx.declines import Declined
from ..fx.graph import LAYOUT_OPS, VIEWS, data_users, is_transpose_2d, val
from ..fx.matmuls import Matmul
from ..kit.blocks import can_view
from ..kit.emit import Emitter, fake_eval

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


Change = Callable[[], None]  # called before the graph is first changed


def split_fused_projections(graph: Graph, before_change: Change) -> bool:
    """Split every fused projection whose parts all meet all-to-alls; did any change?"""
    if not graph.find_nodes(op="call_function", target=ALL_TO_ALL):
        return False
    changed = False
    for target in SPLITS:
        for split in graph.find_nodes(op="call_function", target=target):
            changed |= _split(_split_product, graph, split, before_change)
    for cat in graph.find_nodes(op="call_function", target=aten.cat.default):
        changed |= _split(_split_concatenation, graph, cat, before_change)
    return changed


def _split(
    how: Callable[[Graph, Node, Change], bool], graph: Graph, node: Node, before_change: Change
) -> bool:
    """``how`` on ``node``; a node whose neighbours carry no fake values is left alone
    (the sites there are declined for it, with the reason)."""
    try:
        return how(graph, node, before_change)
    except Declined:
        return False


# ----------------------------------------------------------------------------------------
# forward: a product split on its columns


def _split_product(graph: Graph, split: Node, before_change: Change) -> bool:
    parts = _last_dim_parts(split)
    if parts is None:
        return False
    getitems, sizes = parts
    views, mm = _views_back_to_matmul(split.args[0])  # type: ignore[arg-type]
    if mm is None or not all(_meets_all_to_all(g, forward=True) for g in getitems):
        return False
    shape = list(val(split.args[0]).shape)  # type: ignore[arg-type]
    if not all(isinstance(size, int) for size in shape):
        return False
    before_change()
    emit = _Emitter(graph, before=split)
    for getitem, (start, size) in zip(getitems, _offsets(sizes), strict=True):
        w = emit(aten.slice.Tensor, (mm.b, 1, start, start + size))
        if mm.bias is None:
            part = emit(aten.mm.default, (mm.a, w))
        else:
            bias = emit(aten.slice.Tensor, (mm.bias, -1, start, start + size))
            part = emit(aten.addmm.default, (bias, mm.a, w), dict(mm.node.kwargs))
        part = emit(aten.view.default, (part, [*shape[:-1], size]))
        readers = list(getitem.users)
        getitem.replace_all_uses_with(part)
        emit.refresh(readers)
    _erase_dead(graph, [*getitems, split, *views, mm.node])
    return True


def _last_dim_parts(split: Node) -> tuple[list[Node], list[int]] | None:
    """(the split's getitems in order, their sizes) if it splits the last dim in int sizes."""
    value = val(split.args[0])  # type: ignore[arg-type]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if value.dim() < 2 or dim not in (-1, value.dim() - 1):
        return None
    parts = list(split.meta.get("val", ()))
    sizes = [p.shape[-1] for p in parts]
    if not all(isinstance(s, int) for s in sizes) or len(sizes) < 2:
        return None
    getitems = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if set(getitems) != set(range(len(sizes))):
        return None
    return [getitems[i] for i in range(len(sizes))], sizes


def _views_back_to_matmul(node: Node) -> tuple[list[Node], Matmul | None]:
    """The views from a 2-D matmul's product to ``node`` that keep its columns last."""
    views: list[Node] = []
    while node.target in VIEWS and len(data_users(node)) == 1:
        source: Node = node.args[0]  # type: ignore[assignment]
        if val(source).shape[-1] != val(node).shape[-1]:
            return views, None
        views.append(node)
        node = source
    mm = Matmul.of(node)
    if mm is None or len(data_users(node)) != 1 or val(node).dim() != 2:
        return views, None
    return views, mm


# ----------------------------------------------------------------------------------------
# backward: a concatenation the matmuls contract or keep


def _split_concatenation(graph: Graph, cat: Node, before_change: Change) -> bool:
    inputs: list[Node] = list(cat.args[0])  # type: ignore[arg-type]
    value = val(cat)
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if value.dim() < 2 or dim not in (-1, value.dim() - 1) or len(inputs) < 2:
        return False
    sizes = [val(c).shape[-1] for c in inputs]
    if not all(isinstance(s, int) for s in sizes):
        return False
    if not all(_meets_all_to_all(c, forward=False) for c in inputs):
        return False
    found = _matmuls_of_concatenation(cat)
    if found is None:
        return False
    views, uses = found
    before_change()
    first = _Emitter(graph, before=min((mm.node for mm, _ in uses), key=lambda n: n._sort_key))
    parts2d = [first.view(c, [-1, s]) for c, s in zip(inputs, sizes, strict=True)]
    for mm, form in uses:
        emit = _Emitter(graph, before=mm.node)  # where its other operand is computed
        pieces = []
        for part, (start, size) in zip(parts2d, _offsets(sizes), strict=True):
            if form == "contract":  # P2d @ W: W's rows of the part
                w = emit(aten.slice.Tensor, (mm.b, 0, start, start + size))
                pieces.append(emit(aten.mm.default, (part, w)))
            elif form == "contract_right":  # Y @ t(P2d): Y's columns of the part
                y = emit(aten.slice.Tensor, (mm.a, 1, start, start + size))
                pieces.append(emit(aten.mm.default, (y, emit.transpose(part))))
            elif form == "rows":  # t(P2d) @ X
                pieces.append(emit(aten.mm.default, (emit.transpose(part), mm.b)))
            else:  # "columns": Y @ P2d
                pieces.append(emit(aten.mm.default, (mm.a, part)))
        if form.startswith("contract"):
            total = pieces[0]
            for piece in pieces[1:]:
                total = emit(aten.add.Tensor, (total, piece))
        else:
            total = emit(aten.cat.default, (pieces, 0 if form == "rows" else 1))
        mm.node.replace_all_uses_with(total)
    _erase_dead(graph, [*(mm.node for mm, _ in uses), *views, cat])
    return True


def _matmuls_of_concatenation(cat: Node) -> tuple[list[Node], list[tuple[Matmul, str]]] | None:
    """(views and transposes in between, each matmul with how it reads the concatenation
    viewed 2-D P2d), if matmuls without bias are all that read it."""
    views: list[Node] = []
    uses: list[tuple[Matmul, str]] = []
    frontier = [cat]
    while frontier:
        node = frontier.pop()
        for user in data_users(node):
            mm = Matmul.of(user)
            if user.target in VIEWS and val(user).shape[-1] == val(node).shape[-1]:
                views.append(user)
                frontier.append(user)
            elif mm is not None and mm.bias is None and val(node).dim() == 2:
                uses.append((mm, "contract" if mm.a is node else "columns"))
            elif is_transpose_2d(user) and node is not cat and val(node).dim() == 2:
                views.append(user)
                for consumer in data_users(user):
                    mm = Matmul.of(consumer)
                    if mm is None or mm.bias is not None:
                        return None
                    uses.append((mm, "rows" if mm.a is user else "contract_right"))
            else:
                return None
    return (views, uses) if uses else None


# ----------------------------------------------------------------------------------------
# helpers


def _meets_all_to_all(node: Node, forward: bool) -> bool:
    """Does ``node`` reach an all-to-all (its input, ``forward``) or come from one (its
    wait) through layout ops alone?"""
    frontier, seen = [node], set()
    while frontier:
        current = frontier.pop()
        if current.target is ALL_TO_ALL:
            return True
        if current in seen:
            continue
        seen.add(current)
        if forward:
            frontier += [u for u in current.users if u.target in (*LAYOUT_OPS, ALL_TO_ALL)]
        elif current.target in (*LAYOUT_OPS, c10d.wait_tensor.default):
            frontier += current.all_input_nodes
    return False


def _offsets(sizes: Sequence[int]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes, strict=True))


def _erase_dead(graph: Graph, nodes: Sequence[Node]) -> None:
    for node in sorted(set(nodes), key=lambda n: n._sort_key, reverse=True):
        if not node.users:
            graph.erase_node(node)


class _Emitter:
    """New nodes before one node, each with its fake value (``emit.Emitter``), and the
    views and fake values the splitting needs."""

    def __init__(self, graph: Graph, before: Node) -> None:
        fake_mode = detect_fake_mode([val(before.all_input_nodes[0])])
        assert fake_mode is not None, "graphs the pass sees carry fake values"
        self.emit = Emitter(graph, before, fake_mode)

    def __call__(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> Node:
        return self.emit.add_node(target, args, kwargs)

    def view(self, node: Node, shape: list[int]) -> Node:
        """``node`` viewed as ``shape``, copied first where its strides forbid it."""
        with self.emit.fake_mode:
            if not can_view(val(node), shape):
                node = self(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
        return self(aten.view.default, (node, shape))

    def transpose(self, node: Node) -> Node:
        return self(aten.permute.default, (node, [1, 0]))

    def refresh(self, readers: Sequence[Node]) -> None:
        """Recompute the fake values of ``readers`` and of what they feed, for as long as
        they change: a part is now contiguous where the split's was a strided view, and a
        compiler below lays buffers out by these values."""
        stack = list(readers)
        while stack:
            node = stack.pop()
            if node.op != "call_function" or "val" not in node.meta:
                continue
            new = fake_eval(self.emit.fake_mode, node.target, node.args, node.kwargs)  # type: ignore[arg-type]
            old = node.meta["val"]
            if _same_layout(old, new):
                continue
            node.meta["val"] = new
            stack += node.users


def _same_layout(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b, strict=True))
    return a == b
