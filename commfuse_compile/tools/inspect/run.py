"""``commfuse inspect DIR``: a debug dump as one self-contained HTML page and a Chrome trace.

The dump (``dump``) is what every rank writes with ``debug_dir``. The page
(``page``) shows each graph's code before and after the pass, every site of every
rank and each rank's predicted timeline; ``trace.json`` holds the same timeline as Chrome
trace events (Perfetto).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..trace import Process, Span, chrome_trace
from .dump import Dump, DumpedSite, PlacedEvent, load, timeline
from .page import render_html


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
# the trace


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
