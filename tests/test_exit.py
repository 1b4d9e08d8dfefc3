"""Every torchrun example ends with exit code 0, every time.

A rank of an example used to abort now and then after all its output ("terminate called
without an active exception", exit code -6, so ``torchrun`` reported the job failed):
gloo's worker thread (``ProcessGroupGloo::runLoop``), releasing a collective's work after
the waiting thread had gone on (the final ``barrier()``'s among them), took the GIL for a
tensor Python had held while the interpreter was finalizing, and Python ended that thread
with ``pthread_exit`` through torch's ``noexcept`` destructors (docs/training.md, "Ending
the job"). The examples now end with ``training_examples.leave_torchrun()``, which leaves
without finalizing the interpreter.

The default run checks that contract in one process (atexit handlers run, output flushed,
threads joined, no finalization, the exit code given) and runs the Megatron-style
example (where the abort was seen) once at 2 ranks; ``-m matrix`` runs every example
3 times at 2 ranks and the Ulysses and Megatron-style ones at 4. Each rank's process
group times out after ``GROUP_TIMEOUT_S`` (a rank left waiting fails the run soon), and
each run after ``RUN_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The examples' process group timeout: long enough for 4 ranks' compiles on 2 cores to
# meet (the pass's compile-time exchange waits half of it), short enough that a rank
# stuck in the barrier at exit fails the run in minutes, not torch's 30.
GROUP_TIMEOUT_S = 120
RUN_TIMEOUT_S = 600
SMALL = ["--steps", "1", "--blocks", "1"]
EXAMPLES = {  # file in examples/ -> its arguments (the smallest run that compiles)
    "tp_mlp.py": [],
    "train_tp_transformer.py": SMALL,
    "train_fsdp_style.py": SMALL,
    "train_megatron_style.py": SMALL,
    "train_ulysses.py": SMALL,
    "train_deepspeed_ulysses.py": SMALL,
    "train_hf_tp.py": ["--steps", "1", "--layers", "1"],
    "train_deepspeed_hf.py": ["--steps", "1"],
    "train_moe.py": SMALL,
    "generate_hf_tp.py": ["--layers", "1", "--rounds", "1", "--new-tokens", "2"],
}
RUNS = 3  # runs of each (example, ranks) under -m matrix

# Runs an example as torchrun's entry point with a shorter default process group timeout
# (the examples call init_process_group / init_device_mesh without one).
LAUNCHER = """\
import runpy, sys
from datetime import timedelta
import torch.distributed.distributed_c10d as c10d
c10d.default_pg_timeout = timedelta(seconds=float(sys.argv[1]))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def run_example(tmp_path: Path, example: str, ranks: int) -> None:
    """One torchrun job of ``example`` on ``ranks`` gloo ranks; fails unless every rank
    exits with 0 and none printed a C++ abort."""
    launcher = tmp_path / "short_group_timeout.py"
    launcher.write_text(LAUNCHER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port: other jobs on this machine keep theirs
        "--nproc-per-node",
        str(ranks),
        str(launcher),
        str(GROUP_TIMEOUT_S),
        str(ROOT / "examples" / example),
        *EXAMPLES[example],
    ]
    try:
        done = subprocess.run(
            cmd,
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        tail = str(err.stdout or "")[-3000:]
        pytest.fail(f"{example} at {ranks} ranks ran past {RUN_TIMEOUT_S} s:\n{tail}")
    out = done.stdout + done.stderr
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert done.returncode == 0 and "terminate called" not in out, (
        f"{example} at {ranks} ranks: torchrun exit code {done.returncode}, ranks' exit "
        f"codes {codes}:\n{out[-4000:]}"
    )


CONTRACT = """\
import atexit, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
import torch.distributed as dist
from commfuse_compile.tools.training.examples import leave_torchrun

out = sys.argv[1]


class FinalizedWith:
    # runs only if the interpreter finalizes (module globals cleared: bound here)
    def __del__(self, open=open, path=os.path.join(out, "finalized")):
        open(path, "w").close()


KEEP = FinalizedWith()
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())


def late():
    time.sleep(0.5)
    open(os.path.join(out, "joined"), "w").close()


threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)  # its idle worker stops at threading's shutdown, not by a join
pool.submit(int).result()
dist.init_process_group(
    "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
)
dist.all_reduce(__import__("torch").ones(4))
print("unflushed output", end="")
leave_torchrun(3)
"""


def test_leave_torchrun_exits_with_the_code_without_finalizing(tmp_path):
    """What leave_torchrun promises: the atexit handlers ran, a non-daemon thread was
    joined (an idle executor's worker did not hang it), buffered output reached the
    pipe, the process ended with the code given and before the interpreter's
    finalization (where gloo's worker thread aborted it)."""
    script = tmp_path / "leave.py"
    script.write_text(CONTRACT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stdout == "unflushed output"
    assert (tmp_path / "atexit").exists() and (tmp_path / "joined").exists()
    assert not (tmp_path / "finalized").exists()


def test_megatron_style_example_exits_0(tmp_path):
    """The example whose 2-rank run aborted at exit, once (the rest under -m matrix)."""
    run_example(tmp_path, "train_megatron_style.py", 2)


MATRIX = [(example, 2) for example in EXAMPLES] + [
    ("train_ulysses.py", 4),
    ("train_megatron_style.py", 4),
]


@pytest.mark.matrix
@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize(("example", "ranks"), MATRIX)
def test_every_example_exits_0_every_time(tmp_path, example, ranks, run):
    run_example(tmp_path, example, ranks)
