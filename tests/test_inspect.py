"""`commfuse inspect DIR`: the HTML page and the Chrome trace of a debug dump.

Synthetic dumps carry predicted timelines (and every kind of damage a dump can have);
a real dump comes from the pass itself, on torch's fake process group, one rank after
the other. One test opens the page in headless Chromium and reads the site table from
the DOM after the page's script ran.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch.distributed as dist
from cases import AgMm, MmRs, trace
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.tools.cli import main
from commfuse_compile.tools.inspect.dump import load, timeline
from commfuse_compile.tools.inspect.page import render_html
from commfuse_compile.tools.inspect.run import inspect_dump, rank_processes
from commfuse_compile.tools.trace import chrome_trace

BEFORE = """
def forward(self, x, w):
    all_gather_into_tensor = torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, '0')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
    mm = torch.ops.aten.mm.default(wait_tensor, w);  wait_tensor = None
    relu = torch.ops.aten.relu.default(mm)
    return (relu,)
"""
AFTER = """
def forward(self, x, w):
    p2p_default = torch.ops.commfuse.p2p.default([x], [1], [x], [1], 2, '0')
    getitem = p2p_default[1]
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(getitem)
    mm_default = torch.ops.aten.mm.default(x, w)
    mm = torch.ops.aten.cat.default([mm_default, wait_tensor_default])
    relu = torch.ops.aten.relu.default(mm)
    return (relu,)
"""
REWRITTEN_NODES = ["p2p_default", "getitem", "wait_tensor_default", "mm_default", "mm"]


def ag_mm_site(site: int, timeline: list[dict] | None = None, **extra) -> dict:
    record = {
        "kind": "ag_mm",
        "graph": "forward",
        "decision": "rewritten",
        "schedule": "ring",
        "reason": "schedule 'ring' requested",
        "site": site,
        "nodes": REWRITTEN_NODES,
        "collectives": ["all_gather_into_tensor"],
        "group": "0",
        "group_size": 2,
        "gather_dim": 0,
        "gathered_shape": [8, 4],
        "matmuls": ["mm"],
        "roles": {"mm": "rows"},
        "predicted_us": {"collective": 30.0, "ring": 25.0, "bidir": 27.5},
        **extra,
    }
    if timeline is not None:
        record["timeline"] = timeline
    return record


def declined_mm_rs_site(site: int, reason: str = "reduce op 'max' is not 'sum'") -> dict:
    return {
        "kind": "mm_rs",
        "graph": "backward",
        "decision": "declined",
        "schedule": "off",
        "reason": reason,
        "site": site,
        "nodes": [],
        "collectives": ["reduce_scatter_tensor"],
        "group": "0",
        "group_size": 2,
        "scatter_dim": 0,
        "product_shape": [8, 6],
        "matmuls": ["mm"],
        "blocks": "rows",
    }


def event(lane: str, step: int, start: float, end: float) -> dict:
    return {"lane": lane, "step": step, "name": f"{lane} {step}", "start_us": start, "end_us": end}


RING_TIMELINE = [  # two steps: matmul of the own block while the other block travels
    event("compute", 0, 0.0, 10.0),
    event("comm", 0, 0.0, 15.0),
    event("compute", 1, 15.0, 25.0),
]
SHORT_TIMELINE = [event("compute", 0, 0.0, 5.0), event("comm", 0, 2.0, 8.0)]


def write_dump(root: Path, sites_by_rank: dict[int, list[dict]]) -> Path:
    """A dump of two graphs per rank (forward: BEFORE/AFTER, backward: unchanged)."""
    for rank, sites in sites_by_rank.items():
        rank_dir = root / f"rank{rank}"
        rank_dir.mkdir(parents=True)
        (rank_dir / "graph000_forward_before.py").write_text(BEFORE)
        (rank_dir / "graph000_forward_after.py").write_text(AFTER)
        backward = BEFORE.replace("all_gather_into_tensor", "reduce_scatter_tensor")
        (rank_dir / "graph001_backward_before.py").write_text(backward)
        (rank_dir / "graph001_backward_after.py").write_text(backward)
        (rank_dir / "report.json").write_text(json.dumps({"sites": sites}))
    return root


@pytest.fixture
def two_rank_dump(tmp_path: Path) -> Path:
    return write_dump(
        tmp_path,
        {
            0: [ag_mm_site(0, RING_TIMELINE, measured_us=26.5), declined_mm_rs_site(1)],
            1: [ag_mm_site(0, RING_TIMELINE), ag_mm_site(2, SHORT_TIMELINE)],
        },
    )


class SiteTable(HTMLParser):
    """The text of every cell of ``table#sites``'s body, row by row."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = self._in_body = self._in_cell = False
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("id", "sites") in attrs:
            self._in_table = True
        elif self._in_table and tag == "tbody":
            self._in_body = True
        elif self._in_body and tag == "tr":
            self.rows.append([])
        elif self._in_body and tag == "td":
            self.rows[-1].append("")
            self._in_cell = True
        elif self._in_cell and tag == "br":
            self.rows[-1][-1] += "\n"

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._in_cell = False
        elif tag == "table":
            self._in_table = self._in_body = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[-1][-1] += data

    def column(self, name: str) -> list[str]:
        headers = ["rank", "site", "graph", "kind", "shapes", "matmuls", "group", "schedule"]
        headers += ["predicted (µs)", "measured (µs)", "decision", "reason"]
        return [row[headers.index(name)] for row in self.rows]


def code_lines(page: str, css_class: str) -> list[str]:
    """The code lines the page marks with ``css_class`` (e.g. "def rewritten")."""
    return texts(page, "span", f"line {css_class}")


def texts(page: str, tag: str, css_class: str) -> list[str]:
    """The text of each ``tag`` element of class ``css_class``."""
    parser = _Text(tag, css_class)
    parser.feed(page)
    return parser.texts


class _Text(HTMLParser):
    def __init__(self, tag: str, css_class: str) -> None:
        super().__init__()
        self.tag, self.css_class, self.texts, self._open = tag, css_class, [], False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open = tag == self.tag and ("class", self.css_class) in attrs
        if self._open:
            self.texts.append("")

    def handle_endtag(self, tag: str) -> None:
        self._open = False

    def handle_data(self, data: str) -> None:
        if self._open:
            self.texts[-1] += data


# ----------------------------------------------------------------------------------------
# the page and the trace of a synthetic dump


def test_writes_the_page_and_the_trace_into_the_dump(two_rank_dump: Path):
    assert inspect_dump(two_rank_dump) == [
        two_rank_dump / "report.html",
        two_rank_dump / "trace.json",
    ]
    json.loads((two_rank_dump / "trace.json").read_text())
    assert (two_rank_dump / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_site_table_has_one_row_per_site_of_every_rank(two_rank_dump: Path):
    table = SiteTable(render_html(load(two_rank_dump)))
    assert [(r[0], r[1], r[3], r[10]) for r in table.rows] == [
        ("0", "0", "ag_mm", "rewritten"),
        ("0", "1", "mm_rs", "declined"),
        ("1", "0", "ag_mm", "rewritten"),
        ("1", "2", "ag_mm", "rewritten"),
    ]
    assert table.column("graph")[:2] == ["graph000 forward", "graph001 backward"]
    assert table.column("shapes")[:2] == ["gathered [8, 4], dim 0", "product [8, 6], dim 0"]
    assert table.column("matmuls")[:2] == ["mm (rows)", "mm\nblocks: rows"]
    assert table.column("group")[0] == "0 (2 ranks)"
    assert table.column("schedule")[:2] == ["ring", "off"]
    assert table.column("predicted (µs)")[0] == "collective 30.0\nring 25.0\nbidir 27.5"
    assert table.column("predicted (µs)")[1] == "—"  # a declined site may have no prediction
    assert table.column("measured (µs)")[:3] == ["26.5", "—", "—"]
    assert table.column("reason")[1] == "reduce op 'max' is not 'sum'"


def test_the_chosen_schedules_prediction_is_bold(two_rank_dump: Path):
    page = render_html(load(two_rank_dump))
    assert "<b>ring 25.0</b>" in page
    assert "<b>collective" not in page
    collective_kept = ag_mm_site(0, decision="declined", schedule="off")
    page = render_html(load(write_dump(two_rank_dump / "kept", {0: [collective_kept]})))
    assert "<b>collective 30.0</b>" in page


def test_rows_link_to_their_graph_and_graphs_show_before_and_after(two_rank_dump: Path):
    page = render_html(load(two_rank_dump))
    for rank in (0, 1):
        for graph in ("graph000", "graph001"):
            assert f'id="rank{rank}-{graph}"' in page
    assert page.count('href="#rank0-graph000"') == 1
    assert page.count('href="#rank1-graph000"') == 2
    assert page.count("<h4>before</h4>") == page.count("<h4>after</h4>") == 4


def test_rewritten_nodes_are_highlighted_in_the_code(two_rank_dump: Path):
    page = render_html(load(write_dump(two_rank_dump / "one", {0: [ag_mm_site(0)]})))
    defined = [line.split("=")[0].strip() for line in code_lines(page, "def rewritten")]
    # before: the collective and the matmul; after: every node the rewrite created
    assert defined == ["all_gather_into_tensor", "mm", *REWRITTEN_NODES]
    mentioning = [line.split("=")[0].strip() for line in code_lines(page, "use rewritten")]
    assert mentioning == ["wait_tensor", "relu", "relu"]  # lines that read a site's node


def test_declined_sites_are_highlighted_as_declined(two_rank_dump: Path):
    page = render_html(load(two_rank_dump))
    defined = {line.split("=")[0].strip() for line in code_lines(page, "def declined")}
    assert defined == {"reduce_scatter_tensor", "mm"}  # rank 0's backward graph


def test_timeline_puts_each_site_after_the_previous_one(two_rank_dump: Path):
    sites = timeline(load(two_rank_dump).ranks[1])
    assert [(s.site.record["site"], s.start_us, s.end_us) for s in sites] == [
        (0, 0, 25),
        (2, 25, 33),
    ]
    placed = [
        (s.site.record["site"], e.lane, e.start_us, e.end_us) for s in sites for e in s.events
    ]
    assert placed == [
        (0, "compute", 0.0, 10.0),
        (0, "comm", 0.0, 15.0),
        (0, "compute", 15.0, 25.0),
        (2, "compute", 25.0, 30.0),
        (2, "comm", 27.0, 33.0),
    ]


def test_page_draws_one_svg_timeline_per_rank(two_rank_dump: Path):
    page = render_html(load(two_rank_dump))
    assert page.count('<svg class="timeline"') == 2
    assert page.count('<rect class="compute"') == 2 + 3
    assert page.count('<rect class="comm"') == 1 + 2
    assert "site 2 (ag_mm) step 0: comm 0, 27 µs to 33 µs" in page


def test_chrome_trace_has_a_process_per_rank_and_a_thread_per_lane(two_rank_dump: Path):
    events = chrome_trace(rank_processes(load(two_rank_dump)))["traceEvents"]
    names = {
        (e["pid"], e.get("tid"), e["args"]["name"]) for e in events if e["name"].endswith("name")
    }
    assert names == {
        (0, None, "rank 0"),
        (0, 1, "compute"),
        (0, 2, "comm"),
        (1, None, "rank 1"),
        (1, 1, "compute"),
        (1, 2, "comm"),
    }
    spans = [(e["pid"], e["tid"], e["ts"], e["dur"], e["name"]) for e in events if e["ph"] == "X"]
    assert spans == [
        (0, 1, 0.0, 10.0, "compute 0"),
        (0, 2, 0.0, 15.0, "comm 0"),
        (0, 1, 15.0, 10.0, "compute 1"),
        (1, 1, 0.0, 10.0, "compute 0"),
        (1, 2, 0.0, 15.0, "comm 0"),
        (1, 1, 15.0, 10.0, "compute 1"),
        (1, 1, 25.0, 5.0, "compute 0"),
        (1, 2, 27.0, 6.0, "comm 0"),
    ]
    last = events[-1]
    assert last["cat"] == "ag_mm" and last["args"]["site"] == 2 and last["args"]["step"] == 0


def test_without_timelines_the_page_says_so(tmp_path: Path):
    dump = load(write_dump(tmp_path, {0: [ag_mm_site(0), declined_mm_rs_site(1)]}))
    page = render_html(dump)
    assert "No site in this dump has a predicted timeline" in page
    assert "<svg" not in page
    assert [e for e in chrome_trace(rank_processes(dump))["traceEvents"] if e["ph"] == "X"] == []


def test_page_is_self_contained(two_rank_dump: Path):
    page = render_html(load(two_rank_dump))
    for external in ("http:", "https:", "<link", " src=", "url(", "@import"):
        assert external not in page


def test_code_and_text_are_escaped(tmp_path: Path):
    hostile = '<script>alert("x")</script> & "quoted"'
    record = ag_mm_site(0, reason=hostile, group="<g>")
    root = write_dump(tmp_path, {0: [record]})
    (root / "rank0" / "graph000_forward_after.py").write_text(AFTER + f"    # {hostile}\n")
    page = render_html(load(root))
    assert "<script>alert" not in page and "<g>" not in page
    assert page.count("&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp;") == 2
    assert SiteTable(page).column("reason") == [hostile]


def test_timeline_draws_only_labels_that_fit(tmp_path: Path):
    """A site's label, else a shorter one, where it fits its band; the tooltip names it."""
    wide, narrow = [event("compute", 0, 0.0, 1000.0)], [event("compute", 0, 0.0, 1.0)]
    root = write_dump(
        tmp_path, {0: [ag_mm_site(0, wide), ag_mm_site(1, narrow), ag_mm_site(2, wide)]}
    )
    page = render_html(load(root))
    assert texts(page, "text", "site") == ["site 0 (ag_mm)", "site 2 (ag_mm)"]
    assert texts(page, "text", "step") == ["0", "0"]  # the narrow box has none
    assert "<title>site 1 (ag_mm), rewritten" in page


@pytest.mark.parametrize(
    ("end_us", "unit", "ticks", "tooltip"),
    [
        (33.0, "µs", ["0", "5", "10", "15", "20", "25", "30"], "0 µs to 33 µs"),
        (25_000.0, "ms", ["0", "5", "10", "15", "20", "25"], "0 ms to 25 ms"),
        (3e6, "s", ["0", "0.5", "1", "1.5", "2", "2.5", "3"], "0 s to 3 s"),
    ],
)
def test_the_time_axis_has_one_unit_chosen_from_the_span(
    tmp_path: Path, end_us: float, unit: str, ticks: list[str], tooltip: str
):
    root = write_dump(tmp_path, {0: [ag_mm_site(0, [event("comm", 0, 0.0, end_us)])]})
    page = render_html(load(root))
    assert texts(page, "text", "unit") == [f"time ({unit})"]
    assert texts(page, "text", "tick") == ticks
    assert f"comm 0, {tooltip}</title>" in page  # the tooltips too


def test_every_colour_has_a_legend(tmp_path: Path):
    declined = declined_mm_rs_site(1) | {"timeline": SHORT_TIMELINE}
    page = render_html(load(write_dump(tmp_path, {0: [ag_mm_site(0, RING_TIMELINE), declined]})))
    swatches = set(re.findall(r'<span class="swatch ([^"]+)">', page))
    drawn = set(re.findall(r'<rect class="([^"]+)"', page))
    assert drawn == {"band rewritten", "band declined", "compute", "comm"}
    marked = {c.removeprefix("line ") for c in re.findall(r'<span class="(line [^"]+)"', page)}
    assert marked == {"def rewritten", "use rewritten", "def declined", "use declined"}
    assert drawn | marked <= swatches


def test_the_measured_column_says_when_it_is_filled(two_rank_dump: Path):
    page = render_html(load(two_rank_dump))
    (title,) = re.findall(r'<th title="([^"]*)">measured \(µs\)</th>', page)
    assert 'options={"measure": True}' in html.unescape(title)
    assert 'options={"measure": True}' in html.unescape(texts(page, "p", "note")[0])


def test_damaged_dumps_still_give_a_page(tmp_path: Path):
    timeline_with_junk = [
        "not an event",
        {"lane": "disk", "start_us": 0, "end_us": 1},
        {"lane": "comm", "start_us": 5, "end_us": 1},
        {"lane": "comm", "start_us": True, "end_us": 1},
        {"lane": "comm", "start_us": 0, "end_us": float("nan")},
        {"lane": "compute", "start_us": 0, "end_us": 4},  # no step, no name: still drawn
    ]
    root = write_dump(
        tmp_path,
        {
            0: [{}, {"kind": "ag_mm", "nodes": "p2p_default", "timeline": timeline_with_junk}],
            1: [],
            2: [],
            3: [],
        },
    )
    (root / "rank1" / "report.json").write_text("{not json")
    (root / "rank2" / "report.json").unlink()
    (root / "rank3" / "report.json").write_text('{"sites": 5}')
    (root / "rank3" / "graph001_backward_after.py").unlink()
    dump = load(root)
    page = render_html(dump)
    assert len(SiteTable(page).rows) == 2
    assert [
        (e.lane, e.step, e.name, e.end_us) for s in timeline(dump.ranks[0]) for e in s.events
    ] == [("compute", None, "compute", 4.0)]
    notes = "\n".join(dump.notes)
    assert "rank1/report.json: unreadable (JSONDecodeError" in notes
    assert "rank2/report.json: missing" in notes
    assert "rank3/report.json: no 'sites' list" in notes
    assert "rank 0: no graph found for site ? (?), site ? (ag_mm)" in notes
    assert "no after code in the dump" in page


def test_sites_find_their_graph_by_kind_order_and_node_names(tmp_path: Path):
    root = write_dump(tmp_path, {0: []})
    rank_dir = root / "rank0"
    unrelated = (
        "\ndef forward(self, x):\n    relu = torch.ops.aten.relu.default(x)\n    return (relu,)\n"
    )
    for index, code in ((2, unrelated), (3, BEFORE)):
        for stage in ("before", "after"):
            (rank_dir / f"graph{index:03d}_forward_{stage}.py").write_text(code)
    gather = {"graph": "forward", "collectives": ["all_gather_into_tensor"]}
    sites = [
        declined_mm_rs_site(0) | gather,  # graph000: the first forward graph, names there
        declined_mm_rs_site(1),  # graph001: the only backward graph
        declined_mm_rs_site(2) | gather,  # graph003: graph002 is later but lacks the names
        declined_mm_rs_site(3) | gather | {"graph_index": 2},  # where the record says
    ]
    (rank_dir / "report.json").write_text(json.dumps({"sites": sites}))
    found = [
        (s.record["site"], s.graph.index if s.graph else None) for s in load(root).ranks[0].sites
    ]
    assert found == [(0, 0), (1, 1), (2, 3), (3, 2)]


def test_cli_prints_the_paths_it_wrote(two_rank_dump: Path, capsys):
    assert main(["inspect", str(two_rank_dump)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        str(two_rank_dump / "report.html"),
        str(two_rank_dump / "trace.json"),
    ]


def test_cli_rejects_a_directory_that_is_not_a_dump(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(tmp_path)])
    assert exit_.value.code == 2
    assert "is not a commfuse debug dump" in capsys.readouterr().err


def test_cli_says_that_a_directory_does_not_exist(tmp_path: Path, capsys):
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(missing)])
    assert exit_.value.code == 2
    assert f"{missing} does not exist" in capsys.readouterr().err


def test_cli_fails_when_no_rank_has_a_readable_report(tmp_path: Path, capsys):
    root = write_dump(tmp_path, {0: [], 1: []})
    (root / "rank0" / "report.json").write_text('{"sites": [{"kind": "ag_')  # truncated
    (root / "rank1" / "report.json").unlink()
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(root)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{root}: no rank's report.json could be read" in err
    assert f"{root / 'rank0' / 'report.json'}: unreadable (JSONDecodeError" in err
    assert f"{root / 'rank1' / 'report.json'}: missing" in err
    assert not (root / "report.html").exists()


def test_cli_warns_about_each_unreadable_rank_and_still_writes_the_page(
    two_rank_dump: Path, capsys
):
    report = two_rank_dump / "rank1" / "report.json"
    report.write_text(report.read_text()[:40])  # truncated
    assert main(["inspect", str(two_rank_dump)]) == 0
    out, err = capsys.readouterr()
    assert [line.split(" (")[0] for line in err.splitlines()] == [f"warning: {report}: unreadable"]
    assert out.splitlines()[0] == str(two_rank_dump / "report.html")
    page = (two_rank_dump / "report.html").read_text()
    assert [row[0] for row in SiteTable(page).rows] == ["0", "0"]


# ----------------------------------------------------------------------------------------
# a dump the pass wrote


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as ``rank`` of a fake process group, with an empty report."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    report.reset()
    try:
        yield
    finally:
        report.reset()
        dist.destroy_process_group()


def test_real_dump_of_two_ranks(tmp_path: Path):
    world_size = 4
    ring = Options(schedule="ring", inner="eager", debug_dir=str(tmp_path))
    graphs = [("forward", AgMm()), ("backward", MmRs()), ("forward", MmRs(op="max"))]
    for rank in (0, 1):
        with fake_rank(rank, world_size):
            for kind, case in graphs:
                rewrite_graph(trace(case, world_size, case.inputs(rank, seed=0)), kind, ring)

    assert main(["inspect", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    written = [
        json.loads((tmp_path / f"rank{r}" / "report.json").read_text())["sites"] for r in (0, 1)
    ]
    table = SiteTable(page)
    expected = [(str(r), s["kind"], s["decision"]) for r in (0, 1) for s in written[r]]
    assert [(row[0], row[3], row[10]) for row in table.rows] == expected
    assert [row[2] for row in table.rows] == [
        "graph000 forward",
        "graph001 backward",
        "graph002 forward",
    ] * 2
    assert [row[10] for row in table.rows[:3]] == ["rewritten", "rewritten", "declined"]
    assert table.column("shapes")[0] == "gathered [2, 12, 8], dim 1"
    assert (
        table.column("reason")[2] == written[0][2]["reason"] and "'max'" in written[0][2]["reason"]
    )
    defined = {line.split("=")[0].strip() for line in code_lines(page, "def rewritten")}
    assert set(written[0][0]["nodes"]) <= defined
    assert "reduce_scatter_tensor" in {
        line.split("=")[0].strip() for line in code_lines(page, "def declined")
    }
    has_timeline = any("timeline" in site for sites in written for site in sites)
    assert ("<svg" in page) == has_timeline  # the pass may not predict timelines yet
    trace_events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace_events} == {0, 1}


# ----------------------------------------------------------------------------------------
# the page in a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_page_runs_in_headless_chromium(two_rank_dump: Path, tmp_path: Path):
    (page,) = (p for p in inspect_dump(two_rank_dump) if p.suffix == ".html")
    command = [
        CHROMIUM,
        *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"),
        *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    table = SiteTable(dom)
    assert [(r[0], r[1], r[3], r[10]) for r in table.rows] == [
        ("0", "0", "ag_mm", "rewritten"),
        ("0", "1", "mm_rs", "declined"),
        ("1", "0", "ag_mm", "rewritten"),
        ("1", "2", "ag_mm", "rewritten"),
    ]
    assert "4 of 4 sites shown" in dom  # written by the page's script: it ran
    assert dom.count('<svg class="timeline"') == 2
