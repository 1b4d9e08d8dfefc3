"""Collectives that frameworks register as custom ops, read as the functional collective
each one computes.

A framework whose collective must stay differentiable under ``torch.compile`` registers
it as an op of its own (``torch.library.custom_op`` with a fake implementation and a
backward): DeepSpeed's Hugging Face Ulysses path exchanges q, k, v and the attention
output through ``deepspeed::dim_zero_all_to_all(Tensor input, str group_name) -> Tensor``
(``all_to_all_single`` of n equal blocks of dim 0 over the group of that name; its
backward is the same op on the gradient). AOTAutograd keeps such an op opaque, so the
graphs hold it, forward and backward, where the site kinds look for
``_c10d_functional`` collectives.

``KNOWN`` says, as data, what each op that the pass knows computes; a user adds an op
with ``register_collective_op``. The canonical stage (``canonical.py``) replaces each
call of such an op by the functional collective and its ``wait_tensor``
(``functional``), so that the site kinds match it as they match the functional spelling.
Every other op whose schema takes a process group (an argument of type ``ProcessGroup``,
or a string argument named for a group) is recorded where it stands
(``kinds/unclaimed.py``, ``site.custom_op``), as is a known op whose call does not fit
what it is said to compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from ...options import CommfuseOptionError
from ...runtime.groups import ranks_of
from . import dims
from .graph import node_arg

c10d = torch.ops._c10d_functional

# the functional collective each custom op may stand for, and its output shape from the
# input's and the group size (an all-to-all: n equal blocks of dim 0, block j to rank j)
_SHAPES: dict[str, Callable[[Sequence[dims.Size], int], list[dims.Size]]] = {
    "all_to_all_single": lambda shape, n: list(shape),
    "all_gather_into_tensor": lambda shape, n: [shape[0] * n, *shape[1:]],
    "reduce_scatter_tensor": lambda shape, n: [shape[0] // n, *shape[1:]],
    "all_reduce": lambda shape, n: list(shape),
}
COLLECTIVES = tuple(_SHAPES)
REDUCING = frozenset({"reduce_scatter_tensor", "all_reduce"})
REDUCE_OPS = frozenset({"sum", "avg", "product", "min", "max"})  # c10d's names for them
# namespaces whose ops are no framework's: torch's own, and the pass's transfers
OWN_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "commfuse"})


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """A custom op that computes ``collective`` of its argument ``tensor`` over the
    process group named by its string argument ``group`` (``reduce_op``: how a
    reduce-scatter or all-reduce combines, c10d's name for it)."""

    op: str  # "namespace::name", or "namespace::name.overload"
    collective: str  # one of COLLECTIVES
    tensor: str = "input"
    group: str = "group_name"
    reduce_op: str | None = None


KNOWN = (
    # DeepSpeed (deepspeed/sequence/layer.py, 0.19.8): the Hugging Face Ulysses path's
    # exchange (runtime/sequence_parallel/ulysses_sp.py, ``_dim_zero_all_to_all``)
    CollectiveOp("deepspeed::dim_zero_all_to_all", "all_to_all_single"),
)
_registered: dict[str, CollectiveOp] = {}


def register_collective_op(
    op: str,
    collective: str,
    *,
    tensor: str = "input",
    group: str = "group_name",
    reduce_op: str | None = None,
) -> CollectiveOp:
    """Tell the pass that custom op ``op`` ("namespace::name", defined before this call)
    computes the functional collective ``collective`` (``all_to_all_single``: n equal
    blocks of dim 0, block j to rank j; ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` along dim 0; ``all_reduce``) of its tensor argument
    ``tensor`` over the process group whose c10d name its string argument ``group``
    holds (``ProcessGroup.group_name``), combining by ``reduce_op`` ("sum", "avg", ...)
    for a reduce-scatter or all-reduce. Its calls in the graphs the pass sees are then
    rewritten as that collective's are; an entry for the same op replaces an earlier
    one (or a known op's). Raises ``CommfuseOptionError`` if the op is not defined or
    its schema does not fit."""
    entry = CollectiveOp(op, collective, tensor=tensor, group=group, reduce_op=reduce_op)
    problem = _entry_problem(entry) or _schema_problem(entry, _resolved(op))
    if problem is not None:
        raise CommfuseOptionError(f"register_collective_op({op!r}, {collective!r}): {problem}")
    _registered[op] = entry
    return entry


def unregister_collective_op(op: str) -> None:
    """Forget ``register_collective_op``'s entry for ``op`` (a known op stays known)."""
    _registered.pop(op, None)


def collective_of(target: object) -> CollectiveOp | None:
    """What op ``target`` computes, if the pass knows (registered entries first)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target.name()
    return _registered.get(name) or next((e for e in KNOWN if e.op == name), None)


def group_argument(target: object) -> str | None:
    """The argument through which a framework's op ``target`` names a process group (a
    ``ProcessGroup``, or a string named for a group), or None: not torch's own ops."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in OWN_NAMESPACES:
        return None
    for argument in target._schema.arguments:
        kind = str(argument.type)
        if kind.endswith("ProcessGroup") or (kind == "str" and "group" in argument.name):
            return argument.name
    return None


def argument(node: Node, name: str) -> Any:
    """The value of ``node``'s argument ``name`` (by its op's schema), or None."""
    for i, arg in enumerate(node.target._schema.arguments):  # type: ignore[union-attr]
        if arg.name == name:
            return node_arg(node, i, name, arg.default_value)
    return None


def functional(entry: CollectiveOp, node: Node) -> tuple[Any, tuple[Any, ...]] | str:
    """The functional collective ``node``, a call of ``entry``'s op, computes: its op and
    arguments (an all-to-all's split sizes as sizes, which may be symbolic), or why the
    call does not fit what ``entry`` says (its schema, the group, the output's shape)."""
    problem = _schema_problem(entry, node.target)  # type: ignore[arg-type]
    if problem is not None:
        return problem
    tensor, group = argument(node, entry.tensor), argument(node, entry.group)
    if not isinstance(group, str):
        return f"its group argument {entry.group!r} is not a constant name"
    n = len(ranks_of(group))
    if not n:
        return f"process group {group!r} is unknown in this process"
    value, out = (x.meta.get("val") if isinstance(x, Node) else None for x in (tensor, node))
    if not isinstance(value, FakeTensor) or not isinstance(out, FakeTensor):
        return "its tensors are not fake tensors (meta['val']): no new value can be computed"
    shape: list[dims.Size] = list(value.shape)
    if entry.collective in ("all_to_all_single", "reduce_scatter_tensor") and not (
        shape and dims.divisible(shape[0], n)
    ):
        return f"dim 0 of its input {dims.as_json(shape)} is not{_provably(shape)} divisible by {n}"
    expected = _SHAPES[entry.collective](shape, n)
    if not dims.same_shape(out.shape, expected) or out.dtype != value.dtype:
        return (
            f"its output {dims.as_json(out.shape)} {out.dtype} is not {entry.collective}'s "
            f"{dims.as_json(expected)} {value.dtype} over {n} ranks"
        )
    op = getattr(c10d, entry.collective).default
    if entry.collective == "all_to_all_single":
        splits = [shape[0] // n] * n
        return op, (tensor, splits, splits, group)
    if entry.collective == "all_gather_into_tensor":
        return op, (tensor, n, group)
    if entry.collective == "reduce_scatter_tensor":
        return op, (tensor, entry.reduce_op, n, group)
    return op, (tensor, entry.reduce_op, group)


def _provably(shape: Sequence[dims.Size]) -> str:
    return " provably" if dims.is_symbolic(shape[:1]) else ""


def _entry_problem(entry: CollectiveOp) -> str | None:
    if entry.collective not in _SHAPES:
        return f"collective must be one of {', '.join(COLLECTIVES)}"
    if entry.collective in REDUCING and entry.reduce_op not in REDUCE_OPS:
        return f"{entry.collective} needs reduce_op, one of {', '.join(sorted(REDUCE_OPS))}"
    if entry.collective not in REDUCING and entry.reduce_op is not None:
        return f"{entry.collective} takes no reduce_op"
    return None


def _resolved(op: str) -> torch._ops.OpOverload | str:
    """The op called ``op``, or why there is none."""
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    if not namespace or not name:
        return f"{op!r} is not a 'namespace::name' of an op"
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except (AttributeError, RuntimeError):
        return f"torch.ops has no op {op!r} (define it, or import the module that does, first)"


def _schema_problem(entry: CollectiveOp, target: torch._ops.OpOverload | str) -> str | None:
    """Why an op with ``target``'s schema cannot compute ``entry``'s collective."""
    if isinstance(target, str):
        return target
    schema = target._schema
    kinds = {a.name: str(a.type) for a in schema.arguments}
    if schema.is_mutable:
        return f"{schema} writes into an argument"
    if [str(r.type) for r in schema.returns] != ["Tensor"]:
        return f"{schema} does not return one tensor"
    if kinds.get(entry.tensor) != "Tensor":
        return f"{schema} has no tensor argument {entry.tensor!r}"
    if kinds.get(entry.group) != "str":
        return f"{schema} has no string argument {entry.group!r} for the group's name"
    return None
