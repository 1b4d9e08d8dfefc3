"""The `commfuse` command: `demo` (the README's main command) end to end in a fresh
process, and `sim`. What it says to a wrong argument: test_user_errors.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_demo_runs_checks_and_reports(tmp_path):
    dump = tmp_path / "dump"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commfuse_compile.tools.cli",
            "demo",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--debug-dir",
            str(dump),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sites rewritten: 11 of 11" in proc.stdout
    assert "OK" in proc.stdout
    for graph in ("forward", "backward"):
        for kind in ("ag_mm", "mm_rs"):
            assert any(
                line.startswith(f"{graph:<9} {kind:<6} rewritten")
                for line in proc.stdout.splitlines()
            ), (graph, kind)
    assert "unwaited" not in proc.stderr  # every P2P output was waited on
    assert proc.stdout.rstrip().endswith(
        f"debug dump written to {dump}; for its HTML report and Perfetto trace run: "
        f"commfuse inspect {dump}"
    )
    assert {p.name for p in dump.iterdir()} == {"rank0", "rank1"}
    assert all((dump / rank / "report.json").is_file() for rank in ("rank0", "rank1"))


def test_sim_prints_every_schedule_and_writes_traces(tmp_path, capsys):
    from commfuse_compile.cost.simulator import SCHEDULES
    from commfuse_compile.tools.cli import main
    from commfuse_compile.tools.sim import PRESETS, layer_sites

    assert (
        main(["sim", "--model", "llama3-70b", "--group-size", "2,8", "--out", str(tmp_path)]) == 0
    )
    out = capsys.readouterr().out
    assert "llama3-70b layer, tokens 8192, profile h100-nvlink4" in out
    for n in (2, 8):
        assert f"n = {n}:" in out
        trace = json.loads((tmp_path / f"trace_n{n}.json").read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert names == {f"{s} rank {r}" for s in SCHEDULES for r in range(n)}
        assert all(e["dur"] >= 0 for e in spans)
    for name, _ in layer_sites(PRESETS["llama3-70b"], 2):
        assert name in out


def test_sim_takes_the_tokens_and_slices_given(capsys):
    from commfuse_compile.tools.cli import main

    assert main(["sim", "--group-size", "4", "--tokens", "1024", "--slices", "64"]) == 0
    assert "llama3-8b layer, tokens 1024, profile h100-nvlink4" in capsys.readouterr().out


def test_sim_rejects_an_unknown_profile(capsys):
    from commfuse_compile.tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--profile", "no-such-machine"])
    assert exit_info.value.code == 2
    assert "neither a built-in profile" in capsys.readouterr().err
