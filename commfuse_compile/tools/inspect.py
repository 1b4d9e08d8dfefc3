"""``commfuse inspect DIR``: a debug dump as one self-contained HTML page and a Chrome trace.

The dump is what every rank writes with ``debug_dir``: ``DIR/rank<r>/report.json`` and
``DIR/rank<r>/graphNNN_<kind>_{before,after}.py``. The page shows, per graph, the code
before and after the pass with each site's nodes highlighted, one table of every site of
every rank, and each rank's predicted timeline (the ``timeline`` of the site records) as
inline SVG; ``trace.json`` holds the same timeline as Chrome trace events (Perfetto).
Nothing is fetched from anywhere: the page must open from a file on a machine offline.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

LANES = ("compute", "comm")
_RANK_DIR = re.compile(r"rank(\d+)")
_GRAPH_FILE = re.compile(r"graph(\d+)_(\w+)_(before|after)\.py")
_DEFINED = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_]\w*")  # not an attribute: torch.ops.aten.addmm


class NotADumpError(ValueError):
    """The directory given to ``inspect`` holds no ``rank<r>`` directory of a debug dump."""


@dataclasses.dataclass
class GraphCode:
    index: int
    kind: str  # "forward" | "backward" | "inference" | "export"
    before: str | None = None
    after: str | None = None


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


@dataclasses.dataclass
class Dump:
    path: Path
    ranks: list[RankDump]
    notes: list[str]  # what could not be read or placed, shown on the page


@dataclasses.dataclass(frozen=True)
class PlacedEvent:
    """A timeline event at its place on the rank's timeline (sites one after another)."""

    site: DumpedSite
    lane: str
    step: int | None
    name: str
    start_us: float
    end_us: float


def inspect_dump(debug_dir: str | Path) -> list[Path]:
    """Write ``report.html`` and ``trace.json`` into the dump; returns their paths."""
    dump = load(debug_dir)
    page, trace = dump.path / "report.html", dump.path / "trace.json"
    page.write_text(render_html(dump), encoding="utf-8")
    trace.write_text(json.dumps(chrome_trace(dump), indent=1), encoding="utf-8")
    return [page, trace]


# ----------------------------------------------------------------------------------------
# reading the dump


def load(debug_dir: str | Path) -> Dump:
    path = Path(debug_dir)
    rank_dirs = sorted(
        (int(m.group(1)), p)
        for p in (path.iterdir() if path.is_dir() else ())
        if p.is_dir() and (m := _RANK_DIR.fullmatch(p.name))
    )
    if not rank_dirs:
        raise NotADumpError(f"{path} is not a commfuse debug dump (no rank<r> directory)")
    dump = Dump(path=path, ranks=[], notes=[])
    for rank, rank_dir in rank_dirs:
        graphs = _load_graphs(rank_dir)
        records = _load_records(rank_dir / "report.json", dump.notes)
        sites = [DumpedSite(rank, record) for record in records]
        _assign_graphs(sites, graphs)
        unplaced = [s.label for s in sites if s.graph is None]
        if unplaced:
            dump.notes.append(f"rank {rank}: no graph found for {', '.join(unplaced)}")
        dump.ranks.append(RankDump(rank, graphs, sites))
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


def _load_records(report: Path, notes: list[str]) -> list[dict[str, Any]]:
    try:
        sites = json.loads(report.read_text(encoding="utf-8")).get("sites")
    except FileNotFoundError:
        notes.append(f"{report}: missing (the rank wrote no report)")
        return []
    except (OSError, ValueError, AttributeError) as err:
        notes.append(f"{report}: unreadable ({type(err).__name__}: {err})")
        return []
    if not isinstance(sites, list):
        notes.append(f"{report}: no 'sites' list")
        return []
    return [s for s in sites if isinstance(s, dict)]


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


def timeline(rank: RankDump) -> list[PlacedEvent]:
    """The rank's sites one after another, each site's events shifted to where the
    previous site with a timeline ended; malformed events are left out."""
    placed: list[PlacedEvent] = []
    offset = 0.0
    for site in rank.sites:
        raw = site.record.get("timeline")
        events = [e for e in map(_event, raw if isinstance(raw, list) else []) if e is not None]
        if not events:
            continue
        for lane, step, name, start, end in events:
            placed.append(PlacedEvent(site, lane, step, name, offset + start, offset + end))
        offset += max(end for *_, end in events)
    return placed


def _event(raw: object) -> tuple[str, int | None, str, float, float] | None:
    """(lane, step, name, start, end) of one timeline event; None if it is malformed."""
    if not isinstance(raw, dict) or raw.get("lane") not in LANES:
        return None
    start, end = _number(raw.get("start_us")), _number(raw.get("end_us"))
    if start is None or end is None or end < start:
        return None
    step, name = raw.get("step"), raw.get("name")
    return (
        raw["lane"],
        step if isinstance(step, int) and not isinstance(step, bool) else None,
        name if isinstance(name, str) else raw["lane"],
        start,
        end,
    )


def _number(value: object) -> float | None:
    """``value`` as a finite float; None for anything else (booleans included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def chrome_trace(dump: Dump) -> dict[str, Any]:
    """Trace-event JSON: a process per rank, a thread per lane, one "X" event per event."""
    events: list[dict[str, Any]] = []
    for rank in dump.ranks:
        events.append(_metadata("process_name", rank.rank, 0, {"name": f"rank {rank.rank}"}))
        events.append(_metadata("process_sort_index", rank.rank, 0, {"sort_index": rank.rank}))
        for tid, lane in enumerate(LANES, start=1):
            events.append(_metadata("thread_name", rank.rank, tid, {"name": lane}))
            events.append(_metadata("thread_sort_index", rank.rank, tid, {"sort_index": tid}))
        for event in timeline(rank):
            record = event.site.record
            events.append(
                {
                    "name": event.name,
                    "cat": str(record.get("kind", "site")),
                    "ph": "X",
                    "ts": event.start_us,
                    "dur": event.end_us - event.start_us,
                    "pid": rank.rank,
                    "tid": LANES.index(event.lane) + 1,
                    "args": {
                        "site": record.get("site"),
                        "step": event.step,
                        "graph": record.get("graph"),
                        "schedule": record.get("schedule"),
                        "decision": record.get("decision"),
                    },
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


# ----------------------------------------------------------------------------------------
# the page


def render_html(dump: Dump) -> str:
    sites = [s for r in dump.ranks for s in r.sites]
    rewritten = sum(s.decision == "rewritten" for s in sites)
    notes = "".join(f"<li>{_e(n)}</li>" for n in dump.notes)
    body = [
        f"<h1>CommFuse report: {_e(str(dump.path))}</h1>",
        f"<p>{len(dump.ranks)} rank(s), {sum(len(r.graphs) for r in dump.ranks)} graph(s), "
        f"{len(sites)} site(s): {rewritten} rewritten, {len(sites) - rewritten} declined.</p>",
        f'<ul class="notes">{notes}</ul>' if notes else "",
        "<h2>Sites</h2>",
        _site_table(sites),
        "<h2>Predicted timeline</h2>",
        _timelines(dump),
        "<h2>Graphs</h2>",
        *(_graphs(rank, open_=rank is dump.ranks[0]) for rank in dump.ranks),
    ]
    return _PAGE.format(title=_e(f"CommFuse report: {dump.path}"), body="\n".join(body))


def _site_table(sites: list[DumpedSite]) -> str:
    headers = (
        *("rank", "site", "graph", "kind", "shapes", "matmuls", "group", "schedule"),
        *("predicted (µs)", "measured (µs)", "decision", "reason"),
    )
    rows = []
    for site in sites:
        r = site.record
        cells = [
            str(site.rank),
            _e(str(r.get("site", ""))),
            _graph_link(site),
            _e(str(r.get("kind", ""))),
            _shapes(r),
            _matmuls(site),
            _e(f"{r.get('group', '')} ({r['group_size']} ranks)" if "group_size" in r else ""),
            _e(str(r.get("schedule", ""))),
            _times(r.get("predicted_us"), _chosen(r)),
            _times(r.get("measured_us"), _chosen(r)),
            f'<span class="{_e(site.decision)}">{_e(site.decision)}</span>',
            _e(str(r.get("reason", ""))),
        ]
        rows.append(
            f'<tr data-rank="{site.rank}" data-site="{_e(str(r.get("site", "")))}">'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in headers)
    return (
        '<p><input id="site-filter" type="search" placeholder="filter: rank, kind, reason..."> '
        '<span id="site-count"></span></p>'
        f'<table id="sites"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _graph_link(site: DumpedSite) -> str:
    if site.graph is None:
        return _e(f"{site.record.get('graph', '?')} (not found)")
    name = f"graph{site.graph.index:03d} {site.graph.kind}"
    return f'<a href="#{_graph_id(site.rank, site.graph)}">{_e(name)}</a>'


def _shapes(record: dict[str, Any]) -> str:
    parts = []
    for key, dim_key, label in (
        ("gathered_shape", "gather_dim", "gathered"),
        ("product_shape", "scatter_dim", "product"),
    ):
        shape = record.get(key)
        if isinstance(shape, list) and shape:
            dim = f", dim {record[dim_key]}" if dim_key in record else ""
            parts.append(f"{label} {shape}{dim}")
    return "<br>".join(_e(p) for p in parts)


def _matmuls(site: DumpedSite) -> str:
    roles = site.record.get("roles")
    roles = roles if isinstance(roles, dict) else {}
    names = [f"{m} ({roles[m]})" if m in roles else m for m in site.names("matmuls")]
    if isinstance(site.record.get("blocks"), str):
        names.append(f"blocks: {site.record['blocks']}")
    return "<br>".join(_e(n) for n in names)


def _chosen(record: dict[str, Any]) -> str:
    """The key of ``predicted_us`` that the decision ran: "off" keeps the collective."""
    schedule = str(record.get("schedule", ""))
    return "collective" if schedule == "off" else schedule


def _times(value: object, chosen: str) -> str:
    """Microseconds: one number, or one per schedule with the chosen one in bold."""
    if (us := _number(value)) is not None:
        return _e(f"{us:,.1f}")
    if not isinstance(value, dict):
        return ""
    lines = []
    for schedule, raw in value.items():
        us = _number(raw)
        text = _e(f"{schedule} {us:,.1f}" if us is not None else f"{schedule} {raw}")
        lines.append(f"<b>{text}</b>" if schedule == chosen else text)
    return "<br>".join(lines)


# -- timeline as SVG

_LEFT, _PLOT_WIDTH, _TOP, _LANE_HEIGHT, _LANE_GAP, _AXIS = 80, 960, 18, 24, 6, 22


def _timelines(dump: Dump) -> str:
    placed = {rank.rank: timeline(rank) for rank in dump.ranks}
    if not any(placed.values()):
        return (
            '<p class="empty">No site in this dump has a predicted timeline (the "timeline" '
            "of a site in report.json), so there is nothing to draw.</p>"
        )
    span = max(e.end_us for events in placed.values() for e in events) or 1.0
    parts = [
        "<p>Each rank's sites one after another (the cost model's prediction of the chosen "
        'schedule), on one time scale; <span class="key compute">compute</span> and '
        '<span class="key comm">comm</span> lanes. <code>trace.json</code> holds the same '
        "events for Perfetto or chrome://tracing.</p>"
    ]
    for rank in dump.ranks:
        parts.append(f"<h3>rank {rank.rank}</h3>")
        parts.append(_svg(placed[rank.rank], span) if placed[rank.rank] else "<p>no timeline</p>")
    return "\n".join(parts)


def _svg(events: list[PlacedEvent], span_us: float) -> str:
    scale = _PLOT_WIDTH / span_us
    height = _TOP + len(LANES) * (_LANE_HEIGHT + _LANE_GAP) + _AXIS
    lanes_bottom = height - _AXIS
    out = [
        f'<svg class="timeline" viewBox="0 0 {_LEFT + _PLOT_WIDTH + 10} {height}" '
        f'width="{_LEFT + _PLOT_WIDTH + 10}" height="{height}" role="img">'
    ]
    sites: dict[int, tuple[DumpedSite, float, float]] = {}
    for event in events:
        first, last = sites.get(id(event.site), (event.site, event.start_us, event.end_us))[1:]
        sites[id(event.site)] = (event.site, min(first, event.start_us), max(last, event.end_us))
    for n, (site, start, end) in enumerate(sites.values()):
        x = _LEFT + start * scale
        out.append(
            f'<rect class="band{n % 2}" x="{x:.2f}" y="{_TOP}" '
            f'width="{max((end - start) * scale, 0.5):.2f}" height="{lanes_bottom - _TOP}">'
            f"<title>{_e(site.label)}</title></rect>"
            f'<text class="site" x="{x + 2:.2f}" y="{_TOP - 5}">{_e(site.label)}</text>'
        )
    for row, lane in enumerate(LANES):
        y = _TOP + row * (_LANE_HEIGHT + _LANE_GAP) + _LANE_GAP / 2
        out.append(f'<text class="lane" x="4" y="{y + _LANE_HEIGHT * 0.7:.1f}">{lane}</text>')
        for event in (e for e in events if e.lane == lane):
            out.append(_event_rect(event, y, scale))
    for tick in _ticks(span_us):
        x = _LEFT + tick * scale
        out.append(
            f'<line class="tick" x1="{x:.2f}" x2="{x:.2f}" y1="{_TOP}" y2="{lanes_bottom + 4}"/>'
            f'<text class="tick" x="{x:.2f}" y="{height - 4}">{_e(_format_us(tick))}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _event_rect(event: PlacedEvent, y: float, scale: float) -> str:
    x = _LEFT + event.start_us * scale
    width = max((event.end_us - event.start_us) * scale, 0.5)
    step = "" if event.step is None else f" step {event.step}"
    tip = (
        f"{event.site.label}{step}: {event.name}, "
        f"{_format_us(event.start_us)} to {_format_us(event.end_us)}"
    )
    label = ""
    if event.step is not None and width > 14:
        label = (
            f'<text class="step" x="{x + width / 2:.2f}" y="{y + _LANE_HEIGHT * 0.7:.1f}">'
            f"{event.step}</text>"
        )
    return (
        f'<rect class="{event.lane}" x="{x:.2f}" y="{y:.1f}" width="{width:.2f}" '
        f'height="{_LANE_HEIGHT}"><title>{_e(tip)}</title></rect>{label}'
    )


def _ticks(span_us: float) -> list[float]:
    """Round tick positions, about six over the span."""
    raw = span_us / 6
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(span_us / step) + 1)]


def _format_us(us: float) -> str:
    return f"{us / 1000:g} ms" if abs(us) >= 10_000 else f"{us:g} µs"


# -- code


def _graphs(rank: RankDump, open_: bool) -> str:
    """Each graph of the rank, before and after side by side (the first rank's unfolded)."""
    parts = [f"<h3>rank {rank.rank}</h3>"] if rank.graphs else []
    for graph in rank.graphs:
        sites = [s for s in rank.sites if s.graph is graph]
        rewritten = sum(s.decision == "rewritten" for s in sites)
        summary = (
            f"graph{graph.index:03d} {graph.kind}: {len(sites)} site(s), {rewritten} rewritten"
        )
        parts.append(
            f'<details id="{_graph_id(rank.rank, graph)}"{" open" if open_ else ""}>'
            f"<summary>{_e(summary)}</summary>"
            f'<div class="code-pair">'
            f"{_code('before', graph.before, sites, DumpedSite.before_names)}"
            f"{_code('after', graph.after, sites, DumpedSite.after_names)}"
            f"</div></details>"
        )
    return "\n".join(parts)


def _code(
    stage: str,
    code: str | None,
    sites: list[DumpedSite],
    names_of: Callable[[DumpedSite], list[str]],
) -> str:
    """The code, one span per line: lines that define a site's node and lines that
    mention one are highlighted, coloured by the site's decision."""
    if code is None:
        return f'<div><h4>{stage}</h4><p class="empty">no {stage} code in the dump</p></div>'
    site_names = [(site, set(names_of(site))) for site in sites]
    lines = []
    for line in code.splitlines():
        defined = m.group(1) if (m := _DEFINED.match(line)) else None
        mentioned = set(_IDENTIFIER.findall(line))
        owners = [(site, defined in names) for site, names in site_names if names & mentioned]
        if not owners:
            lines.append(f'<span class="line">{_e(line)}</span>')
            continue
        site, defines = next(((s, d) for s, d in owners if d), owners[0])
        classes = f"line {'def' if defines else 'use'} {_e(site.decision)}"
        title = "; ".join(f"{s.label}: {s.decision}" for s, _ in owners)
        lines.append(f'<span class="{classes}" title="{_e(title)}">{_e(line)}</span>')
    return f'<div><h4>{stage}</h4><pre class="code">{"".join(lines)}</pre></div>'


def _graph_id(rank: int, graph: GraphCode) -> str:
    return f"rank{rank}-graph{graph.index:03d}"


def _e(text: str) -> str:
    return html.escape(text, quote=True)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; text-align: left; }}
th {{ background: #f0f0f0; position: sticky; top: 0; }}
.rewritten {{ color: #1a7f37; font-weight: 600; }}
.declined {{ color: #b35900; font-weight: 600; }}
.notes {{ color: #b35900; }}
.empty {{ color: #666; font-style: italic; }}
.code-pair {{ display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }}
.code-pair > div {{ min-width: 0; }}
pre.code {{ overflow-x: auto; background: #fafafa; border: 1px solid #ddd; padding: 4px;
  font-size: 12px; counter-reset: line; }}
.line {{ display: block; white-space: pre; color: #222; font-weight: normal; }}
.line::before {{ counter-increment: line; content: counter(line); display: inline-block;
  width: 3.5em; color: #999; }}
.line.def.rewritten {{ background: #c8f0d0; }}
.line.use.rewritten {{ background: #ebfaee; }}
.line.def.declined {{ background: #ffe1bf; }}
.line.use.declined {{ background: #fff4e6; }}
details {{ margin: 0.4em 0; }}
summary {{ cursor: pointer; font-weight: 600; }}
svg.timeline {{ max-width: 100%; height: auto; font-size: 11px; }}
svg .compute, .key.compute {{ fill: #4e79a7; background: #4e79a7; }}
svg .comm, .key.comm {{ fill: #f28e2b; background: #f28e2b; }}
.key {{ color: #fff; padding: 0 4px; }}
svg .band0 {{ fill: #f4f4f4; }}
svg .band1 {{ fill: #e8e8e8; }}
svg text.step {{ fill: #fff; text-anchor: middle; }}
svg text.tick {{ fill: #555; text-anchor: middle; }}
svg line.tick {{ stroke: #bbb; stroke-dasharray: 2 3; }}
</style>
</head>
<body>
{body}
<script>
(function () {{
  var input = document.getElementById("site-filter");
  var count = document.getElementById("site-count");
  var rows = Array.prototype.slice.call(document.querySelectorAll("#sites tbody tr"));
  function filter() {{
    var words = input.value.toLowerCase().split(/\\s+/).filter(Boolean);
    var shown = 0;
    rows.forEach(function (row) {{
      var text = row.textContent.toLowerCase();
      row.hidden = !words.every(function (w) {{ return text.indexOf(w) >= 0; }});
      if (!row.hidden) shown += 1;
    }});
    count.textContent = shown + " of " + rows.length + " sites shown";
  }}
  function openLinkedGraph() {{
    var target = document.getElementById(location.hash.slice(1));
    if (target && target.tagName === "DETAILS") target.open = true;
  }}
  input.addEventListener("input", filter);
  window.addEventListener("hashchange", openLinkedGraph);
  filter();
  openLinkedGraph();
}})();
</script>
</body>
</html>
"""
