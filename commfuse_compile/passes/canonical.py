"""Canonical form before matching: the in-place c10d spellings read as the functional one.

Training code written as Megatron-LM and DeepSpeed write it calls the in-place c10d API
into a preallocated buffer (``out = torch.empty(...)``, then
``dist.all_gather_into_tensor(out, x)``, ``dist.reduce_scatter_tensor(out, y)`` or
``dist.all_to_all_single(out, x)``; ``dist.all_gather(list_of_buffers, x)`` then
``torch.cat``). Dynamo traces each into the functional collective followed by a copy of
its value into the fresh buffer:

    copy(empty([...]), wait_tensor(all_gather_into_tensor(x, n, group)))
    cat([copy(empty_like(x), slice(w, 0, 0, s)), copy(empty_like(x), slice(w, 0, s, 2s)), ...])

Such a copy preserves the value (same sizes, strides, dtype and device; the buffer read by
nothing else), so it *is* the collective's value: here it is replaced by that value, a
``cat`` of consecutive slices that cover a gathered tensor by the tensor, and the buffers
left unread are dropped. Every site kind then matches these graphs as it matches the
functional spelling, with no pattern per spelling. (``async_op=True`` with ``.wait()`` is
a graph break in torch 2.13: that collective runs outside any compiled graph.)

Only copies of a collective's result (or of slices of it) are touched; the pipeline
restores the graph as it came when no site is then rewritten.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .graph import SLICE_ARGS, node_arg

aten = torch.ops.aten
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
COPIES = frozenset({aten.copy.default, aten.copy_.default})
# a fresh buffer: allocated, never read before it is written whole
FRESH = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.empty_strided.default,
        aten.new_empty_strided.default,
    }
)

Change = Callable[[], None]


def canonicalize(graph: Graph, before_change: Change) -> bool:
    """Replace every value-preserving copy of a collective's result, and every ``cat``
    that reassembles one from its slices, by the value itself; did anything change?"""
    changed = False
    for node in list(graph.nodes):
        value = _copied_value(node) if node.target in COPIES else _reassembled(node)
        if value is None:
            continue
        before_change()
        buffers = [node.args[0]] if node.target in COPIES else []
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        for buffer in buffers:
            if isinstance(buffer, Node) and not buffer.users:
                graph.erase_node(buffer)
        changed = True
    return changed


def _copied_value(copy: Node) -> Node | None:
    """``src`` of ``copy(fresh, src)`` when that copy is ``src``'s value: ``src`` is (a
    slice of) a waited collective, ``fresh`` a new buffer only this copy reads, and the
    copy's result has ``src``'s sizes, strides, dtype and device (no broadcast, no
    conversion, no other layout)."""
    fresh, src = copy.args[:2]
    if not isinstance(fresh, Node) or not isinstance(src, Node):
        return None
    if fresh.target not in FRESH or list(fresh.users) != [copy] or not _collective_value(src):
        return None
    out, value = copy.meta.get("val"), src.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(value, torch.Tensor):
        return None
    same = (out.dtype, out.device) == (value.dtype, value.device) and _equal(
        (*out.shape, *out.stride()), (*value.shape, *value.stride())
    )
    return src if same else None


def _reassembled(cat: Node) -> Node | None:
    """``w`` of ``cat([w[0:s], w[s:2s], ...], dim)``: consecutive slices of one waited
    collective along ``dim`` that cover it, read by nothing but the ``cat``."""
    if cat.target is not aten.cat.default or not cat.args[0]:
        return None
    parts, dim = cat.args[0], node_arg(cat, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, Node) for p in parts):
        return None
    sources = {p.args[0] for p in parts if p.target is aten.slice.Tensor}
    if len(sources) != 1 or any(len(p.users) != 1 for p in parts):
        return None
    (whole,) = sources
    if not isinstance(whole, Node) or not _collective_value(whole):
        return None
    value = whole.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(dim, int):
        return None
    dim %= value.dim()
    end: object = 0
    for part in parts:
        if part.target is not aten.slice.Tensor:
            return None
        part_dim, start, stop, step = (
            _value(node_arg(part, i, name, d)) for i, name, d in SLICE_ARGS
        )
        if (
            not isinstance(part_dim, int)
            or part_dim % value.dim() != dim
            or step != 1
            or not _equal((start or 0,), (end,))
        ):
            return None
        end = stop
    return whole if _equal((end,), (value.shape[dim],)) else None


def _value(arg: object) -> object:
    """A slice bound as a number: a size node's value."""
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def _collective_value(node: Node) -> bool:
    """Is ``node`` a waited collective's result, or a slice of one?"""
    while node.target is aten.slice.Tensor and isinstance(node.args[0], Node):
        node = node.args[0]
    return node.target is WAIT_TENSOR


def _equal(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Provably equal, element by element (sizes may be symbolic)."""
    return len(a) == len(b) and all(
        statically_known_true(x == y) for x, y in zip(a, b, strict=True)
    )  # type: ignore[arg-type]
