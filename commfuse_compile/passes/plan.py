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

import torch

from ..cost.profiles import Profile, for_device, load
from ..cost.simulator import Timeline, Work
from ..options import Options
from .declines import decline
from .kinds import of
from .site import Site

# ``auto`` decomposes only for a predicted gain of at least 5%: within the model's
# error, the collective (one call, no extra steps) is the safer choice.
MIN_GAIN = 1.05


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    why: str


def plan_options(options: Options) -> None:
    """Decline before anything is predicted when the options rule every schedule out."""
    if options.schedule == "off":
        raise decline("plan.off")
    if options.schedule in options.disable:
        raise decline("plan.schedule_disabled", schedule=options.schedule)


def check_applies(predicted: dict[str, Timeline], options: Options, kind: str) -> None:
    """A requested schedule must have steps for the site's kind (``predict`` times only
    those that do): an all-to-all has no ring to forward along, nor chunks to slice."""
    if options.schedule not in ("auto", "off") and options.schedule not in predicted:
        raise decline("plan.schedule_not_for_kind", schedule=options.schedule, kind=kind)


def plan(predicted: dict[str, Timeline], options: Options) -> Plan:
    """The schedule for a site with these predicted timelines (by schedule)."""
    plan_options(options)
    if options.schedule != "auto":
        return Plan(options.schedule, f"schedule {options.schedule!r} requested")
    times = {k: t.end_s for k, t in predicted.items() if k not in options.disable}
    best = auto_choice(times)
    collective = times["collective"]
    if best == "collective":
        if len(times) == 1:
            raise decline("plan.all_disabled")
        runner_up = min((k for k in times if k != "collective"), key=times.__getitem__)
        raise decline(
            "plan.not_profitable",
            runner_up=runner_up,
            runner_up_us=times[runner_up] * 1e6,
            collective_us=collective * 1e6,
            gain=MIN_GAIN - 1,
        )
    return Plan(best, f"{best} predicted {collective / times[best]:.2f}x faster")


def auto_choice(times: dict[str, float]) -> str:
    """``auto``'s rule on predicted times (by schedule, "collective" included): the
    fastest schedule if it gains at least ``MIN_GAIN`` over the collective."""
    best = min(times, key=times.__getitem__)
    return best if times[best] * MIN_GAIN <= times["collective"] else "collective"


def site_work(site: Site, n: int) -> Work:
    """Per-block matmul FLOPs and message bytes of a matched site; symbolic sizes are
    evaluated at their hints (the sizes of the example inputs the graph was traced with)."""
    return of(site).work(site, n)


def profile_for(site: Site, options: Options) -> Profile:
    """The option's profile (a file is read once per process), else the device's."""
    if options.profile is not None:
        return _loaded(options.profile)
    value = site.anchor.args[0].meta.get("val")  # type: ignore[union-attr]
    return for_device(value.device.type if isinstance(value, torch.Tensor) else "cpu")


@functools.cache
def _loaded(name_or_path: str) -> Profile:
    return load(name_or_path)
