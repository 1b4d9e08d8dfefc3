"""Sequence parallelism done inside the graph: the all-reduce after a row-parallel
matmul becomes a reduce-scatter of the product's rows (the tokens), the token-wise work
after it runs on this rank's rows, and an all-gather stands where a reader needs every
token.

Plain tensor parallelism (DTensor's ``RowwiseParallel`` with its replicated output,
Hugging Face's ``tp_plan="auto"``, Megatron without ``--sequence-parallel``) ends a
row-parallel matmul with an all-reduce; hand-written sequence parallelism ends it with a
reduce-scatter and gathers again before the next column-parallel matmul, running the
residual add and the norm between on 1/n of the tokens. Both give the same numbers: an
all-reduce is a reduce-scatter then an all-gather, and a token-wise op commutes with
taking rows. Once split, the reduce-scatter is an ``mm_rs`` site and an all-gather that
a matmul reads an ``ag_mm`` site, each rewritten as any other.

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
a vector of the width, not the tokens. Any other reader of a shard's value, the graph's
outputs among them (a value returned or saved for the backward keeps its full value) and
the matmuls, reads the value all-gathered: one all-gather per value, shared by its
readers (q, k and v's projections share one). An all-reduce whose values reach no
matmul that way is left to ``mm_ar``, which rewrites it as it stands.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node

from ..runtime.groups import Group
from . import dims
from .emit import Emitter
from .graph import (
    VIEWS,
    data_users,
    is_matmul,
    normalized_dim,
    numel,
    op_name,
    saved_unwaited,
    val,
)
from .kinds.mm_ar import MmArSite
from .kinds.reduced_product import REDUCE_OPS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER = c10d.all_gather_into_tensor.default
ALL_REDUCE = c10d.all_reduce.default
COLLECTIVES = frozenset(
    {GATHER, c10d.reduce_scatter_tensor.default, ALL_REDUCE, c10d.wait_tensor.default}
)
# node.meta key on a split's collectives, or on an all-reduce left whole: what the
# report shows of it
META = "commfuse_split"

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
Change = Callable[[], None]  # called before the graph is first changed


@dataclasses.dataclass
class _Chain:
    """What the split moves: per node in graph order, how it runs on the shard."""

    tokens: dims.Size
    sources: dict[Node, MmArSite]  # an all-reduce's wait -> its site
    moved: dict[Node, str] = dataclasses.field(default_factory=dict)  # node -> how
    # read from the shard, whole values: sums over the tokens, full-sized allocations
    replaced: dict[Node, str] = dataclasses.field(default_factory=dict)
    gathered: dict[Node, list[Node]] = dataclasses.field(default_factory=dict)
    why_gathered: dict[str, str] = dataclasses.field(default_factory=dict)  # reader -> why

    def sharded(self, node: object) -> bool:
        return isinstance(node, Node) and (node in self.sources or node in self.moved)

    def lead(self, node: Node) -> int | None:
        return lead_dims(val(node).shape, self.tokens)


def split_all_reduces(
    graph: Graph,
    sites: Sequence[MmArSite],
    group_of: Callable[[MmArSite], Group | None],
    before_change: Change,
) -> bool:
    """Split the all-reduces of ``sites`` that ``group_of`` admits (their group, or None
    to leave the site as it is), those of one group and token count together; did any
    change? A site declined for having no matmul (``ar.not_matmul``: a vocabulary-parallel
    embedding's lookup) is split too: its reduce-scatter hides nothing, the gather after
    the norm does."""
    joint: dict[tuple[str, Any], list[tuple[MmArSite, Group]]] = {}
    for site in sites:
        tokens = _tokens(site)
        if tokens is None or saved_unwaited(site.collective):
            continue
        group = group_of(site)
        if group is None:
            continue
        joint.setdefault((site.group_name, tokens), []).append((site, group))
    changed = False
    for (_, tokens), members in joint.items():
        chain = _chain(graph, tokens, {s.wait: s for s, _ in members})
        if chain is None:
            for site, _ in members:
                site.collective.meta[META] = {"not_split": "no matmul reads a value after it"}
            continue
        before_change()
        changed |= _emit(graph, chain, members[0][1])
    return changed


def _tokens(site: MmArSite) -> dims.Size | None:
    """The rows the all-reduce's value is split into: its product's rows, or for an
    all-reduce of no matmul (a vocabulary-parallel embedding's lookup) the value's rows
    before its last dim; None where the site is declined otherwise or n does not divide
    them."""
    if site.declined is None:
        return site.product_shape[0]
    waited = site.wait.target is c10d.wait_tensor.default and bool(site.wait.users)
    if site.declined.code != "ar.not_matmul" or site.reduce_op not in REDUCE_OPS or not waited:
        return None
    shape = val(site.collective).shape
    rows = math.prod(shape[:-1])
    return rows if len(shape) > 1 and dims.divisible(rows, site.group_size) else None


def lead_dims(shape: Sequence[dims.Size], tokens: dims.Size) -> int | None:
    """The fewest leading dims of ``shape`` that hold ``tokens`` elements: the token dims."""
    for k in range(1, len(shape) + 1):
        if dims.equal(math.prod(shape[:k]), tokens):
            return k
    return None


# ----------------------------------------------------------------------------------------
# which nodes move


def _chain(graph: Graph, tokens: dims.Size, sources: dict[Node, MmArSite]) -> _Chain | None:
    """The token-wise region after ``sources`` (waits), or None when no matmul would read
    an all-gather of it (nothing for ``ag_mm`` to hide: ``mm_ar`` does as well alone)."""
    chain = _Chain(tokens, sources)
    first = min(sources, key=lambda n: n._sort_key)
    node: Node | None = first
    while node is not None and node.op != "root":
        inputs = [a for a in node.all_input_nodes if chain.sharded(a)]
        if node not in sources and inputs:
            how = _how(chain, node)
            if how.startswith("gather:"):
                for value in inputs:
                    chain.gathered.setdefault(value, []).append(node)
                chain.why_gathered[node.name] = how.removeprefix("gather:")
            elif how in ("token sum", "full sized"):
                chain.replaced[node] = how
            else:
                chain.moved[node] = how
        node = node.next
    readers = [r for rs in chain.gathered.values() for r in rs]
    if not any(map(_for_matmul, readers)):
        return None
    return chain


def _views_into_matmul(node: Node) -> bool:
    """A transpose or view of a gathered value that a matmul reads (a weight gradient)."""
    if node.op != "call_function" or node.target not in (
        aten.t.default,
        aten.permute.default,
        aten.transpose.int,
        *VIEWS,
    ):
        return False
    return any(is_matmul(u) or _views_into_matmul(u) for u in data_users(node))


def _how(chain: _Chain, node: Node) -> str:
    """How ``node`` runs on the shard ("pointwise", "reshape", ...), or "gather:<why>"."""
    if node.op != "call_function":
        return "gather:graph output" if node.op == "output" else f"gather:{node.op}"
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if target in FULL_SIZED and "memory_format" not in node.kwargs:
        return "full sized"
    if is_matmul(node):
        return "gather:matmul"
    value = node.meta.get("val")
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in (
        target.tags
    ):
        return f"gather:{op_name(node)} is random"
    if target in NORMS:
        return _norm(chain, node)
    if not isinstance(value, torch.Tensor) and target not in (aten.var_mean.correction,):
        return f"gather:{op_name(node)} has no tensor value"
    if target in REDUCTIONS:
        return _reduction(chain, node)
    out_lead = chain.lead(node) if isinstance(value, torch.Tensor) else None
    if out_lead is None:
        return f"gather:{op_name(node)} does not keep the tokens in front"
    if target in RESHAPES or target in CASTS:
        return "reshape" if target in RESHAPES else "pointwise"
    if target is aten.expand.default:
        source = node.args[0]
        shape = val(node).shape
        keeps = isinstance(source, Node) and _same_lead(val(source).shape, shape, out_lead)
        return "expand" if keeps else "gather:expand over the token dims"
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _pointwise(chain, node, out_lead)
    return f"gather:{op_name(node)} is not token-wise"


def _pointwise(chain: _Chain, node: Node, out_lead: int) -> str:
    out = val(node).shape
    for arg in node.all_input_nodes:
        if not isinstance(arg.meta.get("val"), torch.Tensor):
            return f"gather:{op_name(node)} reads a non-tensor"
        shape = val(arg).shape
        if chain.sharded(arg):
            if not _same_lead(shape, out, out_lead):
                return f"gather:{op_name(node)} broadcasts a shard"
        elif _operand(shape, out, out_lead) is None:
            return f"gather:{op_name(node)} broadcasts over part of the tokens"
    return "pointwise"


def _same_lead(shape: Sequence[dims.Size], out: Sequence[dims.Size], lead: int) -> bool:
    padded = [1] * (len(out) - len(shape)) + list(shape)
    return len(padded) == len(out) and dims.same_shape(padded[:lead], out[:lead])


def _operand(shape: Sequence[dims.Size], out: Sequence[dims.Size], lead: int) -> str | None:
    """How a replicated operand meets the shard: "rows" (sliced) or "broadcast" (as is)."""
    padded = [1] * (len(out) - len(shape)) + list(shape)
    if len(padded) != len(out):
        return None
    if all(dims.equal(s, 1) for s in padded[:lead]):
        return "broadcast"
    return "rows" if dims.same_shape(padded[:lead], out[:lead]) else None


def _reduction(chain: _Chain, node: Node) -> str:
    source = node.args[0]
    if not isinstance(source, Node) or not chain.sharded(source):
        return f"gather:{op_name(node)} reads a shard as a non-input"
    lead = chain.lead(source)
    reduced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if lead is None or reduced is None:
        return f"gather:{op_name(node)} reduces over the tokens"
    reduced_dims = {normalized_dim(source, int(d)) for d in reduced}  # type: ignore[union-attr, arg-type]
    if all(d >= lead for d in reduced_dims):
        return "reduction"
    if node.target is aten.sum.dim_IntList and reduced_dims == set(range(lead)):
        return "token sum"
    return f"gather:{op_name(node)} reduces over the tokens"


def _norm(chain: _Chain, node: Node) -> str:
    source = node.args[0]
    normalized = node.args[1]
    lead = chain.lead(source) if isinstance(source, Node) and chain.sharded(source) else None
    if lead is None or len(val(source).shape) - lead < len(normalized):  # type: ignore[arg-type]
        return f"gather:{op_name(node)} normalizes over the tokens"
    return "norm"


# ----------------------------------------------------------------------------------------
# emitting the split


def _emit(graph: Graph, chain: _Chain, group: Group) -> bool:
    """Each source's reduce-scatter, the moved nodes on the shard, the all-gathers and the
    token sums' all-reduces; then the readers switched to them and the replaced nodes
    erased. A failure while the new nodes are built takes them back (the graph as it
    was, the all-reduces left to ``mm_ar``) and warns."""
    first_wait = next(iter(chain.sources))
    em = Emitter(graph, first_wait, detect_fake_mode([val(first_wait)]))
    kept = _recomputed(chain)
    try:
        scatters, replacements = _built(em, chain, group, kept)
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        em.discard()
        first = (str(err).splitlines() or [""])[0][:300]
        warnings.warn(
            f"commfuse: all-reduces left whole (token-wise split failed: "
            f"{type(err).__name__}: {first})",
            stacklevel=4,
        )
        return False
    for (reader, value), new in replacements.items():
        if reader is None:
            value.replace_all_uses_with(new)
        else:
            reader.replace_input_with(value, new)
    erased = [node for node in [*chain.moved, *chain.replaced] if node not in kept]
    erased += chain.sources  # kept ones are read gathered now
    for node in sorted(erased, key=_order, reverse=True):
        graph.erase_node(node)
        if node in chain.sources:
            graph.erase_node(chain.sources[node].collective)
    for node in reversed(em.created):  # shard values only kept nodes needed
        if not node.users and node.op == "call_function" and node.target not in COLLECTIVES:
            graph.erase_node(node)
    note = {
        "from": "all_reduce",
        "token_wise_ops": len(chain.moved),
        "token_sums": sum(how == "token sum" for how in chain.replaced.values()),
        "gathered": sorted(v.name for v in chain.gathered),
        "gathered_for": dict(sorted(chain.why_gathered.items())),
        "all_reduce_bytes": sum(nbytes(wait) for wait in chain.sources),
        "gathered_bytes": sum(nbytes(value) for value in chain.gathered)
        + sum(nbytes(source) for source in chain.sources if source in kept),
        "recomputed": len([node for node in kept if node not in chain.sources]),
    }
    for scatter in scatters:
        scatter.meta[META] = note
    return True


def _recomputed(chain: _Chain) -> set[Node]:
    """The nodes kept as they are, on every token, for the values only the graph's outputs
    (or other whole readers) read, recomputed from the all-reduces' gathered values;
    empty where gathering each such value moves fewer bytes. (Forward graphs save many
    values of the chain for the backward: the residual, the norm's statistics, ...)"""
    whole = [v for v, readers in chain.gathered.items() if not any(map(_for_matmul, readers))]
    kept: set[Node] = set()
    stack = list(whole)
    while stack:
        node = stack.pop()
        if node not in kept:
            kept.add(node)
            stack.extend(a for a in node.all_input_nodes if chain.sharded(a))
    sources = [node for node in kept if node in chain.sources]
    if sum(map(nbytes, sources)) >= sum(map(nbytes, whole)):
        return set()
    for value in whole:
        if value not in chain.sources:  # a source returned whole: its gather serves both
            del chain.gathered[value]
    return kept


def _for_matmul(reader: Node) -> bool:
    return is_matmul(reader) or _views_into_matmul(reader)


def _built(
    em: Emitter, chain: _Chain, group: Group, kept: set[Node]
) -> tuple[list[Node], dict[tuple[Node | None, Node], Node]]:
    """The new nodes: the reduce-scatters, and per (reader or None for every reader,
    replaced value) the node that replaces the value; the ``kept`` nodes read their
    all-reduces' values gathered."""
    shard: dict[Node, Node] = {}
    rows = _Rows(em, chain.tokens, group)
    scatters = []
    for wait, site in chain.sources.items():
        scatter, shard[wait] = _reduce_scattered(em, site, wait, chain, group)
        scatters.append(scatter)
    for node, how in sorted(chain.moved.items(), key=lambda item: item[0]._sort_key):
        shard[node] = _moved(em, node, how, shard, chain, rows)
    replacements: dict[tuple[Node | None, Node], Node] = {}
    for node, how in chain.replaced.items():
        summed = how == "token sum"
        new = _token_sum(em, node, shard, group) if summed else _full_sized(em, node, shard)
        replacements[None, node] = new
    # each gathered value once for its readers, and for the kept nodes that read it (an
    # all-reduce's value, from which the values returned whole are recomputed)
    for value in dict.fromkeys([*chain.gathered, *(s for s in chain.sources if s in kept)]):
        readers = chain.gathered.get(value, [])
        readers = [*readers, *(r for r in value.users if r in kept and r not in readers)]
        if readers:
            full = _gathered(em, shard[value], value, group, readers)
            replacements.update(((reader, value), full) for reader in readers)
    return scatters, replacements


def nbytes(node: Node) -> int:
    """Bytes of ``node``'s value, symbolic sizes at their hints."""
    return numel(node) * val(node).element_size()


def _order(node: Node) -> Any:
    return node._sort_key


class _Rows:
    """This rank's rows of a replicated value of every token: a free slice."""

    def __init__(self, em: Emitter, tokens: dims.Size, group: Group) -> None:
        self.em, self.tokens, self.n, self.rank = em, tokens, group.size, group.rank

    def of(self, value: Node, lead: int, before: Node) -> Node:
        shape = val(value).shape
        rows = _reshaped(self.em, value, [self.tokens, *shape[lead:]], before)
        width = self.tokens // self.n
        start = self.em.size(width * self.rank, 0, before)
        end = self.em.size(width * (self.rank + 1), 0, before)
        return self.em.node(aten.slice.Tensor, (rows, 0, start, end), before=before)


def _reduce_scattered(
    em: Emitter, site: MmArSite, wait: Node, chain: _Chain, group: Group
) -> tuple[Node, Node]:
    """The all-reduce's operand reduce-scattered on its rows, shaped as the shard of the
    wait's value (the token rows first, then the rest of the value's dims)."""
    operand: Node = site.collective.args[0]  # type: ignore[assignment]
    before = site.collective
    width = val(operand).numel() // chain.tokens
    flat = _reshaped(em, operand, [chain.tokens, width], before)
    scatter = em.node(
        c10d.reduce_scatter_tensor.default,
        (flat, site.reduce_op, group.size, site.group_name),
        before=before,
    )
    waited = em.node(c10d.wait_tensor.default, (scatter,), before=before)
    lead = chain.lead(wait)
    assert lead is not None  # noqa: S101 - a wait of the tokens' product
    shape = _shard_shape(val(wait).shape, lead, chain, group.size)
    return scatter, _reshaped(em, waited, shape, wait)


def _shard_shape(shape: Sequence[dims.Size], lead: int, chain: _Chain, n: int) -> list[dims.Size]:
    return [chain.tokens // n, *shape[lead:]]


def _moved(
    em: Emitter,
    node: Node,
    how: str,
    shard: dict[Node, Node],
    chain: _Chain,
    rows: _Rows,
) -> Node:
    """``node`` run on the shard, before the original (which stays until it is unread)."""
    if how == "getitem":
        return em.node(operator.getitem, (shard[node.args[0]], node.args[1]), before=node)  # type: ignore[index]
    lead = chain.lead(node) if isinstance(node.meta.get("val"), torch.Tensor) else None

    def arg(a: Any) -> Any:
        if isinstance(a, Node) and a in shard:
            return shard[a]
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor) and lead:
            return _replicated(em, a, node, lead, rows)
        return a

    if how in ("reshape", "expand"):
        assert lead is not None  # noqa: S101 - checked by ``_how``
        source = shard[node.args[0]]  # type: ignore[index]
        shape = _shard_shape(val(node).shape, lead, chain, rows.n)
        if how == "reshape":
            return _reshaped(em, source, shape, node)
        return em.node(aten.expand.default, (source, em.shape(shape, 0)), before=node)
    args, kwargs = tuple(arg(a) for a in node.args), {k: arg(v) for k, v in node.kwargs.items()}
    if how == "reduction":
        source_lead = chain.lead(node.args[0])  # type: ignore[arg-type]
        assert source_lead is not None  # noqa: S101 - checked by ``_how``
        reduced = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        shifted = [normalized_dim(node.args[0], d) - source_lead + 1 for d in reduced]  # type: ignore[arg-type, union-attr]
        if len(node.args) > 1:
            args = (args[0], shifted, *args[2:])
        else:
            kwargs["dim"] = shifted
    return em.node(node.target, args, kwargs, before=node)  # type: ignore[arg-type]


def _replicated(em: Emitter, value: Node, reader: Node, lead: int, rows: _Rows) -> Node:
    """A replicated operand of ``reader`` as the shard meets it."""
    out = val(reader).shape
    shape = val(value).shape
    how = _operand(shape, out, lead)
    trailing = ([1] * (len(out) - len(shape)) + list(shape))[lead:]
    if how == "broadcast":
        return _reshaped(em, value, trailing, reader) if len(shape) > len(trailing) else value
    expanded = value
    if len(shape) < len(out):
        expanded = _reshaped(em, value, [1] * (len(out) - len(shape)) + list(shape), reader)
    return rows.of(expanded, lead, reader)


def _token_sum(em: Emitter, node: Node, shard: dict[Node, Node], group: Group) -> Node:
    """A sum over the tokens: this rank's rows summed, then all-reduced."""
    source = shard[node.args[0]]  # type: ignore[index]
    dtype = node.kwargs.get("dtype")
    partial = em.node(
        aten.sum.dim_IntList, (source, [0]), {"dtype": dtype} if dtype else None, before=node
    )
    partial = _reshaped(em, partial, list(val(node).shape), node)
    reducing = em.node(c10d.all_reduce.default, (partial, "sum", group.name), before=node)
    return em.node(c10d.wait_tensor.default, (reducing,), before=node)


def _full_sized(em: Emitter, node: Node, shard: dict[Node, Node]) -> Node:
    """An allocation like the whole value, from its shard's dtype and device."""
    source = shard[node.args[0]]  # type: ignore[index]
    shape = em.shape(val(node).shape, 0)
    return em.node(FULL_SIZED[node.target], (source, shape), dict(node.kwargs), before=node)  # type: ignore[index]


def _gathered(em: Emitter, shard: Node, value: Node, group: Group, readers: list[Node]) -> Node:
    """``value`` rebuilt from every rank's shard: one all-gather of the token rows, before
    its first reader. It is marked with whether a matmul reads it (the all-reduce's second
    half, or a gather only a returned value needs: the split's extra bytes)."""
    before = min(readers, key=_order)
    if not val(shard).is_contiguous():
        shard = em.node(
            aten.clone.default, (shard,), {"memory_format": torch.contiguous_format}, before=before
        )
    gathering = em.node(
        c10d.all_gather_into_tensor.default, (shard, group.size, group.name), before=before
    )
    for_matmul = any(map(_for_matmul, readers))
    gathering.meta[META] = {"from": "all_reduce", "for_matmul": for_matmul}
    gathered = em.node(c10d.wait_tensor.default, (gathering,), before=before)
    return _reshaped(em, gathered, list(val(value).shape), before)


def _reshaped(em: Emitter, node: Node, shape: Iterable[dims.Size], before: Node) -> Node:
    shape = list(shape)
    if dims.same_shape(val(node).shape, shape):
        return node
    return em.node(aten.reshape.default, (node, em.shape(shape, 0)), before=before)
