"""What users see without a debug dir: nothing when nothing is wrong; one summary line
per graph with ``TORCH_LOGS="commfuse"``; every decision with ``TORCH_LOGS="+commfuse"``;
and ``TORCH_TRACE`` (what tlparse reads) holds each graph's code before and after."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from cases import AgMm, MmRs, trace
    from commfuse_compile import Options
    from commfuse_compile.passes import rewrite_graph

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    for case in (AgMm(), MmRs(op="max")):
        rewrite_graph(trace(case, 2, case.inputs(0, 0, 2) if isinstance(case, AgMm)
                            else case.inputs(0, 0)), "forward",
                      Options(schedule="ring", inner="eager"))
    """
)


def run(tmp_path, **env):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")} | env
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_quiet_by_default_and_one_line_per_graph_at_info(tmp_path):
    assert "commfuse" not in run(tmp_path)
    info = run(tmp_path, TORCH_LOGS="commfuse")
    assert "commfuse: forward: 1 sites, 1 rewritten (ring)" in info
    assert "commfuse: forward: 1 sites, 0 rewritten; declined: 1 unsupported pattern" in info
    assert "site" not in info.replace("sites", "")  # no per-site lines at INFO


def test_torch_logs_and_structured_trace(tmp_path):
    stderr = run(tmp_path, TORCH_LOGS="+commfuse", TORCH_TRACE=str(tmp_path))
    assert "commfuse: ag_mm site" in stderr and "rewritten (ring)" in stderr
    assert "declined: reduce op 'max' is neither 'sum' nor 'avg'" in stderr
    trace = "".join(path.read_text() for path in tmp_path.iterdir())
    for stage in ("before", "after"):
        assert f"commfuse_graph000_forward_{stage}" in trace
    assert "torch.ops.commfuse.p2p.default" in trace  # the rewritten code itself
