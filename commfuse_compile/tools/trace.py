"""Chrome trace-event JSON (Perfetto, chrome://tracing) of per-rank timelines.

``commfuse inspect`` (a dump's predicted timelines) and ``commfuse sim --out`` (a
simulated layer per schedule) write the same shape: a process per rank, a thread per
lane, a complete ("X") event per span, and metadata events that name the processes and
threads and keep them in the order given (viewers otherwise sort by id or by name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

LANES = ("compute", "comm")  # a rank's threads: matmuls and adds; messages and collectives


@dataclasses.dataclass(frozen=True)
class Span:
    lane: str  # one of LANES
    name: str
    category: str
    start_us: float
    end_us: float
    args: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Process:
    pid: int
    name: str
    spans: list[Span]


def chrome_trace(processes: Iterable[Process]) -> dict[str, Any]:
    """The trace of ``processes``, shown in this order, their lanes in the order of LANES."""
    events: list[dict[str, Any]] = []
    for order, process in enumerate(processes):
        pid = process.pid
        events += [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process.name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": order}},
        ]
        for tid, lane in enumerate(LANES, start=1):
            events += [
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}},
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                },
            ]
        events += [
            {
                "name": span.name,
                "cat": span.category,
                "ph": "X",
                "ts": span.start_us,
                "dur": span.end_us - span.start_us,
                "pid": pid,
                "tid": LANES.index(span.lane) + 1,
                "args": span.args,
            }
            for span in process.spans
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}
