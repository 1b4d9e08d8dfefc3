"""The matmuls a site is built around, declared as data: where each op's operands sit
(``MatmulForm``), the layout of its dims (``Layout``), one matmul as a site reads it
(``Matmul``), and whether a value flows into or out of one."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from . import dims
from .declines import Declined
from .graph import (
    FLOAT8_DTYPES,
    PASS_THROUGH,
    nbytes,
    node_arg,
    numel,
    op_name,
    part_readers,
    region,
    val,
    value_readers,
)

aten = torch.ops.aten


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
    def rate_class(self) -> str:
        """Its class as the cost model rates it (``Profile.matmul_rates``): A's dtype by
        name ("bfloat16"), " grouped" added for a grouped matmul."""
        return rate_class(val(self.a).dtype, grouped=self.offs is not None)

    def whole_bytes(self, columns: bool) -> float:
        """Bytes of the operand a block of the product's rows (``columns``: of its
        columns) reads whole: B (A). A matmul cut into n blocks reads it n times."""
        return float(nbytes(self.a if columns else self.b))

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


def flops_of(node: Node) -> float:
    """A matmul node's FLOPs (0 for any other node, or one without tensor metadata)."""
    matmul = Matmul.of(node, batched=True)
    try:
        return matmul.flops() if matmul is not None else 0.0
    except Declined:
        return 0.0


def weight_bytes_of(node: Node) -> float:
    """The bytes of a matmul node's B, which it reads whole (0 for any other node)."""
    matmul = Matmul.of(node, batched=True)
    return matmul.whole_bytes(columns=False) if matmul is not None else 0.0


def rate_class(dtype: torch.dtype, grouped: bool) -> str:
    """A matmul's class (``Profile.matmul_rates``): "bfloat16", "bfloat16 grouped"."""
    name = str(dtype).removeprefix("torch.")
    return f"{name} grouped" if grouped else name


def rate_class_of(node: Node) -> str | None:
    """A matmul node's ``Matmul.rate_class`` (None for any other node, or one without tensor
    metadata)."""
    matmul = Matmul.of(node, batched=True, grouped=True)
    try:
        return matmul.rate_class if matmul is not None else None
    except Declined:
        return None


def is_matmul(node: Node, ops: frozenset[object] = MATMUL_OPS) -> bool:
    return node.op == "call_function" and node.target in ops


def reaches_matmul(node: Node, ops: frozenset[object] = MATMUL_OPS) -> bool:
    """Does the value flow into a matmul (of ``ops``) through layout, copy or reassembly
    ops only, and through the buffers it is written into (``value_readers``)?

    With ``comes_from_matmul``, decides what counts as "next to a matmul", so that every
    such collective is reported (rewritten or declined with a reason), never silently
    skipped, however long the chain.
    """
    return _matmul_through_pass_through(value_readers(node), value_readers, ops)


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


def bias_is_row_broadcast(bias: Node) -> bool:
    shape = val(bias).shape
    return len(shape) < 2 or dims.equal(shape[0], 1)


def has_zero_size_dim(mm: Matmul) -> bool:
    """An empty operand or product: no work to hide a transfer behind (and no blocks).
    Symbolic sizes are never 0 (torch specializes sizes 0 and 1)."""
    shapes = (val(node).shape for node in (mm.node, mm.a, mm.b))
    return any(isinstance(size, int) and size == 0 for shape in shapes for size in shape)
