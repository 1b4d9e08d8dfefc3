"""What an all-gather -> matmul site is: the matmuls reading the gathered tensor
(``GatherUse``, by role) and the per-row scales gathered beside it (``Beside``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch.fx import Node

from ...fx import dims
from ...kit.uses import U, Use, UsesSite

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherUse(Use):
    """A matmul reading the gathered tensor G, viewed 2-D with the gathered dim in its rows.

    Where G2d sits decides what a block of it computes (``role``):
    ``rows``:      ``G2d @ W``    (column-parallel input): a block of the product's rows.
    ``contract``:  ``G2d^T @ X``  (weight gradient): adds ``G2d_b^T @ X_b``.
    ``columns``:   ``X @ G2d^T``  (a gathered weight, FSDP): a block of the product's columns.
    ``contract_left``: ``Y @ G2d`` (input gradient of a gathered weight): adds ``Y_b @ G2d_b``.
    ``contract_k``: ``G2d @ W`` with the gathered dim in G2d's columns (an activation
    gathered on its last dim): adds ``G2d_b @ W[K_b]``.
    """

    row_dims: int  # the gathered tensor's dims [:row_dims] fold into G2d's rows
    cast: torch.dtype | None = None  # the dtype G is cast to before the matmul reads it
    # a batched or grouped matmul (or one behind copies and permutes) is ``laid_out``:
    # the layout ops and casts from the gathered tensor to its operand, with the dims
    # that hold the blocks (``paths``); the role from where they are there
    laid_out: bool = False
    path: tuple[tuple[Node, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Beside:
    """A per-row scale of A gathered on its own, beside A (its shard's rows' scales, on
    the same group and dim), read only as the scale of the site's row-block matmuls: its
    collective joins the site, its shard travels in A's messages (``rewrite.packed``)."""

    gather: Node
    wait: Node
    shard: Node
    chain: tuple[Node, ...]  # its reassembly and views, up to the matmuls' scale_a
    readers: frozenset[Node]  # those matmuls


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgMmSite(UsesSite):
    kind: ClassVar[str] = "ag_mm"
    LEFT_OUT: ClassVar[str] = "ag.matmuls_left_out"
    gathers: tuple[Node, ...]  # all-gathers of one shard on one group (merged: one ring)
    waits: tuple[Node, ...]
    shard: Node
    gather_dim: int  # dim of the logical gathered tensor the shards are concatenated on
    gathered_shape: tuple[dims.Size, ...] = ()
    uses: tuple[GatherUse, ...] = ()
    chain: tuple[Node, ...] = ()  # nodes between the waits and the matmuls
    beside: Beside | None = None

    @property
    def collectives(self) -> tuple[Node, ...]:
        return (*self.gathers, *((self.beside.gather,) if self.beside else ()))

    @property
    def results(self) -> tuple[Node, ...]:
        return self.waits

    def replaced(self) -> list[Node]:
        beside = (self.beside.gather, self.beside.wait, *self.beside.chain) if self.beside else ()
        return [*self.gathers, *self.waits, *self.chain, *(u.mm.node for u in self.uses), *beside]

    def describe(self) -> dict[str, object]:
        return {
            "collectives": [n.name for n in self.collectives],
            "scale_beside": self.beside.gather.name if self.beside else None,
            "group": self.group_name,
            "group_size": self.group_size,
            "gather_dim": self.gather_dim,
            "gathered_shape": dims.as_json(self.gathered_shape),
            "matmuls": [u.mm.node.name for u in self.uses],
            "roles": {u.mm.node.name: u.role for u in self.uses},
            "unmatched": list(self.unmatched),
        }

    def leaving_out(self, left: Mapping[U, str]) -> AgMmSite:
        """As ``UsesSite.leaving_out``; the scales gathered beside A stay gathered on
        their own if a matmul left out reads them."""
        site = super().leaving_out(left)
        beside = site.beside
        if beside is not None and not beside.readers <= {u.mm.node for u in site.uses}:
            site = dataclasses.replace(site, beside=None)
        return site
