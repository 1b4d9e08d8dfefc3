"""Device readiness: what a short stay on one GPU must bring back, in one command.

Nothing in this project has run on a GPU yet: the GPU profiles behind ``auto`` and
``commfuse sim`` are datasheet figures, and the program check has only read Inductor's
C++ wrapper code. GPU time comes rarely and briefly, so this script is prepared and
tested on CPU and collects, on one CUDA GPU in a few minutes:

1. **Split-GEMM efficiency.** For the tensor-parallel shapes of the ``llama3-8b`` and
   ``llama3-70b`` sim presets on n = 2, 4, 8 ranks, one rank's bf16 matmul whole against
   its n blocks back to back, cut three ways: ``rows`` (the forward MLP input
   projection's gathered input, ag_mm rows), ``columns`` (the same product cut into
   column blocks, as a gathered weight makes it) and ``contracting`` (that projection's
   weight gradient, the gathered tokens contracted, accumulated block by block); and the
   blocks again with a copy of one ring step's message between each two (the cost of a
   P2P-sized copy between kernels). From these, ``profile.json`` (the ``commfuse
   calibrate`` format: ``options={"profile": ...}``, ``commfuse sim --profile``):
   matmul throughput and call latency fitted on every whole and block matmul, memory
   bandwidth from an element-wise add, the step overhead from the copies; the link and
   collective fields stay the built-in profile's (one device has no link to measure).
   It is printed beside the built-in profile, with ``commfuse sim``'s layer on both.
2. **The program check on Inductor's wrapper code.** A TP+SP transformer block
   (``tools/training/fronts.py``, one block, final norm and head), traced on torch's fake
   process group at world size 4, compiled with ``backend="commfuse"`` and Inductor for
   every schedule; each generated program (Triton kernels and streams on CUDA) is
   checked with ``passes/program.check``: it must parse, keep every transfer's buffer,
   and every site must stay rewritten. ``exposed_steps`` are printed.
3. **The rewritten block, run.** The fake group runs collectives and point-to-point ops
   as no-ops (nothing moves; a received tensor is left unwritten), so each compiled block
   is timed for its compute side alone (forward + backward), against the same compile
   with ``schedule="off"``; the ring's step is recorded with ``torch.profiler``.

Everything goes under ``--out``: ``summary.md`` and ``summary.json`` (the tables),
``profile.json``, ``programs/`` (each generated program), ``trace_ring.json`` (Chrome
trace: Perfetto) and ``profile_ring.txt`` (the profiler's top ops). On a GPU:

    python benchmarks/gpu_check.py --out gpu/

CPU dry mode (tiny shapes, Inductor for CPU, every other code path the same; the test
suite runs it so that the script cannot rot; about a minute on 2 cores once Inductor's
cache is warm):

    python benchmarks/gpu_check.py --cpu --out gpu-dry/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import benchmark

from commfuse_compile import report
from commfuse_compile.cost.profiles import Profile, for_device, load, save
from commfuse_compile.options import SCHEDULES, Options
from commfuse_compile.passes import program
from commfuse_compile.runtime import groups
from commfuse_compile.tools.calibrate import fit_line
from commfuse_compile.tools.sim import PRESETS, ModelShape, simulate_layer
from commfuse_compile.tools.training import fronts

WORLD_SIZE, RANK = 4, 1  # the fake group, and this process's rank in it (neighbours 0, 2)
GROUP_SIZES = (2, 4, 8)
MODELS = ("llama3-8b", "llama3-70b")
DIRECTIONS = ("rows", "columns", "contracting")
# every schedule the pass can be told to use ("auto" picks among them), after "off": the
# same compile with every collective kept, the baseline of the step times
TIMED = ("off", *(s for s in SCHEDULES if s not in ("auto", "off")))
PROFILED = "ring"
DTYPE, DTYPE_NAME = torch.bfloat16, "bfloat16"  # as LLM training runs its matmuls
SLICES = Options().slices  # the slicing schedule's chunks, in the block and in the sim
DRY_NOTE = (
    " Dry mode: tiny shapes on a CPU; the numbers only show that every path runs, they "
    "measure nothing worth keeping."
)
FAKE_GROUP_NOTE = (
    "torch's fake process group runs collectives and point-to-point ops as no-ops "
    "(nothing is sent; a received tensor is left unwritten): block times are the compute "
    "side alone, every transfer free"
)


@dataclasses.dataclass(frozen=True)
class Mode:
    """Where the check runs and how big it is."""

    device: str
    shrink: int  # the presets' sizes divided by this for the split GEMMs
    gemm_min_run_s: float  # per timed statement (torch.utils.benchmark)
    block_min_run_s: float
    block: fronts.TrainConfig

    def device_name(self) -> str:
        if self.device == "cuda":
            return torch.cuda.get_device_name()
        return platform.processor() or "CPU"


def gpu_mode() -> Mode:
    """Llama 3 8B's block at full size (its hidden size, heads, FFN and sequence; every
    head with its own k/v, as ``tools/training/models.Block`` has them)."""
    model = PRESETS["llama3-8b"]
    block = fronts.TrainConfig(
        blocks=1,
        dim=model.hidden,
        heads=model.heads,
        hidden=model.ffn,
        batch=1,
        seq=model.tokens,
        device="cuda",
        dtype=DTYPE_NAME,
    )
    return Mode("cuda", 1, 0.2, 1.0, block)


def cpu_mode() -> Mode:
    """Tiny shapes: every path but CUDA's, in about a minute."""
    block = fronts.TrainConfig(
        blocks=1, dim=32, heads=4, hidden=64, batch=2, seq=16, dtype=DTYPE_NAME
    )
    return Mode("cpu", 32, 0.01, 0.05, block)


def seconds(fn: Callable[[], object], min_run_s: float) -> float:
    """The median time of one call (torch.utils.benchmark synchronizes CUDA around each
    timed block of calls)."""
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return float(timer.blocked_autorange(min_run_time=min_run_s).median)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------
# 1. split GEMMs


@dataclasses.dataclass(frozen=True)
class Split:
    """One rank's matmul of a TP layer on ``n`` ranks, cut into ``n`` blocks."""

    model: str
    n: int
    direction: str  # one of DIRECTIONS
    shape: tuple[int, int, int]  # M, K, N of the whole matmul

    @property
    def flops(self) -> float:
        m, k, cols = self.shape
        return 2.0 * m * k * cols

    @property
    def message_elements(self) -> int:
        """One block of the gathered operand: what one ring step sends."""
        m, k, cols = self.shape
        if self.direction == "columns":
            return k * cols // self.n  # a block of the gathered weight
        return m * k // self.n  # rows of the gathered input, or its contracted tokens

    def operands(
        self, dtype: torch.dtype, device: str
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The whole operands, laid out as the pass finds them (a gathered X contracted
        as X^T, a gathered weight W used as W^T), and the n blocks as views of them."""
        m, k, cols = self.shape

        def randn(rows: int, columns: int) -> torch.Tensor:
            return torch.randn(rows, columns, dtype=dtype, device=device)

        a = randn(k, m).t() if self.direction == "contracting" else randn(m, k)
        b = randn(cols, k).t() if self.direction == "columns" else randn(k, cols)
        if self.direction == "rows":
            blocks = [(part, b) for part in a.chunk(self.n, 0)]
        elif self.direction == "columns":
            blocks = [(a, part) for part in b.chunk(self.n, 1)]
        else:
            blocks = list(zip(a.chunk(self.n, 1), b.chunk(self.n, 0), strict=True))
        return a, b, blocks


def split_shapes(model: ModelShape, n: int) -> dict[str, tuple[int, int, int]]:
    """The MLP input projection on ``n`` ranks (tokens x hidden @ hidden x FFN/n) and its
    weight gradient (hidden x tokens @ tokens x FFN/n), per direction."""
    t, d, f = model.tokens, model.hidden, model.ffn // n
    return {"rows": (t, d, f), "columns": (t, d, f), "contracting": (d, t, f)}


def run_blocks(
    direction: str,
    blocks: list[tuple[torch.Tensor, torch.Tensor]],
    between: Callable[[], object] | None = None,
) -> list[torch.Tensor]:
    """The blocks' matmuls back to back (``between`` runs between each two); contracting
    blocks accumulate into one output, as a ring's partial products do."""
    outputs: list[torch.Tensor] = []
    for i, (a, b) in enumerate(blocks):
        if i and between is not None:
            between()
        if direction == "contracting" and outputs:
            outputs[0].addmm_(a, b)
        else:
            outputs.append(torch.mm(a, b))
    return outputs


@dataclasses.dataclass(frozen=True)
class SplitTiming:
    split: Split
    whole_s: float
    blocks_s: float  # the n blocks back to back
    with_copies_s: float  # the same with a message-sized copy between each two

    @property
    def efficiency(self) -> float:
        return self.whole_s / self.blocks_s

    @property
    def copy_s(self) -> float:
        """What one message-sized copy adds between two block matmuls."""
        return (self.with_copies_s - self.blocks_s) / (self.split.n - 1)

    def as_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.split),
            "message_bytes": self.split.message_elements * DTYPE.itemsize,
            "whole_us": self.whole_s * 1e6,
            "blocks_us": self.blocks_s * 1e6,
            "with_copies_us": self.with_copies_s * 1e6,
            "efficiency": self.efficiency,
            "copy_us": self.copy_s * 1e6,
        }


def time_split(split: Split, mode: Mode) -> SplitTiming:
    """The whole matmul, its blocks, and its blocks with a ring step's copy between."""
    a, b, blocks = split.operands(DTYPE, mode.device)
    source = torch.randn(split.message_elements, dtype=DTYPE, device=mode.device)
    target = torch.empty_like(source)
    return SplitTiming(
        split,
        seconds(lambda: torch.mm(a, b), mode.gemm_min_run_s),
        seconds(lambda: run_blocks(split.direction, blocks), mode.gemm_min_run_s),
        seconds(
            lambda: run_blocks(split.direction, blocks, lambda: target.copy_(source)),
            mode.gemm_min_run_s,
        ),
    )


def add_bytes_per_s(elements: int, mode: Mode) -> float:
    """out = x + y (a partial sum's add): two reads and a write."""
    x, y = (torch.randn(elements, dtype=DTYPE, device=mode.device) for _ in range(2))
    return 3 * x.nbytes / seconds(lambda: torch.add(x, y), mode.gemm_min_run_s)


def measured_profile(
    timings: list[SplitTiming], add_rate: float, base: Profile, where: str
) -> Profile:
    """``base`` with what one device can measure: matmul throughput and latency fitted
    on every whole and block matmul, memory bandwidth, and the step overhead as the
    fixed part of a message-sized copy between two block matmuls."""
    points = [(t.split.flops, t.whole_s) for t in timings]
    points += [(t.split.flops / t.split.n, t.blocks_s / t.split.n) for t in timings]
    latency, s_per_flop = fit_line(points)
    copy_fixed_s, _ = fit_line(
        [(t.split.message_elements * DTYPE.itemsize, t.copy_s) for t in timings]
    )
    return dataclasses.replace(
        base,
        name=f"gpu-check-{base.name}",
        source=f"measured by benchmarks/gpu_check.py on {where} "
        f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}): matmul_flops and "
        "matmul_latency_s fitted on bf16 matmuls of the llama3-8b/70b TP shapes, whole and "
        "split; memory_bytes_per_s from an element-wise add; step_overhead_s the fixed "
        "cost of a message-sized copy between two block matmuls (a copy kernel, not an "
        f"NCCL transfer: a lower bound). Every other field is {base.name}'s, not measured "
        "(one device has no link to measure)",
        matmul_flops=1 / s_per_flop,
        matmul_latency_s=latency,
        memory_bytes_per_s=add_rate,
        step_overhead_s=copy_fixed_s,
    )


def sim_layers(profiles: Iterable[Profile]) -> list[dict[str, Any]]:
    """``commfuse sim``'s TP+SP layer of each preset on each profile: the collective's
    time against ``auto``'s (the best schedule per site)."""
    rows = []
    for profile in profiles:
        for name in MODELS:
            for n in GROUP_SIZES:
                layer = simulate_layer(PRESETS[name], n, profile, SLICES)
                rows.append(
                    {
                        "profile": profile.name,
                        "model": name,
                        "n": n,
                        "collective_us": layer.total_s("collective") * 1e6,
                        "auto_us": layer.auto_s() * 1e6,
                    }
                )
    return rows


# ----------------------------------------------------------------------------------------
# 2 and 3. the block: Inductor's programs checked, the compute side timed and profiled


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
    run.sites = len(records)
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


# ----------------------------------------------------------------------------------------
# the run and its summary


def table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def summary_markdown(summary: dict[str, Any]) -> str:
    base, measured = summary["base_profile"], summary["profile"]
    lines = [
        f"# gpu_check on {summary['device_name']} ({summary['mode']} mode)",
        "",
        f"torch {summary['torch']}, {summary['date']}, {summary['seconds']:.0f} s."
        + (DRY_NOTE if summary["mode"] == "cpu" else ""),
        "",
        "## Split GEMMs: whole matmul against its n blocks",
        "",
        f"dtype {summary['dtype']}; shapes M x K x N of one rank's matmul (the presets' sizes"
        + (f" divided by {summary['shrink']}" if summary["shrink"] > 1 else "")
        + "). Efficiency = whole / blocks (1.00: splitting costs nothing); the model's "
        "efficiency is the same ratio as the measured profile and the built-in one predict "
        "it; copy = the added time of one message-sized copy between two block matmuls.",
        "",
    ]
    lines += table(
        [
            "model",
            "n",
            "direction",
            "M x K x N",
            "whole us",
            "blocks us",
            "efficiency",
            "model: measured / built-in",
            "copy us (bytes)",
        ],
        [
            [
                c["model"],
                c["n"],
                c["direction"],
                " x ".join(map(str, c["shape"])),
                f"{c['whole_us']:.1f}",
                f"{c['blocks_us']:.1f}",
                f"{c['efficiency']:.2f}",
                f"{c['model_efficiency']:.2f} / {c['base_model_efficiency']:.2f}",
                f"{c['copy_us']:.1f} ({c['message_bytes']})",
            ]
            for c in summary["split_gemm"]
        ],
    )
    lines += ["", f"## Profile: measured beside `{base['name']}`", ""]
    lines += table(
        ["field", "measured", base["name"]],
        [
            [field, _number(measured[field]), _number(base[field])]
            for field in (
                "matmul_flops",
                "matmul_latency_s",
                "memory_bytes_per_s",
                "step_overhead_s",
            )
        ],
    )
    lines += [
        "",
        "Written to `profile.json` (`commfuse sim --profile`); the other fields are "
        f"`{base['name']}`'s.",
        "",
        "## commfuse sim: one TP+SP layer's sites, collective against auto",
        "",
    ]
    lines += table(
        ["profile", "model", "n", "collective us", "auto us", "speedup"],
        [
            [
                r["profile"],
                r["model"],
                r["n"],
                f"{r['collective_us']:.1f}",
                f"{r['auto_us']:.1f}",
                f"{r['collective_us'] / r['auto_us']:.2f}x",
            ]
            for r in summary["sim"]
        ],
    )
    off = next((r["step_s"] for r in summary["block"] if r["schedule"] == "off"), None)
    lines += [
        "",
        "## The TP+SP block: Inductor's programs checked, the compute side timed",
        "",
        f"{summary['block_config']}, on the fake process group (rank {RANK} of "
        f"{WORLD_SIZE}); {FAKE_GROUP_NOTE}. Transfers: starts the program check read; "
        "waits without matmul: every transfer waited with none in flight (collectives "
        "the pass keeps included); exposed steps: the rewritten sites' (report.json).",
        "",
    ]
    lines += table(
        [
            "schedule",
            "programs",
            "sites rewritten",
            "transfers",
            "violations",
            "waits without matmul",
            "exposed steps",
            "step ms",
            "vs off",
            "verdict",
        ],
        [
            [
                r["schedule"],
                r["programs"],
                f"{r['rewritten']}/{r['sites']}",
                r["transfers"],
                len(r["violations"]),
                r["waits_without_matmul"],
                len(r["exposed_steps"]),
                "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.2f}",
                "-" if r["step_s"] is None or off is None else f"{off / r['step_s']:.2f}x",
                r["verdict"],
            ]
            for r in summary["block"]
        ],
    )
    exposed = [f"{r['schedule']}: {e}" for r in summary["block"] for e in r["exposed_steps"]]
    lines += ["", "exposed_steps: " + ("; ".join(exposed) if exposed else "none")]
    for part, error in summary["errors"].items():
        lines += ["", f"## Error: {part}", "", "```", error.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return f"{value:.3g}"


def split_gemm_part(mode: Mode, out: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Part 1: every split timed, the profile written, read back and simulated."""
    base = for_device(mode.device)
    timings: list[SplitTiming] = []
    for name in MODELS:
        preset = PRESETS[name]
        model = dataclasses.replace(
            preset,
            tokens=preset.tokens // mode.shrink,
            hidden=preset.hidden // mode.shrink,
            ffn=preset.ffn // mode.shrink,
        )
        for n in GROUP_SIZES:
            for direction, shape in split_shapes(model, n).items():
                timing = time_split(Split(name, n, direction, shape), mode)
                timings.append(timing)
                say(
                    f"split GEMM {name} n={n} {direction} {shape}: efficiency "
                    f"{timing.efficiency:.2f}, copy {timing.copy_s * 1e6:.1f} us"
                )
    largest = max(t.split.message_elements for t in timings)
    measured = measured_profile(timings, add_bytes_per_s(largest, mode), base, mode.device_name())
    save(measured, out / "profile.json")
    profile = load(out / "profile.json")  # as `commfuse sim --profile` reads it
    say(f"profile written: {out / 'profile.json'}")
    return {
        "profile": profile.as_json(),
        "split_gemm": [
            {
                **t.as_json(),
                "model_efficiency": _model_efficiency(profile, t.split),
                "base_model_efficiency": _model_efficiency(base, t.split),
            }
            for t in timings
        ],
        "sim": sim_layers([profile, base]),
    }


def block_part(
    mode: Mode, out: Path, say: Callable[[str], None], errors: dict[str, str]
) -> list[BlockRun]:
    """Parts 2 and 3: the block under every schedule on the fake group, the ring's step
    profiled; a schedule that fails is recorded and the next one runs."""
    dist.init_process_group("fake", rank=RANK, world_size=WORLD_SIZE, store=FakeStore())
    say(FAKE_GROUP_NOTE)
    runs = []
    try:
        for schedule in TIMED:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--cpu", action="store_true", help="dry mode: tiny shapes, Inductor for CPU"
    )
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: --cpu runs the dry mode")
    mode = cpu_mode() if args.cpu else gpu_mode()
    (args.out / "programs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", flush=True)

    block = mode.block
    summary: dict[str, Any] = {
        "mode": mode.device,
        "device_name": mode.device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dtype": DTYPE_NAME,
        "shrink": mode.shrink,
        "base_profile": for_device(mode.device).as_json(),
        "block_config": (
            f"1 block (dim {block.dim}, {block.heads} heads, FFN {block.hidden}, batch "
            f"{block.batch} x sequence {block.seq}, {block.dtype}) with final norm and head, "
            "forward + backward"
        ),
    }
    say(f"gpu_check on {mode.device_name()}, {mode.device} mode, output in {args.out}")
    errors: dict[str, str] = {}
    try:
        summary.update(split_gemm_part(mode, args.out, say))
    except Exception:  # noqa: BLE001 - one part failing must not cost the others' facts
        errors["split GEMMs"] = traceback.format_exc()
        say(f"split GEMMs failed:\n{errors['split GEMMs']}")
        summary.update(profile=summary["base_profile"], split_gemm=[], sim=[])
    runs = block_part(mode, args.out, say, errors)
    summary.update(
        block=[r.as_json() for r in runs], errors=errors, seconds=time.perf_counter() - started
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    markdown = summary_markdown(summary)
    (args.out / "summary.md").write_text(markdown)
    print("\n" + markdown)
    ok = not errors and all(r.verdict == "pass" for r in runs)
    say("done: " + ("every check passed" if ok else "FAILED (see above)"))
    return 0 if ok else 1


def _model_efficiency(profile: Profile, split: Split) -> float:
    """Whole / blocks as ``profile``'s matmul model predicts it."""
    return profile.matmul_s(split.flops) / (split.n * profile.matmul_s(split.flops / split.n))


if __name__ == "__main__":
    sys.exit(main())
