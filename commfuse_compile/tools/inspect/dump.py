"""A debug dump as ``commfuse inspect`` reads it: each rank's graphs and site records,
and each rank's predicted timeline.

The dump is what every rank writes with ``debug_dir``: ``DIR/rank<r>/report.json`` and
``DIR/rank<r>/graphNNN_<kind>_{before,after}.py``. What cannot be read or placed becomes
a note (shown on the page), not an error, unless no rank's report can be read at all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from ..trace import LANES

_RANK_DIR = re.compile(r"rank(\d+)")
_GRAPH_FILE = re.compile(r"graph(\d+)_(\w+)_(before|after)\.py")
DEFINED = re.compile(r"\s*([A-Za-z_]\w*)\s*=")  # a line of graph code that defines a name


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
    return {m.group(1) for line in code.splitlines() if (m := DEFINED.match(line))}


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
    start, end = number(raw.get("start_us")), number(raw.get("end_us"))
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


def number(value: object) -> float | None:
    """``value`` as a finite float; None for anything else (booleans included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
