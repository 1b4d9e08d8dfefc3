"""One small block of a framework-style front end trained on gloo ranks with and without
the pass (``tools/fronts.py``): the config the multi-rank front-end tests share, the
function each rank runs, and what the tests read of its result."""

from __future__ import annotations

import functools
from typing import Any

from commfuse_compile.tools.training import fronts, loop, styles


@functools.cache
def small_config(front: str, n: int, **fields: Any) -> fronts.TrainConfig:
    """One block sized so every sharded dim divides by ``n``, 2 steps."""
    defaults: dict[str, Any] = {
        "blocks": 1,
        "dim": 8 * 2 * n,
        "heads": 2 * n,
        "hidden": 16 * n,
        "batch": 2,
        "seq": 4 * n,
        "steps": 2,
        "bias": front in ("megatron", "megatron_core"),
    }
    return fronts.TrainConfig(front=front, **{**defaults, **fields})


def train(rank: int, n: int, cfg: fronts.TrainConfig, options: dict) -> dict:
    """Run on each rank: the losses with and without the pass, and every site as
    (graph, kind, decision, reason, decline code)."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    # Megatron-Core's global memory buffer as a fresh process has it (none): the counts
    # the tests expect do not depend on the jobs this rank ran before
    styles._GLOBAL_MEMORY_BUFFER = None
    fused, eager = loop.compare(rank, n, cfg, options)
    return {
        "losses": (fused.losses, eager.losses),
        "sites": [
            (s["graph"], s["kind"], s["decision"], s["reason"], s["decline_code"])
            for s in fused.sites
        ],
    }


def loss_difference(result: dict) -> float:
    """The largest relative difference of the losses with the pass from those without."""
    fused, eager = result["losses"]
    return loop.max_relative_diff(fused, eager)


def counts(result: dict, kind: str) -> tuple[int, int]:
    """(forward, backward) sites of ``kind``."""
    found = [s[0] for s in result["sites"] if s[1] == kind]
    return found.count("forward"), found.count("backward")
