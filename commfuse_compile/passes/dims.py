"""Dimension algebra: where does a collective's dim land in a matmul?

A chain of view/reshape ops between a tensor and a 2-D matmul operand is one reshape,
so only the two shapes matter. ``row_split`` finds how the tensor's dims fold into
the operand's rows and columns; a collective dim among the row dims means every block
of it is an independent set of rows of the product.

Sizes are ints or, under dynamic shapes, SymInts. Every comparison of sizes here is
decided from what the ShapeEnv already knows (``statically_known_true``): the pass never
adds a guard, so a fact it cannot prove counts as false and the site is declined.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

Size = int | torch.SymInt


def sizes(shape: Sequence[Size]) -> tuple[Size, ...]:
    """The sizes, SymInts kept only where the size is not a known constant."""
    return tuple(_plain(size) for size in shape)


def _plain(size: Size) -> Size:
    if isinstance(size, torch.SymInt):
        value = size.node.maybe_as_int()
        return size if value is None else value
    return int(size)


def is_symbolic(shape: Sequence[Size]) -> bool:
    return any(isinstance(_plain(size), torch.SymInt) for size in shape)


def equal(a: Size, b: Size) -> bool:
    """``a == b``, proven without a guard (a symbolic equality not provable is False)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return statically_known_true(a == b)
    return a == b


def same_shape(a: Sequence[Size], b: Sequence[Size]) -> bool:
    return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))


def divisible(size: Size, n: int) -> bool:
    """Is ``size`` a multiple of ``n``, for every value its symbols can take?"""
    if isinstance(size, torch.SymInt):
        return statically_known_true(size % n == 0)
    return size % n == 0


def hint(size: Size) -> int:
    """An int for the cost model: the size itself, or the hint of a symbolic size."""
    return optimization_hint(size) if isinstance(size, torch.SymInt) else int(size)


def as_json(shape: Sequence[Size]) -> list[int | str]:
    """The shape for the report: ints, and symbolic sizes as their expressions."""
    return [str(size) if isinstance(size, torch.SymInt) else size for size in sizes(shape)]


def row_split(shape: Sequence[Size], rows: Size, cols: Size) -> int | None:
    """Largest j such that shape[:j] folds into ``rows`` and shape[j:] into ``cols``."""
    for j in range(len(shape), -1, -1):
        if equal(math.prod(shape[:j]), rows) and equal(math.prod(shape[j:]), cols):
            return j
    return None


def outer_split(src: Sequence[Size], dim: int, dst: Sequence[Size], n: int) -> int | None:
    """A reshape of ``src`` into ``dst``: the dim of ``dst`` whose outermost ``n``-way split
    is that of ``src``'s ``dim`` (the same elements in the same n blocks), or None. Both
    dims start at the same offset (equal products before them) and ``n`` divides both."""
    if not divisible(src[dim], n):
        return None
    before = math.prod(src[:dim])
    for d in range(len(dst)):
        if equal(math.prod(dst[:d]), before) and divisible(dst[d], n) and not equal(dst[d], 1):
            return d
    return None
