"""The FX vocabulary every site kind matches with: views and transposes, casts, the users
that read data, the regions of a buffer, and where a node stands (matmuls:
``matmuls``; collectives: ``collectives``). Nothing here changes a graph."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import dims
from .declines import decline

aten = torch.ops.aten

VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


# read a tensor's metadata, not its data (dynamic-shape graphs take sizes with these)
SIZE_READERS = frozenset(
    {
        aten.sym_size.int,
        aten.sym_stride.int,
        aten.sym_numel.default,
        aten.sym_storage_offset.default,
    }
)


# allocate a new tensor like their input: they read its sizes, dtype and device, not its
# values (in-place c10d code allocates its output buffer like its input)
ALLOCATE_LIKE = frozenset(
    {
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.zeros_like.default,
        aten.new_zeros.default,
    }
)


TRANSPOSES = frozenset({aten.t.default, aten.permute.default, aten.transpose.int})


# a dtype conversion as the graphs Inductor compiles spell it (``_to_copy`` is decomposed
# before them, and Inductor has no lowering for it)
CONVERT = torch.ops.prims.convert_element_type.default


PASS_THROUGH = (
    VIEWS
    | TRANSPOSES
    | {
        aten.split.Tensor,
        aten.split_with_sizes.default,
        operator.getitem,
        aten.cat.default,
        aten.clone.default,
        aten._to_copy.default,
        CONVERT,
        aten.copy.default,  # into a buffer: the value, unless it converts (canonical.py)
        aten.contiguous.default,
        aten.slice.Tensor,  # DTensor unpads an uneven gather with a slice ...
        aten.constant_pad_nd.default,  # ... and pads an uneven reduce-scatter
        aten.view.dtype,  # float8 data gathered as bytes (view -> gather -> view back)
        aten.detach.default,
        aten.alias.default,
    }
)


FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
FLOAT8_DTYPES = frozenset(
    {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
)


def val(node: Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise decline("site.no_value", node=node.name)
    return value


def data_users(node: Node) -> list[Node]:
    """The users that read ``node``'s values, not only its sizes (the one predicate every
    site kind's walk uses)."""
    return [
        user
        for user in node.users
        if user.target not in SIZE_READERS and user.target not in ALLOCATE_LIKE
    ]


def is_full_slice(node: Node) -> bool:
    """``x[:, 0:size]``, the whole of a dim: DTensor's unpadding of a gather whose size
    it cannot prove even (dynamic shapes) when the size is, after all, the whole dim."""
    if node.target is not aten.slice.Tensor or not isinstance(node.args[0], Node):
        return False
    dim, start, end, step = (node_arg(node, i, name, d) for i, name, d in SLICE_ARGS)
    if start not in (None, 0) or step != 1:
        return False
    size = val(node.args[0]).shape[dim]
    end_value = end.meta.get("val") if isinstance(end, Node) else end
    return (
        end_value is None
        or dims.equal(end_value, size)
        or (isinstance(end_value, int) and isinstance(size, int) and end_value >= size)
    )


SLICE_ARGS = ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1))
SLICE_SCATTER = aten.slice_scatter.default


class Region(NamedTuple):
    """Elements ``start:end:step`` of a dim of ``size``: what a slice reads or a
    ``slice_scatter`` writes (bounds non-negative, clamped to the size; sizes may be
    symbolic, and what cannot be proven counts as false)."""

    dim: int
    start: dims.Size
    end: dims.Size
    step: dims.Size
    size: dims.Size

    def same(self, other: Region) -> bool:
        return self.dim == other.dim and all(
            dims.equal(a, b) for a, b in zip(self[1:4], other[1:4], strict=True)
        )

    def disjoint(self, other: Region) -> bool:
        """Provably no element in common (on one dim, both contiguous)."""
        return (
            self.dim == other.dim
            and self._contiguous(other)
            and (_known(self.end <= other.start) or _known(other.end <= self.start))
        )

    def covers(self, other: Region | None) -> bool:
        """Provably every element of ``other`` (None: of the whole tensor)."""
        if self.same(Region(self.dim, 0, self.size, 1, self.size)):
            return True  # all of the tensor
        return (
            other is not None
            and self.dim == other.dim
            and self._contiguous(other)
            and _known(self.start <= other.start)
            and _known(other.end <= self.end)
        )

    def _contiguous(self, other: Region) -> bool:
        return dims.equal(self.step, 1) and dims.equal(other.step, 1)

    def __str__(self) -> str:
        step = "" if dims.equal(self.step, 1) else f":{self.step}"
        return f"[{self.start}:{self.end}{step}] of dim {self.dim}"


def region(node: Node) -> Region | None:
    """The region a ``slice`` reads of its input or a ``slice_scatter`` writes into its
    buffer; None for other nodes or without metadata."""
    if node.target is aten.slice.Tensor:
        offset = 0
    elif node.target is SLICE_SCATTER:
        offset = 1  # (buffer, src, dim, start, end, step)
    else:
        return None
    base = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if not isinstance(base, torch.Tensor):
        return None
    dim, start, end, step = (
        _number(node_arg(node, i + offset, name, d)) for i, name, d in SLICE_ARGS
    )
    if not isinstance(dim, int) or base.dim() == 0:
        return None
    dim %= base.dim()
    size = dims.sizes(base.shape)[dim]
    start = _bound(0 if start is None else start, size)
    end = _bound(size if end is None else end, size)
    return Region(dim, start, end, step, size)


def _bound(bound: Any, size: dims.Size) -> dims.Size:
    """A slice bound as the index it means: a negative one counted from the end, one past
    the end clamped to it."""
    if isinstance(bound, int) and bound < 0:
        bound += size
    return size if _known(bound >= size) else bound


def _number(arg: object) -> Any:
    """A slice argument as a number: a size node's value."""
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def _known(fact: Any) -> bool:
    return bool(statically_known_true(fact))


def cast_to(node: Node) -> torch.dtype | None:
    """The dtype ``node`` converts its input to, if it is a cast and nothing else (element
    by element: it commutes with every view, transpose, slice and block of its input),
    between floating dtypes; else None."""
    if node.target is aten._to_copy.default:
        layout, memory_format = node.kwargs.get("layout"), node.kwargs.get("memory_format")
        same_layout = layout in (None, torch.strided) and memory_format in (
            None,
            torch.preserve_format,
        )
        if len(node.args) != 1 or not same_layout or node.kwargs.get("pin_memory"):
            return None  # a copy into another layout too
    elif node.target is not CONVERT:
        return None
    source = node.args[0]
    value, source_value = node.meta.get("val"), getattr(source, "meta", {}).get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(source_value, torch.Tensor):
        return None
    floats = value.dtype in FLOAT_DTYPES and source_value.dtype in FLOAT_DTYPES
    return value.dtype if floats and value.device == source_value.device else None


def is_transpose_2d(node: Node) -> bool:
    if node.target is aten.t.default:
        return True
    if node.target is aten.permute.default:
        return list(node_arg(node, 1, "dims")) == [1, 0]
    if node.target is aten.transpose.int:
        return sorted(int(node_arg(node, i, "")) % 2 for i in (1, 2)) == [0, 1]
    return False


def between_note(user: Node, what: str = "gathered") -> str:
    return f"{user.name} ({op_name(user)}) sits between the {what} tensor and a matmul"


def ordered_getitems(split: Node, n: int) -> list[Node] | None:
    parts: dict[int, Node] = {}
    for u in split.users:
        if u.target is not operator.getitem or len(data_users(u)) != 1:
            return None
        parts[node_arg(u, 1, "index")] = u
    if sorted(parts) != list(range(n)):
        return None
    return [parts[i] for i in range(n)]


def value_readers(node: Node) -> list[Node]:
    """The nodes that read ``node``'s values: its users, except that a ``slice_scatter``
    writing ``node`` into a buffer (or over a part of ``node``) passes it on to the
    readers of the part of the buffer that holds it."""
    return [reader for user in node.users for reader in _readers_through(user, node, None)]


def part_readers(scatter: Node, part: Region | None) -> list[Node]:
    """The readers of ``part`` of ``scatter``'s result (None: of any of it): its users
    but the slices that miss the part, through further ``slice_scatter``s."""
    readers: list[Node] = []
    for user in scatter.users:
        read = region(user) if user.target is aten.slice.Tensor else None
        if read is None or part is None or not read.disjoint(part):
            readers += _readers_through(user, scatter, part)
    return readers


def _readers_through(user: Node, node: Node, part: Region | None) -> list[Node]:
    """``user``, or if it is a ``slice_scatter``, the readers of ``part`` of ``node``
    (None: all of it) in its result: where the source went, or the elements of the
    buffer it does not overwrite."""
    if user.target is not SLICE_SCATTER:
        return [user]
    written = region(user)
    if node_arg(user, 1, "src") is node:
        return part_readers(user, written)
    return [] if written is not None and written.covers(part) else part_readers(user, part)


def view_sources(node: Node) -> Iterable[Node]:
    """Producers of ``node``'s inputs, looking through views and casts (one level of a sum
    of matmuls)."""
    for arg in node.all_input_nodes:
        while arg.target in VIEWS or cast_to(arg) is not None:
            arg = node_arg(arg, 0, "self")
        yield arg


def check_tensor(node: Node, what: str) -> None:
    """Floating point data (float8 included: the operands of a scaled matmul, also as
    the bytes a view of them reinterprets, see ``data_dtype``), or declined."""
    dtype = data_dtype(node)
    if dtype not in FLOAT_DTYPES and dtype not in FLOAT8_DTYPES:
        raise decline("site.dtype", what=what, dtype=dtype)


def reinterprets(node: Node) -> bool:
    """Is ``node`` a view of its input's bytes as another dtype of the same element size
    (float8 data gathered as uint8: view -> gather -> view back)?"""
    if node.target is not aten.view.dtype or not isinstance(node.args[0], Node):
        return False
    source = node.args[0].meta.get("val")
    dtype = node_arg(node, 1, "dtype")
    return isinstance(source, torch.Tensor) and source.element_size() == dtype.itemsize


def same_data(node: Node) -> bool:
    """Does ``node`` hold its input's data as it is: a detach or alias, or a view of its
    bytes as another dtype of one element size (``reinterprets``)?"""
    return node.target in (aten.detach.default, aten.alias.default) or reinterprets(node)


def data_dtype(node: Node) -> torch.dtype:
    """The dtype of the data ``node`` holds: a float8 tensor's, where ``node`` views its
    bytes (as uint8, which every collective backend moves)."""
    source = node
    while same_data(source):
        source = source.args[0]  # type: ignore[assignment]
    dtype = val(source).dtype
    return dtype if dtype in FLOAT8_DTYPES else val(node).dtype


def writes_into(user: Node, node: Node) -> bool:
    """Does ``user`` write into ``node`` in place: is ``node`` (alone or in a list) an
    argument ``user``'s schema marks as written? ``copy_(buffer, node)`` only reads
    ``node`` (its source); ``copy_(node, x)``, ``add_(node, 1)`` and ``out=node`` write it."""
    schema = getattr(user.target, "_schema", None)
    if user.op != "call_function" or schema is None:
        return False
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node_arg(user, index, argument.name)
        if any(v is node for v in (value if isinstance(value, list | tuple) else [value])):
            return True
    return False


def normalized_dim(node: Node, dim: int) -> int:
    """``dim`` of ``node``'s value made non-negative (kept as is when the rank is unknown)."""
    value = node.meta.get("val")
    return int(dim) % value.dim() if isinstance(value, torch.Tensor) else int(dim)


def node_arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (or keyword ``name``) of a call node, untyped like FX args are."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def op_name(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op


def position(node: Node) -> Any:
    """Where ``node`` stands in its graph, comparable in O(1) (FX keeps these keys in
    graph order as nodes are inserted): no walk over the graph per site."""
    return node._sort_key


def in_graph_order(nodes: Iterable[Node]) -> list[Node]:
    return sorted(set(nodes), key=position)


def numel(node: Node) -> int:
    """Elements of ``node``'s value, symbolic sizes at their hints."""
    return _numel(val(node))


def nbytes(node: Node) -> int:
    """Bytes of ``node``'s value, symbolic sizes at their hints."""
    return _nbytes(val(node))


def _numel(t: torch.Tensor) -> int:
    return math.prod(dims.hint(size) for size in t.shape)


def _nbytes(t: torch.Tensor) -> int:
    return _numel(t) * t.element_size()


COMMUNICATION_NAMESPACES = frozenset({"_c10d_functional", "c10d", "commfuse"})


def moved_bytes(node: Node) -> int:
    """The bytes an op reads and writes, what an element-wise, indexing, copying or
    reducing op's time is made of (``Profile.memory_op_s``): its tensor operands' and
    its results'. 0 for what moves no data in memory: a view or alias of its input, an
    empty allocation, a size, a scalar, a collective or its wait (the link's bytes), a
    node that is no op."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0
    if target.namespace in COMMUNICATION_NAMESPACES or "empty" in target._schema.name:
        return 0
    returns = target._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return 0  # a view: the same memory, laid out anew

    values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    return sum(_nbytes(t) for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor))


# ops that only lay a tensor out anew: its n blocks along a dim stay n blocks of the result
LAYOUT_OPS = VIEWS | TRANSPOSES | {aten.clone.default, aten.alias.default}


def split_dim_in_input(node: Node, dim: int, split: dims.Split) -> int | None:
    """``node`` lays out its input anew (``LAYOUT_OPS``): the input dim whose blocks of
    ``split`` are those of ``dim`` of its output, or None."""
    source = node_arg(node, 0, "self")
    shape, source_shape = val(node).shape, val(source).shape
    if node.target in VIEWS:
        return dims.split_dim(dims.sizes(shape), dim, dims.sizes(source_shape), split)
    return _moved_dim(node, dim, len(shape), to_input=True)


def split_dim_in_output(node: Node, dim: int, split: dims.Split) -> int | None:
    """The inverse of ``split_dim_in_input``: from ``node``'s input dim to its output's."""
    source = node_arg(node, 0, "self")
    shape, source_shape = val(node).shape, val(source).shape
    if node.target in VIEWS:
        return dims.split_dim(dims.sizes(source_shape), dim, dims.sizes(shape), split)
    return _moved_dim(node, dim, len(shape), to_input=False)


def _moved_dim(node: Node, dim: int, rank: int, to_input: bool) -> int | None:
    """Where a permute or transpose moves ``dim`` (a copy moves nothing)."""
    if node.target in (aten.clone.default, aten.alias.default):
        return dim
    if node.target is aten.permute.default:
        perm = [int(d) % rank for d in node_arg(node, 1, "dims")]
        return perm[dim] if to_input else perm.index(dim)
    if node.target is aten.t.default:
        return (1 - dim) if rank == 2 else dim
    if node.target is aten.transpose.int:
        a, b = (int(node_arg(node, i, "")) % rank for i in (1, 2))
        return b if dim == a else a if dim == b else dim
    return None
