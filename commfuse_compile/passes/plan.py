"""Plan stage: pick a schedule per site from an alpha-beta cost model.

Per ring step: ``c`` = one block's matmuls, ``m`` = alpha + bytes/beta for one block's
message, ``a`` = one block's add, ``o`` = the fixed cost of one more step (issuing a
P2P op, waiting on it, launching a smaller matmul). SPEC.md gives the formulas; the
step overhead is what makes the collective win for small matmuls. The bidirectional
ring does ceil((n-1)/2) rounds of two blocks; its two messages share a rank's bandwidth
unless the profile's links are independent per neighbour (``duplex_neighbours``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..options import Options
from ..report import decline
from .match import AgMmSite, MmRsSite, Site, val


@dataclasses.dataclass(frozen=True)
class Profile:
    """Rough machine constants; ``name`` says where they come from."""

    name: str
    matmul_flops: float  # achieved matmul FLOP/s
    memory_bytes_per_s: float  # for the element-wise add of a partial sum
    link_alpha_s: float  # per-message latency
    link_bytes_per_s: float  # per-direction P2P bandwidth
    step_overhead_s: float  # issue + wait + launch of one extra ring step
    duplex_neighbours: bool = False  # sending to both neighbours at once costs no more


# Defaults by device type until a measured profile is given.
# cpu: measured on this project's 2-core CI machine kind (2026-11-30), gloo ranks on
#   loopback: fp32 mm on one thread 80-110 GFLOP/s; send+recv of a small message
#   0.2-1.9 ms one way depending on load (1 ms taken); 2.5 GB/s for 16 MiB messages;
#   a tiny all-gather site (2x8 shard, eager FX) took 0.23/1.7/3.5 ms as a collective
#   and 0.25/2.5/5.7 ms as a ring on 2/3/4 ranks: ~0.8 ms more per ring step.
# cuda: H100 SXM, NVLink 4: bf16 dense 989 TFLOP/s peak (~600 achieved in large GEMMs),
#   NVLink 4 450 GB/s per direction (~350 achieved by NCCL P2P), HBM3 3.35 TB/s;
#   latency and step overhead are kernel-launch and NCCL P2P orders of magnitude.
PROFILES = {
    "cpu": Profile("cpu+gloo loopback (measured, 2 cores)", 8e10, 5e9, 1e-3, 2.5e9, 8e-4),
    "cuda": Profile("H100 SXM NVLink4 (datasheet-derived)", 6e14, 2.5e12, 1e-5, 3.5e11, 8e-6),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    predicted_s: dict[str, float]
    why: str


def plan(predicted: dict[str, float], options: Options) -> Plan:
    """The schedule for a site with these predicted times (seconds, by schedule)."""
    if options.schedule == "off":
        raise decline("schedule 'off' keeps every collective")
    if options.schedule in options.disable:
        raise decline(f"schedule {options.schedule!r} is disabled")
    if options.schedule != "auto":
        return Plan(options.schedule, predicted, f"schedule {options.schedule!r} requested")
    predicted = {k: v for k, v in predicted.items() if k not in options.disable}
    best = min(predicted, key=predicted.__getitem__)
    collective = predicted["collective"]
    if best == "collective":
        if len(predicted) == 1:
            raise decline("every schedule is disabled")
        runner_up = min((k for k in predicted if k != "collective"), key=predicted.__getitem__)
        raise decline(
            f"not profitable: {runner_up} predicted {predicted[runner_up] * 1e6:.1f} us >= "
            f"collective {collective * 1e6:.1f} us"
        )
    return Plan(best, predicted, f"{best} predicted {collective / predicted[best]:.2f}x faster")


def predict(site: Site, n: int) -> dict[str, float]:
    """Predicted seconds of the collective + matmul and of the ring for one site."""
    if isinstance(site, AgMmSite):
        shard = val(site.shard)
        flops = sum(2 * math.prod(val(u.mm.node).shape) * val(u.mm.a).shape[1] for u in site.uses)
        block_flops, message_bytes = flops / n, shard.numel() * shard.element_size()
        add_bytes = 0
    else:
        assert isinstance(site, MmRsSite)
        out = val(site.terms[0].node)
        block_flops = sum(2 * out.numel() * val(t.a).shape[1] for t in site.terms) / n
        message_bytes = add_bytes = out.numel() * out.element_size() // n
    p = PROFILES.get(_device_type(site), PROFILES["cpu"])
    c = block_flops / p.matmul_flops
    m = p.link_alpha_s + message_bytes / p.link_bytes_per_s
    m2 = p.link_alpha_s + message_bytes * (1 if p.duplex_neighbours else 2) / p.link_bytes_per_s
    a = 3 * add_bytes / p.memory_bytes_per_s
    rounds = n // 2  # bidir: steps after the first
    return {
        "collective": n * c + (n - 1) * (m + a) + p.step_overhead_s,
        "ring": c + (n - 1) * (max(c, m) + a) + n * p.step_overhead_s,
        "bidir": c + rounds * (max(2 * c, m2) + 2 * a) + (rounds + 1) * p.step_overhead_s,
    }


def _device_type(site: Site) -> str:
    node = site.shard if isinstance(site, AgMmSite) else site.reduce_scatter
    value = node.meta.get("val")
    return value.device.type if isinstance(value, torch.Tensor) else "cpu"
