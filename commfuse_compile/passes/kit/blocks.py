"""Block maths: the pieces of a matmul that one step of a decomposed collective
computes, and the views and copies that cut its operands into blocks.

Each helper emits through an ``Emitter`` (``emit.py``) and returns the new node; none
decides where a block goes or when it travels (that is the ring's, ``ring.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._prims_common import is_contiguous_or_false
from torch.fx import Node

from ..fx import dims
from ..fx.declines import decline
from ..fx.graph import CONVERT, VIEWS, cast_to, split_dim_in_input, val
from ..fx.matmuls import Matmul, varies_by_row
from .emit import Emitter

aten = torch.ops.aten


# a block's rows of a tensor laid out like a matmul's A (its [M, c] rows), as a site
# kind cuts them: applied to A's per-row scale the way the kind cut A
Rows = Callable[[Node], Node]


# [start, end) along a dim
Span = tuple[dims.Size, dims.Size]


def multiply(
    em: Emitter,
    mm: Matmul,
    a: Node,
    b: Node,
    step: int,
    rows: Rows | None = None,
    cols: tuple[int, dims.Size] | None = None,
    span: Span | None = None,
    offs: Node | None = None,
) -> Node:
    """One block of ``mm``'s product, by ``mm``'s own op: ``a``, the block's rows of A (cut
    by ``rows``, or all of them), times ``b``, its columns of B (block ``cols`` = (index,
    width), or the columns ``span``; or all); a grouped matmul's ``offs``, the block's
    (``paths.clip_offs_to_span``). What goes with an operand follows it: the bias and B's
    per-column scale take the block's columns, A's per-row scale its rows; a per-tensor
    scale and a row-broadcast bias are shared by every block."""
    bias, scale_a, scale_b = mm.bias, mm.scale_a, mm.scale_b
    if cols is not None:
        span = (cols[0] * cols[1], (cols[0] + 1) * cols[1])
    if span is not None:
        bias = bias and slice_column_span(em, bias, span, step)
        scale_b = scale_b and slice_column_span(em, scale_b, span, step)
    if rows is not None and scale_a is not None and varies_by_row(scale_a):
        scale_a = _make_per_row_scale(em, rows(scale_a), step)
    given = {} if offs is None else {"offs": offs}
    args, kwargs = mm.args(a, b, bias=bias, scale_a=scale_a, scale_b=scale_b, **given)
    return _emit_matmul(em, mm, args, kwargs, step)


def _make_per_row_scale(em: Emitter, scale: Node, step: int) -> Node:
    """A block's per-row scale, [rows, 1], with strides (1, 1): the CPU kernel checks the
    size-1 dim's stride too, and Inductor lays a view of a copy out with stride 0 there."""
    scale = make_contiguous(em, scale, step)
    sizes = [em.compute_size(size, step) for size in val(scale).shape]
    return em(aten.as_strided.default, (scale, sizes, [1, 1]), step=step, lane="compute")


def _emit_matmul(
    em: Emitter, mm: Matmul, args: tuple[Any, ...], kwargs: dict[str, Any], step: int
) -> Node:
    """The block's matmul node. A scaled matmul's kernel may refuse a block the whole
    passed (CUDA's takes only dims divisible by 16, B column-major): declined then."""
    try:
        return em(mm.node.target, args, kwargs, step=step, lane="compute")  # type: ignore[arg-type]
    except RuntimeError as err:  # torch._check's error in the op's meta function
        if not mm.scaled:
            raise
        raise decline("lower.scaled_block", node=mm.node.name, error=err) from None


def chunk_width(width: dims.Size, k: int, what: str) -> dims.Size:
    if not dims.divisible(width, k):
        provably = " provably" if dims.is_symbolic([width]) else ""
        raise decline("lower.slices", k=k, provably=provably, what=what, size=width)
    return width // k


def slice_block(
    em: Emitter, node: Node, dim: int, index: int, width: dims.Size, step: int, lane: str
) -> Node:
    return slice_span(em, node, dim, (index * width, (index + 1) * width), step, lane)


def slice_span(em: Emitter, node: Node, dim: int, span: Span, step: int, lane: str) -> Node:
    bounds = tuple(em.compute_size(bound, step) for bound in span)
    return em(aten.slice.Tensor, (node, dim, *bounds), step=step, lane=lane)


def pack(em: Emitter, data: Node, scale: Node, step: int) -> Node:
    """One message of ``data`` (one-byte elements: float8) and its ``scale`` (float32):
    their bytes, the data's first (its kernels' pointer stays aligned; the scale's stays
    aligned while the data's bytes are a multiple of 16, ``unpack``)."""
    parts = []
    for node in (data, scale):
        node = make_contiguous(em, node, step)
        if val(node).dtype != torch.uint8:
            node = em(aten.view.dtype, (node, torch.uint8), step=step, lane="comm")
        parts.append(em(aten.view.default, (node, [-1]), step=step, lane="comm"))
    return em(aten.cat.default, (parts, 0), step=step, lane="comm")


def unpack(em: Emitter, message: Node, data: Node, scale: Node, step: int) -> tuple[Node, Node]:
    """A message ``pack`` made, as tensors like ``data`` and ``scale``: the data a view of
    it, the scale (a few bytes) copied into its own buffer."""
    nbytes = math.prod(val(data).shape)
    end = val(message).shape[0]
    out = []
    for node, bounds in ((data, (0, nbytes)), (scale, (nbytes, end))):
        part = em(
            aten.slice.Tensor, (message, 0, *(em.compute_size(b, step) for b in bounds)), step=step,
            lane="compute",
        )  # fmt: skip
        dtype = val(node).dtype
        if dtype != torch.uint8:
            part = em(aten.view.dtype, (part, dtype), step=step, lane="compute")
        out.append(view(em, part, val(node).shape, step))
    copy = em(aten.clone.default, (out[1],), step=step, lane="compute")
    return out[0], copy


def slice_row_block(em: Emitter, span: Span, step: int, dim: int = 0) -> Rows:
    """Cuts the rows ``span`` of a 2-D tensor (a block of A's rows, and so of its
    per-row scale), or along ``dim`` (M of a batched A)."""
    return functools.partial(slice_span, em, dim=dim, span=span, step=step, lane="compute")


def make_contiguous(em: Emitter, node: Node, step: int) -> Node:
    value = val(node)
    symbolic = dims.is_symbolic([*value.shape, *value.stride()])
    if is_contiguous_or_false(value) if symbolic else value.is_contiguous():
        return node
    return em(
        aten.clone.default,
        (node,),
        {"memory_format": torch.contiguous_format},
        step=step,
        lane="compute",
    )


def transpose(em: Emitter, node: Node, step: int) -> Node:
    # permute, not t: the graphs Inductor compiles have t decomposed
    return em(aten.permute.default, (node, [1, 0]), step=step, lane="compute")


def slice_column_block(em: Emitter, node: Node, b: int, width: dims.Size, step: int) -> Node:
    """Columns [b*width, (b+1)*width) of ``node`` (kept whole if broadcast along them)."""
    return slice_column_span(em, node, (b * width, (b + 1) * width), step)


def slice_column_span(em: Emitter, node: Node, span: Span, step: int) -> Node:
    """The columns ``span`` of ``node`` (kept whole if broadcast along them)."""
    if val(node).dim() == 0 or dims.equal(val(node).shape[-1], 1):
        return node
    return slice_span(em, node, -1, span, step, "compute")


def accumulate(
    em: Emitter,
    mm: Matmul,
    total: Node | None,
    a: Node,
    b: Node,
    step: int,
    offs: Node | None = None,
) -> Node:
    """``total + a @ b``, ``a @ b`` one block of ``mm``'s contracting dim: one addmm in
    float32/64; half-precision partials are summed in float32 (as one matmul would
    accumulate them), see ``finish_sum``; a scaled matmul's partial is computed in float32
    (its scales, which the contracting dim does not cut, applied) and summed so; a grouped
    one's by its own op with ``offs`` (bfloat16 only), each partial summed in float32."""
    batched = mm.lead > 0
    product = aten.bmm.default if batched else aten.mm.default
    add_product = aten.baddbmm.default if batched else aten.addmm.default
    if mm.form.offs is not None:
        args, kwargs = mm.args(a, b, offs=offs)
        part = em(CONVERT, (_emit_matmul(em, mm, args, kwargs, step), torch.float32),
                  step=step, lane="compute")  # fmt: skip
    elif mm.scaled:
        args, kwargs = mm.args(a, b, bias=None, scale_result=None, out_dtype=torch.float32)
        part = _emit_matmul(em, mm, args, kwargs, step)
    elif val(a).dtype in (torch.float32, torch.float64):
        if total is None:
            return em(product, (a, b), step=step, lane="compute")
        return em(add_product, (total, a, b), step=step, lane="compute")
    else:
        part = em(product, (a, b), step=step, lane="compute")
        part = em(CONVERT, (part, torch.float32), step=step, lane="compute")
    if total is None:
        return part
    return em(aten.add.Tensor, (total, part), step=step, lane="compute")


def finish_sum(em: Emitter, total: Node, like: Node, step: int) -> Node:
    if val(total).dtype == val(like).dtype:
        return total
    return em(CONVERT, (total, val(like).dtype), step=step, lane="compute")


def view(em: Emitter, node: Node, shape: Sequence[dims.Size], step: int) -> Node:
    """``node`` viewed as ``shape``, copied first where its strides forbid the view."""
    if dims.same_shape(val(node).shape, shape):
        return node
    with em.fake_mode:
        if not can_view(val(node), shape):
            node = make_contiguous(em, node, step)
    return em(aten.view.default, (node, em.compute_shape(shape, step)), step=step, lane="compute")


def slice_rows_of_block(
    em: Emitter, x: Node, dim: int, b: int, width: dims.Size, step: int
) -> Node:
    """Block ``b`` along ``dim`` of ``x`` (shaped lead + [K]), as contiguous 2-D rows."""
    rows = make_contiguous(em, slice_block(em, x, dim, b, width, step, "compute"), step)
    k = val(rows).shape[-1]
    return view(em, rows, [val(rows).numel() // k, k], step)


def replay(
    em: Emitter,
    block: Node,
    chain: Sequence[tuple[Node, int]],
    split: dims.Split,
    b: int,
    step: int,
    lane: str,
) -> Node:
    """``chain`` (layout ops and casts, each with the dim of its output that holds the n
    blocks of ``split``) applied to block ``b`` instead of the whole tensor: the same
    permutes and casts, and views with that dim's size the block's share of it (copying
    first where the block's strides forbid one)."""
    for node, dim in chain:
        shape: list[dims.Size] = list(val(node).shape)
        if node.target in VIEWS:
            shape[dim] = split.width(shape[dim], b)
            with em.fake_mode:
                if not can_view(val(block), shape):
                    block = make_contiguous(em, block, step)
            block = em(
                aten.view.default, (block, em.compute_shape(shape, step)), step=step, lane=lane
            )
        elif node.target in (aten.clone.default, aten.alias.default):
            block = make_contiguous(em, block, step)
        elif (dtype := cast_to(node)) is not None:
            block = em(CONVERT, (block, dtype), step=step, lane=lane)
        else:  # a permute or transpose, written as a permute
            perm = [split_dim_in_input(node, d, split) for d in range(len(shape))]
            block = em(aten.permute.default, (block, perm), step=step, lane=lane)
    return block


def can_view(value: torch.Tensor, shape: Sequence[Any]) -> bool:
    try:
        value.view(dims.sizes(shape))
    except (RuntimeError, ValueError):  # a fake tensor's view raises ValueError
        return False
    return True
