"""Canonical form before matching: the in-place c10d spellings, and the collectives
frameworks wrap in custom ops, read as the functional one.

A framework's custom op that computes a collective (DeepSpeed's
``deepspeed::dim_zero_all_to_all``; the table and the ops users register:
``custom_ops.py``) is replaced by that functional collective and its ``wait_tensor``,
first, so that what follows reads it as any other collective.

Training code written as Megatron-LM and DeepSpeed write it calls the in-place c10d API
into a preallocated buffer (``out = torch.empty(...)``, then
``dist.all_gather_into_tensor(out, x)``, ``dist.reduce_scatter_tensor(out, y)`` or
``dist.all_to_all_single(out, x)``; ``dist.all_gather(list_of_buffers, x)`` then
``torch.cat``). Dynamo traces each into the functional collective followed by a copy of
its value into the fresh buffer:

    copy(empty([...]), wait_tensor(all_gather_into_tensor(x, n, group)))
    cat([copy(empty_like(x), slice(w, 0, 0, s)), copy(empty_like(x), slice(w, 0, s, 2s)), ...])

An in-place ``dist.all_reduce(y)`` traces as ``copy(y, wait_tensor(all_reduce(y, ...)))``:
the result written back over its own operand.

Such a copy preserves the value (same sizes, strides, dtype and device; the buffer read by
nothing else), so it *is* the collective's value: here it is replaced by that value, a
``cat`` of consecutive slices that cover a gathered tensor by the tensor, and the buffers
left unread are dropped. Every site kind then matches these graphs as it matches the
functional spelling, with no pattern per spelling.

A copy into a buffer that lives on (a graph input: Megatron-LM gathers into a persistent
global buffer; the eager inner compiler's graphs return ``copy(buffer, value)`` for the
runtime to write back, and read it) stays for the graph's output; its other readers read
the collective's value. The copy is then one more reader of the site's collected tensor,
which the site rebuilds from the ring's blocks for it (as Inductor's graphs, which write
the buffer with ``copy_(buffer, value)``, already read it). (``async_op=True`` with ``.wait()`` is
a graph break in torch 2.13: that collective runs outside any compiled graph.)

A copy into a *view* of a buffer (Megatron-Core's global memory buffer hands out
``buffer[0:numel].view(shape)``) is functionalized as a write of the value into a region
of the buffer, and the matmul reads that region back:

    slice_scatter(buffer, view(copy(view(slice(buffer, 0, 0, k)), w)), 0, 0, k)
    mm(view(slice(slice_scatter(...), 0, 0, k)), weight)

The copy is the value as above; the read-back of exactly the region written is the value
written (``slice(slice_scatter(b, src, R), R) == src``, also past writes into regions
disjoint from R), so the matmul reads the collective's value and the ``slice_scatter``
stays, one more reader of it. Copies left unread are dropped with the views of the
buffer they wrote into. A read of a region that only overlaps the one written is left
as it is: the site kinds decline it (``ag.buffer_region``).

A matmul that ignores an operand does not read the buffer region it is given: with
``beta=0``, ``addmm``, ``baddbmm`` and ``addbmm`` ignore their input (torch's documented
semantics: not read, NaN and inf not propagated). Megatron-Core's attention hands
``baddbmm(buffer_region, q, k, beta=0.0)`` a region of the same global buffer the
column-parallel linear gathered into, as a preallocated output, overlapping the region
written. That operand is replaced by a new tensor of its layout (``empty_strided``): the
same result, and the buffer is no longer read there.

Only such custom ops, copies of a collective's result (or of slices or views of it),
read-backs of one and operands a matmul ignores are touched; the pipeline restores the
graph as it came when no site is then rewritten.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._guards import detect_fake_mode
from torch._prims_common import is_contiguous_or_false
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx import custom_ops, dims
from ..fx.collectives import WAIT_TENSOR
from ..fx.graph import SLICE_ARGS, SLICE_SCATTER, VIEWS, Region, node_arg, region, val, writes_into
from ..kit.emit import Emitter

aten = torch.ops.aten
COPIES = frozenset({aten.copy.default, aten.copy_.default})
# collectives whose in-place c10d spelling writes the result over the operand
IN_PLACE = frozenset({torch.ops._c10d_functional.all_reduce.default})
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
# pure: dropped when nothing reads them any more
UNREAD_DROPPED = FRESH | VIEWS | {aten.copy.default, aten.slice.Tensor}
# matmuls whose input operand (args[0]) is not read when their ``beta`` is 0
IGNORE_INPUT_AT_BETA_0 = frozenset({aten.addmm.default, aten.baddbmm.default, aten.addbmm.default})

Change = Callable[[], None]


def canonicalize(graph: Graph, before_change: Change) -> bool:
    """Replace every call of a custom op known to compute a collective by that functional
    collective (``_make_functional``); then every value-preserving copy of a collective's
    result, and every ``cat`` that reassembles one from its slices, by the value itself
    (a copy into a buffer that lives on: in its readers but the output); then each
    buffer a ``beta=0`` matmul is given and ignores by a new tensor
    (``_give_fresh_input``); then every read-back of the region a collective's value was
    written into (``_read_back``) by that value. Did anything change?

    Two passes: a copy left unread is dropped in the first, with the views of the buffer
    it wrote into, so that the second rewrites reads, not the slices a later copy writes
    through (``copy(slice(buffer), gathered_2)``)."""
    changed = _make_functional(graph, before_change)
    for node in list(graph.nodes):
        value = _copied_value(node) if node.target in COPIES else _reassembled(node)
        if value is None:
            continue
        if node.target in COPIES and not _into_fresh(node):
            changed |= _read_as(graph, node, value, before_change)
            continue
        before_change()
        node.replace_all_uses_with(value)
        _drop_unread(graph, node)
        changed = True
    for node in list(graph.nodes):
        if _ignored_buffer_region(node):
            before_change()
            _give_fresh_input(graph, node)
            changed = True
    for node in list(graph.nodes):
        read_back = _read_back(node)
        if read_back is not None:
            value, part = read_back
            if part is not None:  # a part of the region written: that part of the value
                before_change()
                value = _slice_part(graph, node, value, part)
            changed |= _read_as(graph, node, value, before_change)
    return changed


def _make_functional(graph: Graph, before_change: Change) -> bool:
    """Replace each call of a known collective custom op that fits what it is said to
    compute by ``wait_tensor(collective(...))`` (one that does not stays, and is
    recorded: ``kinds/unclaimed.py``). Did anything change?"""
    changed = False
    for node in [n for n in graph.nodes if n.op == "call_function"]:
        entry = custom_ops.collective_of(node.target)
        call = custom_ops.functional(entry, node) if entry is not None else None
        if call is None or isinstance(call, str):
            continue
        before_change()
        em = Emitter(graph, node, detect_fake_mode([val(node)]))
        op, args = call
        args = tuple([em.compute_size(s, 0) for s in a] if isinstance(a, list) else a for a in args)
        waited = em.add_node(WAIT_TENSOR, (em.add_node(op, args),))
        node.replace_all_uses_with(waited)
        graph.erase_node(node)
        changed = True
    return changed


def _ignored_buffer_region(node: Node) -> bool:
    """Is ``node`` a matmul that ignores its input (``beta=0``), given (a region of) a
    buffer something was written into: a ``slice_scatter``, through slices and views
    (Inductor's clean-up leaves a view of the whole buffer)?"""
    if node.target not in IGNORE_INPUT_AT_BETA_0 or node.kwargs.get("beta", 1) != 0:
        return False
    source = node.args[0]
    while isinstance(source, Node) and (
        source.target in VIEWS or source.target is aten.slice.Tensor
    ):
        source = source.args[0]
    return isinstance(source, Node) and source.target is SLICE_SCATTER


def _give_fresh_input(graph: Graph, matmul: Node) -> None:
    """``matmul``'s ignored input replaced by a new tensor of its sizes, strides, dtype and
    device (``empty_like`` of it where a size is symbolic: that reads its sizes only);
    the region's slice and views go when nothing else reads them."""
    region_read = matmul.args[0]
    assert isinstance(region_read, Node)
    value = region_read.meta["val"]
    layout = (*value.shape, *value.stride())
    args: tuple[Any, ...] = (region_read,)
    target, kwargs = aten.empty_like.default, {}
    if all(isinstance(d, int) for d in layout):
        target, args = aten.empty_strided.default, (list(value.shape), list(value.stride()))
        kwargs = {"dtype": value.dtype, "device": value.device}
    fresh = Emitter(graph, matmul, detect_fake_mode([value])).add_node(target, args, kwargs)
    matmul.replace_input_with(region_read, fresh)
    _drop_unread(graph, region_read)


def _read_as(graph: Graph, node: Node, value: Node, before_change: Change) -> bool:
    """Let ``node``'s readers (but the output and writes into it) read ``value``, which
    equals it; drop ``node`` if nothing reads it then. Did anything change?"""
    readers = [u for u in node.users if u.op != "output" and not writes_into(u, node)]
    if not readers:
        return False
    before_change()
    for reader in readers:
        reader.replace_input_with(node, value)
    _drop_unread(graph, node)
    return True


def _drop_unread(graph: Graph, node: Node) -> None:
    """Erase ``node`` if nothing reads it, and so on up through the copies, views and
    fresh buffers it was made from (never a graph input, never a write in place)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.users or current.op != "call_function" or current.target not in UNREAD_DROPPED:
            continue
        stack += current.all_input_nodes
        graph.erase_node(current)


def _read_back(node: Node) -> tuple[Node, Region | None] | None:
    """``src`` of ``slice(slice_scatter(buffer, src, R), R)``: the region just written,
    read back, is ``src`` (a collective's value, as Megatron-LM's gather into its global
    buffer reads under the eager inner compiler), also through views that give the
    buffer its shape back and past writes into regions of the buffer disjoint from R
    (``slice(slice_scatter(b, x, R2), R)`` reads ``b``). A read of a part of R is that
    part of ``src`` (the part returned, as a region of ``src``); a read reaching past R
    reads the buffer's old bytes too and stays. A value whose layout a view of the slice
    might need is kept unless ``src`` is contiguous."""
    if node.target is not aten.slice.Tensor:
        return None
    read, scatter = region(node), _unviewed(node.args[0])
    while read is not None and scatter is not None and scatter.target is SLICE_SCATTER:
        written = region(scatter)
        if written is None or not (written.covers(read) or written.disjoint(read)):
            return None
        if written.disjoint(read):
            scatter = _unviewed(scatter.args[0])
            continue
        src = scatter.args[1]
        out, value = node.meta.get("val"), getattr(src, "meta", {}).get("val")
        if not isinstance(src, Node) or not _collective_value(src):
            return None
        if not isinstance(out, torch.Tensor) or not isinstance(value, torch.Tensor):
            return None
        if not (
            _equal(tuple(out.stride()), tuple(value.stride())) or is_contiguous_or_false(value)
        ):
            return None
        if written.same(read):
            return src, None
        # elements of src: a slice of it (its bounds as FX takes them: plain ints)
        bounds = (read.start - written.start, read.end - written.start, read.step)
        if not all(isinstance(b, int) for b in bounds) or not dims.equal(written.step, 1):
            return None
        return src, Region(read.dim, *bounds, written.end - written.start)
    return None


def _slice_part(graph: Graph, read: Node, src: Node, part: Region) -> Node:
    """A slice of ``src`` (of its ``part``), for ``read``, which reads that part of it."""
    args = (src, part.dim, part.start, part.end, part.step)
    return Emitter(graph, read, detect_fake_mode([val(src)])).add_node(aten.slice.Tensor, args)


def _unviewed(node: object) -> Node | None:
    """``node``, or what a chain of views that ends in its shape started from (views keep
    the elements' order: the round trip is the tensor itself)."""
    if not isinstance(node, Node):
        return None
    source = node
    while source.target in VIEWS and isinstance(source.args[0], Node):
        source = source.args[0]
    shape, start = node.meta.get("val"), source.meta.get("val")
    round_trip = (
        isinstance(shape, torch.Tensor)
        and isinstance(start, torch.Tensor)
        and shape.dtype == start.dtype
        and _equal(tuple(shape.shape), tuple(start.shape))
    )
    return source if round_trip else node


def _into_fresh(copy: Node) -> bool:
    """Is ``copy``'s buffer a new one that only this copy reads (dropped with it), or the
    operand of an in-place collective that nothing else reads (``dist.all_reduce(y)``
    traces as ``copy(y, wait_tensor(all_reduce(y)))``: y's old value is gone)?"""
    buffer, src = copy.args[:2]
    if not isinstance(buffer, Node):
        return False
    if buffer.target in FRESH:
        return list(buffer.users) == [copy]
    if copy.target is not aten.copy.default or buffer.op != "call_function":
        return False  # a write into a graph input (or through a view) is the program's
    if not isinstance(src, Node) or src.target is not WAIT_TENSOR:
        return False
    collective = src.args[0]
    return (
        isinstance(collective, Node)
        and collective.target in IN_PLACE
        and collective.args[0] is buffer
        and set(buffer.users) == {copy, collective}
    )


def _copied_value(copy: Node) -> Node | None:
    """``src`` of ``copy(buffer, src)`` when that copy is ``src``'s value: ``src`` is (a
    slice of) a waited collective and the copy's result has ``src``'s sizes, strides,
    dtype and device (no broadcast, no conversion, no other layout)."""
    buffer, src = copy.args[:2]
    if not isinstance(buffer, Node) or not isinstance(src, Node) or not _collective_value(src):
        return None
    out, value = copy.meta.get("val"), src.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(value, torch.Tensor):
        return None
    same = (out.dtype, out.device) == (value.dtype, value.device) and _equal(
        (*out.shape, *out.stride()), (*value.shape, *value.stride())
    )
    return src if same else None


def _reassembled(cat: Node) -> Node | None:
    """``w`` of ``cat([w[0:s], w[s:2s], ...], dim)``, or of ``cat(split(w, s, dim))``
    taken in order: the parts of one waited collective, read by nothing but the ``cat``,
    that cover it along ``dim``."""
    if cat.target is not aten.cat.default or not cat.args[0]:
        return None
    parts, dim = cat.args[0], node_arg(cat, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or not isinstance(dim, int):
        return None
    if not all(isinstance(p, Node) and len(p.users) == 1 for p in parts):
        return None
    found = [_part_of(p) for p in parts if isinstance(p, Node)]
    bounds = [b for b in found if b is not None]
    if len(bounds) != len(parts) or len({b.whole for b in bounds}) != 1:
        return None
    whole = bounds[0].whole
    value = whole.meta.get("val")
    if not _collective_value(whole) or not isinstance(value, torch.Tensor):
        return None
    end: object = 0
    for part in bounds:
        if part.dim % value.dim() != dim % value.dim() or not _equal((part.start,), (end,)):
            return None
        end = part.end
    return whole if _equal((end,), (value.shape[dim],)) else None


class _Part(NamedTuple):
    whole: Node
    dim: int
    start: object
    end: object


def _part_of(node: Node) -> _Part | None:
    """Which elements of which tensor ``node`` is: a slice with step 1, a split's part."""
    if node.target is aten.slice.Tensor and isinstance(node.args[0], Node):
        dim, start, end, step = (_value(node_arg(node, i, name, d)) for i, name, d in SLICE_ARGS)
        return (
            _Part(node.args[0], dim, start or 0, end)
            if isinstance(dim, int) and step == 1
            else None
        )
    split = node.args[0] if node.target is operator.getitem else None
    if isinstance(split, Node) and split.target is aten.split.Tensor:
        whole, size, dim = split.args[0], split.args[1], node_arg(split, 2, "dim", 0)
        index = node.args[1]
        if not all(isinstance(v, int) for v in (size, dim, index)) or not isinstance(whole, Node):
            return None
        value = whole.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return None
        full = value.shape[dim]
        end = (index + 1) * size  # type: ignore[operator]
        return _Part(whole, dim, index * size, end if statically_known_true(end <= full) else full)  # type: ignore[arg-type,operator]
    return None


def _value(arg: object) -> object:
    """A slice bound as a number: a size node's value."""
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def _collective_value(node: Node) -> bool:
    """Is ``node`` a waited collective's result, or a part (slice, split) or a view of
    one?"""
    while True:
        part = _part_of(node)
        if part is not None:
            node = part.whole
        elif node.target in VIEWS and isinstance(node.args[0], Node):
            node = node.args[0]
        else:
            return node.target is WAIT_TENSOR


def _equal(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Provably equal, element by element (sizes may be symbolic)."""
    return len(a) == len(b) and all(
        statically_known_true(x == y) for x, y in zip(a, b, strict=True)
    )  # type: ignore[arg-type]
