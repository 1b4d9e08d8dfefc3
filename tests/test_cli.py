"""`commfuse demo`, the README's main command, end to end in a fresh process."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_checks_and_reports():
    proc = subprocess.run(
        [sys.executable, "-m", "commfuse_compile.cli", "demo", "--world-size", "2", "--steps", "2"],
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


def test_demo_rejects_a_single_rank():
    proc = subprocess.run(
        [sys.executable, "-m", "commfuse_compile.cli", "demo", "--world-size", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--world-size must be at least 2" in proc.stderr
