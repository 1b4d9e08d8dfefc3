"""Dimension algebra: where does a collective's dim land in a matmul?

A chain of view/reshape ops between a tensor and a 2-D matmul operand is one reshape,
so only the two shapes matter. ``row_split`` finds how the tensor's dims fold into
the operand's rows and columns; a collective dim among the row dims means every block
of it is an independent set of rows of the product.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..report import decline


def concrete(shape: Sequence[object], what: str) -> tuple[int, ...]:
    """The sizes as ints; declines symbolic (dynamic-shape) sizes it cannot reason about."""
    out = []
    for size in shape:
        if isinstance(size, torch.SymInt):
            hint = size.node.maybe_as_int()
            if hint is None:
                raise decline(f"{what} has a symbolic size ({size}); dynamic shapes not supported")
            size = hint
        out.append(int(size))  # type: ignore[call-overload]
    return tuple(out)


def row_split(shape: Sequence[int], rows: int, cols: int) -> int | None:
    """Largest j such that shape[:j] folds into ``rows`` and shape[j:] into ``cols``."""
    for j in range(len(shape), -1, -1):
        if math.prod(shape[:j]) == rows and math.prod(shape[j:]) == cols:
            return j
    return None
