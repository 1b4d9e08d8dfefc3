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

import dataclasses
import itertools
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


def key(size: Size) -> object:
    """A hashable stand-in for a size (a SymInt is not hashable): the int, or the
    symbolic size's expression, equal for sizes the ShapeEnv simplifies alike."""
    size = _plain(size)
    return size.node.expr if isinstance(size, torch.SymInt) else size


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


@dataclasses.dataclass(frozen=True)
class Split:
    """A dim cut into ``n`` blocks, as an all-to-all cuts its dim 0: n equal blocks
    (``sizes`` None), or blocks of ``sizes`` (ints). Followed to a dim that holds the same
    blocks (through views and permutes), block b is the same share of it: ``sizes[b]``
    of their sum."""

    n: int
    sizes: tuple[int, ...] | None = None

    @classmethod
    def of(cls, sizes: Sequence[object]) -> Split | None:
        """The split an all-to-all's split sizes make: equal (one size n times, which may
        be symbolic), uneven ints, or None (sizes the graph computes that differ)."""
        if len({str(size) for size in sizes}) == 1:
            return cls(len(sizes))
        if all(isinstance(size, int) for size in sizes):
            return cls(len(sizes), tuple(sizes))  # type: ignore[arg-type]
        return None

    def bounds(self, size: Size, b: int) -> tuple[Size, Size]:
        """Block b's [start, end) along a dim of ``size`` that holds the n blocks."""
        if self.sizes is None:
            width = size // self.n
            return b * width, (b + 1) * width
        total, start = sum(self.sizes), sum(self.sizes[:b])
        return size * start // total, size * (start + self.sizes[b]) // total

    def width(self, size: Size, b: int) -> Size:
        start, end = self.bounds(size, b)
        return end - start

    def divides(self, size: Size) -> bool:
        """Does each block of a dim of ``size`` hold whole elements of it (provably)?"""
        if self.sizes is None:
            return divisible(size, self.n)
        total = sum(self.sizes)
        return all(divisible(size * start, total) for start in itertools.accumulate(self.sizes))


def outer_split(src: Sequence[Size], dim: int, dst: Sequence[Size], n: int) -> int | None:
    """``split_dim`` of n equal blocks."""
    return split_dim(src, dim, dst, Split(n))


def split_dim(src: Sequence[Size], dim: int, dst: Sequence[Size], split: Split) -> int | None:
    """A reshape of ``src`` into ``dst``: the dim of ``dst`` whose blocks of ``split`` are
    those of ``src``'s ``dim`` (the same elements in the same n blocks), or None. Both dims
    start at the same offset (equal products before them) and the blocks' bounds fall on
    whole elements of both."""
    if not split.divides(src[dim]):
        return None
    before = math.prod(src[:dim])
    for d in range(len(dst)):
        if equal(math.prod(dst[:d]), before) and split.divides(dst[d]) and not equal(dst[d], 1):
            return d
    return None
