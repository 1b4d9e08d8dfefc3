"""The CommFuse pass: canonical form -> match -> plan -> lower -> verify, over one
aten-level FX graph.

Every site is found before any is rewritten. A site the pass cannot prove correct or
profitable is declined with a reason and left untouched; an unexpected error inside
the pass declines the site (or, if the graph was already touched, restores the whole
graph) and warns, its traceback in the site's record and the log (``declines.failed``;
the ``strict`` option raises it): the user's compile never breaks because of this pass.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch.fx import Graph, GraphModule

from ..options import Options
from ..report import REPORT, BucketRecord, SiteRecord, dump_code, site_id
from ..runtime import groups
from ..schedules import by_name
from . import bucket, match, plan, verify
from .fx.declines import Declined, decline, failed
from .kit.rewrite import Rewrite, Taken, graph_digest, tag_of, transfers_digest
from .kit.site import Site
from .lower import lower, start
from .prepare import shard_tokens, unfuse
from .prepare.canonical import canonicalize
from .ranks import agree, order, program, sequence

T = TypeVar("T")
PASSED = "commfuse_graph"  # GraphModule.meta key: the pass ran on it (its graph's number)


def rewrite_graph(gm: GraphModule, graph_role: str, options: Options) -> list[SiteRecord]:
    """Rewrite ``gm`` in place; returns one record per site found (also in the report).
    The ranks agree on the graph's order of transfers: the graph runs node by node (eager
    FX), or Inductor compiles it afterwards with that order of starts pinned
    (``inner="inductor"``: the Inductor pass, where no program is read back)."""
    result = _rewrite(gm, graph_role, options)
    try:
        why = _agree(result, gm, options, result.graph_events)
        if why is not None and _changed(result):
            _fall_back(result, why)  # the restored graph recompiles
    finally:
        _finish(result, options)
    return result.records


def decline_graph(
    gm: GraphModule, graph_role: str, options: Options, why: Declined
) -> list[SiteRecord]:
    """Leave ``gm`` as it is; every site it has is recorded declined for ``why``."""
    graph_index = REPORT.new_graph(options.described())
    gm.meta[PASSED] = graph_index
    records = _declined_records(gm, graph_index, graph_role, why, options)
    REPORT.finish_graph(records, graph_role, options.debug_dir, options.measure)
    return records


def rewrite_and_compile(
    gm: GraphModule,
    graph_role: str,
    options: Options,
    compile_fn: Callable[[GraphModule], T],
    program_of: Callable[[T], str | None] | None = None,
) -> T:
    """Rewrite ``gm``, then compile it. ``program_of`` gives the code the compiler
    generated, which is checked for buffers reused or written while a transfer uses them
    (``program.check``) and compared across the ranks: they must start their transfers
    in one order, and run together they must complete (``_agree``). Should the compiler
    reject the rewritten graph, or its program fail either check, warn, record every
    site as declined and compile the original graph (on every rank, for the second)."""
    result = _rewrite(gm, graph_role, options)
    try:
        return _compile_and_check(gm, result, options, compile_fn, program_of)
    finally:
        _finish(result, options)


def _compile_and_check(
    gm: GraphModule,
    result: _Result,
    options: Options,
    compile_fn: Callable[[GraphModule], T],
    program_of: Callable[[T], str | None] | None,
) -> T:
    checked: program.Result | None = None
    try:
        compiled = compile_fn(gm)
        if _rewritten(result) and program_of is not None:
            checked = _check_program(program_of(compiled), options, result)
    except Exception as err:
        if not _changed(result):
            raise
        outcome = "compiling the original graph"
        _fall_back(result, failed(err, options.strict, outcome, "compiler.failed"))
        compiled = compile_fn(gm)
    why = _agree(result, gm, options, checked.sequence if checked is not None else None)
    if why is not None and _changed(result):
        _fall_back(result, why)
        compiled = compile_fn(gm)
    return compiled


@dataclasses.dataclass
class _Result:
    """One graph's pass: its records, how to restore it, and what every site's group
    must agree on (``_agree``)."""

    records: list[SiteRecord]
    original: _Original
    graph_index: int
    graph_role: str
    groups: dict[str, tuple[groups.Group, dict[str, Any]]]  # site id -> (group, inputs)
    digest: int = 0  # the graph as it came (``rewrite.graph_digest``): equal on every rank
    ops: list[str] = dataclasses.field(default_factory=list)  # its ops, to name a difference
    # the rewritten graph's transfers in node order, read before ``order.keep_order`` wraps
    # them in control_deps (the order it pins); None: read from the graph as it is
    graph_events: list[sequence.Event] | None = None
    buckets: list[BucketRecord] = dataclasses.field(default_factory=list)  # ``bucket``'s


def _changed(result: _Result) -> bool:
    """Does the graph run other than it came: a site rewritten, or collectives merged?"""
    return bool(result.buckets or _rewritten(result))


def _rewritten(result: _Result) -> list[SiteRecord]:
    return [r for r in result.records if r.decision == "rewritten"]


def _fall_back(result: _Result, why: Declined) -> None:
    """Restore the graph as it came and record every rewritten site as declined (a
    failure warned as it became ``why``: ``declines.failed``)."""
    if why.code not in agree.WARNED and not why.traceback:
        warnings.warn(f"commfuse: {why.reason}; compiling the original graph", stacklevel=3)
    result.original.restore()
    for record in _rewritten(result):
        record.declined(why)
    for record in result.records:
        if record.bucket >= 0:
            record.not_bucketed(why.code, why.reason)
    result.buckets = []


def _agree(
    result: _Result, gm: GraphModule, options: Options, events: list[sequence.Event] | None = None
) -> Declined | None:
    """The ranks' verdict on this graph (``agree.agree``)."""
    identity = (result.digest, result.ops)
    return agree.agree(result.records, result.groups, gm.graph, identity, options, events)


def _finish(result: _Result, options: Options) -> None:
    """The graph's decisions are final: into the report."""
    REPORT.finish_graph(
        result.records, result.graph_role, options.debug_dir, options.measure, result.buckets
    )


class _Original:
    """The graph as it came, copied only when a site is about to change it (a graph
    whose sites are all declined costs no copy)."""

    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.graph: Graph | None = None

    def keep(self) -> None:
        if self.graph is None:
            self.graph = copy.deepcopy(self.gm.graph)

    def restore(self) -> None:
        if self.graph is not None:
            self.gm.graph = self.graph  # recompiles
            self.graph = None  # the graph as it came is the live one: a change copies it again


def _check_program(code: str | None, options: Options, result: _Result) -> program.Result:
    """Decline the graph's rewrites unless the generated program keeps every transfer's
    memory intact until its wait; record the steps whose overlap the compiler lost."""
    if code is None:
        raise decline("compiler.unreadable")
    dump_code(options.debug_dir, result.graph_index, result.graph_role, "inductor", lambda: code)
    try:
        checked = program.check(code, groups.ranks_of)
    except Exception as err:  # noqa: BLE001 - unreadable code, or a fault of the check
        outcome = "compiling the original graph"
        raise failed(err, options.strict, outcome, "compiler.unverifiable") from None
    if checked.violations:
        shown = "; ".join(checked.violations[:3])
        raise decline("compiler.breaks_buffer", violations=shown)
    for record in _rewritten(result):
        prefix = f"site {record.site} "
        record.exposed([e for e in checked.exposed if e.startswith(prefix)])
    return checked


def _rewrite(gm: GraphModule, graph_role: str, options: Options) -> _Result:
    graph_index = REPORT.new_graph(options.described())
    gm.meta[PASSED] = graph_index
    dump_code(options.debug_dir, graph_index, graph_role, "before", lambda: gm.code)
    result = _Result([], _Original(gm), graph_index, graph_role, {})
    try:
        keep = result.original.keep
        result.digest = graph_digest(gm.graph)  # as it came: the same on every rank
        result.ops = agree.graph_ops(gm.graph)
        tags = transfers_digest(gm.graph)
        canonical = canonicalize(gm.graph, before_change=keep)
        split = unfuse.split_fused_projections(gm.graph, before_change=keep)
        sharded = shard_tokens.split_planned(gm, options, keep)
        rewrites = _rewrite_sites(gm, options, result, tags)
        if (canonical or split or sharded) and not rewrites:
            result.original.restore()
        result.buckets = bucket.merge_collectives(
            gm, result.records, options, graph_role, graph_index, keep, result.groups
        )
        if rewrites and options.inner == "inductor":
            result.graph_events = sequence.from_graph(gm.graph, groups.ranks_of)
            order.keep_order(gm.graph, (s for rw in rewrites for s in rw.steps))
        if (rewrites or result.buckets) and options.inner != "inductor":  # Inductor does
            gm.graph.lint()
            gm.recompile()
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        why = failed(err, options.strict, "graph left as it was")
        result.original.restore()
        result.groups.clear()
        result.buckets = []
        result.records = _declined_records(gm, graph_index, graph_role, why, options)
    dump_code(options.debug_dir, graph_index, graph_role, "after", lambda: _code(gm))
    return result


def _code(gm: GraphModule) -> str:
    """The graph's code as it is now (Inductor's input is not recompiled by the pass)."""
    return gm.graph.python_code("self").src


def _rewrite_sites(gm: GraphModule, options: Options, result: _Result, tags: int) -> list[Rewrite]:
    """Find every site once, then rewrite them in graph order. A rewrite changes only the
    nodes around its own site, so a later site is matched again where it stands (its
    collective's neighbourhood, not the graph) once anything was rewritten: a matmul an
    earlier site took is declined with the site that took it. A site declined as found
    keeps its reason."""
    rewrites: list[Rewrite] = []
    taken = Taken()
    for ordinal, found in enumerate(match.find_sites(gm.graph)):
        site = match.rematch(found, taken) if rewrites and not found.declined else found
        record = _record(site, result.graph_index, result.graph_role, ordinal)
        result.records.append(record)
        rewrite = _rewrite_site(gm, site, options, result, record, tag_of(tags, ordinal), taken)
        if rewrite is not None:
            taken.add(rewrite)
            for earlier in rewrites:
                earlier.nest(rewrite)
            rewrites.append(rewrite)
    return rewrites


def _rewrite_site(
    gm: GraphModule,
    site: Site,
    options: Options,
    result: _Result,
    record: SiteRecord,
    tag: int,
    taken: Taken,
) -> Rewrite | None:
    """Plan, lower, verify and commit one site: its rewrite, or None (declined, with the
    reason in ``record``)."""
    rewrite = None
    try:
        if site.declined:
            raise site.declined.error()
        group = plan.site_group(site, options)
        inputs = plan.decision_inputs(options, plan.profile_for(site, options))
        result.groups[record.site] = (group, inputs)
        site, predicted, chosen = plan.plan_site(site, group, options, record)
        result.original.keep()
        rewrite = start(site, record.site, tag, gm.graph, taken, options.measure)
        schedule = by_name(chosen.schedule)
        lower(rewrite, group, schedule, options.slices)
        verify.check_emitted(rewrite)
        verify.check_exchange(rewrite, group, schedule, options.slices)
        rewrite.commit(rewrite.site.replaced())
        verify.check_committed(rewrite)
    except Exception as err:  # noqa: BLE001 - declines and internal errors alike
        if rewrite is not None and rewrite.committing:
            raise  # the graph is half rewritten: rewrite_graph restores all of it
        if rewrite is not None:
            rewrite.discard()
        record.declined(failed(err, options.strict, f"site {record.site} declined"))
        return None
    record.rewritten(
        chosen.schedule,
        chosen.why,
        _described(rewrite.site),  # some matmuls may be left out
        predicted[chosen.schedule].as_json(group.rank),
        [n.name for n in rewrite.created],
        len(rewrite.steps),
        rewrite.p2p_ops,
    )
    return rewrite


def _described(site: Site) -> dict[str, Any]:
    """What the report shows of a site: its match, and the split it came from."""
    return {**site.describe(), **site.anchor.meta.get(shard_tokens.META, {})}


def _record(site: Site, graph_index: int, graph_role: str, ordinal: int) -> SiteRecord:
    """The record of the graph's ``ordinal``-th site as matched: the one place a site's
    record is created; the stages add to it."""
    return SiteRecord(
        kind=site.kind,
        graph=graph_role,
        site=site_id(graph_index, ordinal),
        graph_index=graph_index,
        match=_described(site),
    )


def _declined_records(
    gm: GraphModule, graph_index: int, graph_role: str, why: Declined, options: Options
) -> list[SiteRecord]:
    """A record per site of ``gm`` (numbered as ``_rewrite_sites`` numbers them), each
    declined for ``why``; none if even matching fails (which warns too)."""
    try:
        sites = match.find_sites(gm.graph)
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        failed(err, options.strict, "the graph's sites are not recorded")
        return []
    return [
        _record(site, graph_index, graph_role, ordinal).declined(why)
        for ordinal, site in enumerate(sites)
    ]
