"""Parts 2 and 3: the TP+SP block under every schedule on torch's fake process group;
each program Inductor generated checked, the compute side timed, the ring's step
profiled."""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import report
from commfuse_compile.options import SCHEDULES
from commfuse_compile.passes.ranks import program
from commfuse_compile.runtime import groups
from commfuse_compile.tools.training import fronts

from .mode import RANK, WORLD_SIZE, Mode, seconds, synchronize

# every schedule the pass can be told to use ("auto" picks among them), after "off": the
# same compile with every collective kept, the baseline of the step times
TIMED = ("off", *(s for s in SCHEDULES if s not in ("auto", "off")))
PROFILED = "ring"
FAKE_GROUP_NOTE = (
    "torch's fake process group runs collectives and point-to-point ops as no-ops "
    "(nothing is sent; a received tensor is left unwritten): block times are the compute "
    "side alone, every transfer free"
)


@dataclasses.dataclass
class BlockRun:
    """One schedule's compile of the block: its programs' check and its step time."""

    schedule: str
    programs: int = 0
    sites: int = 0
    rewritten: int = 0
    transfers: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    exposed_steps: list[str] = dataclasses.field(default_factory=list)  # the sites'
    waits_without_matmul: int = 0  # every transfer waited with no matmul (kept ones too)
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # the pass's warnings
    step_s: float | None = None
    error: str | None = None

    @property
    def verdict(self) -> str:
        problems = [self.error.strip().splitlines()[-1]] if self.error else []
        problems += self.violations[:3] + self.fallbacks[:3]
        if self.programs < 2:
            problems.append(f"{self.programs} programs, not forward and backward")
        if self.schedule != "off" and not 0 < self.rewritten == self.sites:
            problems.append(f"{self.rewritten} of {self.sites} sites rewritten")
        return "pass" if not problems else "FAIL: " + "; ".join(map(str, problems))

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "verdict": self.verdict}


def run_block(schedule: str, mode: Mode, out: Path) -> tuple[BlockRun, Callable[[], None] | None]:
    """Compile the block with ``schedule`` (one forward and backward), check every
    program Inductor generated, and time the step; returns the step to profile, or None
    where it could not run (the programs compiled until then are checked all the same)."""
    from torch._inductor.graph import GraphLowering

    run = BlockRun(schedule)
    report.reset()
    torch._dynamo.reset()
    setup = fronts.build(mode.block, RANK, WORLD_SIZE)
    compiled = torch.compile(setup.loss_module, backend="commfuse", options={"schedule": schedule})
    inputs = setup.inputs(0)

    def step() -> None:
        compiled(*inputs).backward()

    codes: list[str] = []  # every program, as Inductor writes it (run_and_get_code's hook)
    with (
        mock.patch.object(GraphLowering, "save_output_code", codes.append),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        try:
            step()
        except Exception:  # noqa: BLE001 - the fake group may not run it: check what compiled
            run.error = traceback.format_exc()
    run.fallbacks = [str(w.message) for w in caught if str(w.message).startswith("commfuse")]
    run.programs = len(codes)
    for index, code in enumerate(codes):
        (out / "programs" / f"{schedule}_{index}.py").write_text(code)
        checked = program.check(code, groups.ranks_of)
        run.transfers += checked.transfers
        run.violations += checked.violations
        run.waits_without_matmul += len(checked.exposed)
    records = report.REPORT.sites
    # sites next to a matmul; the other collectives' records (the head's output gather)
    # are declined with nothing to overlap
    run.sites = sum(bool(r.match.get("matmuls")) for r in records)
    run.rewritten = sum(r.decision == "rewritten" and r.schedule == schedule for r in records)
    run.exposed_steps = [e for r in records for e in r.exposed_steps]
    if run.error is not None:
        return run, None
    run.step_s = seconds(step, mode.block_min_run_s)
    return run, step


def profile_step(step: Callable[[], None], mode: Mode, out: Path) -> None:
    """One step under torch.profiler: a Chrome trace and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if mode.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        synchronize(mode.device)
    prof.export_chrome_trace(str(out / f"trace_{PROFILED}.json"))
    sort = "self_device_time_total" if mode.device == "cuda" else "self_cpu_time_total"
    top = prof.key_averages().table(sort_by=sort, row_limit=25)
    (out / f"profile_{PROFILED}.txt").write_text(top)


def block_part(
    mode: Mode,
    out: Path,
    say: Callable[[str], None],
    errors: dict[str, str],
    schedules: Sequence[str] = TIMED,
) -> list[BlockRun]:
    """Parts 2 and 3: the block under every schedule (or those given, in ``TIMED``'s
    order) on the fake group, the ring's step profiled; a schedule that fails is recorded
    and the next one runs."""
    dist.init_process_group("fake", rank=RANK, world_size=WORLD_SIZE, store=FakeStore())
    say(FAKE_GROUP_NOTE)
    runs = []
    try:
        for schedule in (s for s in TIMED if s in schedules):
            step = None
            try:
                run, step = run_block(schedule, mode, out)
            except Exception:  # noqa: BLE001 - recorded in the run's verdict
                run = BlockRun(schedule, error=traceback.format_exc())
            runs.append(run)
            say(f"block, schedule {schedule}: {run.verdict}")
            if schedule == PROFILED and step is not None:
                try:
                    profile_step(step, mode, out)
                except Exception:  # noqa: BLE001 - the checks stand without the trace
                    errors["profiler"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    return runs
