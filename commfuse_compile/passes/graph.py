"""The FX vocabulary every site kind matches with: matmuls, views and transposes, the
users that read data, and where a node stands. Nothing here changes a graph."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
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


@dataclasses.dataclass(frozen=True)
class MatmulForm:
    """Where the operands of a matmul op sit in its args (patterns as data): A, B, the
    bias and, for a scaled (float8) matmul, A's and B's scales, the result's scale and
    the output dtype."""

    a: int
    b: int
    bias: int | None
    scale_a: int | None = None
    scale_b: int | None = None
    scale_result: int | None = None
    out_dtype: int | None = None
    offs: int | None = None  # a grouped matmul's: where each group's rows end


MATMULS = {
    aten.addmm.default: MatmulForm(a=1, b=2, bias=0),
    aten.mm.default: MatmulForm(a=0, b=1, bias=None),
    # _scaled_mm(A, B, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum):
    # (A * scale_a) @ (B * scale_b) (+ bias), accumulated in float32, in out_dtype
    aten._scaled_mm.default: MatmulForm(
        a=0, b=1, bias=4, scale_a=2, scale_b=3, scale_result=5, out_dtype=6
    ),
}


# batched: [E, M, K] @ [E, K, N] (experts of an MoE, one batch entry each); the blocks of
# a site are along M, K or N of every entry, never along the batch
BATCHED_MATMULS = {aten.bmm.default: MatmulForm(a=0, b=1, bias=None)}


# grouped (``_grouped_mm(A, B, offs, bias, out_dtype)``): A's rows in groups, each by its
# group's weight ([M, K] x [G, K, N] -> [M, N], an MoE's experts), or the contraction in
# groups, each summed on its own ([M, K] x [K, N] -> [G, M, N], their weights' gradient);
# group g ends at offs[g]. Without offs ([G, M, K] x [G, K, N]) a batched matmul.
GROUPED_MM = aten._grouped_mm.default
GROUPED_MATMULS = {GROUPED_MM: MatmulForm(a=0, b=1, bias=3, offs=2, out_dtype=4)}


OTHER_MATMULS = frozenset({aten.baddbmm.default, aten.matmul.default})
MATMUL_OPS = frozenset(MATMULS) | frozenset(BATCHED_MATMULS) | OTHER_MATMULS
# the TP kinds' matmuls: every form, grouped ones too
ANY_MATMUL = MATMUL_OPS | frozenset(GROUPED_MATMULS)
ALL_FORMS = {**MATMULS, **BATCHED_MATMULS, **GROUPED_MATMULS}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where M and K sit in A, K and N in B, M and N in the product (after any batch or
    group dim), and what a grouped matmul's groups cut: A's rows ("M") or the
    contraction ("K")."""

    a: tuple[int, int]
    b: tuple[int, int]
    out: tuple[int, int]
    groups: str = ""


@dataclasses.dataclass(frozen=True)
class Matmul:
    """A matmul node and its operands, read with its op's ``MatmulForm``."""

    node: Node
    a: Node
    b: Node
    bias: Node | None
    scale_a: Node | None = None  # a scaled matmul's: per tensor, or [M, 1] (per row of A)
    scale_b: Node | None = None  # per tensor, or [1, N] (per column of B)

    @staticmethod
    def of(node: Node, batched: bool = False, grouped: bool = False) -> Matmul | None:
        """``node`` read as a matmul: a 2-D one, or with ``batched`` (a kind that cuts
        the blocks of every batch entry, ``lead``) a batched one too, and with
        ``grouped`` a grouped one (a kind that follows its groups, ``layout``)."""
        forms = {**MATMULS, **BATCHED_MATMULS} if batched else dict(MATMULS)
        forms.update(GROUPED_MATMULS if grouped else {})
        form = forms.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
        if form is None:
            return None
        a, b, bias, scale_a, scale_b = (
            _form_arg(node, i) for i in (form.a, form.b, form.bias, form.scale_a, form.scale_b)
        )
        return Matmul(node, a, b, bias, scale_a, scale_b)

    @property
    def out_shape(self) -> tuple[dims.Size, ...]:
        return dims.sizes(val(self.node).shape)

    @property
    def form(self) -> MatmulForm:
        return ALL_FORMS[self.node.target]  # type: ignore[index]

    @property
    def offs(self) -> Node | None:
        """A grouped matmul's group ends (None: not grouped, or batched)."""
        return _form_arg(self.node, self.form.offs)

    @property
    def layout(self) -> Layout | None:
        """Where its dims sit (``Layout``); None for a grouped form no kind cuts
        ([G, M, K] x [K, N])."""
        a, b = val(self.a).dim(), val(self.b).dim()
        if a == b == 2 and self.offs is None:
            return Layout((0, 1), (0, 1), (0, 1))
        if a == b == 3:
            return Layout((1, 2), (1, 2), (1, 2))
        if (a, b) == (2, 3):
            return Layout((0, 1), (1, 2), (0, 1), "M")
        if (a, b) == (2, 2):
            return Layout((0, 1), (0, 1), (1, 2), "K")
        return None

    def flops(self) -> float:
        """Its multiply-adds x 2: each product element sums K terms (a grouped
        contraction's, only its group's: K in all over the groups)."""
        layout, k = self.layout, dims.hint(self.contracted)
        per_group = layout is not None and layout.groups == "K"
        return 2 * numel(self.node) * k / (dims.hint(val(self.node).shape[0]) if per_group else 1)

    @property
    def lead(self) -> int:
        """How many batch dims come before M (or K of B): 0 for a 2-D matmul."""
        return val(self.node).dim() - 2

    @property
    def contracted(self) -> dims.Size:
        """K, the contracting dim's size."""
        return val(self.a).shape[-1]

    @property
    def scaled(self) -> bool:
        return self.scale_a is not None

    @property
    def inputs(self) -> tuple[Node, ...]:
        """Every tensor the product reads: operands, bias, scales."""
        nodes = (self.a, self.b, self.bias, self.scale_a, self.scale_b, self.scale_result)
        return tuple(node for node in nodes if node is not None)

    @property
    def scale_result(self) -> Node | None:
        return _form_arg(self.node, self.form.scale_result)

    def reads_as(self, node: Node) -> str:
        """What the product reads ``node`` as: "a", "b", "bias", "scale_a", ..."""
        fields = ("a", "b", "bias", "scale_a", "scale_b", "scale_result")
        return next((f for f in fields if getattr(self, f) is node), "")

    def args(self, a: Node, b: Node, **given: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """This op's arguments with other operands: ``a``, ``b`` and any of the form's
        other fields (``bias``, ``scale_a``, ``out_dtype``, ...) given; the rest as the
        node has them (addmm's beta and alpha, use_fast_accum)."""
        form, node = self.form, self.node
        args, kwargs = list(node.args), dict(node.kwargs)
        schema = node.target._schema  # type: ignore[union-attr]
        for field, value in {"a": a, "b": b, **given}.items():
            index = getattr(form, field)
            if index is None:
                assert value is None, f"{op_name(node)} has no {field}"
            elif index < len(args):
                args[index] = value
            elif value is not None or schema.arguments[index].name in kwargs:
                kwargs[schema.arguments[index].name] = value
        return tuple(args), kwargs


def _form_arg(node: Node, index: int | None) -> Any:
    """Argument ``index`` of a matmul node, by position or by its schema's name."""
    if index is None:
        return None
    name = node.target._schema.arguments[index].name  # type: ignore[union-attr]
    return node_arg(node, index, name)


def scales_problem(mm: Matmul) -> str | None:
    """Why the blocks of a scaled matmul cannot take slices of its scales, or None: both
    scales per tensor (shared by every block), or per row of A ([M, 1]) and per column of
    B ([1, N]), which a block of rows or columns slices with its operand and a block of
    the contracting dim leaves whole; the result's scale, if any, per tensor."""
    if not mm.scaled:
        return None
    assert mm.scale_a is not None and mm.scale_b is not None
    a, b = val(mm.scale_a), val(mm.scale_b)
    rows, cols = mm.out_shape
    per_tensor = dims.equal(math.prod(a.shape), 1) and dims.equal(math.prod(b.shape), 1)
    per_row = dims.same_shape(a.shape, (rows, 1)) and dims.same_shape(b.shape, (1, cols))
    if not per_tensor and not per_row:
        return (
            f"scales {dims.as_json(a.shape)} and {dims.as_json(b.shape)} are neither per "
            f"tensor nor per row and column of the [{rows}, {cols}] product"
        )
    result = mm.scale_result
    if result is not None and not dims.equal(math.prod(val(result).shape), 1):
        return f"result scale {dims.as_json(val(result).shape)} is not per tensor"
    return None


def varies_by_row(scale: Node) -> bool:
    """Is a scale_a per row of A (not one value for every row)?"""
    value = val(scale)
    return value.dim() > 0 and not dims.equal(value.shape[0], 1)


def sums_problem(mm: Matmul) -> str | None:
    """Why partial products of a scaled matmul cannot be summed as the fused op would,
    or None. Each partial is computed in float32 (its scales applied, as the fused op
    does before rounding) and the sum rounded to the output dtype once; a float8 output
    (or a result scale, which only a float8 output takes) cannot be."""
    if not mm.scaled:
        return None
    dtype = val(mm.node).dtype
    if dtype in FLOAT8_DTYPES or mm.scale_result is not None:
        return f"a {dtype} product (or result scale) summed over blocks"
    return None


def val(node: Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise decline("site.no_value", node=node.name)
    return value


def is_matmul(node: Node, ops: frozenset[object] = MATMUL_OPS) -> bool:
    return node.op == "call_function" and node.target in ops


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


def reaches_matmul(node: Node, ops: frozenset[object] = MATMUL_OPS) -> bool:
    """Does the value flow into a matmul (of ``ops``) through layout, copy or reassembly
    ops only, and through the buffers it is written into (``value_readers``)?

    With ``comes_from_matmul``, decides what counts as "next to a matmul", so that every
    such collective is reported (rewritten or declined with a reason), never silently
    skipped, however long the chain.
    """
    return _matmul_through_pass_through(value_readers(node), value_readers, ops)


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


def read_back(scatter: Node) -> list[Node]:
    """The readers of the region ``scatter`` writes its source into whose values flow
    into a matmul (``reaches_matmul``'s rule)."""
    return [
        reader
        for reader in part_readers(scatter, region(scatter))
        if _matmul_through_pass_through([reader], value_readers, MATMUL_OPS)
    ]


def comes_from_matmul(node: Node, ops: frozenset[object] = MATMUL_OPS) -> bool:
    """Is ``node`` (a reduce-scatter's input) a matmul (of ``ops``), or computed from one
    through layout, copy or reassembly ops only (a cast and a transpose, say)?"""
    return _matmul_through_pass_through([node], lambda n: n.all_input_nodes, ops)


def _matmul_through_pass_through(
    frontier: list[Node], neighbours: Callable[[Node], list[Node]], ops: frozenset[object]
) -> bool:
    """Is a matmul of ``ops`` in ``frontier`` or beyond it, following ``neighbours`` (users
    or inputs) through ``PASS_THROUGH`` ops only?"""
    seen: set[Node] = set()
    while frontier:
        node = frontier.pop()
        if is_matmul(node, ops):
            return True
        if node.target in PASS_THROUGH and node not in seen:
            seen.add(node)
            frontier += neighbours(node)
    return False


def view_sources(node: Node) -> Iterable[Node]:
    """Producers of ``node``'s inputs, looking through views and casts (one level of a sum
    of matmuls)."""
    for arg in node.all_input_nodes:
        while arg.target in VIEWS or cast_to(arg) is not None:
            arg = node_arg(arg, 0, "self")
        yield arg


def bias_is_row_broadcast(bias: Node) -> bool:
    shape = val(bias).shape
    return len(shape) < 2 or dims.equal(shape[0], 1)


def has_zero_size_dim(mm: Matmul) -> bool:
    """An empty operand or product: no work to hide a transfer behind (and no blocks).
    Symbolic sizes are never 0 (torch specializes sizes 0 and 1)."""
    shapes = (val(node).shape for node in (mm.node, mm.a, mm.b))
    return any(isinstance(size, int) and size == 0 for shape in shapes for size in shape)


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
    return math.prod(dims.hint(size) for size in val(node).shape)


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


ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


def exchange_splits(a2a: Node) -> tuple[dims.Split, dims.Split]:
    """(the blocks ``a2a`` receives, the blocks it sends) along dim 0: n equal blocks, or
    uneven ones of int sizes (a head count or sequence the group does not divide).
    Declines sizes the graph computes that differ, sizes that do not cover the tensors,
    an empty block, and splits that give the ranks' graphs different shapes."""
    out_sizes, in_sizes = node_arg(a2a, 1, "output_split_sizes"), node_arg(a2a, 2, "")
    splits = {"out": _sizes(out_sizes), "in": _sizes(in_sizes)}
    received, sent = dims.Split.of(out_sizes), dims.Split.of(in_sizes)
    if received is None or sent is None:
        raise decline("a2a.uneven", node=a2a.name, splits=splits)
    rows = (val(node_arg(a2a, 0, "input")).shape[0], val(a2a).shape[0])
    for split, size, what in ((sent, rows[0], "input"), (received, rows[1], "output")):
        first = (in_sizes if split is sent else out_sizes)[0]
        first = first.meta["val"] if isinstance(first, Node) else first
        covered = sum(split.sizes) if split.sizes else first * split.n
        if not dims.equal(covered, size):
            problem = f"they do not add up to the {size} rows of its {what}"
            raise decline("a2a.splits", node=a2a.name, splits=splits, problem=problem)
    if any(size == 0 for split in (received, sent) for size in split.sizes or ()):
        raise decline("a2a.empty_block", node=a2a.name, splits=splits)
    if not dims.equal(*rows):
        raise decline(
            "a2a.rank_shapes", node=a2a.name, sent=rows[0], received=rows[1], splits=splits
        )
    return received, sent


def split_sizes(a2a: Node, uneven: bool) -> dict[str, object]:
    """An uneven all-to-all's split sizes, for the report (nothing for equal ones)."""
    if not uneven:
        return {}
    return {"splits": {"out": _sizes(node_arg(a2a, 1, "")), "in": _sizes(node_arg(a2a, 2, ""))}}


def check_own_block(a2a: Node, sent: dims.Size, received: dims.Size) -> None:
    """Decline an all-to-all that sends this rank a block of another size than it keeps
    (the program is wrong: the collective itself would fail)."""
    if not dims.equal(sent, received):
        splits = {"out": _sizes(node_arg(a2a, 1, "")), "in": _sizes(node_arg(a2a, 2, ""))}
        problem = f"this rank sends itself {sent} rows and receives {received} from itself"
        raise decline("a2a.splits", node=a2a.name, splits=splits, problem=problem)


def _sizes(sizes: Sequence[Any]) -> list[Any]:
    """Split sizes as the report shows them: ints, or the nodes' values."""
    return [str(s.meta.get("val", s)) if isinstance(s, Node) else s for s in sizes]


def the_wait(collective: Node) -> Node | None:
    """The collective's one ``wait_tensor``, if its other readers are only the graph's
    output: selective activation checkpointing saves a collective's unwaited result for
    the backward, which then reads the rewritten result instead (``also_replaced``)."""
    users = data_users(collective)
    waits = [u for u in users if u.target is torch.ops._c10d_functional.wait_tensor.default]
    if len(waits) != 1 or any(u.op != "output" for u in users if u is not waits[0]):
        return None
    return waits[0]


def saved_unwaited(collective: Node) -> bool:
    """Is the collective's unwaited result an output of the graph (see ``the_wait``)?"""
    return any(user.op == "output" for user in collective.users)
