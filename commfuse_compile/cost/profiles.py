"""Machine profiles: the constants the cost model and the simulator run on.

Built-in profiles describe real hardware; every number says where it comes from. A
profile measured on the current machine and process group (``commfuse calibrate``) is a
JSON file with the same fields, loaded with ``options={"profile": path}``.
GPU matmul figures are for bf16/fp16 tensor-core GEMMs (the dtype of LLM training); a
calibrated profile's ``matmul_flops`` is float32's, its other dtypes' rates by name.

A profile has links by level: its flat ``link_*`` fields are the link between ranks of
one node; ``across_nodes`` (a :class:`Level`), where given, the NIC between nodes. A
profile without it (a single node, or a file written before levels) is one level.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..runtime.topology import INSIDE, Topology
from .profile_checks import ProfileError, checked

CURVE_BLOCK_BYTES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)  # one rank's block, calibrated


@dataclasses.dataclass(frozen=True)
class Curve:
    """A collective's time as measured on a group of one size, by the bytes of one
    rank's block (the all-gather's shard, the reduce-scatter's output, the all-to-all's
    block for one peer: even splits; the all-reduce's tensor over the group size):
    ``points`` (block bytes, seconds) as measured, and the line ``latency_s`` +
    ``seconds_per_byte`` x bytes fitted on them."""

    latency_s: float
    seconds_per_byte: float
    points: tuple[tuple[float, float], ...] = ()

    def seconds(self, block_bytes: float) -> float:
        """Through the measured points, where there are two or more: between two, on the
        line joining them; past the largest, on from it at the fitted per-byte cost;
        below the smallest, its first segment's line (never below zero). One line
        through all of them prices one end only: gloo's 4 KiB calls take about 0.5 ms,
        which a line fitted on its 1-4 MiB ones puts at zero, and ``auto`` then split a
        decode step's all-reduce into four calls. A larger block never takes less time
        than a smaller one measured. Without points (the built-in constants): the line."""
        if len(self.points) < 2:
            return self.latency_s + self.seconds_per_byte * block_bytes
        xs, ys = self._knots
        if block_bytes >= xs[-1]:
            return ys[-1] + self.seconds_per_byte * (block_bytes - xs[-1])
        i = max(1, bisect.bisect_right(xs, block_bytes))
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (block_bytes - xs[i - 1]), 0.0)

    @functools.cached_property
    def _knots(self) -> tuple[list[float], list[float]]:
        """The points by size, each time at least the one before (once per curve: the
        simulator asks a curve many times)."""
        ordered = sorted(self.points)
        return [x for x, _ in ordered], list(itertools.accumulate((y for _, y in ordered), max))


@dataclasses.dataclass(frozen=True)
class MatmulRate:
    """A matmul class's fixed cost per call and achieved FLOP/s (``Profile.matmul_rates``)."""

    latency_s: float
    flops: float


@dataclasses.dataclass(frozen=True)
class Level:
    """The link between nodes: a NIC shared by ``ranks_per_nic`` of a node's ranks (1:
    a NIC per GPU, as on rail-optimized InfiniBand clusters), ``bytes_per_s`` per
    direction for the whole NIC, its collectives as measured across nodes, and the fixed
    costs of a rewritten site whose messages cross it."""

    alpha_s: float  # latency of one message between nodes
    bytes_per_s: float  # one direction, the whole NIC
    duplex: bool = True  # a NIC sends and receives at full rate at once
    ranks_per_nic: int = 1
    collectives: dict[str, dict[int, Curve]] = dataclasses.field(default_factory=dict)
    # ``Profile.step_overhead_s`` and ``overlap_slowdown`` of a ring across nodes (None:
    # as inside a node). They differ by transport: a matmul on this project's CI machine
    # (2 nodes x 2 ranks on 2 cores) slowed by 0.6-1.3x its time under a transfer over
    # the node's own address (the kernel copies it, on the ranks' cores) and by 0-0.6x
    # under one through the NIC, in ten calibrations.
    step_overhead_s: float | None = None
    overlap_slowdown: float | None = None


# a ``Level``'s fixed costs: null is "as inside a node"
LEVEL_NULLABLE = ("step_overhead_s", "overlap_slowdown")


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    source: str  # where the numbers come from
    matmul_flops: float  # achieved FLOP/s of a large matmul (of the dtype ``source`` says)
    matmul_latency_s: float  # fixed cost of one matmul call (launch; dominates tiny ones)
    memory_bytes_per_s: float  # element-wise ops (adding a partial sum)
    link_alpha_s: float  # latency of one point-to-point message
    link_bytes_per_s: float  # bandwidth of one point-to-point message, one direction
    step_overhead_s: float  # issuing and waiting one P2P batch of a rewritten graph
    collective_overhead_s: float  # one collective call, beyond its messages
    # True where each neighbour has its own link (full mesh, physical ring): a rank
    # sending to both neighbours at once gets twice the bandwidth. False behind a
    # switch (NVSwitch, PCIe switch, loopback): both messages share one port.
    duplex_neighbours: bool = False
    # How much slower a matmul runs while a transfer is in flight on the same rank (0.3:
    # 30 % slower): on CPUs the transport's threads take cores; ``calibrate`` measures it.
    overlap_slowdown: float = 0.0
    # How fast a matmul call streams the operand it reads whole (a token-cut product's
    # weight), beyond its FLOPs: a skinny matmul (a decode step's few rows) is bound by
    # reading its weight, and one cut into n blocks of rows reads it n times (measured on
    # this project's CI machine: a 4-row 1024x1024 fp32 matmul takes 0.21 ms, 5x its FLOPs'
    # time). 0: not modelled (the GPU profiles: a weight's read there hides under the call's
    # launch cost). ``calibrate`` measures it on skinny shapes.
    matmul_bytes_per_s: float = 0.0
    # The collectives as the backend runs them, by collective and group size (``calibrate``
    # measures them, ``COLLECTIVES``); without a curve the model takes the faster of
    # a ring and a bidirectional ring of the same messages plus ``collective_overhead_s``.
    collectives: dict[str, dict[int, Curve]] = dataclasses.field(default_factory=dict)
    # the link between nodes (None: one node, every group priced by the fields above)
    across_nodes: Level | None = None
    ranks_per_node: int = 0  # of the cluster described (``commfuse sim``); 0: not said
    # Matmuls of other operand dtypes or forms than ``matmul_flops``'s, by class: the dtype
    # by torch's name ("bfloat16"), then " grouped" for a grouped matmul (an MoE's
    # ``_grouped_mm``). On this project's CI machine (AMX) a large bfloat16 matmul runs
    # 4-7x float32's rate, and a call costs 25-50 us where float32's costs 5.
    # ``calibrate`` measures bfloat16 and its grouped form; a class not here runs as its
    # dtype does, else at ``matmul_latency_s`` and ``matmul_flops``.
    matmul_rates: dict[str, MatmulRate] = dataclasses.field(default_factory=dict)
    # The fixed cost of one other op's call in a traced graph (an index, a sort, a cast):
    # 9-12 us on this project's CI machine, where a float32 matmul's fitted latency
    # comes out 0-5. 0: not measured, a matmul call's latency.
    op_call_s: float = 0.0
    # A collective started under a matmul (``slicing``'s chunks): the compute thread's
    # time to start it, and how much later it ends while the matmul holds the rank's core
    # (at most the matmul's time meanwhile). gloo runs a collective's rounds on a thread
    # of its own: on this project's CI machine (a core per rank) starting one takes
    # 0.1-0.2 ms, and matmuls beside it delay it by 0.7-1.9 ms (four calibrations at
    # 1 Gbit/s), where a P2P transfer, moved by the kernel, goes on. 0: not measured,
    # or a collective that runs on its own (NCCL's kernels). ``calibrate`` measures the
    # first and fits the second on a sliced site.
    collective_issue_s: float = 0.0
    collective_stall_s: float = 0.0
    # A measured collective (``collectives``) called between computations, beyond its
    # curve (calls timed back to back): the compute thread blocks on it, and the matmul
    # after it starts late. On this project's CI machine a 16 KiB all-reduce on 2 ranks
    # takes 0.73 ms back to back, 1.58 ms after a decode matmul, and the matmul after it
    # runs 0.78 ms against 0.48 alone. ``calibrate`` fits it on its step site as written;
    # 0: not measured (the built-in profiles; the ring formula's collectives pay
    # ``collective_overhead_s``, fitted on the same site).
    collective_resume_s: float = 0.0

    def curve(self, collective: str, n: int) -> Curve | None:
        return self.collectives.get(collective, {}).get(n)

    def matmul_s(
        self, flops: float, whole_bytes: float = 0.0, matmul_class: str | None = None
    ) -> float:
        """One matmul call of ``flops`` of ``matmul_class`` (``matmul_rates``; None: the
        profile's own) that reads ``whole_bytes`` of an operand whole."""
        streamed = whole_bytes / self.matmul_bytes_per_s if self.matmul_bytes_per_s else 0.0
        rate = self.matmul_rate(matmul_class)
        return rate.latency_s + flops / rate.flops + streamed

    def matmul_rate(self, matmul_class: str | None) -> MatmulRate:
        """``matmul_class``'s rate: its own, else its dtype's, else the profile's."""
        for name in (matmul_class, (matmul_class or "").split(" ")[0]):
            if name in self.matmul_rates:
                return self.matmul_rates[name]
        return MatmulRate(self.matmul_latency_s, self.matmul_flops)

    def memory_op_s(self, nbytes: float) -> float:
        """One call of an op whose time is its memory traffic (element-wise, indexing, a
        copy) reading and writing ``nbytes``: its call's fixed cost, then the bytes at the
        element-wise rate."""
        return self.op_s + nbytes / self.memory_bytes_per_s

    @property
    def op_s(self) -> float:
        """One op call's fixed cost (``op_call_s``)."""
        return self.op_call_s or self.matmul_latency_s

    def message_s(self, nbytes: float, sharing: int = 1) -> float:
        """One message of ``nbytes`` while ``sharing`` messages leave the rank at once."""
        share = 1 if self.duplex_neighbours else sharing
        return self.link_alpha_s + nbytes * share / self.link_bytes_per_s

    def add_s(self, nbytes: float) -> float:
        """out = x + y over tensors of ``nbytes``: two reads, one write."""
        return 3 * nbytes / self.memory_bytes_per_s

    def across(self, senders_per_nic: int) -> Profile:
        """This profile as a group whose slowest hop crosses between nodes sees it: the
        NIC's latency and its bandwidth shared by the ``senders_per_nic`` ranks that send
        through it at once (never faster than the link inside a node), with the
        collectives and fixed costs measured across nodes. Without ``across_nodes``:
        itself. The latency is the NIC's alone: a step ends with its slowest message, and
        a latency inside a node above the NIC's (on 2 nodes x 2 ranks sharing 2 cores,
        1.9 ms against 0.6 in one calibration) would be charged on top of the NIC's
        bytes, which no hop pays (a TP all-gather across the nodes predicted 8.6 ms as
        bidir, measured 4.5)."""
        nic = self.across_nodes
        if nic is None:
            return self
        # a half-duplex NIC's rate is shared by what a ring member sends and receives
        share = nic.bytes_per_s / max(1, senders_per_nic) / (1 if nic.duplex else 2)
        return dataclasses.replace(
            self,
            name=f"{self.name} across nodes",
            link_alpha_s=nic.alpha_s,
            link_bytes_per_s=min(self.link_bytes_per_s, share),
            duplex_neighbours=False,  # a rank's messages to other nodes share its NIC
            collectives=nic.collectives,
            across_nodes=None,
            step_overhead_s=_or(nic.step_overhead_s, self.step_overhead_s),
            overlap_slowdown=_or(nic.overlap_slowdown, self.overlap_slowdown),
        )

    def for_group(
        self, ranks: Sequence[int], order: Sequence[int], where: Topology, all_pairs: bool
    ) -> Profile:
        """This profile as a group of global ``ranks`` on ``where`` sees it: the link
        inside a node where the ranks share one, else the NIC shared by the ranks that
        send through it at once (its ring ``order``: group ranks; ``all_pairs``: each
        member exchanges with every other, as an all-to-all does)."""
        nic = self.across_nodes
        if nic is None or where.level(ranks) == INSIDE:
            return self
        return self.across(where.senders_per_nic(ranks, order, nic.ranks_per_nic, all_pairs))

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["collectives"] = _curves_json(self.collectives)
        if self.across_nodes is not None:
            out["across_nodes"]["collectives"] = _curves_json(self.across_nodes.collectives)
        return out

    def fingerprint(self) -> str:
        """What every rank must share for the ranks to decide alike (a hash of the
        numbers, not of the name)."""
        numbers = {k: v for k, v in self.as_json().items() if k not in ("name", "source")}
        return hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:12]


def at_compute_speed(p: Profile, factor: float) -> Profile:
    """``p`` on the machine as it ran while a matmul alone took ``factor`` times the
    model's time of it (a ``commfuse bench`` cell's, ``calibrate``'s sliced site's):
    every compute term ``factor`` times slower (the matmul's rate and call, the weight's
    and the element-wise rates, a P2P step's and a measured collective's fixed costs, a
    collective's start: CPU work here), the link and the collectives (their stall too)
    as calibrated. This machine's compute drifts within seconds: in one full run a
    4096x1024x1024 matmul alone took 59 to 131 ms inside one cell, and its three cells'
    medians were 65, 71 and 114 ms."""
    return dataclasses.replace(
        p,
        name=f"{p.name} at {factor:.2f}x its compute time",
        matmul_flops=p.matmul_flops / factor,
        matmul_rates={
            rate_class: MatmulRate(rate.latency_s * factor, rate.flops / factor)
            for rate_class, rate in p.matmul_rates.items()
        },
        matmul_latency_s=p.matmul_latency_s * factor,
        matmul_bytes_per_s=p.matmul_bytes_per_s / factor,
        memory_bytes_per_s=p.memory_bytes_per_s / factor,
        step_overhead_s=p.step_overhead_s * factor,
        collective_resume_s=p.collective_resume_s * factor,
        op_call_s=p.op_call_s * factor,
        collective_issue_s=p.collective_issue_s * factor,
    )


def _or(value: float | None, inside: float) -> float:
    return inside if value is None else value


def _curves_json(curves: dict[str, dict[int, Curve]]) -> dict[str, Any]:
    return {
        collective: {str(n): dataclasses.asdict(c) for n, c in by_n.items()}
        for collective, by_n in curves.items()
    }


def _points(seconds: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """A curve's measured points at the block sizes ``calibrate`` measures."""
    return tuple(zip(map(float, CURVE_BLOCK_BYTES), seconds, strict=True))


BUILTIN = {
    "h100-nvlink4": Profile(
        name="h100-nvlink4",
        source="NVIDIA H100 SXM5 datasheet: bf16 dense 989 TFLOP/s peak (650 taken as "
        "achieved by large cuBLAS GEMMs), HBM3 3.35 TB/s (2.8 achieved); NVLink 4 900 GB/s "
        "per GPU both directions = 450 GB/s per direction through NVSwitch (360 taken as "
        "achieved by NCCL P2P); latency/overheads: NCCL P2P and kernel-launch orders of "
        "magnitude (10 us message, 5 us launch), not measured by us",
        matmul_flops=6.5e14,
        matmul_latency_s=5e-6,
        memory_bytes_per_s=2.8e12,
        link_alpha_s=1e-5,
        link_bytes_per_s=3.6e11,
        step_overhead_s=1e-5,
        collective_overhead_s=1e-5,
    ),
    "a100-nvlink3": Profile(
        name="a100-nvlink3",
        source="NVIDIA A100 SXM4 80GB datasheet: bf16 dense 312 TFLOP/s peak (230 taken "
        "as achieved), HBM2e 2.0 TB/s (1.7 achieved); NVLink 3 600 GB/s per GPU both "
        "directions = 300 GB/s per direction through NVSwitch (230 taken as achieved); "
        "latency/overheads as for H100, not measured by us",
        matmul_flops=2.3e14,
        matmul_latency_s=5e-6,
        memory_bytes_per_s=1.7e12,
        link_alpha_s=1e-5,
        link_bytes_per_s=2.3e11,
        step_overhead_s=1e-5,
        collective_overhead_s=1e-5,
    ),
    "pcie-8x-l40s": Profile(
        name="pcie-8x-l40s",
        source="8 x NVIDIA L40S on PCIe Gen4 x16, no NVLink: L40S datasheet bf16 dense "
        "362 TFLOP/s peak (220 taken as achieved), GDDR6 864 GB/s (750 achieved); PCIe "
        "Gen4 x16 32 GB/s per direction theoretical, 20 GB/s taken for GPU-to-GPU P2P "
        "through the host's switch (shared by both neighbours); 20 us message latency",
        matmul_flops=2.2e14,
        matmul_latency_s=5e-6,
        memory_bytes_per_s=7.5e11,
        link_alpha_s=2e-5,
        link_bytes_per_s=2.0e10,
        step_overhead_s=1.5e-5,
        collective_overhead_s=1.5e-5,
    ),
    "ascend-910b-hccs": Profile(
        name="ascend-910b-hccs",
        source="Huawei Atlas 800T A2 (8 x Ascend 910B) published specs: fp16 ~313-376 "
        "TFLOP/s peak per NPU by SKU (250 taken as achieved), HBM2e 1.6 TB/s (1.3 "
        "achieved); HCCS full mesh, 7 links x 56 GB/s = 392 GB/s per NPU, a dedicated "
        "link per peer (28 GB/s per direction taken: the 56 GB/s figure is read as both "
        "directions); 20 us HCCL message latency, not measured by us",
        matmul_flops=2.5e14,
        matmul_latency_s=1e-5,
        memory_bytes_per_s=1.3e12,
        link_alpha_s=2e-5,
        link_bytes_per_s=2.8e10,
        step_overhead_s=2e-5,
        collective_overhead_s=2e-5,
        duplex_neighbours=True,
    ),
    "gloo-loopback": Profile(
        name="gloo-loopback",
        source="measured on this project's CI machine kind (2 cores, 2 gloo ranks on "
        "loopback, 1 torch thread each, 2026-11-30, `commfuse calibrate` and its parts): "
        "fp32 matmul 65 GFLOP/s; ring exchange of 16 MiB 8.8 ms (~2 GB/s); element-wise "
        "add 16-23 GB/s; a 2x8 all-gather -> matmul site 0.35 ms with its collective "
        "and 0.65-3.0 ms as a one-step ring (eager FX: ~1 ms per P2P step, ~0.25 ms per "
        "collective call, 0.1 ms per hop inside it); gloo's own all-gather and "
        "reduce-scatter on 2 ranks and the matmul slowdown under a transfer measured by "
        "`commfuse calibrate` (2026-12-01); a few-row 1024x1024 matmul reading its weight at "
        "24-29 GB/s beyond its FLOPs (`commfuse calibrate`, 2026-12-06). No curves for "
        "more ranks: on 2 cores they "
        "would be measured with ranks sharing a core, unlike the constants above; larger "
        "groups use the ring formula, or a profile calibrated at their size",
        matmul_flops=6.5e10,
        matmul_latency_s=2e-5,
        memory_bytes_per_s=1.6e10,
        link_alpha_s=1e-4,
        link_bytes_per_s=2e9,
        step_overhead_s=1e-3,
        collective_overhead_s=2.5e-4,
        overlap_slowdown=0.11,
        matmul_bytes_per_s=2.5e10,
        collectives={
            "all_gather": {
                2: Curve(2.85e-4, 1.76e-09, _points((3.07e-4, 6.61e-4, 2.3e-3, 7.93e-3)))
            },
            "reduce_scatter": {
                2: Curve(4.96e-4, 2.85e-09, _points((5.23e-4, 1.13e-3, 4.08e-3, 1.19e-2)))
            },
        },
    ),
}


def _cluster(node: str, name: str, source: str, nic: Level) -> Profile:
    """Nodes of 8 GPUs as profile ``node`` describes one, joined by ``nic``."""
    inside = BUILTIN[node]
    return dataclasses.replace(
        inside,
        name=name,
        source=f"{inside.source}. Across nodes: {source}",
        across_nodes=nic,
        ranks_per_node=8,
    )


BUILTIN |= {
    "h100-ib400": _cluster(
        "h100-nvlink4",
        "h100-ib400",
        "8 x 400 Gb/s InfiniBand NDR per node, a NIC per GPU (DGX H100, rail-optimized): "
        "50 GB/s per direction, 45 taken as achieved by NCCL; 10 us message latency "
        "(switch hops and NCCL's proxy), not measured by us",
        Level(alpha_s=1e-5, bytes_per_s=4.5e10),
    ),
    "a100-ib200": _cluster(
        "a100-nvlink3",
        "a100-ib200",
        "8 x 200 Gb/s InfiniBand HDR per node, a NIC per GPU (DGX A100): 25 GB/s per "
        "direction, 22 taken as achieved by NCCL; 10 us message latency, not measured by us",
        Level(alpha_s=1e-5, bytes_per_s=2.2e10),
    ),
}


def load(name_or_path: str | os.PathLike[str]) -> Profile:
    """A built-in profile by name, or a profile JSON file (``commfuse calibrate``)."""
    if str(name_or_path) in BUILTIN:
        return BUILTIN[str(name_or_path)]
    path = Path(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"profile {str(name_or_path)!r} is neither a built-in profile "
            f"({', '.join(BUILTIN)}) nor a file"
        )
    try:
        fields = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise ProfileError(f"profile file {path} is not JSON: {err}") from None
    return from_json(fields, f"profile file {path}")


def from_json(fields: object, where: str = "profile") -> Profile:
    """A profile from its JSON form, every field checked: a wrong file says which fields
    are missing, unknown or of the wrong kind (``where`` names it in the message)."""
    values = checked(Profile, fields, where, by_caller=("across_nodes", "matmul_rates"))
    values["collectives"] = _curves(values.get("collectives", {}))
    rates = values.get("matmul_rates", {})
    if not isinstance(rates, dict):
        raise ProfileError(f"{where}: matmul_rates must be an object by matmul class")
    values["matmul_rates"] = {
        c: MatmulRate(**checked(MatmulRate, rate, f"{where}: matmul_rates {c}"))
        for c, rate in rates.items()
    }
    if values.get("across_nodes") is not None:
        where_level = f"{where}: across_nodes"
        level = checked(Level, values["across_nodes"], where_level, nullable=LEVEL_NULLABLE)
        level["collectives"] = _curves(level.get("collectives", {}))
        values["across_nodes"] = Level(**level)
    return Profile(**values)


def _curves(value: dict[str, Any]) -> dict[str, dict[int, Curve]]:
    return {
        collective: {
            int(n): Curve(c["latency_s"], c["seconds_per_byte"], tuple(map(tuple, c["points"])))
            for n, c in curves.items()
        }
        for collective, curves in value.items()
    }


def save(profile: Profile, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(profile.as_json(), indent=1) + "\n")


def for_device(device_type: str) -> Profile:
    """The default when no profile is given: loopback gloo on CPU, H100 nodes on
    InfiniBand on CUDA (a group inside one node is priced as on ``h100-nvlink4``)."""
    return BUILTIN["h100-ib400" if device_type == "cuda" else "gloo-loopback"]
