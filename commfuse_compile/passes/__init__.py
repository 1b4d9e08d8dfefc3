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
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch.fx import GraphModule

from .. import groups
from ..options import Options
from ..report import REPORT, Declined, SiteRecord, decline, dump_code
from ..schedules import by_name
from . import match, order, verify
from .lower import Rewrite, lower, site_nodes, start
from .plan import plan, predict

_site_ids = itertools.count()
T = TypeVar("T")


def rewrite_graph(gm: GraphModule, graph_kind: str, options: Options) -> list[SiteRecord]:
    """Rewrite ``gm`` in place; returns one record per site found (also in the report)."""
    return _rewrite(gm, graph_kind, options)[0]


def rewrite_and_compile(
    gm: GraphModule, graph_kind: str, options: Options, compile_fn: Callable[[GraphModule], T]
) -> T:
    """Rewrite ``gm``, then compile it; should the compiler reject the rewritten graph,
    warn, record every site as declined and compile the original graph instead."""
    records, original = _rewrite(gm, graph_kind, options)
    try:
        return compile_fn(gm)
    except Exception as err:
        rewritten = [r for r in records if r.decision == "rewritten"]
        if not rewritten:
            raise
        reason = f"inner compiler failed on the rewritten graph: {_brief(err)}"
        warnings.warn(f"commfuse: {reason}; compiling the original graph", stacklevel=2)
        gm.graph = original
        gm.recompile()
        for record in rewritten:
            record.decision, record.schedule, record.reason = "declined", "off", reason
        if options.debug_dir:
            REPORT.write(options.debug_dir)
        return compile_fn(gm)


def _rewrite(
    gm: GraphModule, graph_kind: str, options: Options
) -> tuple[list[SiteRecord], torch.fx.Graph]:
    graph_index = REPORT.graphs
    REPORT.graphs += 1
    dump_code(options.debug_dir, graph_index, graph_kind, "before", gm.code)
    original = copy.deepcopy(gm.graph)
    try:
        records, rewrites = _rewrite_sites(gm, graph_kind, options, graph_index)
        if rewrites and options.inner == "inductor":
            order.keep_overlap_order(gm.graph, (s for rw in rewrites for s in rw.steps))
        gm.graph.lint()
        gm.recompile()
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        warnings.warn(
            f"commfuse: internal error, graph left as it was: {_brief(err)}", stacklevel=2
        )
        gm.graph = original
        gm.recompile()
        records = [
            SiteRecord(kind=s.kind, graph=graph_kind, reason=f"internal error: {_brief(err)}")
            for s in _sites_or_none(gm)
        ]
    for record in records:
        REPORT.add(record)
    dump_code(options.debug_dir, graph_index, graph_kind, "after", gm.code)
    if options.debug_dir:
        REPORT.write(options.debug_dir)
    return records, original


def _rewrite_sites(
    gm: GraphModule, graph_kind: str, options: Options, graph_index: int
) -> tuple[list[SiteRecord], list[Rewrite]]:
    records, rewrites = [], []
    for site in _each_site(gm):
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
            group = groups.resolve(site.group_name, site.group_size)
            predicted = predict(site, group.size, options)
            record.details["predicted_us"] = {
                k: round(t.end_s * 1e6, 2) for k, t in predicted.items()
            }
            chosen = plan(predicted, options)
            record.details["timeline"] = predicted[chosen.schedule].as_json(group.rank)
            rewrite = start(site, record.site, gm.graph)
            record.details.update(site.describe())  # start may leave some matmuls out
            schedule = by_name(chosen.schedule)
            lower(rewrite, group, schedule, options.slices)
            verify.check_emitted(rewrite)
            verify.check_exchange(rewrite, group, schedule, options.slices)
            rewrite.commit(site_nodes(site))
            verify.check_committed(rewrite, gm.graph)
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


def _each_site(gm: GraphModule) -> Iterator[match.Site]:
    """Every site, in graph order. All are matched up front; after a rewrite the graph has
    new nodes (a rewritten matmul may be the next site's shard), so the sites not yet
    handled are matched again on the current graph, identified by their collective."""
    done: set[torch.fx.Node] = set()
    sites = match.find_sites(gm.graph)
    while sites:
        site = sites[0]
        done.add(site.anchor)
        yield site
        sites = [s for s in match.find_sites(gm.graph) if s.anchor not in done]


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
