"""What a ``moe`` site is: the dispatch and combine all-to-alls of a dropless MoE layer,
the permutation between them and the experts' ops (``find`` matches them, ``lower``
emits the round trip)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.fx import Node

from ...fx import dims
from ...fx.graph import val
from ...kit.site import Site
from .padding import Pad

aten = torch.ops.aten

GROUPED_MM = aten._grouped_mm.default


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeSite(Site):
    kind: ClassVar[str] = "moe"
    dispatch: Node
    combine: Node | None = None
    dispatch_wait: Node | None = None
    combine_wait: Node | None = None
    pad: Pad | None = None  # torchtitan's alignment padding: rows appended, then dropped
    permuted: Node | None = None  # recv[perm] (or padded[perm])
    perm: Node | None = None
    offs: Node | None = None
    experts: tuple[Node, ...] = ()  # from ``permuted`` to the value put back, graph order
    put_back: Node | None = None  # the index_put of the experts' output into ``buffer``
    buffer: Node | None = None
    saved: tuple[Node, ...] = ()  # expert values read whole (saved for the backward)
    paired: tuple[Node, ...] = ()  # tensors whose row q goes with the experts' row q
    # grouped matmuls summing over the rows, per group (weight gradients), and the
    # transposes of rows they read
    sums: tuple[Node, ...] = ()
    transposes: tuple[Node, ...] = ()

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (self.dispatch,) if self.combine is None else (self.dispatch, self.combine)

    def replaced(self) -> list[Node]:
        pad = () if self.pad is None else (self.pad.node, self.pad.unpad)
        nodes = (
            self.dispatch,
            self.dispatch_wait,
            *pad,
            self.permuted,
            *self.experts,
            *self.transposes,
            *self.sums,
            self.put_back,
            self.buffer,
            self.combine,
            self.combine_wait,
        )
        return [node for node in nodes if node is not None]

    @property
    def grouped(self) -> list[Node]:
        return [node for node in (*self.experts, *self.sums) if node.target is GROUPED_MM]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [c.name for c in self.collectives],
            "group": self.group_name,
            "group_size": self.group_size,
            "matmuls": [node.name for node in self.grouped],
            "experts": len(self.experts),
            "saved": [node.name for node in self.saved],
            "summed": [node.name for node in self.sums],
            "exchanged_shape": dims.as_json(val(self.dispatch).shape),
            "padded_rows": 0 if self.pad is None else self.pad.rows,
        }
