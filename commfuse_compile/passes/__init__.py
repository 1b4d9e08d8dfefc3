"""The CommFuse pass: match -> plan -> lower -> verify, over one aten-level FX graph.

Every site is found before any is rewritten. A site the pass cannot prove correct or
profitable is declined with a reason and left untouched; an unexpected error inside
the pass declines the site (or, if the graph was already touched, restores the whole
graph) and warns: the user's compile never breaks because of this pass.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch.fx import Graph, GraphModule

from ..cost.profiles import Profile
from ..cost.simulator import collective_model, predict
from ..options import Options
from ..report import REPORT, SiteRecord, dump_code
from ..runtime import groups
from ..schedules import by_name
from . import match, order, program, unfuse, verify
from .declines import Declined, decline
from .graph import position
from .kinds import of
from .lower import lower, site_nodes, start
from .plan import check_applies, plan, plan_options, profile_for, site_work
from .rewrite import Rewrite
from .site import Site

_site_ids = itertools.count()
T = TypeVar("T")


def rewrite_graph(gm: GraphModule, graph_kind: str, options: Options) -> list[SiteRecord]:
    """Rewrite ``gm`` in place; returns one record per site found (also in the report)."""
    result = _rewrite(gm, graph_kind, options)
    _finish(result, options)
    return result.records


def rewrite_and_compile(
    gm: GraphModule,
    graph_kind: str,
    options: Options,
    compile_fn: Callable[[GraphModule], T],
    program_of: Callable[[T], str | None] | None = None,
) -> T:
    """Rewrite ``gm``, then compile it. ``program_of`` gives the code the compiler
    generated, which is checked for buffers reused or written while a transfer uses them
    (``program.check``). Should the compiler reject the rewritten graph, or its program
    fail that check, warn, record every site as declined and compile the original graph."""
    result = _rewrite(gm, graph_kind, options)
    rewritten = [r for r in result.records if r.decision == "rewritten"]
    try:
        compiled = compile_fn(gm)
        if rewritten and program_of is not None:
            _check_program(program_of(compiled), rewritten, options, result)
            if options.debug_dir:
                REPORT.write(options.debug_dir)
    except Exception as err:
        if not rewritten:
            raise
        why = err if isinstance(err, Declined) else decline("compiler.failed", error=_brief(err))
        warnings.warn(f"commfuse: {why.reason}; compiling the original graph", stacklevel=2)
        result.original.restore()
        for record in rewritten:
            record.decision, record.schedule = "declined", "off"
            record.declined(why)
        if options.debug_dir:
            REPORT.write(options.debug_dir)
        compiled = compile_fn(gm)
    _finish(result, options)
    return compiled


@dataclasses.dataclass
class _Result:
    """One graph's pass: its records, how to restore it, and what every site's group
    must agree on (``groups.agree``)."""

    records: list[SiteRecord]
    original: _Original
    graph_index: int
    graph_kind: str
    groups: dict[int, tuple[groups.Group, dict[str, Any]]]  # site id -> (group, inputs)


def _finish(result: _Result, options: Options) -> None:
    """The graph's decisions are final: check that the ranks agree, then log them."""
    _agree(result)
    REPORT.log_graph(result.records, result.graph_kind)
    if options.measure and options.debug_dir:
        REPORT.write_at_exit(options.debug_dir)


def _agree(result: _Result) -> None:
    """Every group's ranks decided alike on this graph, from the same inputs."""
    by_group: dict[str, tuple[groups.Group, dict[str, Any], list[Any]]] = {}
    for record in result.records:
        if record.site in result.groups:
            group, inputs = result.groups[record.site]
            _, known, decisions = by_group.setdefault(group.name, (group, {}, []))
            known.update({k: sorted({*known.get(k, []), v}) for k, v in inputs.items()})
            decisions.append([record.kind, record.decision, record.schedule])
    for group, inputs, decisions in by_group.values():
        groups.agree(group, inputs, decisions)


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


def _check_program(
    code: str | None, rewritten: list[SiteRecord], options: Options, result: _Result
) -> None:
    """Decline the graph's rewrites unless the generated program keeps every transfer's
    memory intact until its wait; record the steps whose overlap the compiler lost."""
    if code is None:
        raise decline("compiler.unreadable")
    dump_code(options.debug_dir, result.graph_index, result.graph_kind, "inductor", lambda: code)
    try:
        checked = program.check(code)
    except Exception as err:  # noqa: BLE001 - unreadable code, or a fault of the check
        raise decline("compiler.unverifiable", error=_brief(err)) from None
    if checked.violations:
        shown = "; ".join(checked.violations[:3])
        raise decline("compiler.breaks_buffer", violations=shown)
    for record in rewritten:
        prefix = f"site {record.site} "
        record.exposed_steps = [e for e in checked.exposed if e.startswith(prefix)]


def _rewrite(gm: GraphModule, graph_kind: str, options: Options) -> _Result:
    graph_index = REPORT.graphs
    REPORT.graphs += 1
    dump_code(options.debug_dir, graph_index, graph_kind, "before", lambda: gm.code)
    result = _Result([], _Original(gm), graph_index, graph_kind, {})
    try:
        split = unfuse.split_fused_projections(gm.graph, before_change=result.original.keep)
        rewrites = _rewrite_sites(gm, options, result)
        if split and not rewrites:
            result.original.restore()
        if rewrites and options.inner == "inductor":
            order.keep_overlap_order(gm.graph, (s for rw in rewrites for s in rw.steps))
        if rewrites and options.inner != "inductor":  # Inductor lints and recompiles
            gm.graph.lint()
            gm.recompile()
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        warnings.warn(
            f"commfuse: internal error, graph left as it was: {_brief(err)}", stacklevel=2
        )
        result.original.restore()
        result.groups.clear()
        why = decline("internal.error", error=_brief(err))
        result.records = [
            SiteRecord(kind=s.kind, graph=graph_kind).declined(why) for s in _sites_or_none(gm)
        ]
    for record in result.records:
        REPORT.add(record)
    dump_code(options.debug_dir, graph_index, graph_kind, "after", lambda: _code(gm))
    if options.debug_dir:
        REPORT.write(options.debug_dir)
    return result


def _code(gm: GraphModule) -> str:
    """The graph's code as it is now (Inductor's input is not recompiled by the pass)."""
    return gm.graph.python_code("self").src


def _rewrite_sites(gm: GraphModule, options: Options, result: _Result) -> list[Rewrite]:
    """Find every site once, then rewrite them in graph order. A rewrite changes only the
    nodes around its own site, so a later site is matched again where it stands (its
    collective's neighbourhood, not the graph) once anything was rewritten: a matmul an
    earlier site took is declined with the site that took it. A site declined as found
    keeps its reason."""
    rewrites: list[Rewrite] = []
    for found in match.find_sites(gm.graph):
        site = match.rematch(found) if rewrites and not found.declined else found
        record = SiteRecord(
            kind=site.kind,
            graph=result.graph_kind,
            site=next(_site_ids),
            graph_index=result.graph_index,
            match=site.describe(),
        )
        result.records.append(record)
        rewrite = None
        collective_timeline: list[dict[str, object]] = []  # what runs if the site declines
        try:
            if site.declined:
                raise site.declined.error()
            group = _group(site)
            profile = profile_for(site, options)
            result.groups[record.site] = (group, _inputs(options, profile))
            site = _without_disabled(site, options.disable)
            plan_options(options)
            work = site_work(site, group.size)
            predicted = predict(work, profile, options.slices)
            record.predicted_us = {k: round(t.end_s * 1e6, 2) for k, t in predicted.items()}
            record.profile = profile.name
            record.collective_model = collective_model(work, profile)
            collective_timeline = predicted["collective"].as_json(group.rank)
            check_applies(predicted, options, site.kind)
            chosen = plan(predicted, options)
            record.timeline = predicted[chosen.schedule].as_json(group.rank)
            result.original.keep()
            rewrite = start(site, record.site, gm.graph)
            rewrite.timed = options.measure
            record.match = rewrite.site.describe()  # some matmuls may be left out
            schedule = by_name(chosen.schedule)
            lower(rewrite, group, schedule, options.slices)
            verify.check_emitted(rewrite)
            verify.check_exchange(rewrite, group, schedule, options.slices)
            rewrite.commit(site_nodes(rewrite.site))
            verify.check_committed(rewrite)
            _nest_windows(rewrites, rewrite)
        except Exception as err:  # noqa: BLE001 - declines and internal errors alike
            if rewrite is not None and rewrite.committing:
                raise  # the graph is half rewritten: rewrite_graph restores all of it
            if rewrite is not None:
                rewrite.discard()
            record.timeline = collective_timeline
            if isinstance(err, Declined):
                record.declined(err)
            else:
                record.declined(decline("internal.error", error=_brief(err)))
                warnings.warn(
                    f"commfuse: site {record.site} declined, {record.reason}", stacklevel=2
                )
            continue
        record.decision, record.schedule, record.reason = "rewritten", chosen.schedule, chosen.why
        record.nodes = [n.name for n in rewrite.created]
        record.steps, record.p2p_ops = len(rewrite.steps), rewrite.p2p_ops
        rewrites.append(rewrite)
    return rewrites


def _nest_windows(rewrites: list[Rewrite], inner: Rewrite) -> None:
    """Where ``inner`` replaced a matmul of an earlier rewrite's window (a nested ring,
    ``kinds/ag_mm``), that window now computes ``inner``'s whole ring: the order kept
    through Inductor (``order``) holds its transfer open over all of it. A ring that had
    to go before the window's transfer is only dropped from it."""
    replaced = inner.replace
    ring = [n for s in inner.steps for n in ([s.issue] if s.issue else []) + s.compute]
    first = min(inner.created, key=position)
    for rw in rewrites:
        for window in rw.steps:
            taken = [n for n in window.compute if n in replaced]
            if not taken:
                continue
            window.compute = [n for n in window.compute if n not in replaced]
            if window.issue is not None and position(window.issue) < position(first):
                window.compute += [*ring, *(replaced[n] for n in taken)]


def _group(site: Site) -> groups.Group:
    try:
        return groups.resolve(site.group_name, site.group_size)
    except groups.GroupError as err:
        raise decline("site.group", error=err) from None


def _inputs(options: Options, profile: Profile) -> dict[str, Any]:
    """What a rank's decisions depend on besides the graph: every rank must share it."""
    return {
        "schedule": options.schedule,
        "slices": options.slices,
        "disable": ",".join(sorted(options.disable)),
        "profile": f"{profile.name} {profile.fingerprint()}",
    }


def _without_disabled(site: Site, disabled: frozenset[str]) -> Site:
    """``disable``: decline a disabled kind; leave out the parts of a site it names."""
    if site.kind in disabled:
        raise decline("plan.kind_disabled", kind=site.kind)
    return of(site).without(site, disabled)


def _sites_or_none(gm: GraphModule) -> list[Site]:
    """The sites of a restored graph, for the report; none if even matching fails."""
    try:
        return match.find_sites(gm.graph)
    except Exception:  # noqa: BLE001
        return []


def _brief(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:300]}"
