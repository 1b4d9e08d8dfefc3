"""Which nodes after plain TP's all-reduces run on this rank's tokens, and which read a
value gathered whole (and why): the token-wise region, found before anything changes.

Moved onto the shard (token-wise):

* pointwise ops (torch's ``pointwise`` tag) and casts, but no random op: a shard's mask
  would not be the rows of the replicated mask;
* reductions over dims after the token dims (a norm's statistics), LayerNorm and
  RMSNorm over the last dims;
* views, squeezes and expands that keep the token dims in front.

The other operand of such an op is another shard (of this all-reduce or of another one
split with it: the residual stream), broadcast over the tokens (a norm's weight, used
as it is), or a replicated tensor of every token (its rows are a free slice). A sum over
exactly the token dims (a norm weight's gradient) is summed on the shard and all-reduced:
a vector of the width, not the tokens. Any other reader reads the value gathered: a
matmul (``ag_mm``'s site: what the split is for), or one that needs every token, each
with its decline code (``split.output``, ``split.random``, ``split.whole_reader``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

import torch
from torch.fx import Graph, Node

from ...fx import dims
from ...fx.declines import Declined, decline
from ...fx.graph import VIEWS, data_users, normalized_dim, numel, op_name, val
from ...fx.matmuls import is_matmul
from ...kit.all_reduce import AllReduceSite

aten = torch.ops.aten

CASTS = frozenset({aten._to_copy.default, aten.alias.default, aten.detach.default})
RESHAPES = VIEWS | {aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default}
REDUCTIONS = frozenset(
    {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
    | {aten.var.correction, aten.var_mean.correction}
)
# a reader of a value's shape, dtype and device only, and the op that takes the shape
# explicitly: a dropout mask's ``empty_like`` reads the shard (no gather of the value)
FULL_SIZED = {
    aten.empty_like.default: aten.new_empty.default,
    aten.zeros_like.default: aten.new_zeros.default,
    aten.ones_like.default: aten.new_ones.default,
}
NORMS = frozenset({aten.native_layer_norm.default, aten._fused_rms_norm.default})


@dataclasses.dataclass(frozen=True)
class Whole:
    """A reader of a shard's value gathered whole: a matmul (``why`` None: the gather is
    ``ag_mm``'s site), or one that needs every token, and why."""

    why: Declined | None = None


MATMUL = Whole()


@dataclasses.dataclass
class Region:
    """What the split moves: per node in graph order, how it runs on the shard."""

    tokens: dims.Size
    sources: dict[Node, AllReduceSite]  # an all-reduce's wait -> its site
    moved: dict[Node, str] = dataclasses.field(default_factory=dict)  # node -> how
    # read from the shard, whole values: sums over the tokens, full-sized allocations
    replaced: dict[Node, str] = dataclasses.field(default_factory=dict)
    gathered: dict[Node, list[Node]] = dataclasses.field(default_factory=dict)  # value -> readers
    whole: dict[Node, Whole] = dataclasses.field(default_factory=dict)  # reader -> why

    def sharded(self, node: object) -> bool:
        return isinstance(node, Node) and (node in self.sources or node in self.moved)

    def lead(self, node: Node) -> int | None:
        return lead_dims(val(node).shape, self.tokens)

    def root(self, value: Node) -> Node:
        """The shard value ``value`` is a reshape of (itself if none): one gather of the
        root serves every reshape of it (a joint graph views one value once per reader)."""
        while self.moved.get(value) == "reshape":
            value = value.args[0]  # type: ignore[assignment]
        return value


def lead_dims(shape: Sequence[dims.Size], tokens: dims.Size) -> int | None:
    """The fewest leading dims of ``shape`` that hold ``tokens`` elements: the token dims."""
    for k in range(1, len(shape) + 1):
        if dims.equal(math.prod(shape[:k]), tokens):
            return k
    return None


def nbytes(node: Node) -> int:
    """Bytes of ``node``'s value, symbolic sizes at their hints."""
    return numel(node) * val(node).element_size()


def region_after(graph: Graph, tokens: dims.Size, sources: dict[Node, AllReduceSite]) -> Region:
    """The token-wise region after ``sources`` (waits), in graph order."""
    region = Region(tokens, sources)
    node: Node | None = min(sources, key=lambda n: n._sort_key)
    while node is not None and node.op != "root":
        inputs = [a for a in node.all_input_nodes if region.sharded(a)]
        if node not in sources and inputs:
            how = _how(region, node)
            if isinstance(how, Whole):
                for value in inputs:
                    region.gathered.setdefault(value, []).append(node)
                region.whole[node] = how
            elif how in ("token sum", "full sized"):
                region.replaced[node] = how
            else:
                region.moved[node] = how
        node = node.next
    return region


def for_matmul(reader: Node) -> bool:
    """A matmul, or a transpose or view of a gathered value that a matmul reads (a
    weight gradient)."""
    return is_matmul(reader) or _views_into_matmul(reader)


def _views_into_matmul(node: Node) -> bool:
    if node.op != "call_function" or node.target not in (
        aten.t.default,
        aten.permute.default,
        aten.transpose.int,
        *VIEWS,
    ):
        return False
    return any(is_matmul(u) or _views_into_matmul(u) for u in data_users(node))


def _whole(why: str, node: Node) -> Whole:
    return Whole(decline("split.whole_reader", op=op_name(node), why=why))


def _how(region: Region, node: Node) -> str | Whole:
    """How ``node`` runs on the shard ("pointwise", "reshape", ...), or why it reads
    the value whole: a transpose or view that only a matmul reads (a weight gradient's
    operand) is the matmul's."""
    how = _how_alone(region, node)
    if isinstance(how, Whole) and how.why is not None and _views_into_matmul(node):
        return MATMUL
    return how


def _how_alone(region: Region, node: Node) -> str | Whole:
    if node.op == "output":
        return Whole(decline("split.output"))
    if node.op != "call_function":
        return _whole(f"is a {node.op} node", node)
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if target in FULL_SIZED and "memory_format" not in node.kwargs:
        return "full sized"
    if is_matmul(node):
        return MATMUL
    value = node.meta.get("val")
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in (
        target.tags
    ):
        return Whole(decline("split.random", op=op_name(node)))
    if target in NORMS:
        return _norm(region, node)
    if not isinstance(value, torch.Tensor) and target not in (aten.var_mean.correction,):
        return _whole("has no tensor value", node)
    if target in REDUCTIONS:
        return _reduction(region, node)
    out_lead = region.lead(node) if isinstance(value, torch.Tensor) else None
    if out_lead is None:
        return _whole("does not keep the tokens in front", node)
    if target in RESHAPES or target in CASTS:
        return "reshape" if target in RESHAPES else "pointwise"
    if target is aten.expand.default:
        source = node.args[0]
        shape = val(node).shape
        keeps = isinstance(source, Node) and same_lead(val(source).shape, shape, out_lead)
        return "expand" if keeps else _whole("expands over the token dims", node)
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _pointwise(region, node, out_lead)
    return _whole("is not token-wise", node)


def _pointwise(region: Region, node: Node, out_lead: int) -> str | Whole:
    out = val(node).shape
    for arg in node.all_input_nodes:
        if not isinstance(arg.meta.get("val"), torch.Tensor):
            return _whole("reads a non-tensor", node)
        shape = val(arg).shape
        if region.sharded(arg):
            if not same_lead(shape, out, out_lead):
                return _whole("broadcasts a shard", node)
        elif operand(shape, out, out_lead) is None:
            return _whole("broadcasts over part of the tokens", node)
    return "pointwise"


def same_lead(shape: Sequence[dims.Size], out: Sequence[dims.Size], lead: int) -> bool:
    padded = [1] * (len(out) - len(shape)) + list(shape)
    return len(padded) == len(out) and dims.same_shape(padded[:lead], out[:lead])


def operand(shape: Sequence[dims.Size], out: Sequence[dims.Size], lead: int) -> str | None:
    """How a replicated operand meets the shard: "rows" (sliced) or "broadcast" (as is)."""
    padded = [1] * (len(out) - len(shape)) + list(shape)
    if len(padded) != len(out):
        return None
    if all(dims.equal(s, 1) for s in padded[:lead]):
        return "broadcast"
    return "rows" if dims.same_shape(padded[:lead], out[:lead]) else None


def _reduction(region: Region, node: Node) -> str | Whole:
    source = node.args[0]
    if not isinstance(source, Node) or not region.sharded(source):
        return _whole("reads a shard as a non-input", node)
    lead = region.lead(source)
    reduced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if lead is None or reduced is None:
        return _whole("reduces over the tokens", node)
    reduced_dims = {normalized_dim(source, int(d)) for d in reduced}  # type: ignore[union-attr, arg-type]
    if all(d >= lead for d in reduced_dims):
        return "reduction"
    if node.target is aten.sum.dim_IntList and reduced_dims == set(range(lead)):
        return "token sum"
    return _whole("reduces over the tokens", node)


def _norm(region: Region, node: Node) -> str | Whole:
    source = node.args[0]
    normalized = node.args[1]
    lead = region.lead(source) if isinstance(source, Node) and region.sharded(source) else None
    if lead is None or len(val(source).shape) - lead < len(normalized):  # type: ignore[arg-type]
        return _whole("normalizes over the tokens", node)
    return "norm"
