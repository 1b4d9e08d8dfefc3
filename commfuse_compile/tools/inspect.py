"""``commfuse inspect DIR``: a debug dump as one self-contained HTML page and a Chrome trace.

The dump is what every rank writes with ``debug_dir``: ``DIR/rank<r>/report.json`` and
``DIR/rank<r>/graphNNN_<kind>_{before,after}.py``. The page shows, per graph, the code
before and after the pass with each site's nodes highlighted, one table of every site of
every rank, and each rank's predicted timeline (the ``timeline`` of the site records) as
inline SVG; ``trace.json`` holds the same timeline as Chrome trace events (Perfetto).
Nothing is fetched from anywhere: the page must open from a file on a machine offline,
so the templates (``templates/inspect.*``) inline their style and script.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2

from .trace import LANES, Process, Span, chrome_trace

_RANK_DIR = re.compile(r"rank(\d+)")
_GRAPH_FILE = re.compile(r"graph(\d+)_(\w+)_(before|after)\.py")
_DEFINED = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_]\w*")  # not an attribute: torch.ops.aten.addmm
_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("commfuse_compile.tools", "templates"),
    autoescape=True,  # every value is text: code, reasons, names from the dump
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


class NotADumpError(ValueError):
    """The directory given to ``inspect`` is not a debug dump it can show: it does not
    exist, holds no ``rank<r>`` directory, or no rank's report.json can be read."""


@dataclasses.dataclass
class GraphCode:
    index: int
    kind: str  # "forward" | "backward" | "inference" | "export"
    before: str | None = None
    after: str | None = None

    @property
    def name(self) -> str:
        return f"graph{self.index:03d} {self.kind}"


@dataclasses.dataclass
class DumpedSite:
    """One record of a rank's report.json and the graph it was found in (None: unknown)."""

    rank: int
    record: dict[str, Any]
    graph: GraphCode | None = None

    def names(self, key: str) -> list[str]:
        value = self.record.get(key)
        return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []

    @property
    def label(self) -> str:
        return f"site {self.record.get('site', '?')} ({self.record.get('kind', '?')})"

    @property
    def decision(self) -> str:
        return str(self.record.get("decision", "unknown"))

    def before_names(self) -> list[str]:
        """The site's nodes in the original graph: its collectives and matmuls."""
        return self.names("collectives") + self.names("matmuls")

    def after_names(self) -> list[str]:
        """The nodes the rewrite created; a declined site's graph is as it was."""
        return self.names("nodes") or self.before_names()


@dataclasses.dataclass
class RankDump:
    rank: int
    graphs: list[GraphCode]
    sites: list[DumpedSite]
    report_error: str | None  # why its report.json gave no sites (None: it was read)


@dataclasses.dataclass
class Dump:
    path: Path
    ranks: list[RankDump]
    notes: list[str]  # what could not be read or placed, shown on the page


@dataclasses.dataclass(frozen=True)
class PlacedEvent:
    """A timeline event at its place on the rank's timeline."""

    lane: str
    step: int | None
    name: str
    start_us: float
    end_us: float


@dataclasses.dataclass(frozen=True)
class PlacedSite:
    """A site's events on the rank's timeline, which runs its sites one after another:
    the site starts where the previous one ended (its own time 0) and ends at its last
    event's end."""

    site: DumpedSite
    start_us: float
    end_us: float
    events: list[PlacedEvent]


def inspect_dump(debug_dir: str | Path) -> list[Path]:
    """Write ``report.html`` and ``trace.json`` into the dump; returns their paths. Each
    rank whose report could not be read gets a warning on stderr (and a note on the page)."""
    dump = load(debug_dir)
    for rank in dump.ranks:
        if rank.report_error is not None:
            print(f"warning: {rank.report_error}", file=sys.stderr)
    page, trace = dump.path / "report.html", dump.path / "trace.json"
    page.write_text(render_html(dump), encoding="utf-8")
    trace.write_text(json.dumps(chrome_trace(rank_processes(dump)), indent=1), encoding="utf-8")
    return [page, trace]


# ----------------------------------------------------------------------------------------
# reading the dump


def load(debug_dir: str | Path) -> Dump:
    path = Path(debug_dir)
    if not path.exists():
        raise NotADumpError(f"{path} does not exist")
    if not path.is_dir():
        raise NotADumpError(f"{path} is not a directory")
    rank_dirs = sorted(
        (int(m.group(1)), p)
        for p in path.iterdir()
        if p.is_dir() and (m := _RANK_DIR.fullmatch(p.name))
    )
    if not rank_dirs:
        raise NotADumpError(f"{path} is not a commfuse debug dump (no rank<r> directory)")
    dump = Dump(path=path, ranks=[], notes=[])
    for rank, rank_dir in rank_dirs:
        graphs = _load_graphs(rank_dir)
        records, error = _load_records(rank_dir / "report.json")
        sites = [DumpedSite(rank, record) for record in records]
        _assign_graphs(sites, graphs)
        if error is not None:
            dump.notes.append(error)
        unplaced = [s.label for s in sites if s.graph is None]
        if unplaced:
            dump.notes.append(f"rank {rank}: no graph found for {', '.join(unplaced)}")
        dump.ranks.append(RankDump(rank, graphs, sites, error))
    if all(rank.report_error is not None for rank in dump.ranks):
        errors = "".join(f"\n  {rank.report_error}" for rank in dump.ranks)
        raise NotADumpError(f"{path}: no rank's report.json could be read:{errors}")
    return dump


def _load_graphs(rank_dir: Path) -> list[GraphCode]:
    graphs: dict[int, GraphCode] = {}
    for file in rank_dir.iterdir():
        m = _GRAPH_FILE.fullmatch(file.name)
        if m is None:
            continue
        index, kind, stage = int(m.group(1)), m.group(2), m.group(3)
        graph = graphs.setdefault(index, GraphCode(index, kind))
        setattr(graph, stage, file.read_text(encoding="utf-8", errors="replace"))
    return [graphs[i] for i in sorted(graphs)]


def _load_records(report: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The site records of a rank's report.json, and why there are none if it cannot be
    read (None: it was read)."""
    try:
        sites = json.loads(report.read_text(encoding="utf-8")).get("sites")
    except FileNotFoundError:
        return [], f"{report}: missing (the rank wrote no report)"
    except (OSError, ValueError, AttributeError) as err:
        return [], f"{report}: unreadable ({type(err).__name__}: {err})"
    if not isinstance(sites, list):
        return [], f"{report}: no 'sites' list"
    return [s for s in sites if isinstance(s, dict)], None


def _assign_graphs(sites: list[DumpedSite], graphs: list[GraphCode]) -> None:
    """Find each site's graph. report.json lists sites in the order their graphs were
    rewritten, so the search moves forward only: the first graph from the last one found
    with the site's kind and, where the site names them, its nodes in the code."""
    by_index = {g.index: g for g in graphs}
    position = 0
    for site in sites:
        index = site.record.get("graph_index")
        if isinstance(index, int) and index in by_index:
            site.graph = by_index[index]
            continue
        kind = site.record.get("graph")
        same_kind = [i for i in range(position, len(graphs)) if graphs[i].kind == kind]
        named = [i for i in same_kind if _names_the_site(graphs[i], site)]
        if named or same_kind:
            position = (named or same_kind)[0]
            site.graph = graphs[position]


def _names_the_site(graph: GraphCode, site: DumpedSite) -> bool:
    defined_before = _defined_names(graph.before or "")
    defined_after = _defined_names(graph.after or "")
    return set(site.before_names()) <= defined_before and set(site.names("nodes")) <= (
        defined_after
    )


def _defined_names(code: str) -> set[str]:
    return {m.group(1) for line in code.splitlines() if (m := _DEFINED.match(line))}


# ----------------------------------------------------------------------------------------
# timeline


def timeline(rank: RankDump) -> list[PlacedSite]:
    """The rank's sites that have a timeline, one after another; malformed events are
    left out."""
    placed: list[PlacedSite] = []
    offset = 0.0
    for site in rank.sites:
        raw = site.record.get("timeline")
        events = [e for e in (_event(r, offset) for r in _list(raw)) if e is not None]
        if events:
            end = max(e.end_us for e in events)
            placed.append(PlacedSite(site, offset, end, events))
            offset = end
    return placed


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _event(raw: object, offset_us: float) -> PlacedEvent | None:
    """One timeline event of report.json, shifted by ``offset_us``; None if malformed."""
    if not isinstance(raw, dict) or raw.get("lane") not in LANES:
        return None
    start, end = _number(raw.get("start_us")), _number(raw.get("end_us"))
    if start is None or end is None or end < start:
        return None
    step, name = raw.get("step"), raw.get("name")
    return PlacedEvent(
        raw["lane"],
        step if isinstance(step, int) and not isinstance(step, bool) else None,
        name if isinstance(name, str) else raw["lane"],
        offset_us + start,
        offset_us + end,
    )


def _number(value: object) -> float | None:
    """``value`` as a finite float; None for anything else (booleans included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def rank_processes(dump: Dump) -> list[Process]:
    """The dump's timelines for ``trace.chrome_trace``: a process per rank."""
    return [
        Process(
            rank.rank,
            f"rank {rank.rank}",
            [_span(placed.site, event) for placed in timeline(rank) for event in placed.events],
        )
        for rank in dump.ranks
    ]


def _span(site: DumpedSite, event: PlacedEvent) -> Span:
    record = site.record
    args = {"step": event.step} | {
        k: record.get(k) for k in ("site", "graph", "schedule", "decision")
    }
    return Span(
        event.lane, event.name, str(record.get("kind", "site")), event.start_us, event.end_us, args
    )


# ----------------------------------------------------------------------------------------
# the page: the values the template shows, computed here


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
    if (us := _number(value)) is not None:
        return [(f"{us:,.1f}", False)]
    if not isinstance(value, dict):
        return []
    lines = []
    for schedule, raw in value.items():
        us = _number(raw)
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


def _timeline_svg(rank: int, sites: list[PlacedSite], span_us: float) -> _TimelineSvg:
    scale = _PLOT_WIDTH / span_us
    divisor, unit = _unit(span_us)
    lane_top = {
        lane: _TOP + row * (_LANE_HEIGHT + _LANE_GAP) + _LANE_GAP / 2
        for row, lane in enumerate(LANES)
    }
    lanes_bottom = _TOP + len(LANES) * (_LANE_HEIGHT + _LANE_GAP)

    def at(us: float) -> str:
        return f"{us / divisor:.4g} {unit}"

    def x_width(start_us: float, end_us: float) -> tuple[float, float]:
        return _LEFT + start_us * scale, max((end_us - start_us) * scale, 0.5)

    bands, events = [], []
    for placed in sites:
        site, number = placed.site, str(placed.site.record.get("site", "?"))
        reason = f": {site.record['reason']}" if site.record.get("reason") else ""
        x, width = x_width(placed.start_us, placed.end_us)
        bands.append(
            _Box(
                css_class=f"band {site.decision}",
                x=x,
                y=_TOP,
                width=width,
                height=lanes_bottom - _TOP,
                tooltip=f"{site.label}, {site.decision}{reason}; "
                f"{at(placed.start_us)} to {at(placed.end_us)}",
                label=_fitting(width, site.label, f"site {number}", number),
                label_y=_TOP - 5,
            )
        )
        for event in placed.events:
            step = "" if event.step is None else f" step {event.step}"
            x, width = x_width(event.start_us, event.end_us)
            y = lane_top[event.lane]
            events.append(
                _Box(
                    css_class=event.lane,
                    x=x,
                    y=y,
                    width=width,
                    height=_LANE_HEIGHT,
                    tooltip=f"{site.label}{step}: {event.name}, "
                    f"{at(event.start_us)} to {at(event.end_us)}",
                    label=None if event.step is None else _fitting(width, str(event.step)),
                    label_y=y + _LANE_HEIGHT * 0.7,
                )
            )
    return _TimelineSvg(
        rank=rank,
        width=_LEFT + _PLOT_WIDTH + 10,
        height=lanes_bottom + _AXIS,
        bands=bands,
        events=events,
        lanes=[(lane, top + _LANE_HEIGHT * 0.7) for lane, top in lane_top.items()],
        ticks=[(_LEFT + t * scale, f"{t / divisor:.4g}") for t in _ticks(span_us)],
        unit=unit,
        lanes_bottom=lanes_bottom,
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
        defined = m.group(1) if (m := _DEFINED.match(line)) else None
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
