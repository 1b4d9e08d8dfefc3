"""Emitting the split: each all-reduce's reduce-scatter, the region's nodes on the shard,
one all-gather per value a reader needs whole (per root: every reshape of a value shares
its gather) and the token sums' all-reduces. On a joint graph each new node takes the
partitioner's and checkpointing's marks of the node it stands before (``JOINT_MARKS``),
so AOTAutograd puts it in the half its original ran in and saves or recomputes it as
the user's policy says: the shard, not the whole value, is what the backward reads."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from ....runtime.groups import Group
from ...fx import dims
from ...fx.declines import failed
from ...fx.graph import normalized_dim, val
from ...kit.all_reduce import AllReduceSite
from ...kit.emit import JOINT_MARKS, Emitter
from .region import FULL_SIZED, Region, for_matmul, nbytes, operand

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
COLLECTIVES = frozenset(
    {
        c10d.all_gather_into_tensor.default,
        c10d.reduce_scatter_tensor.default,
        c10d.all_reduce.default,
        c10d.wait_tensor.default,
    }
)
# a joint graph node's half (AOTAutograd's partitioner tag), as a collective is pinned to it
PINNED = {"is_forward": "must_be_in_forward", "is_backward": "must_be_in_backward"}
# node.meta key on a split's collectives, or on an all-reduce left whole: what the
# report shows of it
META = "commfuse_split"


def emit_split(graph: Graph, region: Region, group: Group, strict: bool) -> bool:
    """The split, then the readers switched to it and the replaced nodes erased. A
    failure while the new nodes are built takes them back (the graph as it was, the
    all-reduces left to ``mm_ar``) and warns (``declines.failed``: ``strict`` raises)."""
    first_wait = next(iter(region.sources))
    em = Emitter(graph, first_wait, detect_fake_mode([val(first_wait)]), inherit=JOINT_MARKS)
    kept = _recomputed(region)
    try:
        scatters, replacements = _build(em, region, group, kept)
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        em.discard()
        failed(err, strict, "all-reduces left whole (the token-wise split failed)")
        return False
    note = {
        "from": "all_reduce",
        "token_wise_ops": len(region.moved),
        "token_sums": sum(how == "token sum" for how in region.replaced.values()),
        "gathered": sorted({region.root(v).name for v in region.gathered}),
        "gathered_for": {
            reader.name: "matmul" if why.why is None else why.why.code
            for reader, why in sorted(region.whole.items(), key=lambda item: item[0].name)
        },
        "all_reduce_bytes": sum(nbytes(wait) for wait in region.sources),
        "gathered_bytes": sum(nbytes(root) for root in _roots(region, kept)),
        "recomputed": len([node for node in kept if node not in region.sources]),
    }
    for (reader, value), new in replacements.items():
        if reader is None:
            value.replace_all_uses_with(new)
        else:
            reader.replace_input_with(value, new)
    erased = [node for node in [*region.moved, *region.replaced] if node not in kept]
    erased += region.sources  # kept ones are read gathered now
    for node in sorted(erased, key=_order, reverse=True):
        graph.erase_node(node)
        if node in region.sources:
            graph.erase_node(region.sources[node].collective)
    for node in reversed(em.created):  # shard values only kept nodes needed
        if not node.users and node.op == "call_function" and node.target not in COLLECTIVES:
            graph.erase_node(node)
    for scatter in scatters:
        scatter.meta[META] = note
    for node in em.created:
        if node.graph is graph and node.target in COLLECTIVES:
            _pinned(node)
    return True


def _pinned(collective: Node) -> None:
    """A collective of the split, on a joint graph: saved where its original would have
    been (``force_save_collectives``), and then pinned to its half, so that the
    partitioner neither copies it into the other half (a dead gather of a returned value
    in the backward) nor recomputes it there. Under activation checkpointing a
    reduce-scatter that would be recomputed (the policy's default for an op it does not
    name) is saved instead: its value is 1/n of the all-reduce's, and saving it keeps the
    backward from running it again (hand-written sequence parallelism's policies save
    ``reduce_scatter_tensor``); a gather follows the policy (recomputed: gathered again
    from the saved shard, as Megatron's sequence parallelism does)."""
    recompute = collective.meta.get("recompute")
    scatter = collective.target is c10d.reduce_scatter_tensor.default or (
        collective.target is c10d.wait_tensor.default
        and getattr(collective.args[0], "target", None) is c10d.reduce_scatter_tensor.default
    )
    if recompute is CheckpointPolicy.PREFER_RECOMPUTE and scatter:
        collective.meta["recompute"] = recompute = CheckpointPolicy.MUST_SAVE
    if recompute in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE):
        return
    half = collective.meta.get("partitioner_tag")
    if isinstance(half, str):
        collective.meta["partitioner_tag"] = PINNED.get(half, half)


def _recomputed(region: Region) -> set[Node]:
    """The nodes kept as they are, on every token, for the values only the graph's outputs
    (or other whole readers) read, recomputed from the all-reduces' gathered values;
    empty where gathering each such value moves fewer bytes. (A forward graph saves many
    values of the region for the backward: the residual, the norm's statistics, ...; a
    joint graph saves none, AOTAutograd chooses what to save afterwards.)"""
    for_matmuls = {region.root(v) for v, rs in region.gathered.items() if any(map(for_matmul, rs))}
    whole = [
        v
        for v, readers in region.gathered.items()
        if not any(map(for_matmul, readers)) and region.root(v) not in for_matmuls
    ]
    kept: set[Node] = set()
    stack = list(whole)
    while stack:
        node = stack.pop()
        if node not in kept:
            kept.add(node)
            stack.extend(a for a in node.all_input_nodes if region.sharded(a))
    sources = [node for node in kept if node in region.sources]
    if sum(map(nbytes, sources)) >= sum(map(nbytes, whole)):
        return set()
    for value in whole:
        if value not in region.sources:  # a source returned whole: its gather serves both
            del region.gathered[value]
    return kept


def _gathered_values(region: Region, kept: set[Node]) -> dict[Node, list[Node]]:
    """Each value read gathered, with its readers: the region's, and the ``kept`` nodes
    that read an all-reduce's value (to recompute the values returned whole)."""
    values: dict[Node, list[Node]] = {}
    for value in dict.fromkeys([*region.gathered, *(s for s in region.sources if s in kept)]):
        readers = region.gathered.get(value, [])
        readers = [*readers, *(r for r in value.users if r in kept and r not in readers)]
        if readers:
            values[value] = readers
    return values


def _roots(region: Region, kept: set[Node]) -> list[Node]:
    return list(dict.fromkeys(region.root(v) for v in _gathered_values(region, kept)))


def _build(
    em: Emitter, region: Region, group: Group, kept: set[Node]
) -> tuple[list[Node], dict[tuple[Node | None, Node], Node]]:
    """The new nodes: the reduce-scatters, and per (reader or None for every reader,
    replaced value) the node that replaces the value; the ``kept`` nodes read their
    all-reduces' values gathered."""
    shard: dict[Node, Node] = {}
    rows = _Rows(em, region.tokens, group)
    scatters = []
    for wait, site in region.sources.items():
        scatter, shard[wait] = _reduce_scatter(em, site, wait, region, group)
        scatters.append(scatter)
    for node, how in sorted(region.moved.items(), key=lambda item: item[0]._sort_key):
        shard[node] = _move_to_shard(em, node, how, shard, region, rows)
    replacements: dict[tuple[Node | None, Node], Node] = {}
    for node, how in region.replaced.items():
        summed = how == "token sum"
        new = (
            _sum_tokens(em, node, shard, group) if summed else _allocate_full_sized(em, node, shard)
        )
        replacements[None, node] = new
    by_root: dict[Node, dict[Node, list[Node]]] = {}
    for value, readers in _gathered_values(region, kept).items():
        by_root.setdefault(region.root(value), {})[value] = readers
    for root, values in by_root.items():
        readers = [r for rs in values.values() for r in rs]
        full = _gather(em, shard[root], root, group, readers, region)
        for value, its_readers in values.items():
            before = min(its_readers, key=_order)
            value_full = _reshape(em, full, val(value).shape, before, like=value)
            replacements.update(((reader, value), value_full) for reader in its_readers)
    return scatters, replacements


def _order(node: Node) -> Any:
    return node._sort_key


class _Rows:
    """This rank's rows of a replicated value of every token: a free slice."""

    def __init__(self, em: Emitter, tokens: dims.Size, group: Group) -> None:
        self.em, self.tokens, self.n, self.rank = em, tokens, group.size, group.rank

    def slice_own(self, value: Node, lead: int, before: Node) -> Node:
        shape = val(value).shape
        rows = _reshape(self.em, value, [self.tokens, *shape[lead:]], before)
        width = self.tokens // self.n
        start = self.em.compute_size(width * self.rank, 0, before)
        end = self.em.compute_size(width * (self.rank + 1), 0, before)
        return self.em.add_node(aten.slice.Tensor, (rows, 0, start, end), before=before)


def _reduce_scatter(
    em: Emitter, site: AllReduceSite, wait: Node, region: Region, group: Group
) -> tuple[Node, Node]:
    """The all-reduce's operand reduce-scattered on its rows, shaped as the shard of the
    wait's value (the token rows first, then the rest of the value's dims)."""
    operand_node: Node = site.collective.args[0]  # type: ignore[assignment]
    before = site.collective
    width = val(operand_node).numel() // region.tokens
    flat = _reshape(em, operand_node, [region.tokens, width], before)
    scatter = em.add_node(
        c10d.reduce_scatter_tensor.default,
        (flat, site.reduce_op, group.size, site.group_name),
        before=before,
    )
    waited = em.add_node(c10d.wait_tensor.default, (scatter,), before=before)
    lead = region.lead(wait)
    assert lead is not None  # noqa: S101 - a wait of the tokens' product
    shape = _shard_shape(val(wait).shape, lead, region, group.size)
    return scatter, _reshape(em, waited, shape, wait)


def _shard_shape(shape: Sequence[dims.Size], lead: int, region: Region, n: int) -> list[dims.Size]:
    return [region.tokens // n, *shape[lead:]]


def _move_to_shard(
    em: Emitter,
    node: Node,
    how: str,
    shard: dict[Node, Node],
    region: Region,
    rows: _Rows,
) -> Node:
    """``node`` run on the shard, before the original (which stays until it is unread)."""
    if how == "getitem":
        return em.add_node(operator.getitem, (shard[node.args[0]], node.args[1]), before=node)  # type: ignore[index]
    lead = region.lead(node) if isinstance(node.meta.get("val"), torch.Tensor) else None

    def arg(a: Any) -> Any:
        if isinstance(a, Node) and a in shard:
            return shard[a]
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor) and lead:
            return _fit_replicated(em, a, node, lead, rows)
        return a

    if how in ("reshape", "expand"):
        assert lead is not None  # noqa: S101 - checked by ``region``
        source = shard[node.args[0]]  # type: ignore[index]
        shape = _shard_shape(val(node).shape, lead, region, rows.n)
        if how == "reshape":
            return _reshape(em, source, shape, node)
        return em.add_node(aten.expand.default, (source, em.compute_shape(shape, 0)), before=node)
    args, kwargs = tuple(arg(a) for a in node.args), {k: arg(v) for k, v in node.kwargs.items()}
    if how == "reduction":
        source_lead = region.lead(node.args[0])  # type: ignore[arg-type]
        assert source_lead is not None  # noqa: S101 - checked by ``region``
        reduced = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        shifted = [normalized_dim(node.args[0], d) - source_lead + 1 for d in reduced]  # type: ignore[arg-type, union-attr]
        if len(node.args) > 1:
            args = (args[0], shifted, *args[2:])
        else:
            kwargs["dim"] = shifted
    return em.add_node(node.target, args, kwargs, before=node)  # type: ignore[arg-type]


def _fit_replicated(em: Emitter, value: Node, reader: Node, lead: int, rows: _Rows) -> Node:
    """A replicated operand of ``reader`` as the shard meets it."""
    out = val(reader).shape
    shape = val(value).shape
    how = operand(shape, out, lead)
    trailing = ([1] * (len(out) - len(shape)) + list(shape))[lead:]
    if how == "broadcast":
        return _reshape(em, value, trailing, reader) if len(shape) > len(trailing) else value
    expanded = value
    if len(shape) < len(out):
        expanded = _reshape(em, value, [1] * (len(out) - len(shape)) + list(shape), reader)
    return rows.slice_own(expanded, lead, reader)


def _sum_tokens(em: Emitter, node: Node, shard: dict[Node, Node], group: Group) -> Node:
    """A sum over the tokens: this rank's rows summed, then all-reduced."""
    source = shard[node.args[0]]  # type: ignore[index]
    dtype = node.kwargs.get("dtype")
    partial = em.add_node(
        aten.sum.dim_IntList, (source, [0]), {"dtype": dtype} if dtype else None, before=node
    )
    partial = _reshape(em, partial, list(val(node).shape), node)
    reducing = em.add_node(c10d.all_reduce.default, (partial, "sum", group.name), before=node)
    reducing.meta[META] = {"token_sum": node.name}
    return em.add_node(c10d.wait_tensor.default, (reducing,), before=node)


def _allocate_full_sized(em: Emitter, node: Node, shard: dict[Node, Node]) -> Node:
    """An allocation like the whole value, from its shard's dtype and device."""
    source = shard[node.args[0]]  # type: ignore[index]
    shape = em.compute_shape(val(node).shape, 0)
    return em.add_node(FULL_SIZED[node.target], (source, shape), dict(node.kwargs), before=node)  # type: ignore[index]


def _gather(
    em: Emitter, shard: Node, value: Node, group: Group, readers: list[Node], region: Region
) -> Node:
    """``value`` rebuilt from every rank's shard: one all-gather of the token rows,
    before its first reader, with ``value``'s marks (it stands for the value). It is
    marked with whether a matmul reads it (the all-reduce's second half), or else why its
    readers need every token and what that costs. A value only the graph returns is
    gathered as soon as its shard is computed (on a joint graph, in the forward, not
    after the backward)."""
    before = min(readers, key=_order)
    if before.op == "output":
        before = shard.next
    if not val(shard).is_contiguous():
        contiguous = {"memory_format": torch.contiguous_format}
        shard = em.add_node(aten.clone.default, (shard,), contiguous, before=before, like=value)
    gathering = em.add_node(
        c10d.all_gather_into_tensor.default,
        (shard, group.size, group.name),
        before=before,
        like=value,
    )
    note: dict[str, Any] = {"from": "all_reduce", "for_matmul": any(map(for_matmul, readers))}
    if not note["for_matmul"]:
        whys = [region.whole[r].why for r in readers if r in region.whole]
        note["kept_whole"] = sorted({why.code for why in whys if why is not None})
        note["kept_whole_for"] = sorted({why.reason for why in whys if why is not None})
        note["kept_whole_bytes"] = nbytes(value)
    gathering.meta[META] = note
    gathered = em.add_node(c10d.wait_tensor.default, (gathering,), before=before, like=value)
    return _reshape(em, gathered, list(val(value).shape), before, like=value)


def _reshape(
    em: Emitter, node: Node, shape: Iterable[dims.Size], before: Node, like: Node | None = None
) -> Node:
    shape = list(shape)
    if dims.same_shape(val(node).shape, shape):
        return node
    return em.add_node(
        aten.reshape.default, (node, em.compute_shape(shape, 0)), before=before, like=like
    )
