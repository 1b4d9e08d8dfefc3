"""Part 1: split GEMMs. Each TP shape's matmul whole against its n blocks (rows,
columns, contracting), with a message-sized copy between the blocks; the profile fitted
on them, and ``commfuse sim``'s layer on it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from commfuse_compile.cost.profiles import Profile, for_device, load, save
from commfuse_compile.tools.calibrate import fit_line
from commfuse_compile.tools.sim.layer import PRESETS, ModelShape, simulate_layer

from .mode import DTYPE, GROUP_SIZES, MODELS, SLICES, Mode, seconds

DIRECTIONS = ("rows", "columns", "contracting")


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


def _model_efficiency(profile: Profile, split: Split) -> float:
    """Whole / blocks as ``profile``'s matmul model predicts it."""
    return profile.matmul_s(split.flops) / (split.n * profile.matmul_s(split.flops / split.n))
