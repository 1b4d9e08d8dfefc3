"""``commfuse inspect``'s page: a debug dump as one self-contained HTML page.

The page shows, per graph, the code before and after the pass with each site's nodes
highlighted, one table of every site of every rank, and each rank's predicted timeline
(the ``timeline`` of the site records) as inline SVG. The values the template shows are
computed here. Nothing is fetched from anywhere: the page must open from a file on a
machine offline, so the templates (``templates/inspect.*``) inline their style and script.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jinja2

from ..trace import LANES
from .dump import (
    DEFINED,
    Dump,
    DumpedSite,
    GraphCode,
    PlacedEvent,
    PlacedSite,
    RankDump,
    number,
    timeline,
)

_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_]\w*")  # not an attribute: torch.ops.aten.addmm
_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("commfuse_compile.tools.inspect", "templates"),
    autoescape=True,  # every value is text: code, reasons, names from the dump
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def render_html(dump: Dump) -> str:
    sites = [s for r in dump.ranks for s in r.sites]
    return _TEMPLATES.get_template("inspect.html").render(
        dump=dump,
        graph_count=sum(len(r.graphs) for r in dump.ranks),
        rows=[_row(site) for site in sites],
        rewritten=sum(s.decision == "rewritten" for s in sites),
        timelines=_timelines(dump),
        graphs=[
            (rank.rank, [_graph(rank, graph, open_=rank is dump.ranks[0]) for graph in rank.graphs])
            for rank in dump.ranks
        ],
    )


@dataclasses.dataclass(frozen=True)
class _Row:
    """A row of the site table: each cell's text, multi-line cells as lists."""

    rank: int
    site: str
    graph: str
    graph_href: str | None  # None: the site's graph was not found
    kind: str
    shapes: list[str]
    matmuls: list[str]
    group: str
    schedule: str
    predicted: list[tuple[str, bool]]  # (line, whether it is the chosen schedule's)
    measured: list[tuple[str, bool]]
    decision: str
    reason: str


def _row(site: DumpedSite) -> _Row:
    r, graph = site.record, site.graph
    return _Row(
        rank=site.rank,
        site=str(r.get("site", "")),
        graph=graph.name if graph else f"{r.get('graph', '?')} (not found)",
        graph_href=f"#{_graph_id(site.rank, graph)}" if graph else None,
        kind=str(r.get("kind", "")),
        shapes=_shapes(r),
        matmuls=_matmuls(site),
        group=f"{r.get('group', '')} ({r['group_size']} ranks)" if "group_size" in r else "",
        schedule=str(r.get("schedule", "")),
        predicted=_times(r.get("predicted_us"), _chosen(r)),
        measured=_times(r.get("measured_us"), _chosen(r)),
        decision=site.decision,
        reason=str(r.get("reason", "")),
    )


def _shapes(record: dict[str, Any]) -> list[str]:
    parts = []
    for key, dim_key, label in (
        ("gathered_shape", "gather_dim", "gathered"),
        ("product_shape", "scatter_dim", "product"),
    ):
        shape = record.get(key)
        if isinstance(shape, list) and shape:
            dim = f", dim {record[dim_key]}" if dim_key in record else ""
            parts.append(f"{label} {shape}{dim}")
    return parts


def _matmuls(site: DumpedSite) -> list[str]:
    roles = site.record.get("roles")
    roles = roles if isinstance(roles, dict) else {}
    names = [f"{m} ({roles[m]})" if m in roles else m for m in site.names("matmuls")]
    if isinstance(site.record.get("blocks"), str):
        names.append(f"blocks: {site.record['blocks']}")
    return names


def _chosen(record: dict[str, Any]) -> str:
    """The key of ``predicted_us`` that the decision ran: "off" keeps the collective."""
    schedule = str(record.get("schedule", ""))
    return "collective" if schedule == "off" else schedule


def _times(value: object, chosen: str) -> list[tuple[str, bool]]:
    """Microseconds: one number, or one per schedule, marking the chosen one's."""
    if (us := number(value)) is not None:
        return [(f"{us:,.1f}", False)]
    if not isinstance(value, dict):
        return []
    lines = []
    for schedule, raw in value.items():
        us = number(raw)
        text = f"{schedule} {us:,.1f}" if us is not None else f"{schedule} {raw}"
        lines.append((text, schedule == chosen))
    return lines


# -- the timelines as SVG, every rank on one time scale

_LEFT, _PLOT_WIDTH, _TOP, _LANE_HEIGHT, _LANE_GAP, _AXIS = 80, 1150, 18, 24, 6, 22
_CHAR_WIDTH = 6.2  # px of a character of the SVG's 11px sans-serif, about (DejaVu: 6.1)
_UNITS = ((1e6, "s"), (1e3, "ms"), (1.0, "µs"))


@dataclasses.dataclass(frozen=True)
class _Box:
    """A rectangle of a timeline with its tooltip and, if one fits its width, a label
    centred over it at ``label_y``."""

    css_class: str
    x: float
    y: float
    width: float
    height: float
    tooltip: str
    label: str | None
    label_y: float


@dataclasses.dataclass(frozen=True)
class _TimelineSvg:
    rank: int
    width: float
    height: float
    bands: list[_Box]  # one under each site's events, coloured by its decision
    events: list[_Box]
    lanes: list[tuple[str, float]]  # (lane, y of its label)
    ticks: list[tuple[float, str]]  # (x, value in the axis's unit)
    unit: str
    lanes_bottom: float


def _timelines(dump: Dump) -> list[_TimelineSvg]:
    """Every rank's timeline on one time scale, the longest rank's; none if no site has
    a timeline."""
    placed = {rank.rank: timeline(rank) for rank in dump.ranks}
    span_us = max((s.end_us for sites in placed.values() for s in sites), default=0.0)
    if span_us <= 0:
        return []
    return [_timeline_svg(rank, sites, span_us) for rank, sites in placed.items()]


@dataclasses.dataclass(frozen=True)
class _Scale:
    """Microseconds to pixels, and to the axis's unit."""

    px_per_us: float
    divisor: float  # µs of the axis's unit
    unit: str

    def at(self, us: float) -> str:
        return f"{us / self.divisor:.4g} {self.unit}"

    def x_width(self, start_us: float, end_us: float) -> tuple[float, float]:
        return _LEFT + start_us * self.px_per_us, max((end_us - start_us) * self.px_per_us, 0.5)


def _timeline_svg(rank: int, sites: list[PlacedSite], span_us: float) -> _TimelineSvg:
    scale = _Scale(_PLOT_WIDTH / span_us, *_unit(span_us))
    lane_top = {
        lane: _TOP + row * (_LANE_HEIGHT + _LANE_GAP) + _LANE_GAP / 2
        for row, lane in enumerate(LANES)
    }
    lanes_bottom = _TOP + len(LANES) * (_LANE_HEIGHT + _LANE_GAP)
    return _TimelineSvg(
        rank=rank,
        width=_LEFT + _PLOT_WIDTH + 10,
        height=lanes_bottom + _AXIS,
        bands=[_band(placed, scale, lanes_bottom) for placed in sites],
        events=[
            _event_box(placed.site, event, scale, lane_top[event.lane])
            for placed in sites
            for event in placed.events
        ],
        lanes=[(lane, top + _LANE_HEIGHT * 0.7) for lane, top in lane_top.items()],
        ticks=[(_LEFT + t * scale.px_per_us, f"{t / scale.divisor:.4g}") for t in _ticks(span_us)],
        unit=scale.unit,
        lanes_bottom=lanes_bottom,
    )


def _band(placed: PlacedSite, scale: _Scale, lanes_bottom: float) -> _Box:
    """The box under a site's events, over every lane."""
    site, site_number = placed.site, str(placed.site.record.get("site", "?"))
    reason = f": {site.record['reason']}" if site.record.get("reason") else ""
    x, width = scale.x_width(placed.start_us, placed.end_us)
    return _Box(
        css_class=f"band {site.decision}",
        x=x,
        y=_TOP,
        width=width,
        height=lanes_bottom - _TOP,
        tooltip=f"{site.label}, {site.decision}{reason}; "
        f"{scale.at(placed.start_us)} to {scale.at(placed.end_us)}",
        label=_fitting(width, site.label, f"site {site_number}", site_number),
        label_y=_TOP - 5,
    )


def _event_box(site: DumpedSite, event: PlacedEvent, scale: _Scale, y: float) -> _Box:
    """An event's box in its lane (whose top is ``y``), labelled with its step."""
    step = "" if event.step is None else f" step {event.step}"
    x, width = scale.x_width(event.start_us, event.end_us)
    return _Box(
        css_class=event.lane,
        x=x,
        y=y,
        width=width,
        height=_LANE_HEIGHT,
        tooltip=f"{site.label}{step}: {event.name}, "
        f"{scale.at(event.start_us)} to {scale.at(event.end_us)}",
        label=None if event.step is None else _fitting(width, str(event.step)),
        label_y=y + _LANE_HEIGHT * 0.7,
    )


def _unit(span_us: float) -> tuple[float, str]:
    """The axis's one unit (its size in µs, its name): the largest the span fills once."""
    return next(((size, name) for size, name in _UNITS if span_us >= size), _UNITS[-1])


def _fitting(width: float, *labels: str) -> str | None:
    """The first of ``labels`` that fits ``width`` px; None: none does (the tooltip
    still names the box)."""
    return next((label for label in labels if len(label) * _CHAR_WIDTH + 4 <= width), None)


def _ticks(span_us: float) -> list[float]:
    """Round tick positions, about ten over the span."""
    raw = span_us / 10
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(span_us / step) + 1)]


# -- the code of each graph


@dataclasses.dataclass(frozen=True)
class _Line:
    text: str
    css_class: str  # "line", or "line def|use <decision>" where it defines or uses a site's node
    title: str | None  # the sites whose nodes it defines or uses


@dataclasses.dataclass(frozen=True)
class _Graph:
    id: str
    summary: str
    open: bool
    code: list[tuple[str, list[_Line] | None]]  # (stage, its lines; None: not in the dump)


def _graph(rank: RankDump, graph: GraphCode, open_: bool) -> _Graph:
    sites = [s for s in rank.sites if s.graph is graph]
    rewritten = sum(s.decision == "rewritten" for s in sites)
    return _Graph(
        id=_graph_id(rank.rank, graph),
        summary=f"{graph.name}: {len(sites)} site(s), {rewritten} rewritten",
        open=open_,
        code=[
            ("before", _code_lines(graph.before, sites, DumpedSite.before_names)),
            ("after", _code_lines(graph.after, sites, DumpedSite.after_names)),
        ],
    )


def _code_lines(
    code: str | None, sites: list[DumpedSite], names_of: Callable[[DumpedSite], list[str]]
) -> list[_Line] | None:
    """The code's lines; those that define a site's node and those that mention one are
    marked, with the decision of the site (the defining one first)."""
    if code is None:
        return None
    site_names = [(site, set(names_of(site))) for site in sites]
    lines = []
    for line in code.splitlines():
        defined = m.group(1) if (m := DEFINED.match(line)) else None
        mentioned = set(_IDENTIFIER.findall(line))
        owners = [(site, defined in names) for site, names in site_names if names & mentioned]
        if not owners:
            lines.append(_Line(line, "line", None))
            continue
        site, defines = next(((s, d) for s, d in owners if d), owners[0])
        title = "; ".join(f"{s.label}: {s.decision}" for s, _ in owners)
        lines.append(_Line(line, f"line {'def' if defines else 'use'} {site.decision}", title))
    return lines


def _graph_id(rank: int, graph: GraphCode) -> str:
    return f"rank{rank}-graph{graph.index:03d}"
