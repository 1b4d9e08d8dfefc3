"""Bucket stage: the collectives the sites leave in place, merged where it pays.

After the sites are rewritten, the all-reduces and reduce-scatters no site rewrote (a
norm weight's gradient summed over the ranks, sharded data parallelism's reduce-scatters
that no matmul feeds) each pay a collective's fixed cost. Those of one group, op, reduce
op and dtype whose values are first read after the last of them starts go as one: their
inputs flattened into one buffer (a reduce-scatter's rank-r blocks side by side in the
buffer's rank-r block), one collective, its output split and viewed back; each reader
then reads its part. torch's own merge does the rewriting (Inductor's bucketing pass,
which torchtitan's SimpleFSDP buckets with: ``merge_all_reduce_bucket``,
``merge_reduce_scatter_bucket``); this stage decides what to merge:

* in graph order, a collective joins the bucket before it unless a value of the bucket
  is read before it starts (the reader would wait for it; a collective whose input
  depends on the bucket's values is one such reader, so no cycle can form);
* and unless the cost model predicts more exposed communication merged than apart, by
  ``plan``'s margin: each collective apart is exposed for its time less the matmuls
  between it and its wait; merged, one collective of all the bytes (and the copy into
  its buffer) starts where the last one stood and is waited before the first reader.

The graph is the same on every rank (the ranks agree on its digest) and so are the
options and the profile: every rank merges the same collectives. Each collective's site
record says its bucket, or why it has none (a ``bucket.*`` code); report.json's
``buckets`` lists what went where, the bytes and the predicted saving.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.fx_passes.bucketing import (
    merge_all_reduce_bucket,
    merge_reduce_scatter_bucket,
)
from torch.fx import GraphModule, Node

from ..cost.profiles import Profile
from ..options import Options
from ..report import BucketRecord, SiteRecord
from ..runtime import groups
from ..runtime.groups import ranks_of
from . import plan
from .fx import dims
from .fx.collectives import WAIT_TENSOR
from .fx.declines import Declined, decline
from .fx.graph import VIEWS, position, val
from .fx.matmuls import flops_of, rate_class_of

c10d = torch.ops._c10d_functional
ALL_REDUCE, REDUCE_SCATTER = c10d.all_reduce.default, c10d.reduce_scatter_tensor.default
OPS = {ALL_REDUCE: "all_reduce", REDUCE_SCATTER: "reduce_scatter"}
MERGE = {ALL_REDUCE: merge_all_reduce_bucket, REDUCE_SCATTER: merge_reduce_scatter_bucket}
DISABLE = "bucket"  # the name ``disable`` switches the stage off with
META = "commfuse_bucket"  # node.meta key of a merged collective: its bucket's number


@dataclasses.dataclass
class _Member:
    """One collective that could go into a bucket: its wait, its site's record, what the
    collectives of one bucket share (op, reduce op, group, dtype, device), its input's
    bytes, the views of its value (free: they move with the wait) and the first node that
    reads it otherwise."""

    collective: Node
    wait: Node
    record: SiteRecord
    key: tuple[Any, ...]
    nbytes: int
    views: list[Node]
    first_read: Node


@dataclasses.dataclass
class _Bucket:
    """Collectives to merge, and the cost model's exposed seconds apart and merged."""

    members: list[_Member]
    apart_s: float
    merged_s: float
    profile: Profile


def merge_collectives(
    gm: GraphModule,
    records: Sequence[SiteRecord],
    options: Options,
    graph_role: str,
    graph_index: int,
    before_change: Callable[[], None],
    planned: dict[str, tuple[groups.Group, dict[str, Any]]],
) -> list[BucketRecord]:
    """Merge the collectives of ``records``' sites left in place where it pays; returns
    the buckets made (numbered in graph order), and records each site's bucket or why
    it has none. Every bucket is decided on the graph as it came, then merged. Each
    merged site's group and what the decision depended on go into ``planned``: the ranks
    compare them (``ranks.agree``) as they compare the rewritten sites'."""
    if options.schedule == "off":
        return []
    members, timing = _members(gm, records), _Timing(gm)
    if DISABLE in options.disable:
        for member in members:
            _not_bucketed(member, decline("bucket.disabled"))
        return []
    buckets = [b for group in _by_key(members).values() for b in _buckets(group, timing, options)]
    buckets.sort(key=lambda b: position(b.members[0].collective))
    made = []
    for number, bucket in enumerate(buckets):
        before_change()
        made.append(_merge(gm, bucket, graph_role, graph_index, number))
        inputs = plan.decision_inputs(options, bucket.profile)
        group = groups.resolve(made[-1].group, len(ranks_of(made[-1].group)))
        planned.update({site: (group, inputs) for site in made[-1].sites})
    return made


def _members(gm: GraphModule, records: Sequence[SiteRecord]) -> list[_Member]:
    """The all-reduces and reduce-scatters of the sites left in place, in graph order;
    those that cannot go into a bucket get the reason in their record."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "call_function" and n.target in OPS}
    members = []
    for record in records:
        if record.decision == "rewritten":
            continue
        for name in record.match.get("collectives", ()):
            node = by_name.get(name)
            if node is None or "commfuse" in node.meta:
                continue
            try:
                members.append(_member(node, record))
            except Declined as why:
                _not_bucketed(record, why)
    return sorted(members, key=lambda m: position(m.collective))


def _member(node: Node, record: SiteRecord) -> _Member:
    """``node`` as a bucket's member; declined where torch's merge cannot take it."""
    users = list(node.users)
    if len(users) != 1 or users[0].target is not WAIT_TENSOR:
        raise decline("bucket.unfit", node=node.name, why="is not read by its wait alone")
    views, readers = _views_and_readers(users[0])
    if not readers:
        raise decline("bucket.unfit", node=node.name, why="is never read")
    if len(ranks_of(str(node.args[-1]))) < 2:
        raise decline("bucket.unfit", node=node.name, why="runs on no group of 2+ ranks known here")
    value, out = val(node.args[0]), val(node)  # type: ignore[arg-type]
    if dims.is_symbolic(value.shape):
        shape = dims.as_json(value.shape)
        raise decline("bucket.unfit", node=node.name, why=f"has a symbolic shape {shape}")
    key = (node.target, *node.args[1:], out.dtype, out.device)
    nbytes = value.numel() * value.element_size()
    return _Member(node, users[0], record, key, nbytes, views, min(readers, key=position))


def _views_and_readers(wait: Node) -> tuple[list[Node], list[Node]]:
    """The views of ``wait``'s value (views of views too), in graph order, and the nodes
    that read the value or a view of it otherwise."""
    views: list[Node] = []
    readers: list[Node] = []
    frontier = list(wait.users)
    while frontier:
        node = frontier.pop()
        if node.target in VIEWS and node.args[0] in (wait, *views):
            views.append(node)
            frontier += node.users
        else:
            readers.append(node)
    return sorted(set(views), key=position), readers


def _by_key(members: list[_Member]) -> dict[tuple[Any, ...], list[_Member]]:
    """Members by what a bucket's collectives share, each list in graph order; a member
    alone with its key gets the reason."""
    by_key: dict[tuple[Any, ...], list[_Member]] = {}
    for member in members:
        by_key.setdefault(member.key, []).append(member)
    for group in by_key.values():
        if len(group) == 1:
            _not_bucketed(group[0], decline("bucket.alone", **_described(group[0].collective)))
    return by_key


def _buckets(group: list[_Member], timing: _Timing, options: Options) -> list[_Bucket]:
    """``group``'s buckets of two or more, in graph order: each collective joins the
    bucket before it where it may and the cost model says it pays (``_joins``)."""
    profile = plan.profile_of(group[0].collective, options)
    buckets: list[list[_Member]] = [[group[0]]]
    for member in group[1:]:
        why = _joins(buckets[-1], member, timing, profile)
        if why is None:
            buckets[-1].append(member)
            continue
        for alone in (*(buckets[-1] if len(buckets[-1]) == 1 else ()), member):
            _not_bucketed(alone, why)
        buckets.append([member])
    return [
        _Bucket(
            bucket,
            sum(timing.exposed_s([m], profile) for m in bucket),
            timing.exposed_s(bucket, profile),
            profile,
        )
        for bucket in buckets
        if len(bucket) > 1
    ]


def _joins(
    bucket: list[_Member], member: _Member, timing: _Timing, profile: Profile
) -> Declined | None:
    """None if ``member`` may join ``bucket``, else why not: a value of the bucket is read
    before ``member`` starts, or merged is not predicted faster by ``plan``'s margin."""
    early = next((m for m in bucket if position(m.first_read) < position(member.collective)), None)
    if early is not None:
        reader, later = early.first_read.name, member.collective.name
        return decline("bucket.read_early", node=early.collective.name, reader=reader, later=later)
    apart = timing.exposed_s(bucket, profile) + timing.exposed_s([member], profile)
    merged = timing.exposed_s([*bucket, member], profile)
    if plan.auto_choice({"collective": apart, "bucket": merged}) == "bucket":
        return None
    others = ", ".join(m.collective.name for m in bucket)
    return decline(
        "bucket.not_profitable",
        others=others,
        merged_us=merged * 1e6,
        apart_us=apart * 1e6,
        gain=plan.MIN_GAIN - 1,
    )


class _Timing:
    """Exposed communication as the cost model predicts it on the graph as it came: a
    collective's time less the matmuls between its start and its wait (other ops taken
    as free)."""

    def __init__(self, gm: GraphModule) -> None:
        self.order = {node: i for i, node in enumerate(gm.graph.nodes)}
        # the matmuls' FLOPs before each node, by class (each has its rate)
        rated = [(flops_of(n), rate_class_of(n)) for n in gm.graph.nodes]
        self.flops = {
            rate_class: list(
                itertools.accumulate((f if c == rate_class else 0.0 for f, c in rated), initial=0.0)
            )
            for rate_class in {c for f, c in rated if f}
        }

    def exposed_s(self, bucket: list[_Member], profile: Profile) -> float:
        """Of ``bucket`` as one collective: started where its last member stands, waited
        before the first reader of any; one member: as the graph has it."""
        start = bucket[-1].collective
        if len(bucket) == 1:
            end, copy_s = bucket[0].wait, 0.0
        else:
            end = min((m.first_read for m in bucket), key=self.order.__getitem__)
            # the copy into its buffer: one read and one write (an add's two of three)
            copy_s = profile.add_s(sum(m.nbytes for m in bucket)) * 2 / 3
        nbytes = sum(m.nbytes for m in bucket)
        took = plan.collective_seconds(start, nbytes, profile) + copy_s
        between = {
            rate_class: flops[self.order[end]] - flops[self.order[start]]
            for rate_class, flops in self.flops.items()
        }
        hidden = sum(profile.matmul_s(f, matmul_class=c) for c, f in between.items() if f)
        return max(0.0, took - hidden)


def _merge(
    gm: GraphModule, bucket: _Bucket, graph_role: str, graph_index: int, number: int
) -> BucketRecord:
    """One collective for ``bucket`` (torch's merge) where its last member stood, its wait
    before the first reader of any member's value; the bucket's record."""
    members = bucket.members
    first_read = min((m.first_read for m in members), key=position)
    collectives = [m.collective for m in members]
    described = _described(collectives[0])
    merge = MERGE[collectives[0].target]  # type: ignore[index]
    new_nodes, _ = merge(gm.graph, collectives, wait_insertion_point=first_read)
    for view in (view for m in members for view in m.views):  # now after the wait
        first_read.prepend(view)
    next(n for n in new_nodes if n.target in OPS).meta[META] = number
    for member in members:  # (one that could not join the bucket before it has a reason)
        member.record.bucketed(number)
    return BucketRecord(
        graph=graph_role,
        graph_index=graph_index,
        bucket=number,
        collectives=[c.name for c in collectives],
        sites=[m.record.site for m in members],
        bytes=[m.nbytes for m in members],
        predicted_us={"apart": _us(bucket.apart_s), "bucketed": _us(bucket.merged_s)},
        saving_us=_us(bucket.apart_s - bucket.merged_s),
        profile=bucket.profile.name,
        nodes=[n.name for n in new_nodes],
        **described,
    )


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def _described(collective: Node) -> dict[str, str]:
    """A collective's op, reduce op, group and dtype, as reasons and records name them."""
    return {
        "op": OPS[collective.target],  # type: ignore[index]
        "reduce_op": str(collective.args[1]),
        "group": str(collective.args[-1]),
        "dtype": str(val(collective).dtype).removeprefix("torch."),
    }


def _not_bucketed(member: _Member | SiteRecord, why: Declined) -> None:
    record = member.record if isinstance(member, _Member) else member
    record.not_bucketed(why.code, why.reason)
