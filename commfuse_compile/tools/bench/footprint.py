"""A training step's footprint on this rank: the bytes it saves for the backward, the
peak of the memory it allocates, and the bytes it sends.

* Saved: every tensor autograd packs for the backward (``saved_tensors_hooks``), the
  compiled graphs' saved activations among them: what activation checkpointing and
  sequence parallelism are about.
* Peak: the highest total of CPU memory allocated during the step above what was live
  when it started, from the profiler's allocation and free events in time order.
* Sent: the bytes the step's collectives and point-to-point ops send, from the
  profiler's events and their shapes: each functional collective the graphs run
  (``_c10d_functional::all_reduce``, ...) counted as a ring sends it (an all-reduce of S
  bytes 2(n-1)/n x S, an all-gather (n-1) x its input, a reduce-scatter or an all-to-all
  (n-1)/n x its input), each of the backend's sends (``gloo:send``, ``nccl:send``: the
  pass's P2P steps) its size. What the collective is, not how a backend runs it: gloo
  runs a reduce-scatter as an all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

# an op the profiler names (a functional collective, a backend's send) -> bytes sent,
# from its first input's bytes and the group's size
SENT: dict[str, Callable[[float, int], float]] = {
    "_c10d_functional::all_reduce": lambda size, n: 2 * (n - 1) / n * size,
    "_c10d_functional::all_gather_into_tensor": lambda size, n: (n - 1) * size,
    "_c10d_functional::reduce_scatter_tensor": lambda size, n: (n - 1) / n * size,
    "_c10d_functional::all_to_all_single": lambda size, n: (n - 1) / n * size,
    "gloo:send": lambda size, n: size,
    "nccl:send": lambda size, n: size,
}
BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}


@dataclasses.dataclass(frozen=True)
class Footprint:
    saved_bytes: int
    peak_bytes: int
    sent_bytes: int


def measure(step: Callable[[], Any], world_size: int) -> Footprint:
    """Run ``step`` once (compiled already: its compiles are not measured) and measure
    it."""
    from torch.profiler import ProfilerActivity, profile

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with (
        profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return Footprint(saved[0], _peak(events), round(_sent(events, world_size)))


def _peak(events: list[Any]) -> int:
    """The highest running total of the events' own allocations less frees."""
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _sent(events: list[Any], n: int) -> float:
    total = 0.0
    for event in events:
        if event.name not in SENT or not event.input_shapes or not event.input_shapes[0]:
            continue
        dtype = (event.input_dtypes or ["float"])[0]
        size = math.prod(event.input_shapes[0]) * BYTES.get(dtype, 4)
        total += SENT[event.name](size, n)
    return total
