"""The CommFuse pass: match -> plan -> lower -> verify, over one aten-level FX graph.

Every site is found before any is rewritten. A site the pass cannot prove correct or
profitable is declined with a reason and left untouched; an unexpected error inside
the pass declines the site (or, if the graph was already touched, restores the whole
graph) and warns: the user's compile never breaks because of this pass.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable
from typing import TypeVar

from torch.fx import Graph, GraphModule

from .. import groups
from ..options import Options
from ..report import REPORT, Declined, SiteRecord, decline, dump_code
from ..schedules import by_name
from . import match, order, program, verify
from .lower import Rewrite, lower, site_nodes, start
from .plan import plan, plan_options, predict

_site_ids = itertools.count()
T = TypeVar("T")


def rewrite_graph(gm: GraphModule, graph_kind: str, options: Options) -> list[SiteRecord]:
    """Rewrite ``gm`` in place; returns one record per site found (also in the report)."""
    return _rewrite(gm, graph_kind, options)[0]


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
    records, original, graph_index = _rewrite(gm, graph_kind, options)
    rewritten = [r for r in records if r.decision == "rewritten"]
    try:
        compiled = compile_fn(gm)
        if rewritten and program_of is not None:
            _check_program(program_of(compiled), rewritten, options, graph_index, graph_kind)
            if options.debug_dir:
                REPORT.write(options.debug_dir)
        return compiled
    except Exception as err:
        if not rewritten:
            raise
        reason = (
            err.reason
            if isinstance(err, Declined)
            else f"inner compiler failed on the rewritten graph: {_brief(err)}"
        )
        warnings.warn(f"commfuse: {reason}; compiling the original graph", stacklevel=2)
        original.restore()
        for record in rewritten:
            record.decision, record.schedule, record.reason = "declined", "off", reason
        if options.debug_dir:
            REPORT.write(options.debug_dir)
        return compile_fn(gm)


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
    code: str | None,
    rewritten: list[SiteRecord],
    options: Options,
    graph_index: int,
    graph_kind: str,
) -> None:
    """Decline the graph's rewrites unless the generated program keeps every transfer's
    memory intact until its wait; record the steps whose overlap the compiler lost."""
    if code is None:
        raise decline("the inner compiler's program cannot be read, so it cannot be verified")
    dump_code(options.debug_dir, graph_index, graph_kind, "inductor", lambda: code)
    try:
        result = program.check(code)
    except Exception as err:  # noqa: BLE001 - unreadable code, or a fault of the check
        raise decline(f"the inner compiler's program cannot be verified: {_brief(err)}") from None
    if result.violations:
        shown = "; ".join(result.violations[:3])
        raise decline(f"the inner compiler's program breaks a transfer's buffer: {shown}")
    for record in rewritten:
        prefix = f"site {record.site} "
        record.details["exposed_steps"] = [e for e in result.exposed if e.startswith(prefix)]


def _rewrite(
    gm: GraphModule, graph_kind: str, options: Options
) -> tuple[list[SiteRecord], _Original, int]:
    graph_index = REPORT.graphs
    REPORT.graphs += 1
    dump_code(options.debug_dir, graph_index, graph_kind, "before", lambda: gm.code)
    original = _Original(gm)
    try:
        records, rewrites = _rewrite_sites(gm, graph_kind, options, graph_index, original)
        if rewrites and options.inner == "inductor":
            order.keep_overlap_order(gm.graph, (s for rw in rewrites for s in rw.steps))
        if rewrites and options.inner != "inductor":  # Inductor lints and recompiles
            gm.graph.lint()
            gm.recompile()
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        warnings.warn(
            f"commfuse: internal error, graph left as it was: {_brief(err)}", stacklevel=2
        )
        original.restore()
        records = [
            SiteRecord(kind=s.kind, graph=graph_kind, reason=f"internal error: {_brief(err)}")
            for s in _sites_or_none(gm)
        ]
    for record in records:
        REPORT.add(record)
    dump_code(options.debug_dir, graph_index, graph_kind, "after", lambda: _code(gm))
    if options.debug_dir:
        REPORT.write(options.debug_dir)
    return records, original, graph_index


def _code(gm: GraphModule) -> str:
    """The graph's code as it is now (Inductor's input is not recompiled by the pass)."""
    return gm.graph.python_code("self").src


def _rewrite_sites(
    gm: GraphModule, graph_kind: str, options: Options, graph_index: int, original: _Original
) -> tuple[list[SiteRecord], list[Rewrite]]:
    """Find every site once, then rewrite them in graph order. A rewrite changes only the
    nodes around its own site, so a later site is matched again where it stands (its
    collective's neighbourhood, not the graph) once anything was rewritten: a matmul an
    earlier site took is declined with the site that took it. A site declined as found
    keeps its reason."""
    records: list[SiteRecord] = []
    rewrites: list[Rewrite] = []
    for found in match.find_sites(gm.graph):
        site = match.rematch(found) if rewrites and not found.declined else found
        record = SiteRecord(
            kind=site.kind,
            graph=graph_kind,
            site=next(_site_ids),
            details={"graph_index": graph_index, **site.describe()},
        )
        records.append(record)
        rewrite = None
        try:
            if site.declined:
                raise Declined(site.declined)
            _apply_disable(site, options.disable)
            plan_options(options)
            group = groups.resolve(site.group_name, site.group_size)
            predicted = predict(site, group.size, options)
            record.details["predicted_us"] = {
                k: round(t.end_s * 1e6, 2) for k, t in predicted.items()
            }
            chosen = plan(predicted, options)
            record.details["timeline"] = predicted[chosen.schedule].as_json(group.rank)
            original.keep()
            rewrite = start(site, record.site, gm.graph)
            record.details.update(site.describe())  # start may leave some matmuls out
            schedule = by_name(chosen.schedule)
            lower(rewrite, group, schedule, options.slices)
            verify.check_emitted(rewrite)
            verify.check_exchange(rewrite, group, schedule, options.slices)
            rewrite.commit(site_nodes(site))
            verify.check_committed(rewrite)
        except Exception as err:  # noqa: BLE001 - declines and internal errors alike
            if rewrite is not None and rewrite.committing:
                raise  # the graph is half rewritten: rewrite_graph restores all of it
            if rewrite is not None:
                rewrite.discard()
            if isinstance(err, Declined):
                record.reason = err.reason
            else:
                record.reason = f"internal error: {_brief(err)}"
                warnings.warn(
                    f"commfuse: site {record.site} declined, {record.reason}", stacklevel=2
                )
            continue
        record.decision, record.schedule, record.reason = "rewritten", chosen.schedule, chosen.why
        record.nodes = [n.name for n in rewrite.created]
        record.details.update(
            steps=len(rewrite.steps), p2p_ops=rewrite.p2p_ops, group_size=group.size
        )
        rewrites.append(rewrite)
    return records, rewrites


def _apply_disable(site: match.Site, disabled: frozenset[str]) -> None:
    """``disable``: decline a disabled kind; leave matmuls of a disabled role out."""
    if site.kind in disabled:
        raise decline(f"{site.kind} is disabled")
    if isinstance(site, match.AgMmSite) and any(u.role in disabled for u in site.uses):
        site.unmatched += [
            f"{u.mm.node.name} ({u.role}): disabled" for u in site.uses if u.role in disabled
        ]
        site.uses = [u for u in site.uses if u.role not in disabled]
        if not site.uses:
            raise decline("; ".join(site.unmatched))


def _sites_or_none(gm: GraphModule) -> list[match.Site]:
    """The sites of a restored graph, for the report; none if even matching fails."""
    try:
        return match.find_sites(gm.graph)
    except Exception:  # noqa: BLE001
        return []


def _brief(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:300]}"
