"""A collective's n blocks followed through layout ops and casts, to the operand of the
matmul that reads them or from the product that computes them, and what one block of a
batched or grouped matmul computes there (the TP kinds' ``bmm`` and ``_grouped_mm``).

A path is the layout ops (views, permutes, transposes, copies) and dtype casts between
the collective and the matmul, each with the dim of its output that holds the n blocks:
the outermost n-way split of that dim (``dims.outer_split``), so that block b is one
slab of it at every step. At the matmul the dim says what a block is (``role``): A's
rows ("rows"), A's or B's contraction ("contract", "contract_k", "contract_left": a sum
of partial products) or B's columns ("columns"); a batch or group dim is no block.

A grouped matmul's groups stay whole under blocks of B's columns or of the contraction
of a [M, K] x [G, K, N] one, and under blocks of A's rows or B's columns of a
[M, K] x [K, N] -> [G, M, N] one. Its blocks along the dim ``offs`` cuts are groups of
their own: row q of A (or of the contraction) is in group g when
``offs[g-1] <= q < offs[g]``, so the rows [start, start + width) of a block are in its
groups by ``clamp(offs - start, 0, width)`` (``clip_offs_to_span``), the same rows by the
same weights: for 0 <= q' < width, ``clamp(o - start, 0, width) <= q'`` exactly when
``o <= start + q'``. Rows past ``offs[-1]`` are in no group in the block as in the whole.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx import dims
from ..fx.graph import (
    CONVERT,
    LAYOUT_OPS,
    TRANSPOSES,
    cast_to,
    data_users,
    node_arg,
    split_dim_in_input,
    split_dim_in_output,
    val,
)
from ..fx.matmuls import ANY_MATMUL, Layout, Matmul, is_matmul
from .blocks import Span, multiply, slice_column_span, slice_row_block, slice_span
from .emit import Emitter
from .ring import Products

aten = torch.ops.aten

Path = tuple[tuple[Node, int], ...]


def layout_or_cast(node: Node) -> bool:
    return node.target in LAYOUT_OPS or cast_to(node) is not None


def dim_after(user: Node, dim: int, split: dims.Split) -> int | None:
    """The dim of ``user``'s output that holds the blocks of ``split`` of its input's
    ``dim`` (a cast keeps it), or None."""
    return dim if cast_to(user) is not None else split_dim_in_output(user, dim, split)


def producer(node: Node, dim: int, split: dims.Split) -> tuple[Node, int, Path, Node | None]:
    """Back from ``node`` (its ``dim`` holding the blocks of ``split``) through single-user
    layout ops and casts: (the first node that is neither, the dim of it that holds the
    blocks, the path from it to ``node``, the op where the blocks stop being blocks, or
    None)."""
    path: list[tuple[Node, int]] = []
    while layout_or_cast(node) and len(data_users(node)) == 1:
        if cast_to(node) is not None:
            source_dim: int | None = dim
        else:
            source_dim = split_dim_in_input(node, dim, split)
        if source_dim is None:
            return node, dim, tuple(reversed(path)), node
        path.append((node, dim))
        node, dim = node_arg(node, 0, "self"), source_dim
    return node, dim, tuple(reversed(path)), None


def matmul_behind(node: Node) -> Node | None:
    """A matmul (of any form) whose product, or a sum of such products, ``node`` is
    behind layout ops and casts only; else None."""
    while layout_or_cast(node):
        node = node_arg(node, 0, "self")
    if is_matmul(node, ANY_MATMUL):
        return node
    if node.target is aten.add.Tensor and len(node.all_input_nodes) == 2:
        terms = [matmul_behind(arg) for arg in node.all_input_nodes]
        return terms[0] if all(terms) else None
    return None


def along(path: Path, dim: int, split: dims.Split) -> Path | None:
    """The same ops with the dims that hold the blocks of ``split`` (a site's path,
    followed for the n * k chunks of the sliced schedule) from ``dim`` of the first op's
    input, or None where they do not stay blocks."""
    steps = []
    for node, _ in path:
        moved = dim_after(node, dim, split)
        if moved is None:
            return None
        steps.append((node, moved))
        dim = moved
    return tuple(steps)


def role(mm: Matmul, operand: Node, dim: int, path: Path) -> str | None:
    """What a block along ``dim`` of ``operand`` (A or B of ``mm``) is, or None for a
    batch or group dim (or a matmul form no kind cuts). Blocks along A's contraction
    are "contract" where the path transposed them there (a weight gradient's ``G^T``),
    "contract_k" where they were the collected tensor's columns."""
    layout = mm.layout
    if layout is None:
        return None
    if operand is mm.a and dim == layout.a[0]:
        return "rows"
    if operand is mm.a and dim == layout.a[1]:
        return "contract" if any(node.target in TRANSPOSES for node, _ in path) else "contract_k"
    if operand is mm.b and dim == layout.b[0]:
        return "contract_left"
    if operand is mm.b and dim == layout.b[1]:
        return "columns"
    return None


def clip_offs_to_span(em: Emitter, offs: Node, span: Span, step: int) -> Node:
    """The group ends of the rows ``span`` (see the module's docstring), in the offsets'
    dtype (Inductor's lowering would promote them to int64)."""
    start, end = span
    shifted = em(aten.sub.Tensor, (offs, em.compute_size(start, step)), step=step, lane="compute")
    # (clamp as the graphs Inductor compiles spell it)
    low = em(aten.clamp_min.default, (shifted, 0), step=step, lane="compute")
    width = em.compute_size(end - start, step)
    clamped = em(aten.clamp_max.default, (low, width), step=step, lane="compute")
    return em(CONVERT, (clamped, val(offs).dtype), step=step, lane="compute")


def compute_block(
    em: Emitter,
    products: Products,
    i: int,
    mm: Matmul,
    use_role: str,
    block: Node,
    b: int,
    split: dims.Split,
    step: int,
) -> None:
    """What matmul ``i`` of ``products`` computes from ``block``, block ``b`` of ``split``
    of its operand in ``use_role``: a block of its product, or a partial product added
    (the all-to-all kinds' batched uses and the TP kinds' batched and grouped ones)."""
    layout = mm.layout
    assert layout is not None
    cut = _cut(layout, use_role)
    if use_role == "rows":
        span = split.bounds(val(mm.a).shape[layout.a[0]], b)
        rows = slice_row_block(em, span, step, dim=layout.a[0])
        offs = _clip_offs_if_cut(em, mm, cut, span, step)
        products.put(i, b, multiply(em, mm, block, mm.b, step, rows=rows, offs=offs))
    elif use_role == "columns":
        span = split.bounds(val(mm.b).shape[layout.b[1]], b)
        products.put(i, b, multiply(em, mm, mm.a, block, step, span=span))
    elif use_role == "contract_left":
        span = split.bounds(val(mm.b).shape[layout.b[0]], b)
        a = _slice_slab(em, mm.a, layout.a[1], span, step)
        products.add(i, a, block, step, offs=_clip_offs_if_cut(em, mm, cut, span, step))
    else:  # contract, contract_k: blocks of A's contraction
        span = split.bounds(val(mm.a).shape[layout.a[1]], b)
        w = slice_span(em, mm.b, layout.b[0], span, step, "compute")
        products.add(i, block, w, step, offs=_clip_offs_if_cut(em, mm, cut, span, step))


def compute_product_block(em: Emitter, mm: Matmul, columns: bool, span: Span, step: int) -> Node:
    """The rows ``span`` (with ``columns``: the columns) of every batch entry or group of
    ``mm``'s product, by its own op: a grouped matmul's rows with their own offsets (the
    blocks a product computes for a reduce-scatter or an all-to-all)."""
    layout = mm.layout
    assert layout is not None
    if columns:
        return multiply(em, mm, mm.a, slice_column_span(em, mm.b, span, step), step, span=span)
    rows = slice_row_block(em, span, step, dim=layout.a[0])
    offs = _clip_offs_if_cut(em, mm, layout.groups == "M", span, step)
    return multiply(em, mm, rows(mm.a), mm.b, step, rows=rows, offs=offs)


def _cut(layout: Layout, use_role: str) -> bool:
    """Do the blocks of ``use_role`` cut the groups (their own offsets)?"""
    contract = use_role.startswith("contract")
    return (layout.groups == "M" and use_role == "rows") or (layout.groups == "K" and contract)


def _clip_offs_if_cut(em: Emitter, mm: Matmul, cut: bool, span: Span, step: int) -> Node | None:
    """A grouped matmul's offsets for the block: its own where the block cuts the groups."""
    if mm.offs is None or not cut:
        return mm.offs
    return clip_offs_to_span(em, mm.offs, span, step)


def _slice_slab(em: Emitter, node: Node, dim: int, span: Span, step: int) -> Node:
    if dim == val(node).dim() - 1:
        return slice_column_span(em, node, span, step)
    return slice_span(em, node, dim, span, step, "compute")
