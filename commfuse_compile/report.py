"""What the pass decided, per site and per bucket: the report.json of a debug dump and
the log.

Every collective of a graph the pass sees ends up in one ``SiteRecord`` (a site of a
kind, or a declined site of its own: ``passes/kinds/unclaimed.py``), whose id is
``site_id``'s "graph.site". The pipeline creates the record as the site is found; the
stages write to it only through its methods. Collectives the sites left in place and
``passes/bucket.py`` merged into one are a ``BucketRecord`` each. A graph's records and
buckets go into ``REPORT`` when its decisions are final (``Report.finish_graph``).
Declines go through ``passes.fx.declines.decline`` only (an unexpected error through
``declines.failed``), so that every reason reaches the report and the log the same way.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch._logging

# TORCH_LOGS="+commfuse" shows every decision through torch's logging (the top-level
# ``commfuse`` module makes the name acceptable to torch; see its docstring).
log = logging.getLogger("commfuse")


# Why sites are declined, as the one-line summary of a graph counts them. A decline the
# options ask for, or the cost model's choice, is expected; the rest are patterns the
# pass cannot rewrite, or faults (which also warn).
DECLINE_CATEGORIES = {
    "not_profitable": "not profitable",
    "off": "schedule off",
    "disabled": "disabled",
    "unsupported": "unsupported pattern",
    "internal": "internal error",
    "compiler": "inner compiler",
}


def site_id(graph_index: int, ordinal: int) -> str:
    """A site's id, ``"graph.site"`` (``"0.3"``): its graph's number in this process
    (``Report.new_graph``) and its place among the graph's sites in the order
    ``match.find_sites`` gives them. The place is the same on every rank (the ranks agree
    on the graph's digest), the graph's number where the ranks compiled the same graphs
    in the same order. Unique in the process: P2P labels and ``measured_us`` timings are
    keyed by it."""
    return f"{graph_index}.{ordinal}"


@dataclasses.dataclass
class SiteRecord:
    """What the pass decided on one site. The pipeline creates it as the site is found
    (``pipeline._record``); the stages add to it only through its methods: ``predicted``
    (plan), ``rewritten``, ``declined`` and ``exposed`` (the pipeline), ``bucketed`` and
    ``not_bucketed`` (the bucket stage; the pipeline's fall-back)."""

    # a site kind's name (``passes.kinds.KINDS``); an unclaimed collective's: the kind
    # its op would have, or "collective" for an op no kind rewrites
    kind: str
    # "forward" | "backward" | "inference" | "export"; "joint" only in the records the
    # ranks agree on the joint graph's split with (``passes/joint.py``), never reported
    graph: str
    decision: str = "declined"  # "rewritten" | "declined"
    schedule: str = "off"
    reason: str = ""
    decline_code: str = ""  # a code of passes.fx.declines.REASONS when declined
    decline_category: str = ""  # a key of DECLINE_CATEGORIES when declined
    traceback: str = ""  # an internal error's (``declines.failed``), else empty
    site: str = ""  # ``site_id``: "graph.site"
    graph_index: int = -1  # the graph's number in this process (its files in the dump)
    match: dict[str, Any] = dataclasses.field(default_factory=dict)  # the kind's describe()
    nodes: list[str] = dataclasses.field(default_factory=list)  # created by the rewrite
    # the cost model: every schedule's predicted time, on which profile, how it models the
    # collective, and the predicted timeline on this rank of what runs (the collective's
    # until the site is rewritten, then the chosen schedule's)
    predicted_us: dict[str, float] = dataclasses.field(default_factory=dict)
    profile: str = ""
    collective_model: str = ""
    timeline: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # the level of the group's links ("node": inside one node, "nodes": across), and its
    # global ranks in ring order (``runtime.topology``)
    level: str = ""
    ring: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0  # overlap windows of the rewrite
    p2p_ops: int = 0
    # the steps whose transfer the compiled program waited with no matmul in flight
    # (``passes/ranks/program.py``)
    exposed_steps: list[str] = dataclasses.field(default_factory=list)
    # its collective merged with others of its group into one (``passes/bucket.py``): the
    # bucket's number in this graph (``BucketRecord.bucket``), -1 if none; else why not
    bucket: int = -1
    bucket_code: str = ""  # a ``bucket.*`` code of passes.fx.declines.REASONS
    bucket_reason: str = ""
    # the collective's predicted timeline, put back when a rewrite falls back (not in
    # report.json: ``timeline`` is it then)
    _written_timeline: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)

    def bucketed(self, number: int) -> None:
        """Its collective went into bucket ``number`` (``passes/bucket.py``)."""
        self.bucket, self.bucket_code, self.bucket_reason = number, "", ""

    def not_bucketed(self, code: str, reason: str) -> None:
        """Its collective is in no bucket (any it was in was undone): why."""
        self.bucket, self.bucket_code, self.bucket_reason = -1, code, reason

    def predicted(
        self,
        predicted_us: dict[str, float],
        profile: str,
        collective_model: str,
        timeline: list[dict[str, Any]],
        level: str,
        ring: list[int],
    ) -> None:
        """What the cost model said (``plan.predict_site``), the collective's timeline,
        the level of the group's links and its ring."""
        self.predicted_us, self.profile, self.collective_model = (
            predicted_us,
            profile,
            collective_model,
        )
        self.timeline, self.level, self.ring = timeline, level, ring
        self._written_timeline = timeline

    def rewritten(
        self,
        schedule: str,
        why: str,
        match: dict[str, Any],
        timeline: list[dict[str, Any]],
        nodes: list[str],
        steps: int,
        p2p_ops: int,
    ) -> None:
        """The site is rewritten as ``schedule`` (``match``: as lowered, some matmuls may
        be left out), with the schedule's timeline, the nodes it created and its steps."""
        self.decision, self.schedule, self.reason = "rewritten", schedule, why
        self.match, self.timeline = match, timeline
        self.nodes, self.steps, self.p2p_ops = nodes, steps, p2p_ops

    def declined(self, why: Any) -> SiteRecord:
        """Record the decline ``why`` (a ``passes.fx.declines.Declined``): also of a
        rewritten site whose graph falls back, which then runs its collective: its
        timeline is the collective's again, and the rewrite's nodes and steps are gone."""
        self.decision, self.schedule, self.exposed_steps = "declined", "off", []
        self.timeline, self.nodes, self.steps, self.p2p_ops = self._written_timeline, [], 0, 0
        self.reason, self.decline_code, self.decline_category = why.reason, why.code, why.category
        self.traceback = why.traceback
        return self

    def exposed(self, steps: list[str]) -> None:
        """The steps of the rewrite whose overlap the compiled program lost."""
        self.exposed_steps = steps

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["_written_timeline"]
        out.update(out.pop("match"))  # report.json: the site's description at top level
        return out


@dataclasses.dataclass
class BucketRecord:
    """Collectives the sites left in place, merged into one (``passes/bucket.py``): which,
    their bytes, and the cost model's exposed communication apart and merged."""

    graph: str
    graph_index: int
    bucket: int  # its number in this graph
    op: str  # "all_reduce" | "reduce_scatter"
    group: str
    reduce_op: str
    dtype: str
    collectives: list[str]  # the collectives merged, in graph order
    sites: list[str]  # their sites' ids
    bytes: list[int]  # each collective's input bytes
    # exposed communication predicted apart (each collective's time not hidden by the
    # matmuls before its wait) and merged (one collective and the copy into its buffer)
    predicted_us: dict[str, float]
    saving_us: float
    profile: str
    nodes: list[str] = dataclasses.field(default_factory=list)  # the merged collective's

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_bytes": sum(self.bytes)}


class Report:
    """All sites and buckets of every graph this process compiled; written to disk as
    each graph is done."""

    def __init__(self) -> None:
        self.sites: list[SiteRecord] = []
        self.buckets: list[BucketRecord] = []
        self.graphs = 0
        self.options: dict[str, Any] = {}  # the last compile's options and their origins
        self._at_exit: set[str] = set()

    def new_graph(self, options: dict[str, Any]) -> int:
        """Number the next graph (its files in the dump), compiled with ``options``."""
        self.graphs += 1
        self.options = options
        return self.graphs - 1

    def finish_graph(
        self,
        records: list[SiteRecord],
        graph: str,
        debug_dir: str | None,
        measure: bool,
        buckets: list[BucketRecord] | None = None,
    ) -> None:
        """A graph's decisions (its sites' records and its buckets) are final: recorded,
        written (again at exit if its runs are measured) and logged. The one place the
        pass writes the report."""
        self.sites += records
        self.buckets += buckets or []
        if debug_dir:
            self.write(debug_dir)
            if measure:
                self.write_at_exit(debug_dir)
        self.log_graph(records, graph, buckets or [])

    def log_graph(
        self, records: list[SiteRecord], graph: str, buckets: list[BucketRecord] | None = None
    ) -> None:
        """A graph's final decisions: every site and bucket at DEBUG
        (``TORCH_LOGS="+commfuse"``), one summary line at INFO, from rank 0 only unless
        DEBUG is on. Nothing warns here: faults warn where they happen."""
        for record in records:
            names = ", ".join(record.match.get("collectives", ()))
            line = f"commfuse: {record.kind} site {record.site} ({names}) in {graph} graph"
            if record.decision == "rewritten":
                log.debug("%s rewritten (%s): %s", line, record.schedule, record.reason)
            else:
                log.debug("%s declined: %s", line, record.reason)
        for bucket in buckets or []:
            log.debug(
                "commfuse: %s graph: bucket %d, one %s of %s (%d bytes): %.1f us exposed "
                "predicted apart, %.1f us merged",
                graph,
                bucket.bucket,
                bucket.op,
                ", ".join(bucket.collectives),
                sum(bucket.bytes),
                bucket.predicted_us["apart"],
                bucket.predicted_us["bucketed"],
            )
        from .runtime.groups import this_rank

        if records and (this_rank() == 0 or log.isEnabledFor(logging.DEBUG)):
            log.info("commfuse: %s", summary_line(records, graph, buckets or []))

    def as_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "sites": [_with_measurements(s.as_json()) for s in self.sites],
            "buckets": [b.as_json() for b in self.buckets],
        }

    def write(self, debug_dir: str, rank: int | None = None) -> None:
        _write(
            debug_dir,
            "report.json",
            lambda: json.dumps(self.as_json(), indent=1, default=str),
            rank,
        )

    def write_at_exit(self, debug_dir: str) -> None:
        """Write the report again when the process ends, with the measurements its runs
        made (``measure``); once per directory, as this rank."""
        from .runtime.groups import this_rank

        if debug_dir not in self._at_exit:
            self._at_exit.add(debug_dir)
            atexit.register(self.write, debug_dir, this_rank())


REPORT = Report()


def _with_measurements(record: dict[str, Any]) -> dict[str, Any]:
    """``measured_us``: the median, over the calls so far, of the site's span from its
    first P2P op's start to its last wait's end (the ``measure`` option; ``TIMINGS`` by
    site id). It leaves out the matmul before the first transfer (reduce-scatter) or
    after the last wait (all-gather) that ``predicted_us`` includes: one block's matmul."""
    from .runtime.p2p import TIMINGS

    spans = TIMINGS.get(record["site"])
    if record["decision"] != "rewritten" or not spans:
        return record
    median = statistics.median(end - start for start, end in spans)
    return record | {"measured_us": round(median * 1e6, 1), "measured_calls": len(spans)}


def summary_line(
    records: list[SiteRecord], graph: str, buckets: list[BucketRecord] | None = None
) -> str:
    """``backward: 12 sites, 3 rewritten (ring); declined: 9 unsupported pattern; 9
    collectives in 1 bucket``."""
    rewritten = [r for r in records if r.decision == "rewritten"]
    schedules = sorted({r.schedule for r in rewritten})
    line = f"{graph}: {len(records)} sites, {len(rewritten)} rewritten"
    line += f" ({', '.join(schedules)})" if schedules else ""
    declined: dict[str, int] = {}
    for r in records:
        if r.decision != "rewritten":
            category = DECLINE_CATEGORIES.get(r.decline_category, DECLINE_CATEGORIES["unsupported"])
            declined[category] = declined.get(category, 0) + 1
    if declined:
        line += "; declined: " + ", ".join(f"{n} {what}" for what, n in declined.items())
    if buckets:
        merged = sum(len(b.collectives) for b in buckets)
        line += f"; {merged} collectives in {len(buckets)} bucket{'s' * (len(buckets) > 1)}"
    return line


_unwritable: set[str] = set()  # dump directories already warned about


def _write(debug_dir: str, name: str, text: Callable[[], str], rank: int | None = None) -> None:
    """``DIR/rank<r>/name``. A dump that cannot be written warns, once per directory, and
    never fails the compile it describes."""
    from .runtime.groups import this_rank

    path = Path(debug_dir) / f"rank{this_rank() if rank is None else rank}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text())
    except OSError as err:
        if debug_dir not in _unwritable:
            _unwritable.add(debug_dir)
            warnings.warn(
                f"commfuse: cannot write the debug dump to {debug_dir} ({err}); going on "
                "without it: give debug_dir a directory this process can write to",
                stacklevel=2,
            )


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
        _write(debug_dir, f"{name}.py", code)


def reset() -> None:
    """Forget every recorded site and bucket, and the graphs' numbering (tests; a fresh
    process starts empty)."""
    REPORT.sites.clear()
    REPORT.buckets.clear()
    REPORT.graphs = 0
    REPORT.options = {}
