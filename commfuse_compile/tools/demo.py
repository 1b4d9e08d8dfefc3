"""``commfuse demo``: a TP+SP transformer block on local gloo ranks, with and without the pass.

Builds a Llama-style block (RMSNorm, attention with q/k/v sharing one input, SwiGLU MLP)
sharded with DTensor's ``parallelize_module`` (norms sequence-parallel, q/k/v/w1/w3
column-parallel, wo/w2 row-parallel), compiles it with ``backend="commfuse"``, runs
forward + backward, checks outputs and gradients against the uncompiled model, and
reports the sites and the step time of both.

Over plain loopback a transfer costs CPU, not wall time: there is nothing for a matmul to
hide, and the rewrite can only cost. So, as root, the ranks run behind the throttled
links of ``commfuse bench`` (network namespaces, a token bucket per rank) at
``LINK_RATE``, and the headline is the speedup over ``schedule="off"`` there and the
distance to the overlap limit: max(compute, communication), each measured alone
(``bench.alone``: the same programs with every transfer a local copy, and the baseline's
collectives one after the other with nothing computed). Where links cannot be throttled
(not root, no ``tc``) the demo says so and gives the cost model's figure for the block on
such a link instead.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import report
from ..cost.profiles import BUILTIN
from .bench.alone import local_backend, recording, replay
from .bench.figures import slowest
from .bench.netns import can_throttle, throttled_ranks
from .bench.nodes import launched_ranks
from .sim.layer import ModelShape, simulate_layer
from .training.models import Block, block_plan

LINK_RATE = 400e6  # bit/s of each rank's link: the baseline's communication about its compute
CALIBRATED = "gloo-loopback"  # the cost model's profile calibrated on this machine kind

_STEPS: dict[str, Callable[[], float]] = {}  # this rank's compiled steps, kept between jobs


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    world_size: int = 2
    schedule: str = "ring"
    inner: str = "eager"
    batch: int = 2
    seq_per_rank: int = 128
    dim: int = 256
    heads: int = 4
    hidden: int = 768
    steps: int = 5
    debug_dir: str | None = None
    # the ranks over this many nodes (a namespace each, its own NIC at ``LINK_RATE``),
    # launched by one torchrun per node (``bench.nodes``); None: a namespace per rank
    nodes: int | None = None


# ----------------------------------------------------------------------------------------
# On the ranks


def _rank_compile(rank: int, n: int, cfg: DemoConfig) -> dict[str, Any]:
    """Job: compile the block with the pass and with ``schedule="off"``, check the pass's
    first step against the uncompiled block, keep both steps for ``_rank_times``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    eager = Block(cfg.dim, cfg.heads, cfg.hidden)
    fused, baseline = copy.deepcopy(eager), copy.deepcopy(eager)
    alone = {label: copy.deepcopy(eager) for label in ("off", "commfuse")}
    for module in (eager, fused, baseline, *alone.values()):
        parallelize_module(module, mesh, block_plan())
    options: dict[str, Any] = {"schedule": cfg.schedule, "inner": cfg.inner}
    x = torch.randn(cfg.batch, cfg.seq_per_rank * n, cfg.dim).chunk(n, dim=1)[rank]

    def step(model: Any) -> tuple[torch.Tensor, float]:
        inp = DTensor.from_local(x.clone().requires_grad_(), mesh, [Shard(1)])
        start = time.perf_counter()
        out = model(inp)
        out.to_local().square().mean().backward()
        return out.to_local().detach(), time.perf_counter() - start

    # The baseline is the same compile with every collective kept: what the pass buys,
    # not what compiling does. Compiled first, so that the report holds the pass's sites.
    off = torch.compile(baseline, backend="commfuse", options={**options, "schedule": "off"})
    step(off)
    # each program's compute alone (its transfers local copies), and its communication
    # alone (its collectives or P2P steps as one step of it calls them, nothing computed)
    computing = {
        label: torch.compile(
            model,
            backend=local_backend(
                {**options, "schedule": "off" if label == "off" else cfg.schedule}
            ),
        )
        for label, model in alone.items()
    }
    transfers: dict[str, list[Any]] = {}
    for label, model in computing.items():
        step(model)
        with recording() as transfers[label]:
            step(model)

    def communicate(calls: list[Any]) -> float:
        start = time.perf_counter()
        replay(calls)
        return time.perf_counter() - start

    report.reset()
    measured = {**options, "debug_dir": cfg.debug_dir, "measure": cfg.debug_dir is not None}
    compiled = torch.compile(fused, backend="commfuse", options=measured)
    start = time.perf_counter()
    out_fused, _ = step(compiled)
    compile_s = time.perf_counter() - start
    out_eager, _ = step(eager)
    grads = {
        name: (p.grad.full_tensor(), q.grad.full_tensor())  # type: ignore[union-attr]
        for (name, p), q in zip(fused.named_parameters(), eager.parameters(), strict=True)
    }
    _STEPS["off"] = lambda: step(off)[1]
    _STEPS["commfuse"] = lambda: step(compiled)[1]
    for label, program in computing.items():
        _STEPS[f"{label} compute"] = functools.partial(lambda p: step(p)[1], program)
        _STEPS[f"{label} communication"] = functools.partial(communicate, transfers[label])
    return {
        "out_diff": (out_fused - out_eager).abs().max().item(),
        "grad_diff": max((a - b).abs().max().item() for a, b in grads.values()),
        "compile_s": compile_s,
        "sites": [s.as_json() for s in report.REPORT.sites],
    }


def _rank_times(rank: int, n: int, steps: int) -> dict[str, list[float]]:
    """Job: ``steps`` of each kept step, interleaved (both see the same machine state),
    each started on a barrier."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {label: [] for label in _STEPS}
    for _ in range(steps):
        for label, step in _STEPS.items():
            dist.barrier()
            times[label].append(step())
    return times


def _rank_write_dump(rank: int, n: int, debug_dir: str) -> None:
    """Job: report.json again, with the P2P spans the timed steps measured."""
    report.REPORT.write(debug_dir)


# ----------------------------------------------------------------------------------------
# In the parent


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Median steps (forward + backward, the slowest rank's) of the block with the pass
    and with ``schedule="off"``; each program's compute alone and its communication
    alone (``bench.alone``: the pass's ring sends other bytes than gloo's collectives)."""

    commfuse_s: float
    off_s: float
    commfuse_compute_s: float
    off_compute_s: float
    commfuse_communication_s: float
    off_communication_s: float

    @property
    def speedup(self) -> float:
        return self.off_s / self.commfuse_s


def _time_steps(network: Any, ranks: Any, steps: int) -> tuple[StepTimes, StepTimes | None]:
    """Median steps unthrottled and, where the network throttles, on ``LINK_RATE``:
    one step of each per repetition and link, alternated, so that both links see the
    same machine (it is shared)."""
    rates = {"free": None} if network.topology == "none" else {"free": None, "link": LINK_RATE}
    times: dict[str, dict[str, list[float]]] = {"free": {}, "link": {}}
    for _ in range(steps):
        for link, rate in rates.items():
            network.set_rate(rate)
            for label, took in slowest(ranks.run(_rank_times, 1)).items():
                times[link].setdefault(label, []).extend(took)
    medians = {
        link: StepTimes(
            *(
                statistics.median(t[label])
                for label in (
                    "commfuse",
                    "off",
                    "commfuse compute",
                    "off compute",
                    "commfuse communication",
                    "off communication",
                )
            )
        )
        for link, t in times.items()
        if t
    }
    return medians["free"], medians.get("link")


def predicted_on_link(cfg: DemoConfig, rate_bits_per_s: float) -> tuple[float, float]:
    """The cost model's time of the block's sites with their collectives and with
    ``cfg.schedule`` (``commfuse sim``'s layer model of this block): the profile
    calibrated on this machine kind, its link at ``rate_bits_per_s`` and its collectives
    by the ring formula (its measured curves are loopback's)."""
    n = cfg.world_size
    block = ModelShape(
        name="demo block",
        source="commfuse demo's block",
        hidden=cfg.dim,
        heads=cfg.heads,
        kv_heads=cfg.heads,
        head_dim=cfg.dim // cfg.heads,
        ffn=cfg.hidden,
        gated=True,
        tokens=cfg.batch * cfg.seq_per_rank * n,
        dtype_bytes=4,  # float32
    )
    profile = dataclasses.replace(
        BUILTIN[CALIBRATED], link_bytes_per_s=rate_bits_per_s / 8, collectives={}
    )
    schedule = "ring" if cfg.schedule in ("auto", "off") else cfg.schedule
    layer = simulate_layer(block, n, profile, slices=2)
    return layer.total_s("collective"), layer.total_s(schedule)


def nodes_refusal(world_size: int, nodes: int | None) -> str | None:
    """Why ``world_size`` ranks cannot run on ``nodes`` nodes here (None: they can)."""
    if nodes is None:
        return None
    if world_size % nodes:
        return f"--world-size {world_size} is no multiple of {nodes} (as many ranks per node)"
    why_not = can_throttle()
    return None if why_not is None else f"needs network namespaces: {why_not}"


def run(cfg: DemoConfig) -> int:
    where = f" on {cfg.nodes} nodes (one torchrun each)" if cfg.nodes else ""
    print(
        f"commfuse demo: TP+SP transformer block on {cfg.world_size} local gloo ranks{where} "
        f"(schedule={cfg.schedule}, inner={cfg.inner}; dim={cfg.dim}, hidden={cfg.hidden}, "
        f"seq={cfg.seq_per_rank * cfg.world_size}, batch={cfg.batch})",
        flush=True,
    )
    with (
        tempfile.TemporaryDirectory(prefix="commfuse-demo-") as logs,
        (
            launched_ranks(cfg.nodes, cfg.world_size // cfg.nodes, Path(logs))
            if cfg.nodes
            else throttled_ranks(cfg.world_size, Path(logs))
        ) as (network, ranks, link),
    ):
        per = "node" if cfg.nodes else "rank"
        rate = f", {LINK_RATE / 1e6:.0f} Mbit/s per {per}" if network.topology != "none" else ""
        print(f"link: {link}{rate}")
        results = ranks.run(_rank_compile, cfg)
        free, on_link = _time_steps(network, ranks, cfg.steps)
        if cfg.debug_dir is not None:
            ranks.run(_rank_write_dump, cfg.debug_dir)
    first = results[0]
    print(f"\n{'graph':<9} {'site':<6} {'decision':<10} {'schedule':<8} matmuls / reason")
    for s in first["sites"]:
        what = ", ".join(s.get("matmuls", [])) if s["decision"] == "rewritten" else s["reason"]
        print(f"{s['graph']:<9} {s['kind']:<6} {s['decision']:<10} {s['schedule']:<8} {what}")
    rewritten = [s for s in first["sites"] if s["decision"] == "rewritten"]
    ran = collections.Counter(s["schedule"] for s in rewritten)
    out_diff = max(r["out_diff"] for r in results)
    grad_diff = max(r["grad_diff"] for r in results)
    ok = out_diff <= 1e-4 and grad_diff <= 1e-4
    schedules = ", ".join(f"{n} {name}" for name, n in sorted(ran.items())) or "none"
    print(f"\nsites rewritten: {len(rewritten)} of {len(first['sites'])} (rank 0: {schedules})")
    print(
        f"max |output diff| {out_diff:.2e}, max |grad diff| {grad_diff:.2e} vs uncompiled: "
        f"{'OK' if ok else 'MISMATCH'}"
    )
    print(f"first compiled step (includes compile): {first['compile_s']:.1f} s")
    print(f"median step over {cfg.steps} (forward+backward, slowest rank):")
    print(
        f"  unthrottled loopback (a transfer costs no wall time: nothing to hide, only the "
        f"rewrite's cost shows): commfuse {free.commfuse_s * 1e3:.1f} ms, schedule='off' "
        f"{free.off_s * 1e3:.1f} ms"
    )
    print(
        f"  compute alone (every transfer a local copy): commfuse "
        f"{free.commfuse_compute_s * 1e3:.1f} ms, schedule='off' {free.off_compute_s * 1e3:.1f} ms"
    )
    if on_link is not None:
        print(
            f"  on the {LINK_RATE / 1e6:.0f} Mbit/s link: commfuse {on_link.commfuse_s * 1e3:.1f} "
            f"ms, the same compile with schedule='off' {on_link.off_s * 1e3:.1f} ms: "
            f"{on_link.speedup:.2f}x faster with the pass"
        )
        commfuse_limit = max(free.commfuse_compute_s, on_link.commfuse_communication_s)
        off_limit = max(free.off_compute_s, on_link.off_communication_s)
        print(
            f"  communication alone (each program's transfers, nothing computed): commfuse "
            f"{on_link.commfuse_communication_s * 1e3:.1f} ms, schedule='off' "
            f"{on_link.off_communication_s * 1e3:.1f} ms"
        )
        print(
            f"  overlap limit max(compute, communication), each program's own: commfuse at "
            f"{on_link.commfuse_s / commfuse_limit:.2f}x its {commfuse_limit * 1e3:.1f} ms, "
            f"schedule='off' at {on_link.off_s / off_limit:.2f}x its {off_limit * 1e3:.1f} ms"
        )
    else:
        collective_s, fused_s = predicted_on_link(cfg, LINK_RATE)
        print(
            f"  no throttled link here (see link: above); behind a {LINK_RATE / 1e6:.0f} "
            f"Mbit/s link per rank the cost model ({CALIBRATED}, calibrated on this machine "
            f"kind) predicts the block's sites at {fused_s * 1e3:.1f} ms with the pass, "
            f"{collective_s * 1e3:.1f} ms with their collectives: {collective_s / fused_s:.2f}x "
            f"faster (other models and links: commfuse sim)"
        )
    if cfg.debug_dir is not None:
        print(
            f"\ndebug dump written to {cfg.debug_dir}; for its HTML report and Perfetto "
            f"trace run: commfuse inspect {cfg.debug_dir}"
        )
    expected = cfg.schedule != "auto"  # auto may keep every collective, by design
    return 0 if ok and (rewritten or not expected) else 1
