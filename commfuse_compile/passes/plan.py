"""Plan stage: predict every schedule of a site on the machine profile, pick one.

The prediction is the discrete-event simulation of ``simulator.py`` (the same one
``commfuse sim`` runs), fed with the site's per-block matmul FLOPs and message bytes.
Every decision of the pass, each site's schedule and the plain-TP split, is ``pays``:
a rewrite is taken only when predicted at least ``MIN_GAIN`` faster than what it
replaces; the per-step fixed cost in the profile is what makes the collective win for
small matmuls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from ..cost.profiles import Profile, for_device, load
from ..cost.simulator import (
    Timeline,
    Work,
    collective_call_s,
    collective_model,
    matmuls_s,
    predict,
)
from ..options import Options
from ..report import SiteRecord
from ..runtime import groups, topology
from ..schedules import Direction, running
from .fx.declines import Declined, decline, failed
from .kinds import of
from .kit.site import Site

# A rewrite is taken only for a predicted gain of at least 5%: within the model's error,
# the program as written (one call, no extra steps) is the safer choice.
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


def check_applies(predicted: dict[str, Timeline], schedule: str, kind: str) -> None:
    """A requested schedule (as it runs on the site: ``running``) must have steps for the
    site's kind (``predict`` times only those that do): an all-to-all has no ring to
    forward along, nor chunks to slice."""
    if schedule not in ("auto", "off") and schedule not in predicted:
        raise decline("plan.schedule_not_for_kind", schedule=schedule, kind=kind)


def plan(predicted: dict[str, Timeline], options: Options, direction: Direction) -> Plan:
    """The schedule for a site of ``direction`` with these predicted timelines (by
    schedule): the program that runs (``running``: a round trip's for ``ring``)."""
    plan_options(options)
    if options.schedule != "auto":
        schedule = running(options.schedule, direction)
        return Plan(schedule, f"schedule {options.schedule!r} requested")
    disabled = {running(name, direction) for name in options.disable}
    kept = {k: t for k, t in predicted.items() if k not in disabled}
    times = {k: t.end_s for k, t in kept.items()}
    best = auto_schedule(kept)
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


def pays(rewritten_s: float, written_s: float) -> bool:
    """The one decision rule (docs/schedules.md): a rewrite predicted to take
    ``rewritten_s`` replaces the program as written (``written_s``) only when it gains at
    least ``MIN_GAIN``. Each site's schedule and the plain-TP split are decided by it."""
    return rewritten_s * MIN_GAIN <= written_s


def auto_choice(times: Mapping[str, float], calls: Mapping[str, int] | None = None) -> str:
    """``auto``'s rule on predicted times (by schedule, "collective" included): of the
    schedules that ``pay`` against the collective, those within ``MIN_GAIN`` of the
    fastest of them, the one that issues the fewest communication calls (``calls``, by
    schedule; then the faster); the collective where none pays. A call's fixed costs are
    what the model prices worst: on a decode step, slicing's gather, predicted 0.2 %
    faster than the ring, made the step 6.1 ms against the ring's 5.2."""
    collective = times["collective"]
    paying = [k for k, t in times.items() if t < collective and pays(t, collective)]
    if not paying:
        return "collective"
    fastest = min(times[k] for k in paying)
    near = [k for k in paying if times[k] == fastest or not pays(fastest, times[k])]
    return min(near, key=lambda k: ((calls or {}).get(k, 0), times[k]))


def auto_schedule(predicted: Mapping[str, Timeline]) -> str:
    """``auto_choice`` on a site's predicted timelines (by schedule)."""
    times = {k: t.end_s for k, t in predicted.items()}
    return auto_choice(times, {k: t.comm_calls() for k, t in predicted.items()})


c10d = torch.ops._c10d_functional
# how the model times each collective: its direction, whether one rank's block is its
# input over the group size (else the whole input: an all-gather's shard), and whether
# the reduced blocks are then gathered (an all-reduce)
TIMED_COLLECTIVES = {
    c10d.all_gather_into_tensor.default: (Direction.GATHER, False, False),
    c10d.reduce_scatter_tensor.default: (Direction.REDUCE, True, False),
    c10d.all_to_all_single.default: (Direction.EXCHANGE_IN, True, False),
    c10d.all_reduce.default: (Direction.REDUCE, True, True),
}


def collective_seconds(collective: Node, nbytes: float, profile: Profile) -> float:
    """One call like ``collective`` (an all-gather, reduce-scatter, all-to-all or
    all-reduce) of ``nbytes`` input, as a site's collective is timed: the cost model's
    call for a collective no site holds (the bucketing's, the bench's)."""
    n = len(groups.ranks_of(str(collective.args[-1])))
    direction, divided, then_gather = TIMED_COLLECTIVES[collective.target]  # type: ignore[index]
    block = nbytes / max(n, 1) if divided else nbytes
    return collective_call_s(Work(direction, n, 0.0, block, then_gather=then_gather), profile)


def site_work(site: Site, n: int, inner: str = "eager") -> Work:
    """Per-block matmul FLOPs and message bytes of a matched site; symbolic sizes are
    evaluated at their hints (the sizes of the example inputs the graph was traced with).
    Compiled by Inductor (``inner``), each block's matmul writes its product into its slice
    of the concatenation (``extern_kernels.mm(..., out=...)`` on an alias of the
    concatenation's buffer), so the products cost no copy."""
    work = of(site).work(site, n)
    return dataclasses.replace(work, product_bytes=0.0) if inner == "inductor" else work


def profile_for(site: Site, options: Options) -> Profile:
    """The option's profile (a file is read once per process), else the device's."""
    return profile_of(site.anchor, options)


def profile_of(collective: Node, options: Options) -> Profile:
    """The profile for ``collective``: the option's, else that of its operand's device."""
    if options.profile is not None:
        return _loaded(options.profile)
    value = collective.args[0].meta.get("val")  # type: ignore[union-attr]
    return for_device(value.device.type if isinstance(value, torch.Tensor) else "cpu")


@functools.cache
def _loaded(name_or_path: str) -> Profile:
    return load(name_or_path)


def site_group(site: Site, options: Options) -> groups.Group:
    """The site's process group, its ring ordered by node where its schedules run a ring
    (an all-to-all's pairwise steps meet every member anyway); declined where this
    process cannot know it."""
    try:
        group = groups.resolve(site.group_name, site.group_size)
    except groups.GroupError as err:
        raise decline("site.group", error=err) from None
    if not _rings(site):
        return group
    order = topology.current(options.topology).ring_order(group.ranks)
    return dataclasses.replace(group, order=order if order != tuple(range(group.size)) else ())


def _rings(site: Site) -> bool:
    """Do the site's schedules pass blocks along a ring (rather than exchange pairwise)?"""
    return of(site).direction in (Direction.GATHER, Direction.REDUCE)


def group_profile(site: Site, group: groups.Group, options: Options, profile: Profile) -> Profile:
    """``profile`` as the site's group sees it: the link inside a node where the group is
    on one node, else its slowest hop, the NIC, shared by the ranks sending through it at
    once (``Profile.for_group``)."""
    order = [group.member(p) for p in range(group.size)]
    where = topology.current(options.topology)
    return profile.for_group(group.ranks, order, where, all_pairs=not _rings(site))


def predict_site(
    site: Site,
    group: groups.Group,
    options: Options,
    profile: Profile,
    record: SiteRecord | None = None,
) -> tuple[Site, dict[str, Timeline]]:
    """The site as the options leave it and every schedule's predicted timeline;
    declined where the options rule the site out (``plan`` then chooses). What the cost
    model said goes into ``record``."""
    site = without_disabled(site, options.disable)
    plan_options(options)
    work = site_work(site, group.size, options.inner)
    profile = group_profile(site, group, options, profile)
    timelines = predict(work, profile, options.slices)
    if record is not None:
        record.predicted(
            {k: round(t.end_s * 1e6, 2) for k, t in timelines.items()},
            profile.name,
            collective_model(work, profile),
            timelines["collective"].as_json(group.rank),
            topology.current(options.topology).level(group.ranks),
            group.ring(),
        )
    check_applies(timelines, running(options.schedule, work.direction), site.kind)
    return site, timelines


def plan_site(
    site: Site, group: groups.Group, options: Options, record: SiteRecord
) -> tuple[Site, dict[str, Timeline], Plan]:
    """The site as the options leave it, every schedule's predicted timeline, and the
    plan; declined where the options or the prediction rule the site out. What the cost
    model said goes into ``record``, its timeline the collective's until the site is
    rewritten (what runs if it is declined)."""
    site, predicted = predict_site(site, group, options, profile_for(site, options), record)
    return site, predicted, plan(predicted, options, of(site).direction)


def without_disabled(site: Site, disabled: frozenset[str]) -> Site:
    """``disable``: decline a disabled kind; leave out the parts of a site it names."""
    if site.kind in disabled:
        raise decline("plan.kind_disabled", kind=site.kind)
    return of(site).without(site, disabled)


def plannable(site: Site, options: Options) -> groups.Group | Declined:
    """The site's group, if the options and its prediction admit rewriting it (for a
    declined site, the options alone); else why not."""
    try:
        group = site_group(site, options)
        if site.declined:
            plan_options(options)
            without_disabled(site, options.disable)
        else:
            predict_site(site, group, options, profile_for(site, options))
    except Exception as err:  # noqa: BLE001 - its own planning fails: never a compile's
        return failed(err, options.strict, "its all-reduce is not split")
    return group


@dataclasses.dataclass(frozen=True)
class SiteTimes:
    """A site's predicted seconds as written (its collective and its matmuls, one after
    the other), as the plan would run it, and of its matmuls alone."""

    written_s: float
    planned_s: float
    matmuls_s: float


def site_times(site: Site, options: Options) -> SiteTimes | None:
    """The site's predicted times (``planned_s`` = ``written_s`` where the plan keeps the
    collective); None where it has no prediction (declined, or its planning fails: which
    warns, ``declines.failed``)."""
    if site.declined:
        return None
    try:
        group, profile = site_group(site, options), profile_for(site, options)
        _, timelines = predict_site(site, group, options, profile)
    except Exception as err:  # noqa: BLE001 - its own planning fails: never a compile's
        failed(err, options.strict, "the token-wise split is decided without the site")
        return None
    written = timelines["collective"].end_s
    try:
        planned = timelines[plan(timelines, options, of(site).direction).schedule].end_s
    except Declined:
        planned = written
    return SiteTimes(written, planned, matmuls_s(site_work(site, group.size), profile))


def decision_inputs(options: Options, profile: Profile) -> dict[str, Any]:
    """What a rank's decisions depend on besides the graph: every rank must share it."""
    return {
        "torch": torch.__version__,
        "inner": options.inner,
        "measure": options.measure,
        "schedule": options.schedule,
        "slices": options.slices,
        "disable": ",".join(sorted(options.disable)),
        "profile": f"{profile.name} {profile.fingerprint()}",
        "topology": topology.current(options.topology).describe(),
    }
