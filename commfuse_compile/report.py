"""What the pass decided, per site: the report.json of a debug dump and the log.

Every site found next to a matmul ends up as one ``SiteRecord``. Declines go through
``decline`` only, so that every reason reaches the report and the log the same way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch._logging

# TORCH_LOGS="+commfuse" shows every decision through torch's logging (the top-level
# ``commfuse`` module makes the name acceptable to torch; see its docstring).
log = logging.getLogger("commfuse")


class Declined(Exception):
    """Raised by ``decline``: carries the reason a site is left as it was."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decline(reason: str) -> Declined:
    """The one way to decline a site: ``raise decline("why")``."""
    return Declined(reason)


@dataclasses.dataclass
class SiteRecord:
    kind: str  # "ag_mm" | "mm_rs"
    graph: str  # "forward" | "backward" | "inference" | "export"
    decision: str = "declined"  # "rewritten" | "declined"
    schedule: str = "off"
    reason: str = ""
    site: int = -1
    nodes: list[str] = dataclasses.field(default_factory=list)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(out.pop("details"))
        return out


class Report:
    """All sites of every graph this process compiled; written to disk as each graph is done."""

    def __init__(self) -> None:
        self.sites: list[SiteRecord] = []
        self.graphs = 0

    def add(self, record: SiteRecord) -> None:
        self.sites.append(record)
        line = f"commfuse: {record.kind} site {record.site} in {record.graph} graph"
        if record.decision == "rewritten":
            log.info("%s rewritten (%s): %s", line, record.schedule, record.reason)
        else:
            log.warning("%s declined: %s", line, record.reason)

    def as_json(self) -> dict[str, Any]:
        return {"sites": [s.as_json() for s in self.sites]}

    def write(self, debug_dir: str) -> None:
        path = rank_dir(debug_dir) / "report.json"
        path.write_text(json.dumps(self.as_json(), indent=1, default=str))


REPORT = Report()


def rank_dir(debug_dir: str) -> Path:
    from .groups import this_rank

    path = Path(debug_dir) / f"rank{this_rank()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def dump_code(
    debug_dir: str | None, graph_index: int, graph: str, stage: str, code: Callable[[], str]
) -> None:
    """The graph's code to the debug dump, and as an artifact to torch's structured trace
    (what tlparse shows); ``code`` is only called when one of them is on."""
    name = f"graph{graph_index:03d}_{graph}_{stage}"
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"commfuse_{name}", "encoding": "string"},
        payload_fn=code,
    )
    if debug_dir:
        (rank_dir(debug_dir) / f"{name}.py").write_text(code())


def reset() -> None:
    """Forget every recorded site (tests; a fresh process starts empty)."""
    REPORT.sites.clear()
    REPORT.graphs = 0
