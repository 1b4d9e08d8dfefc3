"""Plan stage: pick a schedule per site from an alpha-beta cost model.

Per ring step: ``c`` = one block's matmuls, ``m`` = alpha + bytes/beta for one block's
message, ``a`` = one block's add, ``o`` = the fixed cost of one more step (issuing a
P2P op, waiting on it, launching a smaller matmul). SPEC.md gives the formulas; the
step overhead is what makes the collective win for small matmuls.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..groups import Group
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


# Defaults by device type until a measured profile is given.
# cpu: measured on this project's 2-core CI machine kind (2026-11-30), two gloo ranks on
#   loopback: fp32 mm on one thread 80-110 GFLOP/s; send+recv of a small message
#   0.2-1.9 ms one way depending on load (1 ms taken); 2.5 GB/s for 16 MiB messages.
# cuda: H100 SXM, NVLink 4: bf16 dense 989 TFLOP/s peak (~600 achieved in large GEMMs),
#   NVLink 4 450 GB/s per direction (~350 achieved by NCCL P2P), HBM3 3.35 TB/s;
#   latency and step overhead are kernel-launch and NCCL P2P orders of magnitude.
PROFILES = {
    "cpu": Profile("cpu+gloo loopback (measured, 2 cores)", 8e10, 5e9, 1e-3, 2.5e9, 1e-4),
    "cuda": Profile("H100 SXM NVLink4 (datasheet-derived)", 6e14, 2.5e12, 1e-5, 3.5e11, 8e-6),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    predicted_s: dict[str, float]
    why: str


def plan(site: Site, group: Group, options: Options) -> Plan:
    if options.schedule == "off":
        raise decline("schedule 'off' keeps every collective")
    predicted = predict(site, group.size)
    ring, collective = predicted["ring"], predicted["collective"]
    if options.schedule == "ring":
        return Plan("ring", predicted, "schedule 'ring' requested")
    if ring >= collective:
        raise decline(
            f"not profitable: ring predicted {ring * 1e6:.1f} us >= collective "
            f"{collective * 1e6:.1f} us"
        )
    return Plan("ring", predicted, f"ring predicted {collective / ring:.2f}x faster")


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
    a = 3 * add_bytes / p.memory_bytes_per_s
    return {
        "collective": n * c + (n - 1) * (m + a) + p.step_overhead_s,
        "ring": c + (n - 1) * (max(c, m) + a) + n * p.step_overhead_s,
    }


def _device_type(site: Site) -> str:
    node = site.shard if isinstance(site, AgMmSite) else site.reduce_scatter
    value = node.meta.get("val")
    return value.device.type if isinstance(value, torch.Tensor) else "cpu"
