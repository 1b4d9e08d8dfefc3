"""The `commfuse` command: `demo` (the README's main command) end to end in a fresh
process, and `sim`. What it says to a wrong argument: test_user_errors.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from commfuse_compile.tools.bench import netns
from commfuse_compile.tools.bench.netns import can_throttle
from commfuse_compile.tools.demo import LINK_RATE, DemoConfig, predicted_on_link

_MODEL_FIGURE = re.compile(
    r"no throttled link here \(see link: above\); behind a \d+ Mbit/s link per rank the cost "
    r"model \(gloo-loopback, calibrated on this machine kind\) predicts the block's sites at "
    r"[\d.]+ ms with the pass, [\d.]+ ms with their collectives: [\d.]+x faster"
)


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
    # the headline: behind a throttled link as root, else the cost model's figure for one
    # (values vary with the machine: only what is said is checked)
    if can_throttle() is None:
        assert "link: 2 namespaces, one veth link per rank" in proc.stdout
        assert re.search(
            r"on the \d+ Mbit/s link: commfuse [\d.]+ ms, the same compile with "
            r"schedule='off' [\d.]+ ms: [\d.]+x faster with the pass",
            proc.stdout,
        )
        # the limit's terms measured alone: each program computing with its transfers
        # local copies, and its transfers with nothing computed
        assert re.search(
            r"compute alone \(every transfer a local copy\): commfuse [\d.]+ ms, "
            r"schedule='off' [\d.]+ ms",
            proc.stdout,
        )
        assert re.search(
            r"communication alone \(each program's transfers, nothing computed\): commfuse "
            r"[\d.]+ ms, schedule='off' [\d.]+ ms",
            proc.stdout,
        )
        assert re.search(
            r"overlap limit max\(compute, communication\), each program's own: commfuse at "
            r"[\d.]+x its [\d.]+ ms, schedule='off' at [\d.]+x its [\d.]+ ms",
            proc.stdout,
        )
    else:
        assert _MODEL_FIGURE.search(proc.stdout)
    assert proc.stdout.rstrip().endswith(
        f"debug dump written to {dump}; for its HTML report and Perfetto trace run: "
        f"commfuse inspect {dump}"
    )
    assert {p.name for p in dump.iterdir()} == {"rank0", "rank1"}
    assert all((dump / rank / "report.json").is_file() for rank in ("rank0", "rank1"))


def test_demo_without_root_says_so_and_gives_the_cost_models_figure(monkeypatch, capsys):
    monkeypatch.setattr(netns, "can_throttle", lambda: "not root: namespaces need root")
    from commfuse_compile.tools.cli import main

    assert main(["demo", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "link: UNTHROTTLED (not root: namespaces need root)" in out
    assert "unthrottled loopback (a transfer costs no wall time: nothing to hide" in out
    assert _MODEL_FIGURE.search(out)
    assert "faster with the pass" not in out  # nothing measured behind a link


def test_the_cost_models_figure_is_the_simulated_block():
    collective_s, ring_s = predicted_on_link(DemoConfig(), LINK_RATE)
    slower_collective_s, _ = predicted_on_link(DemoConfig(), LINK_RATE / 2)
    assert 0 < ring_s < collective_s < slower_collective_s


def test_sim_prints_every_schedule_and_writes_traces(tmp_path, capsys):
    from commfuse_compile.cost.simulator import SCHEDULES
    from commfuse_compile.tools.cli import main
    from commfuse_compile.tools.sim.layer import PRESETS, layer_sites

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
