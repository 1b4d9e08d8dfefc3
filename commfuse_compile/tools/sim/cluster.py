"""``commfuse sim --parallelism cluster``: jobs that span nodes, each group priced by its
own level (``Profile.for_group``), as the pass prices a site's group: projections of the
cost model on a cluster profile (one with ``across_nodes``), not measurements.

Rows: Llama 3 70B with TP 8 inside a node; its sharded data parallelism (FSDP-style: each
weight all-gathered before its matmuls, forward and backward, each weight gradient
reduce-scattered) across 16 to 128 nodes, one rank per node in each group; TP 16 over 2
nodes; a DeepSeek-V3-like MoE layer with expert parallelism inside a node and across
nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ...cost.profiles import Profile
from ...cost.simulator import Work, predict
from ...passes.plan import auto_choice
from ...runtime.topology import Topology
from ...schedules import Direction
from .layer import PRESETS, LayerResult, ModelShape, simulate_layer
from .moe import MOE_PRESETS, simulate_moe

DP_NODES = (16, 32, 64, 128)
EP_SIZES = (8, 16, 32, 64)  # ranks of the expert-parallel group (8: one node)


@dataclasses.dataclass(frozen=True)
class ClusterRow:
    """One projected job: what runs, on which group, and its times in seconds."""

    job: str
    group: str  # its ranks: how many, on how many nodes
    level: str
    link: str  # the link a rank of the group gets: latency and bandwidth
    collective_s: float  # every site with its collective
    best: str  # the fastest fixed schedule over all sites
    best_s: float
    auto_s: float  # per site, what ``auto`` picks
    result: LayerResult | None = None  # the layer's timelines, for traces


def _group(n: int, per_node: int, stride: int = 1) -> tuple[list[int], str]:
    """The global ranks of a group of ``n`` taking every ``stride``-th rank, and its
    description."""
    ranks = list(range(0, n * stride, stride))
    nodes = len({r // per_node for r in ranks})
    return ranks, f"{n} ranks on {nodes} node{'s' if nodes > 1 else ''}"


def _priced(profile: Profile, ranks: list[int], per_node: int, all_pairs: bool) -> Profile:
    return profile.for_group(ranks, range(len(ranks)), Topology(per_node), all_pairs)


def _link(p: Profile) -> str:
    return f"{p.link_alpha_s * 1e6:.0f} us, {p.link_bytes_per_s / 1e9:.1f} GB/s"


def fsdp_sites(model: ModelShape, tp: int, n: int) -> list[tuple[str, Work]]:
    """One layer's sharded-DP sites on a group of ``n``: each TP rank's weight columns
    sharded over the group, gathered into the forward's and the backward's matmul (the
    TP-gathered ``tokens`` rows), its gradient reduce-scattered."""
    t, d, e = model.tokens, model.hidden, model.dtype_bytes
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim
    attn = model.heads * model.head_dim
    projections = 2 if model.gated else 1
    weights = {
        "q/k/v": (d, qkv / tp),
        "attention output": (attn / tp, d),
        "MLP input": (d, projections * model.ffn / tp),
        "MLP output": (model.ffn / tp, d),
    }
    sites = []
    for name, (d_in, d_out) in weights.items():
        flops, nbytes = 2 * t * d_in * d_out / n, d_in * d_out / n * e
        # a block is a weight shard: the forward reads the input x whole, the gradient
        # dY; the backward's dX = dY @ W^T contracts over the shards (nothing whole)
        forward = Work(Direction.GATHER, n, flops, nbytes, whole_bytes=t * d_in * e)
        gradient = Work(Direction.REDUCE, n, flops, nbytes, whole_bytes=t * d_out * e)
        sites += [
            (f"forward {name} weight gather", forward),
            (f"backward {name} weight gather", Work(Direction.GATHER, n, flops, nbytes)),
            (f"backward {name} gradient", gradient),
        ]
    return sites


def _row(job: str, group: str, level: str, p: Profile, result: LayerResult) -> ClusterRow:
    fixed = {s: result.total_s(s) for s in result.schedules if s != "collective"}
    best = min(fixed, key=fixed.__getitem__)
    return ClusterRow(
        job,
        group,
        level,
        _link(p),
        result.total_s("collective"),
        best,
        fixed[best],
        result.auto_s(),
        result,
    )


def cluster_rows(profile: Profile, slices: int = 2) -> list[ClusterRow]:
    """Every projected job on ``profile`` (which must have ``across_nodes``)."""
    per_node = profile.ranks_per_node or 8
    llama = PRESETS["llama3-70b"]
    rows = []
    for n, level in ((8, "node"), (16, "nodes")):
        ranks, group = _group(n, per_node)
        p = _priced(profile, ranks, per_node, all_pairs=False)
        result = simulate_layer(llama, n, p, slices)
        rows.append(_row(f"llama3-70b layer, TP+SP {n}", group, level, p, result))
    for nodes in DP_NODES:
        ranks, group = _group(nodes, per_node, stride=per_node)  # TP rank 0 of each node
        p = _priced(profile, ranks, per_node, all_pairs=False)
        sites = [(name, predict(w, p, slices)) for name, w in fsdp_sites(llama, 8, nodes)]
        job = f"llama3-70b layer, sharded DP over {nodes} nodes (TP 8 inside)"
        rows.append(_row(job, group, "nodes", p, LayerResult(nodes, sites)))
    moe = MOE_PRESETS["deepseek-v3-moe"]
    for n in EP_SIZES:
        ranks, group = _group(n, per_node)
        p = _priced(profile, ranks, per_node, all_pairs=True)
        r = simulate_moe(moe, n, p)
        times = {"collective": r.baseline_s, "ring": r.sites_ring_s}
        auto = times[auto_choice(times)]
        level = "node" if n <= per_node else "nodes"
        rows.append(
            ClusterRow(
                f"{moe.name} routed experts, EP {n}",
                group,
                level,
                _link(p),
                r.baseline_s,
                "ring",
                r.sites_ring_s,
                auto,
            )
        )
    return rows


def format_cluster(profile: Profile, rows: Iterable[ClusterRow]) -> str:
    lines = [
        f"JOBS THAT SPAN NODES on profile {profile.name} ({profile.ranks_per_node or 8} "
        "ranks per node): PROJECTIONS of the cost model, not measurements. Each group is "
        "priced by its level: inside a node the node's link, across nodes the NIC shared "
        "by the node's ranks sending through it at once. Times per layer (one step's "
        "sites; MoE: its routed experts, forward), in ms.",
        f"{'job':<58} {'group':<20} {'level':<6} {'link per rank':<20} "
        f"{'collective':>10} {'best fixed':>18} {'auto':>9} {'auto gain':>9}",
    ]
    for r in rows:
        best = f"{r.best} {r.best_s * 1e3:.2f}"
        lines.append(
            f"{r.job:<58} {r.group:<20} {r.level:<6} {r.link:<20} "
            f"{r.collective_s * 1e3:>10.2f} {best:>18} {r.auto_s * 1e3:>9.2f} "
            f"{r.collective_s / r.auto_s:>8.2f}x"
        )
    return "\n".join(lines)
