"""Where ``gpu_check`` runs and how big: the GPU's full sizes or the CPU dry mode's tiny
ones, the fake group's rank, the timer."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable

import torch
from torch.utils import benchmark

from commfuse_compile.options import Options
from commfuse_compile.tools.sim.layer import PRESETS
from commfuse_compile.tools.training import fronts

WORLD_SIZE, RANK = 4, 1  # the fake group, and this process's rank in it (neighbours 0, 2)
GROUP_SIZES = (2, 4, 8)
MODELS = ("llama3-8b", "llama3-70b")
DTYPE, DTYPE_NAME = torch.bfloat16, "bfloat16"  # as LLM training runs its matmuls
SLICES = Options().slices  # the slicing schedule's chunks, in the block and in the sim


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
