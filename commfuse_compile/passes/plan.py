"""Plan stage: predict every schedule of a site on the machine profile, pick one.

The prediction is the discrete-event simulation of ``simulator.py`` (the same one
``commfuse sim`` runs), fed with the site's per-block matmul FLOPs and message bytes.
``auto`` takes the fastest prediction and keeps the collective when no schedule is
predicted at least ``MIN_GAIN`` faster; the per-step fixed cost in the profile is what
makes the collective win for small matmuls.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch.fx import Node

from ..options import Options
from ..profiles import Profile, for_device, load
from ..report import decline
from ..simulator import Timeline, Work
from . import dims
from .match import AgMmSite, MmRsSite, Site, val

# ``auto`` decomposes only for a predicted gain of at least 5%: within the model's
# error, the collective (one call, no extra steps) is the safer choice.
MIN_GAIN = 1.05


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    predicted: dict[str, Timeline]
    why: str


def plan_options(options: Options) -> None:
    """Decline before anything is predicted when the options rule every schedule out."""
    if options.schedule == "off":
        raise decline("schedule 'off' keeps every collective", "off")
    if options.schedule in options.disable:
        raise decline(f"schedule {options.schedule!r} is disabled", "disabled")


def plan(predicted: dict[str, Timeline], options: Options) -> Plan:
    """The schedule for a site with these predicted timelines (by schedule)."""
    plan_options(options)
    if options.schedule != "auto":
        return Plan(options.schedule, predicted, f"schedule {options.schedule!r} requested")
    times = {k: t.end_s for k, t in predicted.items() if k not in options.disable}
    best = min(times, key=times.__getitem__)
    collective = times["collective"]
    if best != "collective" and times[best] * MIN_GAIN > collective:
        best = "collective"
    if best == "collective":
        if len(times) == 1:
            raise decline("every schedule is disabled", "disabled")
        runner_up = min((k for k in times if k != "collective"), key=times.__getitem__)
        raise decline(
            f"not profitable: {runner_up} predicted {times[runner_up] * 1e6:.1f} us, "
            f"collective {collective * 1e6:.1f} us (a schedule must gain {MIN_GAIN - 1:.0%})",
            "not_profitable",
        )
    return Plan(best, predicted, f"{best} predicted {collective / times[best]:.2f}x faster")


def site_work(site: Site, n: int) -> Work:
    """Per-block matmul FLOPs and message bytes of a matched site; symbolic sizes are
    evaluated at their hints (the sizes of the example inputs the graph was traced with)."""
    if isinstance(site, AgMmSite):
        shard = val(site.shard)
        flops = sum(2 * _numel(u.mm.node) * dims.hint(val(u.mm.a).shape[1]) for u in site.uses)
        shard_bytes = _numel(site.shard) * shard.element_size()
        return Work("gather", n, flops / n, shard_bytes, len(site.uses))
    assert isinstance(site, MmRsSite)
    out = site.terms[0].node
    flops = sum(2 * _numel(out) * dims.hint(val(t.a).shape[1]) for t in site.terms)
    out_bytes = _numel(out) * val(out).element_size()
    return Work("reduce", n, flops / n, out_bytes / n, len(site.terms))


def _numel(node: Node) -> int:
    return math.prod(dims.hint(size) for size in val(node).shape)


def profile_for(site: Site, options: Options) -> Profile:
    """The option's profile (a file is read once per process), else the device's."""
    if options.profile is not None:
        return _loaded(options.profile)
    node = site.shard if isinstance(site, AgMmSite) else site.reduce_scatter
    value = node.meta.get("val")
    return for_device(value.device.type if isinstance(value, torch.Tensor) else "cpu")


@functools.cache
def _loaded(name_or_path: str) -> Profile:
    return load(name_or_path)
