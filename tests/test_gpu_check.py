"""``benchmarks/gpu_check.py``, the one command a short stay on a GPU runs, in its CPU dry
mode: every part runs and writes what it must, so that the script cannot rot before a
GPU comes. Nothing here asserts a timing (the dry mode's numbers measure nothing).

The default run compiles the block for ``off`` and ``ring`` only (``--schedules``: the
baseline and the profiled schedule; every schedule's Inductor program is checked in
``test_default_path`` and ``test_inductor_order``); ``pytest -m matrix`` runs the dry
mode as a GPU run does, every schedule."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import gpu_check  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
from gpu_check_parts.block import TIMED
from gpu_check_parts.mode import GROUP_SIZES, MODELS, SLICES, WORLD_SIZE, cpu_mode, gpu_mode
from gpu_check_parts.split_gemm import DIRECTIONS, Split, run_blocks

from commfuse_compile.cost import profiles
from commfuse_compile.tools import cli
from commfuse_compile.tools.sim.layer import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("off", "ring"), id="off-ring"),
        pytest.param(TIMED, id="every-schedule", marks=pytest.mark.matrix),
    ],
)
def dry_run(request, tmp_path_factory) -> tuple[Path, str, tuple[str, ...]]:
    """The script as a GPU run would start it, with --cpu (and the schedules given):
    (output folder, stdout, schedules)."""
    out = tmp_path_factory.mktemp("gpu-dry")
    schedules = request.param
    flags = [] if schedules == TIMED else ["--schedules", ",".join(schedules)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout, schedules


def test_dry_mode_times_every_split(dry_run):
    out, _, _ = dry_run
    cells = json.loads((out / "summary.json").read_text())["split_gemm"]
    expected = itertools.product(MODELS, GROUP_SIZES, DIRECTIONS)
    assert [(c["model"], c["n"], c["direction"]) for c in cells] == list(expected)
    for cell in cells:
        assert cell["whole_us"] > 0 and cell["blocks_us"] > 0 and cell["with_copies_us"] > 0
        assert cell["efficiency"] == pytest.approx(cell["whole_us"] / cell["blocks_us"])
        m, k, cols = cell["shape"]  # one block of the gathered operand, in bf16
        gathered = k * cols if cell["direction"] == "columns" else m * k
        assert cell["message_bytes"] == 2 * gathered // cell["n"]
        assert 0 < cell["model_efficiency"] <= 1 and 0 < cell["base_model_efficiency"] <= 1


def test_dry_mode_profile_feeds_the_simulator(dry_run, capsys):
    out, _, _ = dry_run
    path = out / "profile.json"
    profile = profiles.load(path)
    base = profiles.for_device("cpu")
    assert profile.name == f"gpu-check-{base.name}" and "gpu_check.py" in profile.source
    assert profile.matmul_flops > 0 and profile.memory_bytes_per_s > 0
    assert (profile.link_bytes_per_s, profile.collectives) == (
        base.link_bytes_per_s,
        base.collectives,
    )  # one device has no link: the built-in profile's stand
    assert cli.main(["sim", "--profile", str(path), "--group-size", "2,4"]) == 0
    printed = capsys.readouterr().out
    assert f"profile {profile.name}" in printed and "layer (fwd + bwd sites)" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"] == json.loads(json.dumps(profile.as_json()))
    assert {(r["profile"], r["model"], r["n"]) for r in summary["sim"]} == set(
        itertools.product((profile.name, base.name), MODELS, GROUP_SIZES)
    )


def test_dry_mode_checks_every_schedules_program(dry_run):
    out, stdout, schedules = dry_run
    runs = json.loads((out / "summary.json").read_text())["block"]
    assert TIMED == ("off", "ring", "bidir", "push", "slicing")
    assert [r["schedule"] for r in runs] == list(schedules)
    for run in runs:
        assert run["verdict"] == "pass", run
        assert run["programs"] == 2 and run["violations"] == [] and run["fallbacks"] == []
        assert run["transfers"] > 0 and run["step_s"] > 0 and run["error"] is None
        programs = [(out / "programs" / f"{run['schedule']}_{i}.py").read_text() for i in (0, 1)]
        p2p = ["torch.ops.commfuse.p2p.default" in code for code in programs]
        assert p2p == [run["schedule"] in ("ring", "bidir", "push")] * 2
        if run["schedule"] != "off":
            assert run["rewritten"] == run["sites"] > 0
    assert "exposed_steps:" in stdout and "| ring | 2 |" in stdout
    assert (out / "summary.md").read_text() in stdout  # the table, printed too


def test_dry_mode_writes_a_chrome_trace_of_the_ring(dry_run):
    out, _, _ = dry_run
    events = json.loads((out / "trace_ring.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "commfuse::p2p" in names and "aten::mm" in names
    assert "commfuse::p2p" in (out / "profile_ring.txt").read_text()


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("n", [2, 4])
def test_blocks_compute_the_whole_matmul(direction, n):
    """What is timed as the n blocks is the whole matmul, cut the way the pass cuts it."""
    split = Split("tiny", n, direction, (8, 12, 16))
    a, b, blocks = split.operands(torch.float64, "cpu")
    outputs = run_blocks(direction, blocks)
    joined = {"rows": 0, "columns": 1}
    if direction in joined:
        assert len(outputs) == n
        rebuilt = torch.cat(outputs, dim=joined[direction])
    else:
        (rebuilt,) = outputs  # accumulated
    torch.testing.assert_close(rebuilt, a @ b)
    sent = blocks[0][1] if direction == "columns" else blocks[0][0]
    assert sent.numel() == split.message_elements


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_a_gpu_it_points_to_the_dry_mode(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", str(tmp_path)])
    assert exit_.value.code == 2 and "--cpu runs the dry mode" in capsys.readouterr().err


def test_an_unknown_schedule_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--cpu", "--out", str(tmp_path), "--schedules", "off,rign"])
    assert exit_.value.code == 2 and "--schedules: unknown rign" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [gpu_mode(), cpu_mode()], ids=["gpu", "cpu"])
def test_every_shape_splits_evenly(mode):
    """The GPU mode's sizes cannot be run here: at least they divide as the run needs
    (even blocks for every n and direction; the block's heads, sequence and slicing
    chunks over the fake group's ranks)."""
    for name in MODELS:
        preset = PRESETS[name]
        for n in GROUP_SIZES:
            assert preset.ffn // mode.shrink % (n * n) == 0
            assert preset.tokens // mode.shrink % n == 0
    block, ranks = mode.block, WORLD_SIZE
    assert block.dim % block.heads == 0 and block.heads % ranks == 0
    assert block.hidden % ranks == 0 and block.seq % (ranks * SLICES) == 0
