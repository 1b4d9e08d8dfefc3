"""Compile time of the pass against the depth of the model (not a test: it times things).

Traces the TP+SP transformer of ``commfuse_compile.tools.training.fronts`` (front "tp") at
several depths on torch's fake process group (one process, rank 0 of 2: collectives and P2P
complete at once without moving data), compiles one forward and backward with
``backend="commfuse"`` and Inductor, once with ``schedule="ring"`` and once with
``schedule="off"``, and prints per depth: the sites, the time spent inside the pass
(forward + backward graphs), per site, and Inductor's own compile time of the rewritten
graphs beside it. ``--profile N`` prints where the pass spent its time at depth N.

    python benchmarks/compile_time.py                      # 2, 8, 24 and 48 blocks
    python benchmarks/compile_time.py --blocks 24 --profile 24
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile.passes.pipeline as pipeline
from commfuse_compile import report
from commfuse_compile.tools.training import fronts


class Timers:
    """Seconds spent in the pass and in Inductor's inner compile, summed over graphs."""

    def __init__(self, profile: bool) -> None:
        self.pass_s = self.inner_s = 0.0
        self.profiler = cProfile.Profile() if profile else None

    def install(self) -> Callable[[], None]:
        import torch._inductor.compile_fx as compile_fx

        rewrite, inner = pipeline._rewrite, compile_fx.compile_fx_inner

        def timed_rewrite(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            if self.profiler:
                self.profiler.enable()
            try:
                return rewrite(*args, **kwargs)
            finally:
                if self.profiler:
                    self.profiler.disable()
                self.pass_s += time.perf_counter() - start

        def timed_inner(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.inner_s += time.perf_counter() - start

        pipeline._rewrite, compile_fx.compile_fx_inner = timed_rewrite, timed_inner

        def restore() -> None:
            pipeline._rewrite, compile_fx.compile_fx_inner = rewrite, inner

        return restore


def compile_once(blocks: int, schedule: str, profile: bool) -> tuple[int, Timers]:
    """One forward and backward of a ``blocks``-deep model; (sites, timers)."""
    report.reset()
    torch._dynamo.reset()
    cfg = fronts.TrainConfig(blocks=blocks, dim=32, heads=4, hidden=64, batch=2, seq=16)
    setup = fronts.build(cfg, rank=0, world_size=dist.get_world_size())
    compiled = torch.compile(setup.loss_module, backend="commfuse", options={"schedule": schedule})
    timers = Timers(profile)
    restore = timers.install()
    try:
        compiled(*setup.inputs(0)).backward()
    finally:
        restore()
    return len(report.REPORT.sites), timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="2,8,24,48", help="depths (default 2,8,24,48)")
    parser.add_argument("--profile", type=int, default=0, help="profile the pass at this depth")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    print(
        f"{'blocks':>6} {'sites':>5} {'pass ring':>10} {'pass off':>9} {'per site':>9} "
        f"{'inductor':>9} {'pass/inductor':>13}"
    )
    for blocks in (int(b) for b in args.blocks.split(",")):
        sites, ring = compile_once(blocks, "ring", args.profile == blocks)
        _, off = compile_once(blocks, "off", False)
        print(
            f"{blocks:>6} {sites:>5} {ring.pass_s:>9.2f}s {off.pass_s:>8.2f}s "
            f"{ring.pass_s / max(sites, 1) * 1e3:>7.1f}ms {ring.inner_s:>8.1f}s "
            f"{ring.pass_s / ring.inner_s:>12.1%}",
            flush=True,
        )
        if ring.profiler:
            out = io.StringIO()
            pstats.Stats(ring.profiler, stream=out).sort_stats("cumulative").print_stats(30)
            print(out.getvalue())


if __name__ == "__main__":
    main()
