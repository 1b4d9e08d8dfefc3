"""`commfuse bench`: runs and writes well-formed results; its namespaces never outlive it.

No timing is asserted: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from commfuse_compile.tools.bench.block import (
    BlockJob,
    alone_labels,
    block_compile,
    block_times,
)
from commfuse_compile.tools.bench.cells import SiteJob, measure_site
from commfuse_compile.tools.bench.config import (
    DROPLESS_KIND,
    DROPLESS_SKEW,
    MOE_KIND,
    BlockShape,
    SiteShape,
)
from commfuse_compile.tools.bench.figures import (
    KIND_TITLES,
    block_result,
    format_block,
    format_cell,
    site_cell,
    slowest,
)
from commfuse_compile.tools.bench.markdown import markdown
from commfuse_compile.tools.bench.netns import PREFIX, can_throttle, remove_stale_namespaces
from commfuse_compile.tools.bench.plot import plot_speedup
from commfuse_compile.tools.bench.predicted import matmul_alone_s
from commfuse_compile.tools.bench.run import FULL, QUICK, kind_rows, variants
from commfuse_compile.tools.bench.sites import build_site, dropless_routing
from commfuse_compile.tools.bench.targets import predicted_cells
from commfuse_compile.tools.cli import _parser, main

ROOT_ONLY = pytest.mark.skipif(can_throttle() is not None, reason=str(can_throttle()))
ULYSSES = ("mm_a2a", "a2a_mm")
ULYSSES_ROWS = ["baseline", "ring", "auto"]
QUICK_KINDS = {"ag_mm", "mm_rs", *ULYSSES, "mm_ar_mm"}  # the MoE cells: full preset only


def _our_namespaces(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if f"{PREFIX}{pid}-" in line]


BLOCK_ROWS = ["baseline", "ring"]
TIMED = [*BLOCK_ROWS, *(x for label in BLOCK_ROWS for x in alone_labels(label))]


def alone(times: dict[str, list[float]]) -> dict[str, tuple[float, ...]]:
    """Each row's compute alone and communication alone, taken out of ``times``."""
    out = {
        label: tuple(statistics.median(times.pop(x)) for x in alone_labels(label))
        for label in BLOCK_ROWS
    }
    assert all(t > 0 for pair in out.values() for t in pair)
    return out


def _computed_alone(rank: int, n: int, schedule: str) -> dict:
    """Job: an all-gather -> matmul -> reduce-scatter compiled with ``local_backend``:
    what it computes, the calls it replaced, and their replay on the real group."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from commfuse_compile.tools.bench.alone import local_backend, recording, replay

    group = dist.group.WORLD

    def site(x, w):
        return funcol.reduce_scatter_tensor(
            funcol.all_gather_tensor(x, 0, group) @ w, "sum", 0, group
        )

    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    compiled = torch.compile(site, backend=local_backend({"schedule": schedule}))
    compiled(x, w)
    with recording() as calls:
        out = compiled(x, w)
    replay(calls)  # every rank posts the same transfers: it returns
    return {
        "shape": list(out.shape),
        # the collectives' copies: the gathered tensor n copies of x, the scattered rows
        # its first block's
        "local": schedule != "off" or torch.equal(out, (torch.cat([x] * n) @ w)[:4]),
        "calls": [str(target) for target, _ in calls],
    }


def test_compute_alone_sends_nothing_and_communication_alone_replays_it(ranks):
    """The limit's terms (``bench.alone``): the program with every collective (``off``)
    or P2P batch (``ring``) a local copy of the same shape, computing what it computes on
    local copies; the replaced calls, recorded in order, replayed on the group."""
    for schedule, calls in (
        (
            "off",
            [
                "_c10d_functional.all_gather_into_tensor.default",
                "_c10d_functional.reduce_scatter_tensor.default",
            ],
        ),
        # the all-gather's ring, one P2P batch on 2 ranks; the reduce-scatter of the same
        # matmul stays a collective
        ("ring", ["commfuse.p2p.default", "_c10d_functional.reduce_scatter_tensor.default"]),
    ):
        for result in ranks(2).run(_computed_alone, schedule):
            assert result == {"shape": [4, 8], "local": True, "calls": calls}, schedule


def test_rows_follow_the_schedule_list():
    labels = [v.label for v in variants(("auto", "ring", "bidir", "push", "slicing", "off"))]
    assert labels == ["baseline", "slicing k=2", "slicing k=4", "push", "ring", "bidir", "auto"]
    assert [v.label for v in variants(("auto", "ring", "off", "new"))] == [
        "baseline",
        "ring",
        "auto",
        "new",
    ]
    assert variants(("slicing",))[1].options("p.json") == {
        "schedule": "slicing",
        "slices": 4,
        "profile": "p.json",
    }


def test_shapes_fitted_to_the_world_size():
    """On 2 ranks the presets' shapes run as they are; on 3 a site's sequence and hidden
    size are rounded down to multiples of 3, a block's heads, hidden and sequence up."""
    site = QUICK.cells[0].sizes[0]
    assert site.fitted(2) == site and (site.fitted(3).seq, site.fitted(3).ffn) == (2046, 2046)
    assert QUICK.block.shape.fitted(2) == QUICK.block.shape
    block = QUICK.block.shape.fitted(3)
    assert (block.heads, block.dim, block.hidden, block.seq) == (6, 384, 768, 258)
    assert QUICK.block_plain is not None and not QUICK.block_plain.shape.sequence_parallel
    assert [v.label for v in kind_rows(variants(), "mm_ar_mm")] == [v.label for v in variants()]


def test_ulysses_cells_have_the_rows_of_their_direction():
    """An all-to-all has the pairwise (ring) order only: its cells are the baseline,
    ring and auto; the quick preset has one cell per Ulysses kind."""
    for kind in ULYSSES:
        assert [v.label for v in kind_rows(variants(), kind)] == ULYSSES_ROWS
    assert [v.label for v in kind_rows(variants(), "ag_mm")] == [v.label for v in variants()]
    cells = [cell for cells in QUICK.cells for cell in cells]
    assert sorted(kind for kind, _, _ in cells if kind in ULYSSES) == sorted(ULYSSES)


def test_moe_cells_and_block_are_in_the_full_preset_and_selectable(tmp_path, capsys):
    """The capacity-MoE cell (dispatch -> experts -> combine: two all-to-alls, the rows
    of the all-to-all kinds) at the three ratios and its block (baseline, ring, auto) are
    in the full preset, not in ``--quick``; ``--kinds`` cuts a preset to the cells of
    some kinds and the blocks made of them, and refuses a cut with no cell."""
    assert [v.label for v in kind_rows(variants(), MOE_KIND)] == ULYSSES_ROWS
    moe = [(size, ratio) for cells in FULL.cells for kind, size, ratio in cells if kind == MOE_KIND]
    assert [ratio for _, ratio in moe] == [0.5, 1.0, 2.0]
    assert not any(kind == MOE_KIND for cells in QUICK.cells for kind, _, _ in cells)
    size = moe[0][0]  # slots in n x 2 experts' blocks of one capacity; experts unsharded
    assert size.fitted(2, MOE_KIND) == size
    assert (size.fitted(3, MOE_KIND).seq, size.fitted(3, MOE_KIND).ffn) == (2046, size.ffn)
    assert QUICK.block_moe is None and FULL.block_moe is not None
    assert FULL.block_moe.schedules == ("baseline", "ring", "auto")
    assert FULL.block_moe.shape.mesh(2) == "ep=2, 2 experts per rank"

    only = FULL.only((MOE_KIND,))
    assert [c.kinds for c in only.cells] == [(MOE_KIND,)]
    assert only.block_moe is FULL.block_moe
    assert only.block is only.block_plain is only.block_2d is None
    tp = FULL.only(("ag_mm", "mm_a2a"))
    assert {k for c in tp.cells for k in c.kinds} == {"ag_mm", "mm_a2a"}
    assert tp.block is FULL.block and tp.block_2d is FULL.block_2d
    assert tp.block_plain is tp.block_moe is None

    args = _parser().parse_args(["bench", "--kinds", f"{MOE_KIND},ag_mm"])
    assert args.kinds == (MOE_KIND, "ag_mm") and _parser().parse_args(["bench"]).kinds is None
    assert main(["bench", "--quick", "--kinds", MOE_KIND, "--out", str(tmp_path)]) == 2
    assert f"the quick preset has no cells of {MOE_KIND}" in capsys.readouterr().err


@pytest.mark.matrix  # the capacity layer's sites: test_moe and test_numerics by default
def test_moe_cell_and_block_rewrite_every_site_with_the_ring(ranks):
    """The MoE cell, as ``measure_site`` runs it (tiny, unthrottled, untimed): the
    baseline keeps both all-to-alls (an ``a2a_mm`` and an ``mm_a2a`` site, declined);
    the ring rewrites both; ``auto`` decides on the same two sites. The MoE block's step
    (one untimed step per row): 4 sites, none rewritten without the pass, all with the
    ring (forward: dispatch into the first ``bmm``, second ``bmm`` into the combine;
    backward: the gradients' two all-to-alls, each into the matmuls that read it)."""
    pool = ranks(2)
    rows = tuple(v for v in variants() if v.label in ULYSSES_ROWS)
    job = SiteJob(MOE_KIND, SiteShape(64, 16, 32), rows, None, 0, 1, breakdown_reps=1)
    per_rank = pool.run(measure_site, job)
    records = per_rank[0]["rows"]
    assert all(
        r["rows"][label]["sites"] == record["sites"]
        for r in per_rank
        for label, record in records.items()
    ), "ranks disagree on the sites"
    sites = {
        label: [(s["kind"], s["decision"]) for s in r["sites"]] for label, r in records.items()
    }
    assert sites["baseline"] == [("a2a_mm", "declined"), ("mm_a2a", "declined")]
    assert sites["ring"] == [("a2a_mm", "rewritten"), ("mm_a2a", "rewritten")]
    assert [kind for kind, _ in sites["auto"]] == ["a2a_mm", "mm_a2a"]
    assert records["ring"]["schedule"] == "ring" and records["ring"]["decision"] == "rewritten"
    assert {s["schedule"] for s in records["ring"]["sites"]} == {"ring"}
    cell = site_cell(MOE_KIND, job.shape, 1.0, math.inf, [], per_rank, list(rows), 2)
    assert [r["label"] for r in cell["rows"]] == ULYSSES_ROWS
    assert "a2a_experts_a2a S=64 D=16 F=32" in format_cell(cell)

    shape = BlockShape(seq=32, dim=16, heads=1, hidden=32, front="moe")
    block_rows = rows[:2]
    sites_per_rank = pool.run(block_compile, BlockJob(shape, block_rows, None))
    assert all(s == sites_per_rank[0] for s in sites_per_rank), "ranks disagree on the sites"
    times = slowest(pool.run(block_times, TIMED, 0, 1))
    block = block_result(shape, 1e8, alone(times), times, sites_per_rank[0], 1.0, 2, 2)
    off, ring = block["rows"]
    assert (off["sites"]["rewritten"], off["sites"]["found"]) == (0, 4)
    assert (ring["sites"]["rewritten"], ring["sites"]["found"]) == (4, 4)
    assert ring["sites"]["schedules"] == ["ring"]
    found = {(r["graph"], r["kind"]): r["found"] for r in ring["sites"]["summary"]}
    assert found == {("forward", "a2a_mm"): 1, ("forward", "mm_a2a"): 1, ("backward", "a2a_mm"): 2}
    assert block["mesh"] == "ep=2, 2 experts per rank"
    results = {"sites": [], "targets": [], "meta": {"preset": "full", "world_size": 2}}
    results["meta"] |= {"command": "commfuse bench", "date": "-", "warmup": 2, "reps": 9}
    results["meta"] |= {"network": {"throttled": True, "description": "veth"}}
    machine = {"cpu": "x", "cores": 2, "kernel": "-", "python": "-", "torch": "-"}
    machine["load_average"] = [1.0, 1.0, 1.0]
    results["meta"] |= {"machine_before": machine, "machine_after": machine}
    page = markdown({**results, "block": None, "block_moe": block})
    assert "## Whole MoE layer, expert parallel: training step" in page
    assert "One capacity-MoE layer (S=32 D=16 F=32 top-2" in page and "| ring |" in page


def test_served_cells_are_in_both_presets_and_selectable():
    """Served plain TP (prefills at three prompt lengths, decode steps at three batch
    sizes) is in both presets; ``--kinds served`` keeps it alone, with no site cell."""
    assert QUICK.served is FULL.served is not None
    phases = [(phase, shape.seq) for phase, shape in QUICK.served.shapes()]
    assert [p for p, _ in phases] == ["prefill"] * 3 + ["decode"] * 3
    only = QUICK.only(("served",))
    assert only.served is QUICK.served and not only.cells
    assert only.block is only.block_plain is only.block_2d is None
    assert QUICK.only(("ag_mm",)).served is None
    assert _parser().parse_args(["bench", "--kinds", "served"]).kinds == ("served",)


def test_dropless_cells_and_block_are_in_the_full_preset_and_selectable():
    """The dropless-MoE cell (counts exchanged, ``.tolist()`` splits, dispatch ->
    grouped SwiGLU -> combine: one ``moe`` site, the rows of an all-to-all) at the three
    ratios, balanced, and skewed at ratio 1; its block (training's dropless layer:
    baseline, ring, auto): the full preset only, ``--kinds`` keeps them apart from the
    capacity MoE's. Skewed routing keeps every rank's rows; on 3 or more ranks, and on 2
    both directions together, the rows on the link too."""
    assert [v.label for v in kind_rows(variants(), DROPLESS_KIND)] == ULYSSES_ROWS
    cells = [(s, r) for c in FULL.cells for k, s, r in c if k == DROPLESS_KIND]
    assert [(s.skew, r) for s, r in cells] == [(1.0, 0.5), (1.0, 1.0), (1.0, 2.0), (2.0, 1.0)]
    assert DROPLESS_SKEW == 2.0 and cells[-1][0].label.endswith("skew 2x")
    assert not any(k == DROPLESS_KIND for c in QUICK.cells for k, _, _ in c)
    size = cells[0][0]
    assert size.dim % 16 == 0 and size.ffn % 16 == 0  # _grouped_mm's strides on CPU
    assert size.fitted(2, DROPLESS_KIND) == size
    assert size.fitted(3, DROPLESS_KIND).seq == size.seq - size.seq % 6
    assert QUICK.block_dropless is None and FULL.block_dropless is not None
    assert FULL.block_dropless.shape.moe == "dropless"
    assert FULL.block_dropless.schedules == ("baseline", "ring", "auto")
    assert FULL.block_moe is not None and FULL.block_moe.shape.moe == "capacity"
    only = FULL.only((DROPLESS_KIND,))
    assert {k for c in only.cells for k in c.kinds} == {DROPLESS_KIND}
    assert only.block_dropless is FULL.block_dropless and only.block_moe is None
    assert FULL.only((MOE_KIND,)).block_dropless is None

    assert dropless_routing(2, 96) == [[48, 48], [48, 48]]
    assert dropless_routing(2, 96, 2.0) == [[32, 64], [32, 64]]  # rank 1 runs 2x rank 0
    for n in (3, 4, 5):
        routing = dropless_routing(n, 120, 2.0)
        assert all(sum(row) == 120 for row in routing)  # each rank's rows
        assert [sum(col) for col in zip(*routing, strict=True)] == [120] * n  # received
        assert all(row[(src + 1) % n] == 2 * 120 // n for src, row in enumerate(routing))


def test_dropless_cell_and_block_rewrite_the_moe_site(ranks, tmp_path):
    """The dropless cell, as ``measure_site`` runs it (tiny, unthrottled, untimed),
    balanced and skewed: the token counts' exchange declined in every row (integers);
    the baseline keeps the dispatch and combine (one ``moe`` site, declined), the ring
    rewrites it, ``auto`` decides on it. The dropless block's step (training's layer,
    one untimed step per row): without the pass nothing rewritten; with the ring the
    ``moe`` site forward and backward. The cells on a profile file, as the bench runs
    them: each row predicted again at the cell's compute speed, one factor on both ranks
    (skewed, a rank's own matmul differs: ranks with different profiles refuse to run)."""
    from commfuse_compile.cost.profiles import for_device, save

    pool = ranks(2)
    rows = tuple(v for v in variants() if v.label in ULYSSES_ROWS)
    profile = str(tmp_path / "profile.json")
    save(for_device("cpu"), profile)
    for skew in (1.0, DROPLESS_SKEW):
        shape = SiteShape(96, 32, 32, skew)
        job = SiteJob(DROPLESS_KIND, shape, rows, profile, 0, 1, breakdown_reps=1)
        per_rank = pool.run(measure_site, job)
        records = per_rank[0]["rows"]
        assert all(
            r["rows"][label]["sites"] == record["sites"]
            for r in per_rank
            for label, record in records.items()
        ), "ranks disagree on the sites"
        sites = {
            label: [(s["kind"], s["decision"]) for s in r["sites"]] for label, r in records.items()
        }
        counts = ("a2a_mm", "declined")
        assert sites["baseline"] == [counts, ("moe", "declined")]
        assert sites["ring"] == [counts, ("moe", "rewritten")]
        assert [kind for kind, _ in sites["auto"]] == ["a2a_mm", "moe"]
        ring = records["ring"]
        # the row asked for ``ring``: the moe site runs, and is priced as, its round trip
        assert (ring["schedule"], ring["decision"], ring["reason"]) == (
            "round_trip",
            "rewritten",
            "",
        )
        assert set(ring["predicted_us"]) == {"round_trip", "collective"}  # the moe site's
        # the row's program: the site, and the counts' exchange and the sort before it
        assert ring["predicted_program_us"] > ring["predicted_us"]["round_trip"]
        written = records["baseline"]["predicted_program_us"]
        assert written > ring["predicted_us"]["collective"]
        assert records["baseline"]["program"] != ring["program"]
        factors = {r["rows"][label]["compute_factor"] for r in per_rank for label in records}
        assert len(factors) == 1 and factors.pop() > 0
        assert ring["predicted_at_cell_speed_us"] > 0
        assert "matmul" in per_rank[0]["breakdown"]["ring"]
        cell = site_cell(DROPLESS_KIND, shape, 1.0, math.inf, [], per_rank, list(rows), 2)
        assert [r["label"] for r in cell["rows"]] == ULYSSES_ROWS
        assert f"a2a_gmm_a2a {shape.label}" in format_cell(cell)

    shape = BlockShape(seq=32, dim=32, heads=1, hidden=32, front="moe", moe="dropless")
    sites_per_rank = pool.run(block_compile, BlockJob(shape, rows[:2], None))
    assert all(s == sites_per_rank[0] for s in sites_per_rank), "ranks disagree on the sites"
    times = slowest(pool.run(block_times, TIMED, 0, 1))
    block = block_result(shape, 1e8, alone(times), times, sites_per_rank[0], 1.0, 2, 2)
    off, ring = block["rows"]
    assert (off["sites"]["rewritten"], off["sites"]["found"]) == (0, 3)
    assert (ring["sites"]["rewritten"], ring["sites"]["found"]) == (2, 3)
    summary = {(r["graph"], r["kind"]): r for r in ring["sites"]["summary"]}
    assert summary["forward", "a2a_mm"]["reasons"] == {"site.dtype": 1}  # the counts
    assert {k: (r["found"], r["rewritten"]) for k, r in summary.items() if k[1] == "moe"} == {
        ("forward", "moe"): (1, 1),
        ("backward", "moe"): (1, 1),
    }
    results = {"sites": [], "targets": [], "meta": {"preset": "full", "world_size": 2}}
    results["meta"] |= {"command": "commfuse bench", "date": "-", "warmup": 2, "reps": 9}
    results["meta"] |= {"network": {"throttled": True, "description": "veth"}}
    machine = {"cpu": "x", "cores": 2, "kernel": "-", "python": "-", "torch": "-"}
    machine["load_average"] = [1.0, 1.0, 1.0]
    results["meta"] |= {"machine_before": machine, "machine_after": machine}
    page = markdown({**results, "block": None, "block_moe_dropless": block})
    assert "## Whole dropless MoE layer, expert parallel: training step" in page
    assert "One dropless MoE layer (S=32 D=32 F=32 top-2 dropless" in page


# ``commfuse bench --quick`` as the CLI runs it, its preset shrunk for the test: the same
# kinds of cells (TP+SP at two ratios, the Ulysses ones, the plain-TP one at ratio 1),
# rows, blocks (TP+SP and plain TP, both without auto: its choice on the calibrated
# profile is each cell's auto row, and a block compiles in seconds a row) and targets, at
# a smaller site and block and with fewer repetitions (the quick preset's sizes take
# minutes on 2 cores; a well-formed result needs none of them).
SMALL_QUICK = textwrap.dedent(
    """
    import dataclasses, sys
    from commfuse_compile.tools import cli
    from commfuse_compile.tools.bench import run
    from commfuse_compile.tools.bench.config import BlockShape, ServedBench, SiteShape

    site, quick = SiteShape(512, 256, 512), run.QUICK
    small = BlockShape(seq=64, dim=64, heads=4, hidden=192, batch=2)
    plain = dataclasses.replace(small, sequence_parallel=False)

    def shrunk(cells):  # the plain-TP cell (two matmuls, one all-reduce) at ratio 1 only,
        # the TP+SP ones at two of the three ratios: the test's time stays as it was
        ratios = {run.PLAIN_TP_KINDS: (1.0,), run.TP_KINDS: (0.5, 1.0)}.get(cells.kinds)
        return dataclasses.replace(cells, sizes=(site,), ratios=ratios or cells.ratios)

    run.QUICK = dataclasses.replace(
        quick,
        cells=tuple(shrunk(c) for c in quick.cells),
        warmup=1,
        reps=5,
        calibrate_reps=1,  # the profile well formed, not steady: one timed call a point
        rate_reps=3,
        cell_timed_s=1.2,
        block=dataclasses.replace(quick.block, shape=small, schedules=("baseline", "ring"), reps=5),
        block_plain=dataclasses.replace(
            quick.block_plain, shape=plain, schedules=("baseline", "ring"), reps=3, compare=small
        ),
        served=ServedBench(256, 512, prompts=(128, 256), batches=(4,)),
    )
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def test_a_rows_prediction_prices_what_no_site_holds_as_the_row_runs_it(tmp_path):
    """``predicted.program_us``: the plain-TP cell's residual add and RMSNorm (between the
    all-reduce and the next matmul) are in no site. Written, they run on every row;
    split (``ring``: reduce-scatter, then all-gather), on this rank's half of them: half
    their bytes, as two profiles that differ in their element-wise rate alone show. Graph
    level, rank 0 of 2 on the fake process group."""
    import copy
    import dataclasses

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse_compile import apply, report
    from commfuse_compile.cost.profiles import for_device, save
    from commfuse_compile.tools.bench.predicted import program_us

    outside: dict[tuple[str, float], float] = {}  # beyond the rewritten sites, seconds
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        site = build_site("mm_ar_mm", SiteShape(64, 32, 64), 2, 0)
        for rate in (1e9, 2e9):
            path = str(tmp_path / f"{rate:g}.json")
            save(dataclasses.replace(for_device("cpu"), memory_bytes_per_s=rate), path)
            for schedule in ("off", "ring"):
                first = len(report.REPORT.sites)
                gm = apply(copy.deepcopy(site.graph), schedule=schedule, profile=path)
                records = report.REPORT.sites[first:]
                sites_us = sum(r.predicted_us[r.schedule] for r in records if r.schedule != "off")
                assert (schedule == "off") == (sites_us == 0)
                outside[schedule, rate] = (program_us(gm, records, path) - sites_us) / 1e6
    finally:
        dist.destroy_process_group()
    # the norm's bytes: add, pow, mean, add, rsqrt, mul, mul over 64 rows of 32 fp32 (the
    # mean's and rsqrt's per row; the last mul reads the norm's weight, 128 bytes, whole),
    # at 1 and 2 GB/s
    moved, weight = 24576 + 16384 + 8448 + 512 + 512 + 16640 + 16512, 128
    assert outside["off", 1e9] - outside["off", 2e9] == pytest.approx(moved / 2e9)
    halved = (moved - weight) / 2 + weight
    assert outside["ring", 1e9] - outside["ring", 2e9] == pytest.approx(halved / 2e9)


def test_the_dropless_cells_site_is_priced_alike_on_every_compile():
    """The bench compiles each row on a copy of one captured graph, whose received rows
    are unbacked sizes: a compile moves their hint (1024, then torch's 8192), and the
    returned bytes, scaled by it, once came out 8x smaller on every row after the first
    (``moe``'s ``work`` now takes the rows sent, static, both ways). Graph level, rank 0
    of 2 on the fake process group."""
    import copy
    import dataclasses

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse_compile import apply, report
    from commfuse_compile.cost.profiles import MatmulRate, for_device

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        site = build_site(DROPLESS_KIND, SiteShape(256, 64, 32), 2, 0)
        predicted = []
        for _ in range(2):
            first = len(report.REPORT.sites)
            apply(copy.deepcopy(site.graph), schedule="ring")
            (moe,) = [r for r in report.REPORT.sites[first:] if r.kind == "moe"]
            predicted.append(moe.predicted_us)
    finally:
        dist.destroy_process_group()
    assert predicted[0] == predicted[1]
    # its matmul alone (three grouped bfloat16 calls) at that class's rate, as the model
    # prices the site's matmuls: the compute factor of the cell's at-speed column
    rated = {"bfloat16 grouped": MatmulRate(1e-4, 1e12)}
    p = dataclasses.replace(for_device("cpu"), matmul_rates=rated)
    assert matmul_alone_s(site, p) == pytest.approx(3e-4 + site.flops / 1e12)


def test_a_cell_whose_collective_is_fixed_cost_gets_a_rate_tc_takes():
    """``link.choose_rate`` raises the rate while the collective alone is too slow for
    the ratio; where that is its fixed cost, no rate helps, and one run asked tc for a
    97 Tbit/s tbf, which it refused: the rate stops at ``MAX_RATE_BITS``."""
    from commfuse_compile.tools.bench.link import MAX_RATE_BITS, choose_rate

    class Network:
        def __init__(self):
            self.rates: list[float | None] = []

        def set_rate(self, rate):
            self.rates.append(rate)

    class Ranks:  # the matmul alone 1 ms, the collective alone 5 ms at any rate
        def run(self, job, *args):
            return [{"times": {"matmul": [1e-3], "comm": [5e-3]}, "sent_bytes": 1e9}] * 2

    network = Network()
    rate, tries = choose_rate(network, Ranks(), "ag_mm", SiteShape(8, 8, 8), 0.5, 1)
    assert rate == MAX_RATE_BITS and len(tries) == 5
    assert all(r is None or r <= MAX_RATE_BITS for r in network.rates)


def _timed_sleeps(rank: int, n: int) -> dict:
    """``interleaved`` of a 2 ms call and a 30 ms one with a 0.3 s budget: the calls each
    made and the times each got."""
    import time

    from commfuse_compile.tools.bench.cells import interleaved

    made = {"short": 0, "long": 0}

    def call(label: str, seconds: float):
        def run():
            made[label] += 1
            time.sleep(seconds)

        return run

    fns = {"short": call("short", 2e-3), "long": call("long", 30e-3)}
    times = interleaved(fns, warmup=1, reps=2, timed_s=0.3)
    return {"made": made, "times": times}


def test_a_cells_short_calls_are_timed_back_to_back_and_its_rounds_fill_the_budget(ranks):
    """A call under ``MIN_TIMED_S`` is timed as several back to back after one barrier,
    their mean (the ranks leave a barrier at times 0.9-3.0 ms apart, which a call of a
    few milliseconds timed alone carries whole); the rounds fill ``timed_s``, every rank
    alike."""
    from commfuse_compile.tools.bench.config import MIN_TIMED_S

    results = ranks(2).run(_timed_sleeps)
    rounds = len(results[0]["times"]["long"]) + 1  # and the warm-up
    for result in results:
        made, times = result["made"], result["times"]
        assert len(times["short"]) == len(times["long"]) == rounds - 1
        assert made["long"] == rounds  # 30 ms: once per timing
        per_timing = (made["short"] - 1) / (rounds - 1)  # the warm-up's: once
        assert per_timing == int(per_timing) and 2 <= per_timing <= MIN_TIMED_S / 2e-3
        assert max(times["short"]) < min(times["long"])  # per call, not per timing
    # 0.3 s of rounds of about 2 x 30 ms (plus the sleeps' overshoot): more than reps
    assert 3 <= rounds - 1 <= 6
    assert results[0]["made"] == results[1]["made"]


def test_the_bench_links_bucket_holds_the_same_time_of_traffic_at_every_rate():
    """An idle link's full token bucket lets its first bytes through at once; at a fixed
    floor of 128 KiB that was 4 ms at 250 Mbit/s and 1 at 1 Gbit/s, where the profile
    the model gets is measured at one rate and scaled. Now: 1 ms at every rate, never
    under two jumbo frames (tbf passes no packet larger than its bucket)."""
    from commfuse_compile.tools.bench.netns import BURST_S, MTU, burst_bytes

    for rate in (250e6, 1e9, 4e9):
        assert burst_bytes(rate) * 8 / rate == pytest.approx(BURST_S, rel=1e-6)
    assert burst_bytes(1e6) >= 2 * int(MTU)


def test_a_cells_link_times_are_affine_in_its_rate_through_two_and_never_below_the_machines():
    """``LinkProfiles.at``: a collective's point (and a P2P byte) at a cell's rate is
    affine in 1 / rate through its times at the two reference rates (a call's own cost
    stays, the wire's part scales; gloo's all-to-all lost more than its bytes at low
    rates, which one rate scaled missed) and never below its time unthrottled (gloo
    overlaps its own work with the wire: not the sum)."""
    import dataclasses

    from commfuse_compile.cost.profiles import Curve, for_device
    from commfuse_compile.tools.bench.config import LOW_RATE, REFERENCE_RATE
    from commfuse_compile.tools.bench.link import LinkProfiles

    def profile(call_s: float, point_s: float, bytes_per_s: float) -> object:
        curve = Curve(1e-4, point_s / 1e6, ((4096.0, call_s), (1e6, point_s)))
        return dataclasses.replace(
            for_device("cpu"), link_bytes_per_s=bytes_per_s, collectives={"all_reduce": {2: curve}}
        )

    assert LOW_RATE == REFERENCE_RATE / 4
    # 1 MB: 8 ms at the reference rate, 36 at a quarter of it (4 ms more than 4 x 8), 4
    # unthrottled; 4 KiB: 0.5 ms at every rate
    links = LinkProfiles(
        profile(0.5e-3, 8e-3, 1.25e8), profile(0.5e-3, 36e-3, 3.125e7), profile(0.5e-3, 4e-3, 1e10)
    )
    # at 4x the reference rate the line says 8 - 28 / 4 = 1 ms: unthrottled's 4 instead;
    # at half the rate, a third of the way to the low rate's: 8 + 28 / 3
    expected = {4: [0.5e-3, 4e-3], 1 / 2: [0.5e-3, 8e-3 + 28e-3 / 3], 1: [0.5e-3, 8e-3]}
    for times, point_times in expected.items():
        at = links.at(times * REFERENCE_RATE)
        points = at.collectives["all_reduce"][2].points
        assert [x for x, _ in points] == [4096, 1e6]
        assert [t for _, t in points] == pytest.approx(point_times)
        assert at.collectives["all_reduce"][2].latency_s == 1e-4
    assert links.at(LOW_RATE).collectives == links.low.collectives
    assert links.at(4 * REFERENCE_RATE).link_bytes_per_s == pytest.approx(5e8)
    assert links.at(REFERENCE_RATE / 2).link_bytes_per_s == pytest.approx(6.25e7)
    assert links.at(math.inf) is links.free


def test_a_cells_overlap_slowdown_is_the_share_of_the_core_its_rate_takes():
    """``LinkProfiles.at``: a transfer takes the same core time per byte at any rate, so
    the matmul's slowdown beside it is the reference's share of the core scaled by the
    cell's bytes per second (0.2 of the core at the reference rate: 0.8 at 4x, 0.1 at
    half), up to the probe's cap; where the link saturates, so does the share."""
    import dataclasses

    from commfuse_compile.cost.profiles import for_device
    from commfuse_compile.tools.bench.config import REFERENCE_RATE
    from commfuse_compile.tools.bench.link import LinkProfiles

    def profile(bytes_per_s: float) -> object:
        return dataclasses.replace(
            for_device("cpu"), link_bytes_per_s=bytes_per_s, overlap_slowdown=0.25
        )

    links = LinkProfiles(profile(1.25e8), profile(1.25e8 / 4), profile(1e9))
    assert links.at(4 * REFERENCE_RATE).overlap_slowdown == pytest.approx(0.8 / 0.2)
    assert links.at(REFERENCE_RATE / 2).overlap_slowdown == pytest.approx(0.1 / 0.9)
    # past unthrottled (1e9 B/s, 8x the reference): the share stops at 8 x 0.2, capped
    assert links.at(100 * REFERENCE_RATE).overlap_slowdown == pytest.approx(0.95 / 0.05)


@pytest.mark.slow
def test_bench_quick_writes_well_formed_results(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-c", SMALL_QUICK, "bench", "--quick", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout
    assert "targets:" in stdout and "[" in stdout  # progress lines and the closing summary
    if can_throttle() is None:
        assert _our_namespaces(proc.pid) == []

    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    assert meta["preset"] == "quick" and meta["world_size"] == 2
    assert meta["reps"] >= 5 and meta["network"]["throttled"] == (can_throttle() is None)
    labels = [row["label"] for row in meta["rows"]]
    assert labels[0] == "baseline" and "ring" in labels and "auto" in labels
    assert {c["kind"] for c in results["sites"]} == QUICK_KINDS
    assert len({c["ratio"] for c in results["sites"]}) >= 2
    assert sorted(c["kind"] for c in results["sites"] if c["kind"] in ULYSSES) == sorted(ULYSSES)
    # a cell whose 5 rounds take under 1.2 s is timed over more, the same count on each rank
    assert all(cell["timed_calls"] >= meta["reps"] for cell in results["sites"])
    assert any(cell["timed_calls"] > meta["reps"] for cell in results["sites"])
    for cell in results["sites"]:
        ulysses = cell["kind"] in ULYSSES
        assert [r["label"] for r in cell["rows"]] == (ULYSSES_ROWS if ulysses else labels)
        assert cell["matmul_alone"]["median"] > 0 and cell["comm_alone"]["median"] > 0
        for row in cell["rows"]:
            assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
            assert math.isclose(row["vs_limit"], row["median_s"] / cell["limit_s"])
            assert row["predicted_s"] is None or row["predicted_s"] > 0
        assert next(r for r in cell["rows"] if r["label"] == "ring")["ran"] == "ring"
    # plain TP's all-reduce between two matmuls: the baseline keeps it (one mm_ar site,
    # declined); every schedule's row splits it into a reduce-scatter site and an
    # all-gather site, both rewritten with the row's schedule; auto splits it or not, and
    # may keep a site's collective (at this small size, on the calibrated profile)
    (plain,) = [c for c in results["sites"] if c["kind"] == "mm_ar_mm"]
    assert [r["label"] for r in plain["rows"]] == labels
    baseline, *passed = plain["rows"]
    assert [(s["kind"], s["decision"]) for s in baseline["sites"]] == [("mm_ar", "declined")]
    for row in passed:
        kinds = [s["kind"] for s in row["sites"]]
        if row["label"] == "auto":
            assert kinds in (["mm_rs", "ag_mm"], ["mm_ar"])
            continue
        assert kinds == ["mm_rs", "ag_mm"], row["label"]
        assert {(s["decision"], s["schedule"]) for s in row["sites"]} == {("rewritten", row["ran"])}
    assert results["block_2d"] is None  # opt-in: --block-2d
    assert results["block_moe"] is None  # full preset only
    assert results["block_moe_dropless"] is None
    block = results["block"]
    assert block["rows"][0]["label"] == "baseline" and len(block["rows"]) >= 2
    assert all(row["median_s"] > 0 for row in block["rows"])
    assert block["rows"][0]["sites"]["rewritten"] == 0
    assert next(r for r in block["rows"] if r["label"] == "ring")["sites"]["rewritten"] > 0
    # the plain-TP block: without the pass its all-reduces stay; with the ring they are
    # split into reduce-scatter and all-gather sites, rewritten forward and backward
    plain_block = results["block_plain_tp"]
    assert plain_block["shape"]["sequence_parallel"] is False
    assert plain_block["mesh"] == "plain tp=2"
    off, ring = (
        next(r for r in plain_block["rows"] if r["label"] == x) for x in ("baseline", "ring")
    )
    assert off["sites"]["rewritten"] == 0
    # the all-reduces, and the head's output gather after its matmul (no kind: recorded)
    kinds = {(r["kind"], *r["reasons"]) for r in off["sites"]["summary"]}
    assert {k for k in kinds if k[0] != "mm_ar"} <= {("ag_mm", "site.no_kind")}, kinds
    assert any(k[0] == "mm_ar" for k in kinds), kinds
    rewritten = {(r["graph"], r["kind"]) for r in ring["sites"]["summary"] if r["rewritten"]}
    assert {(g, k) for g in ("forward", "backward") for k in ("mm_rs", "ag_mm")} <= rewritten
    # the same block with sequence parallelism by hand, on the same link, and every row's
    # footprint: with the pass, plain TP saves less than without it
    labels_plain = [r["label"] for r in plain_block["rows"]]
    assert labels_plain == ["baseline", "ring", "TP+SP baseline", "TP+SP ring"]
    for row in plain_block["rows"]:
        assert row["sent_bytes"] > 0 and row["saved_bytes"] > 0 and row["peak_bytes"] > 0
    assert ring["saved_bytes"] < off["saved_bytes"]
    texts = [t["target"] for t in results["targets"]]
    assert len(texts) == 9 and texts[3].startswith("auto within") and texts[6].startswith("whole")
    assert texts[5].startswith("no row below max(compute alone, communication alone)")
    assert texts[7].startswith("plain TP with the pass")
    assert texts[8].startswith("served plain TP: auto never slower than the baseline")
    errors = results["model_error"]  # the cost model's error over every predicted row
    assert errors["rows"] == sum(
        r["model_error"] is not None for c in predicted_cells(results) for r in c["rows"]
    )
    assert errors["by_kind"]["served"]["rows"] > 0  # the served cells' rows count too
    assert errors["min"] <= errors["median"] <= errors["max"] and "model error:" in stdout
    # the same rows again at each cell's measured compute speed: every cell's factor is the
    # slowest rank's matmul alone over the model's time of it, the same on every row
    at_speed = results["model_error_at_cell_speed"]
    assert 0 < at_speed["rows"] <= errors["rows"] and "at each cell's compute speed" in stdout
    for cell in results["sites"]:
        factors = {row["compute_factor"] for row in cell["rows"]}
        assert len(factors) == 1 and factors.pop() > 0
    # served plain TP: prefills and a decode step on one link rate, every mm_ar_mm row
    served = results["served"]
    assert [(c["phase"], c["tokens"]) for c in served["cells"]] == [
        ("prefill", 128),
        ("prefill", 256),
        ("decode", 4),
    ]
    assert {c["rate_bits_per_s"] for c in served["cells"]} == {served["rate_bits_per_s"]}
    assert all([r["label"] for r in c["rows"]] == labels for c in served["cells"])
    assert all(t["reached"] in (True, False, None) for t in results["targets"])

    markdown = (out / "results.md").read_text()
    for heading in (
        "## Sites",
        "## Whole block",
        "## Whole block, plain TP",
        "## Served plain TP",
        "## Targets",
    ):
        assert heading in markdown
    for kind in QUICK_KINDS:  # a table per site kind, the Ulysses ones too
        assert f"### {KIND_TITLES[kind]}" in markdown
    assert "| ag_mm |" in markdown and "| mm_a2a |" in markdown  # where the time goes
    assert "](speedup.svg)" in markdown
    check_plot(out / "speedup.svg", labels[1:], QUICK_KINDS)


def test_2d_block_row_is_built_and_reported(ranks):
    """``--block-2d``: training's fsdp front with tp=2 on a 2 x 2 mesh of its own 4 ranks,
    every site of its step rewritten with the ring, none without the pass; its table
    says the mesh, that the ranks share the cores, and the sites per graph and kind.
    One untimed step per row on unthrottled gloo ranks (the shape of both presets)."""
    assert _parser().parse_args(["bench", "--quick", "--block-2d"]).block_2d
    assert not _parser().parse_args(["bench", "--quick"]).block_2d
    spec = QUICK.block_2d
    assert spec is not None and spec is FULL.block_2d and spec.world_size == 4
    assert spec.schedules == ("baseline", "ring", "auto")
    rows = tuple(v for v in variants() if v.label in ("baseline", "ring"))
    pool = ranks(spec.world_size)
    sites = pool.run(block_compile, BlockJob(spec.shape, rows, None))
    times = slowest(pool.run(block_times, TIMED, 0, 1))
    assert all(s == sites[0] for s in sites), "ranks disagree on the sites"
    block = block_result(spec.shape, 1e8, alone(times), times, sites[0], spec.ratio, 4, 2)
    off, ring = block["rows"]
    assert off["sites"]["rewritten"] == 0 and off["sites"]["found"] > 0
    assert ring["sites"]["found"] == off["sites"]["found"]
    assert ring["sites"]["schedules"] == ["ring"]
    summary = {(r["graph"], r["kind"]): r for r in ring["sites"]["summary"]}
    matmul_kinds = {(g, k) for g in ("forward", "backward") for k in ("ag_mm", "mm_rs")}
    # every site next to a matmul rewritten; the norm weights' gathers and gradient
    # reduce-scatters (no matmul) and the head's output gather (after its matmul: no kind)
    # are recorded declined
    unclaimed = {"ag.no_matmul", "rs.no_matmul", "site.no_kind"}
    for k in matmul_kinds:
        kept = sum(n for code, n in summary[k]["reasons"].items() if code in unclaimed)
        assert summary[k]["rewritten"] == summary[k]["found"] - kept > 0, summary[k]
        assert set(summary[k]["reasons"]) <= unclaimed, summary[k]
    # the TP-replicated parameters' gradient sums: all-reduces with no matmul, recorded
    assert set(summary) - matmul_kinds == {("backward", "mm_ar")}
    assert summary["backward", "mm_ar"]["reasons"] == {"ar.not_matmul": 3}
    assert block["mesh"] == "dp=2 x tp=2" and block["world_size"] == 4
    text = format_block(block)
    assert "4 ranks (dp=2 x tp=2, sharing 2 cores)" in text and "forward ag_mm" in text
    results = {"sites": [], "targets": [], "meta": {"preset": "quick", "world_size": 2}}
    results["meta"] |= {"command": "commfuse bench --block-2d", "date": "-", "warmup": 2}
    results["meta"] |= {"reps": 9, "network": {"throttled": True, "description": "veth"}}
    machine = {"cpu": "x", "cores": 2, "kernel": "-", "python": "-", "torch": "-"}
    machine["load_average"] = [1.0, 1.0, 1.0]
    results["meta"] |= {"machine_before": machine, "machine_after": machine}
    page = markdown({**results, "block": None, "block_2d": block})
    assert "## 2-D block (data x tensor parallel, 4 ranks)" in page
    assert "| ring |" in page and "sharing 2 cores" in page and "100 Mbit/s" in page


def check_plot(path: Path, labels: list[str], kinds: set[str] | None = None) -> None:
    """An SVG with a titled panel per site kind (of ``kinds``; None: every kind) and a
    legend entry per schedule."""
    svg = ET.fromstring(path.read_text())
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {KIND_TITLES[k] for k in kinds or KIND_TITLES} <= texts
    assert {*labels, "baseline", "perfect overlap", "best with 2 blocks"} <= texts


SPEEDUPS = [("baseline", 1.0), ("slicing k=2", 1.1), ("ring", 1.5), ("auto", 1.4)]


def test_plot_of_synthetic_results(tmp_path: Path):
    rows = [{"label": label, "speedup": x, "median_s": 1 / x} for label, x in SPEEDUPS]
    ulysses = [r for r in rows if r["label"] in ULYSSES_ROWS]  # no slicing of an a2a
    cells = [
        {
            "kind": kind,
            "ratio": ratio,
            "rows": ulysses if kind in (*ULYSSES, MOE_KIND, DROPLESS_KIND) else rows,
            "limit_s": 0.5,
            "n_block_bound_s": 0.6,
        }
        for kind in KIND_TITLES
        for ratio in ((1.0,) if kind in ULYSSES else (0.5, 1.0, 2.0))
        for _size in range(2)
    ]
    results = {"sites": cells, "meta": {"world_size": 2, "network": {"throttled": False}}}
    plot_speedup(results, tmp_path / "speedup.svg")
    check_plot(tmp_path / "speedup.svg", [label for label, _ in SPEEDUPS[1:]])


HOLD_NETWORK = textwrap.dedent(
    """
    import sys
    from commfuse_compile.tools.bench.netns import ThrottledNetwork
    with ThrottledNetwork(2, "veth") as net:
        net.set_rate(1e8)
        print("ready", flush=True)
        sys.stdin.readline()  # interrupted by the signal, or told to fail
        raise RuntimeError("boom")
    """
)


@ROOT_ONLY
# SIGINT: a KeyboardInterrupt through the same cleanup as "raise" (in the matrix)
@pytest.mark.parametrize(
    "how", ["raise", pytest.param("SIGINT", marks=pytest.mark.matrix), "SIGTERM"]
)
def test_namespaces_removed_on_failure_and_signals(how):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_NETWORK],
        # Ctrl-C as at a terminal: a job started with ``&`` by a shell without job control
        # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    assert len(_our_namespaces(proc.pid)) == 3  # switch + one per rank
    if how == "raise":
        proc.stdin.write("\n")
        proc.stdin.flush()
    else:
        os.kill(proc.pid, getattr(signal, how))
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert _our_namespaces(proc.pid) == []


@ROOT_ONLY
def test_stale_namespaces_of_dead_processes_are_removed():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    name = f"{PREFIX}{dead}-r0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in remove_stale_namespaces()
    assert _our_namespaces(int(dead)) == []
