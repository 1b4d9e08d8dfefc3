"""Lowering an all-gather -> matmul site: what each use computes from one piece
of the gathered tensor, on the ring core's drivers (``ring.py``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch._prims_common import is_contiguous_or_false
from torch.fx import Node

from ....runtime.groups import Group
from ....schedules import Direction, Schedule
from ...fx import dims
from ...fx.declines import decline
from ...fx.graph import CONVERT, same_data, val
from ...kit import paths
from ...kit.blocks import (
    chunk_width,
    make_contiguous,
    multiply,
    pack,
    replay,
    slice_block,
    slice_column_block,
    slice_rows_of_block,
    transpose,
    unpack,
    view,
)
from ...kit.emit import Emitter
from ...kit.rewrite import Rewrite
from ...kit.ring import Products, collect_then_compute, lower_sliced_steps, replace_collective
from .site import AgMmSite, GatherUse

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class _GatherBlocks:
    """What every use of the gathered tensor computes from one piece of it.

    A piece is block ``index`` of ``count`` equal blocks along the gathered dim (a shard,
    or a chunk of a shard under slicing); rows/columns uses keep a product block per
    piece, contracting uses add the piece's partial product to a running sum."""

    def __init__(self, rw: Rewrite, site: AgMmSite) -> None:
        self.em, self.site = rw.emit, site
        self.products = Products(rw, [(u.mm, u.role) for u in site.uses])
        self.others: dict[int, Node] = {}  # contract: the other operand viewed like G
        for i, use in enumerate(site.uses):
            if use.laid_out and use.mm.layout is not None:  # rows of each batch entry
                self.products.rows_dims[i] = use.mm.layout.out[0]

    def add(
        self,
        piece: Node,
        scale: Node | None,
        index: int,
        shape: Sequence[dims.Size],
        s: int,
        count: int,
    ) -> None:
        """Piece ``index`` of ``count`` (``shape``); ``scale``: the piece's rows' scales,
        where they came beside it (``Beside``)."""
        em, site = self.em, self.site
        views: dict[tuple[object, ...], Node] = {}  # one 2-D view of the piece per shape
        for i, use in enumerate(site.uses):
            if use.laid_out:
                self._compute_laid_out(i, use, piece, index, count, s)
                continue
            shape2d = (math.prod(shape[: use.row_dims]), math.prod(shape[use.row_dims :]))
            # the operand's dtype: the piece cast (``use.cast``), or float8 data that
            # travelled as bytes viewed as itself again
            dtype = val(use.operands[0]).dtype
            key = (*dims.as_json(shape2d), dtype)
            if key not in views:
                data = piece
                if val(piece).dtype != dtype:
                    convert = CONVERT if use.cast is not None else aten.view.dtype
                    data = em(convert, (piece, dtype), step=s, lane="compute")
                views[key] = em(
                    aten.view.default, (data, em.compute_shape(shape2d, s)), step=s, lane="compute"
                )
            self._compute(i, use, views[key], scale, index, shape, s)

    def _compute(
        self,
        i: int,
        use: GatherUse,
        g2d: Node,
        scale: Node | None,
        index: int,
        shape: Sequence[dims.Size],
        s: int,
    ) -> None:
        """What ``use``'s matmul computes from piece ``index`` (of ``shape``) viewed 2-D
        (``g2d``)."""
        em, site, mm = self.em, self.site, use.mm
        width, lead = shape[site.gather_dim], shape[: use.row_dims]
        shape2d = (math.prod(lead), math.prod(shape[use.row_dims :]))
        if use.role == "rows":
            rows = functools.partial(self._slice_rows_of, use, index, width, s)
            if scale is not None and site.beside and mm.node in site.beside.readers:
                rows = functools.partial(_view_as_rows, em, scale, shape2d[0], s)
            part = multiply(em, mm, g2d, mm.b, s, rows=rows)
            self.products.put(i, index, view(em, part, [*lead, val(part).shape[1]], s))
        elif use.role == "columns":
            g_t = transpose(em, g2d, s)
            self.products.put(i, index, multiply(em, mm, mm.a, g_t, s, cols=(index, shape2d[0])))
        elif use.role == "contract":
            if i not in self.others:
                k = val(mm.b).shape[1]
                self.others[i] = view(em, mm.b, [*site.gathered_shape[: use.row_dims], k], s)
            x_b = slice_rows_of_block(em, self.others[i], site.gather_dim, index, width, s)
            self.products.add(i, transpose(em, g2d, s), x_b, s)
        elif use.role == "contract_k":
            w_b = slice_block(em, mm.b, 0, index, shape2d[1], s, "compute")
            self.products.add(i, g2d, w_b, s)
        else:  # contract_left
            y_b = self._slice_columns_meeting(i, use, index, width, shape2d[0], s)
            self.products.add(i, y_b, g2d, s)

    def _compute_laid_out(
        self, i: int, use: GatherUse, piece: Node, index: int, count: int, s: int
    ) -> None:
        """What a batched or grouped use computes from the piece, laid out as its operand
        (``paths``)."""
        split = dims.Split(count)
        path = paths.along(use.path, self.site.gather_dim, split)
        if path is None:
            what = f"the gathered blocks on the way to {use.mm.node.name}"
            size = self.site.gathered_shape[self.site.gather_dim]
            raise decline("lower.slices", k=count // self.site.group_size, provably="",
                          what=what, size=size)  # fmt: skip
        block = replay(self.em, piece, path, split, index, s, "compute")
        paths.compute_block(self.em, self.products, i, use.mm, use.role, block, index, split, s)

    def _slice_rows_of(self, use: GatherUse, index: int, width: dims.Size, s: int, x: Node) -> Node:
        """Piece ``index``'s rows of ``x``, laid out like the rows of the gathered tensor
        viewed 2-D (a per-row scale of A: the rows the piece holds, in its order)."""
        em, site = self.em, self.site
        lead = [*site.gathered_shape[: use.row_dims], val(x).shape[-1]]
        return slice_rows_of_block(em, view(em, x, lead, s), site.gather_dim, index, width, s)

    def _slice_columns_meeting(
        self, i: int, use: GatherUse, index: int, width: dims.Size, rows: dims.Size, s: int
    ) -> Node:
        """The columns of Y (in ``Y @ G2d``) that meet block ``index`` of G2d's rows: a
        column block where the gathered dim is outermost; otherwise (the sequence of
        [batch, seq, dim], a weight gradient's t(dY) @ X) Y viewed with G's leading
        dims, sliced on the gathered dim and copied into 2-D."""
        em, site, y = self.em, self.site, use.mm.a
        if dims.equal(math.prod(site.gathered_shape[: site.gather_dim]), 1):
            return slice_column_block(em, y, index, rows, s)
        m = val(y).shape[0]
        if i not in self.others:
            self.others[i] = view(em, y, [m, *site.gathered_shape[: use.row_dims]], s)
        part = slice_block(em, self.others[i], 1 + site.gather_dim, index, width, s, "compute")
        return view(em, make_contiguous(em, part, s), [m, rows], s)

    def finish(self, count: int, step: int) -> None:
        """Assemble the ``count`` pieces' products into each matmul's replacement."""
        self.products.finish(count, step, self.site.gather_dim)


def _view_as_rows(em: Emitter, scale: Node, rows: dims.Size, s: int, _: Node) -> Node:
    """A piece's per-row scales (that came beside it), as its [rows, 1] scale_a."""
    return view(em, scale, [rows, 1], s)


def lower_ring(rw: Rewrite, site: AgMmSite, group: Group, schedule: Schedule) -> None:
    """The ring of messages: a shard, or a shard and its rows' scales packed (``Beside``);
    each block's matmuls read it as it arrives (this rank's own block first, unpacked)."""
    em, n = rw.emit, group.size
    shard_shape = dims.sizes(val(site.shard).shape)
    local = _prepare_local_shard(em, site)
    scale = site.beside.shard if site.beside else None
    pieces: dict[int, tuple[Node, Node | None]] = {group.rank: (local, scale)}
    held: dict[int, Node] = {group.rank: pack(em, local, scale, 0) if scale else local}
    products = _GatherBlocks(rw, site)

    def compute(b: int, message: Node, s: int) -> None:
        if b not in pieces:
            pieces[b] = _unpack_piece(em, message, local, scale, s)
        products.add(*pieces[b], b, shard_shape, s, n)

    collect_then_compute(
        rw, group, schedule, Direction.GATHER, held, lambda t, _: held[t.block], compute
    )
    last = len(rw.steps)
    products.finish(n, last)
    _rebuild_gathered(rw, site, [pieces[b][0] for b in range(n)], last)


def lower_sliced(rw: Rewrite, site: AgMmSite, group: Group, schedule: Schedule, k: int) -> None:
    """k all-gathers of shard chunks along the gathered dim, chunk i-1's matmuls under
    chunk i's all-gather; piece (b, i) is block b*k + i of the gathered dim."""
    em, n, dim = rw.emit, group.size, site.gather_dim
    shard_shape = dims.sizes(val(site.shard).shape)
    width = chunk_width(shard_shape[dim], k, f"the shard's dim {dim}")
    chunk_shape = [*shard_shape[:dim], width, *shard_shape[dim + 1 :]]
    chunks: dict[int, tuple[Node, Node | None]] = {}  # this rank's chunk i (and its scales)
    pieces: dict[tuple[int, int], tuple[Node, Node | None]] = {}  # (block, chunk) -> piece
    products = _GatherBlocks(rw, site)

    def issue(i: int, s: int) -> Node:
        chunks[i] = chunk, scale = _slice_chunk(em, site, i, width, s)
        message = pack(em, chunk, scale, s) if scale else chunk
        gather = c10d.all_gather_into_tensor.default
        return em(gather, (message, n, group.name), step=s, lane="comm")

    def compute(i: int, s: int) -> None:
        for b in range(n):
            products.add(*pieces[b, i], b * k + i, chunk_shape, s, n * k)

    def collected(i: int, gathered: Node, s: int) -> None:
        chunk, scale = chunks[i]
        length = val(gathered).shape[0] // n
        for b in range(n):
            part = slice_block(em, gathered, 0, b, length, s, "comm")
            pieces[b, i] = _unpack_piece(em, part, chunk, scale, s)

    lower_sliced_steps(rw, schedule, Direction.GATHER, k, issue, compute, collected)
    last = len(rw.steps)
    products.finish(n * k, last)
    if site.outlives():
        shards = [
            em(aten.cat.default, ([pieces[b, i][0] for i in range(k)], dim), step=last, lane="comm")
            for b in range(n)
        ]
        _rebuild_gathered(rw, site, shards, last)


def _unpack_piece(
    em: Emitter, message: Node, data: Node, scale: Node | None, s: int
) -> tuple[Node, Node | None]:
    """A received (or gathered) block: the data and its rows' scales, if packed with it."""
    return unpack(em, message, data, scale, s) if scale is not None else (message, None)


def _slice_chunk(
    em: Emitter, site: AgMmSite, i: int, width: dims.Size, s: int
) -> tuple[Node, Node | None]:
    """This rank's chunk ``i`` along the gathered dim, and its rows' scales if they come
    beside it (then the chunk's bytes must keep them aligned: a multiple of 16)."""
    dim = site.gather_dim
    chunk = make_contiguous(em, slice_block(em, site.shard, dim, i, width, s, "comm"), s)
    if site.beside is None:
        return chunk, None
    size = math.prod(val(chunk).shape)
    if not dims.divisible(size, 16):
        raise decline("lower.scale_beside", node=site.shard.name, size=size)
    scale = slice_block(em, site.beside.shard, dim, i, width, s, "comm")
    return chunk, make_contiguous(em, scale, s)


def _prepare_local_shard(em: Emitter, site: AgMmSite) -> Node:
    """The shard as the ring sends it and every block is viewed (2-D rows): the data it
    holds (float8 data viewed as bytes for the collective travels as itself: P2P moves
    any dtype, and a view is no buffer of its own), copied once if it is neither
    contiguous nor 2-D already (received blocks always are contiguous)."""
    node = site.shard
    while same_data(node) and dims.same_shape(val(node.args[0]).shape, val(node).shape):  # type: ignore[arg-type]
        node = node.args[0]  # type: ignore[assignment]
    shard = val(node)
    if shard.dim() == 2 or is_contiguous_or_false(shard):
        return node
    return make_contiguous(em, node, 0)


def _rebuild_gathered(rw: Rewrite, site: AgMmSite, shards: list[Node], step: int) -> None:
    """all_gather_into_tensor's value, rebuilt from the shards: never gather twice."""
    if not site.outlives():
        return
    rebuilt = rw.emit(aten.cat.default, (shards, 0), step=step, lane="comm")
    dtype = val(site.waits[0]).dtype  # the collective's (bytes, for float8 data)
    if val(rebuilt).dtype != dtype:
        rebuilt = rw.emit(aten.view.dtype, (rebuilt, dtype), step=step, lane="comm")
    replace_collective(rw, site.gathers, site.waits, rebuilt)
