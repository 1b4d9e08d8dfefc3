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

Before a training graph is partitioned the split runs on its joint graph (forward and
backward in one: ``passes/joint.py``), so that the backward's all-reduces (each
column-parallel input's gradient) are split the same way, and what the backward reads of
the region is the rank's shard: AOTAutograd saves shards, as hand-written sequence
parallelism does. Graphs without a backward (inference, exported programs) are split as
they come. Which nodes move: ``region``; the new nodes: ``build``.

    # before (plain TP)                   # after (sequence parallelism)
    y = all_reduce(x @ w_o)               y = reduce_scatter(x @ w_o)      # mm_rs
    h = norm(residual + y)                h = norm(residual[rows] + y)     # 1/n tokens
    q = h @ w_q                           q = all_gather(h) @ w_q          # ag_mm
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule

from ....cost.simulator import Work, collective_s
from ....options import Options
from ....runtime.groups import Group
from ....schedules import Direction
from ... import match, plan
from ...fx import dims
from ...fx.collectives import saved_unwaited
from ...fx.declines import Declined, decline
from ...fx.graph import val
from ...kit.all_reduce import AllReduceSite, all_reduces
from ...kit.reduced import REDUCE_OPS
from ..merge_reduces import merge_summed
from .build import META, emit_split
from .region import nbytes, region_after

c10d = torch.ops._c10d_functional
GATHER = c10d.all_gather_into_tensor.default
ALL_REDUCE = c10d.all_reduce.default
Change = Callable[[], None]  # called before the graph is first changed

__all__ = ["ALL_REDUCE", "GATHER", "META", "not_split", "split_all_reduces", "split_planned"]


def split_planned(gm: GraphModule, options: Options, before_change: Change) -> bool:
    """Split plain tensor parallelism's all-reduces into sequence parallelism's
    reduce-scatter and all-gathers where the all-reduce's own site could be rewritten;
    did the graph change? Under ``auto`` the split stays only if the plan predicts its
    sites (the reduce-scatters' rings and the gathers' rings into the next matmuls) take
    less time than the all-reduces' own sites would, each as the plan would run it
    (``_split_faster``): a few tokens' all-reduce (decode) stays. An all-reduce decided
    on before (the joint graph's, in its forward or backward graph) keeps that
    decision."""
    sites = [s for s in all_reduces(gm.graph) if META not in s.collective.meta]
    if not sites:
        return False
    planned = {site.collective: plan.plannable(site, options) for site in sites}
    auto = options.schedule == "auto"
    unsplit = copy.deepcopy(gm.graph) if auto else None
    whole = {site.collective: plan.site_times(site, options) for site in sites} if auto else {}
    if not split_all_reduces(gm.graph, sites, planned.__getitem__, before_change, options.strict):
        return False
    why = _split_faster(gm.graph, whole, options) if unsplit is not None else None
    if unsplit is not None and why is not None:
        for node in unsplit.find_nodes(op="call_function", target=ALL_REDUCE):
            if META not in node.meta:
                node.meta[META] = not_split(why, node)
        gm.graph = unsplit
        return False
    return True


def split_all_reduces(
    graph: Graph,
    sites: Sequence[AllReduceSite],
    group_of: Callable[[Any], Group | Declined],
    before_change: Change,
    strict: bool,
) -> bool:
    """Split the all-reduces of ``sites`` whose collective ``group_of`` admits (their
    group, or why the site is left as it is), those of one group and token count
    together; did any change? A site declined for having no matmul (``ar.not_matmul``: a
    vocabulary-parallel embedding's lookup) is split too: its reduce-scatter hides
    nothing, the gather after the norm does. All-reduced values added together are
    reduce-scattered as one (``merge_reduces``). Every all-reduce left whole is marked
    with why (``META``: ``not_split``). ``strict``: a failure to build a split raises
    (``declines.failed``)."""
    # by group and token count (a symbolic count by its expression: a SymInt is unhashable)
    together: dict[tuple[str, object], tuple[dims.Size, list[tuple[AllReduceSite, Group]]]] = {}
    for site in sites:
        tokens = _tokens(site)
        group = tokens if isinstance(tokens, Declined) else group_of(site.collective)
        if isinstance(group, Declined):
            why = group if group is tokens else decline("split.planned", why=group.reason)
            site.collective.meta[META] = not_split(why, site.collective)
            continue
        assert not isinstance(tokens, Declined)  # noqa: S101 - for mypy
        key = (site.group_name, dims.key(tokens))
        together.setdefault(key, (tokens, []))[1].append((site, group))
    changed = False
    for tokens, members in together.values():
        region = region_after(graph, tokens, {s.wait: s for s, _ in members})
        whys = [region.whole[r].why for rs in region.gathered.values() for r in rs]
        if None not in whys:
            read = sorted({f"{w.code}: {w.reason}" for w in whys if w is not None})
            why = decline("split.no_matmul_after", read="; ".join(read) or "nothing")
            for site, _ in members:
                site.collective.meta[META] = not_split(why, site.collective)
            continue
        before_change()
        waits = merge_summed(graph, set(region.sources), before_change)
        if waits != set(region.sources):  # the sums of all-reduced values, one each
            merged = {s.wait: s for s in all_reduces(graph) if s.wait in waits}
            region = region_after(graph, tokens, merged)  # type: ignore[arg-type]
        changed |= emit_split(graph, region, members[0][1], strict)
    return changed


def not_split(why: Declined, all_reduce: Any) -> dict[str, Any]:
    """What the report shows of an all-reduce left whole: the code, the reason and the
    bytes every rank keeps whole that the split would have sharded."""
    return {
        "not_split": why.code,
        "not_split_reason": why.reason,
        "whole_bytes": nbytes(all_reduce),
    }


def _tokens(site: AllReduceSite) -> dims.Size | Declined:
    """The rows the all-reduce's value is split into: its product's rows, or for an
    all-reduce of no matmul (a vocabulary-parallel embedding's lookup) the value's rows
    before its last dim; why not, where the site is declined otherwise or n does not
    divide them."""
    if saved_unwaited(site.collective):
        return decline("split.unwaited")
    if site.declined is None:
        return site.product_shape[0]
    if site.declined.code in ("ar.indivisible", "ar.not_provably_divisible"):
        return decline("split.indivisible", why=site.declined.reason)
    waited = site.wait.target is c10d.wait_tensor.default and bool(site.wait.users)
    if site.declined.code != "ar.not_matmul" or site.reduce_op not in REDUCE_OPS or not waited:
        return decline("split.site", why=site.declined.reason)
    shape = val(site.collective).shape
    rows = math.prod(shape[:-1])
    if len(shape) < 2:
        return decline("split.site", why=site.declined.reason)
    if not dims.divisible(rows, site.group_size):
        why = f"{site.group_size} ranks do not divide its {rows} rows"
        return decline("split.indivisible", why=why)
    return rows


def _split_faster(
    graph: Graph, whole: dict[Any, plan.SiteTimes | None], options: Options
) -> Declined | None:
    """Why the split is not kept (``split.not_profitable``), or None: the split's sites
    as planned, plus the gathers no matmul reads (values read whole: bytes the
    all-reduce did not move), less the matmuls of the gathers' sites (which the
    all-reduces' alternative runs outside any site), against the split all-reduces' own
    sites as planned (``whole``: by all-reduce, predicted before the split), decided by
    the rule that decides every site (``plan.pays``). Totals, not per-site gains: merged
    all-reduces (one reduce-scatter for q, k and v's input gradients) save the
    collectives they remove."""
    split = [s for s in match.find_sites(graph) if META in s.anchor.meta]
    gone = [t for c, t in whole.items() if c not in graph.nodes and t is not None]
    whole_s = sum(t.planned_s for t in gone)
    split_s = 0.0
    for site in split:
        times = plan.site_times(site, options)
        if times is not None:
            split_s += times.planned_s - (times.matmuls_s if site.kind == "ag_mm" else 0.0)
    if split:
        profile = plan.profile_for(split[0], options)
        for gather in graph.find_nodes(op="call_function", target=GATHER):
            if not gather.meta.get(META, {"for_matmul": True})["for_matmul"]:
                n = int(gather.args[1])  # type: ignore[arg-type, call-overload]
                block = nbytes(gather.args[0])  # type: ignore[arg-type]
                split_s += collective_s(Work(Direction.GATHER, n, 0.0, block), profile)
    if plan.pays(split_s, whole_s):
        return None
    return decline(
        "split.not_profitable",
        split_us=split_s * 1e6,
        whole_us=whole_s * 1e6,
        gain=plan.MIN_GAIN - 1,
    )
