"""``commfuse sim --parallelism moe``: an MoE layer's expert parallelism, projected.

Under expert parallelism (MOE: each of n ranks holds experts / n routed experts and its
own tokens) an MoE layer's forward dispatches [tokens x top_k, hidden] rows with an
all-to-all, runs the expert MLP (gate/up, SwiGLU, down) on the rows it received and
sends the results back with a second all-to-all (``moe_sites``: ``a2a_mm`` into gate/up,
``mm_a2a`` out of down: what the pass does for a capacity layer's batched experts, equal
splits). The fused row is the pass's ``moe`` site, what it does for a dropless layer
(grouped GEMMs, uneven splits): each peer's block through the whole expert MLP and back.
Every MOE row is a projection of the cost model; ``simulate_moe`` says what each row
assumes.

"""

from __future__ import annotations

import dataclasses

from ...cost import steps
from ...cost.profiles import Profile
from ...cost.simulator import Work, simulate
from ...schedules import Direction, by_name

MOE_GROUP_SIZES = (4, 8)  # expert-parallel ranks of the MOE section
MOE_TOKENS = (4096, 8192)  # tokens per rank (before routing) of the MOE section
MOE_SKEW = 2.0  # the skewed rows: one peer gets this many times the average rows


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """One MoE layer's routed experts under expert parallelism: each of ``n`` ranks holds
    ``experts / n`` experts and ``tokens`` tokens, each routed to ``top_k`` experts."""

    name: str
    source: str
    hidden: int
    experts: int  # routed experts
    shared_experts: int  # run on every rank's own tokens: no communication
    ffn: int  # one expert's intermediate width (SwiGLU: gate and up of this width)
    top_k: int
    tokens: int  # per rank, before routing
    dtype_bytes: int = 2  # bf16

    @property
    def rows(self) -> int:
        """Rows a rank dispatches (its tokens, top_k copies each); balanced routing: also
        the rows it receives and runs through its experts."""
        return self.tokens * self.top_k


MOE_PRESETS = {
    "deepseek-v3-moe": MoeShape(
        "deepseek-v3-moe",
        "DeepSeek-V3 config (MoE layers): hidden 7168, 256 routed experts + 1 shared, "
        "expert FFN 2048 (SwiGLU), top-8 routing",
        7168,
        256,
        1,
        2048,
        8,
        4096,
    ),
    "mixtral-8x7b-moe": MoeShape(
        "mixtral-8x7b-moe",
        "Mixtral 8x7B config: hidden 4096, 8 experts, no shared expert, expert FFN 14336 "
        "(SwiGLU), top-2 routing",
        4096,
        8,
        0,
        14336,
        2,
        4096,
    ),
}


def moe_problem(model: MoeShape, n: int) -> str | None:
    """Why ``model``'s experts cannot be split evenly over ``n`` ranks (None if they can)."""
    if model.experts % n:
        return f"expert parallelism on {n} ranks needs {n} to divide {model.name}'s " + (
            f"{model.experts} routed experts"
        )
    return None


def _gate_up_flops(model: MoeShape, rows: float) -> float:
    return 2 * rows * model.hidden * 2 * model.ffn  # [rows, hidden] @ [hidden, 2 x ffn]


def _down_flops(model: MoeShape, rows: float) -> float:
    return 2 * rows * model.ffn * model.hidden  # [rows, ffn] @ [ffn, hidden]


def moe_activation_s(model: MoeShape, rows: float, profile: Profile) -> float:
    """SwiGLU between the expert GEMMs, memory bound: read [rows, 2 x ffn], write
    [rows, ffn]."""
    return 3 * rows * model.ffn * model.dtype_bytes / profile.memory_bytes_per_s


def moe_shared_s(model: MoeShape, profile: Profile) -> float:
    """The shared experts on the rank's own tokens (no communication; the same in every
    row, so left out of them and printed apart)."""
    if not model.shared_experts:
        return 0.0
    rows = model.tokens * model.shared_experts
    return (
        profile.matmul_s(_gate_up_flops(model, rows))
        + moe_activation_s(model, rows, profile)
        + profile.matmul_s(_down_flops(model, rows))
    )


def moe_sites(model: MoeShape, n: int, rows_per_block: float | None = None) -> list[Work]:
    """The dispatch and the combine as the pass's sites see them, balanced routing:
    ``a2a_mm`` (the dispatch all-to-all's output [rows, hidden] into the gate/up GEMM, one
    grouped call per block) and ``mm_a2a`` (the down GEMM's product [rows, hidden] into
    the combine all-to-all). Counted as ``a2a_mm.work`` / ``mm_a2a.work`` count: a
    block is 1/n of the exchanged tensor (a rank's rows for one peer) and 1/n of the
    FLOPs. ``rows_per_block``: another block size (the padded skewed rows)."""
    block = model.rows / n if rows_per_block is None else rows_per_block
    nbytes = block * model.hidden * model.dtype_bytes
    return [
        Work(Direction.EXCHANGE_IN, n, _gate_up_flops(model, block), nbytes),
        Work(Direction.EXCHANGE_OUT, n, _down_flops(model, block), nbytes),
    ]


def moe_routing(n: int, rows: float, skew: float = 1.0) -> list[list[float]]:
    """``routing[src][dst]``: rows rank ``src`` dispatches to rank ``dst``. Balanced:
    ``rows / n`` each. Skewed: each rank sends ``skew`` x the average to the next rank
    (its hot peer), keeps the average for itself and shares the rest evenly among its
    other n - 2 peers: every rank still sends, receives and runs the same rows as when
    balanced (the baseline and the limit are unchanged); only the blocks differ."""
    average = rows / n
    if n < 3 or skew == 1.0:
        return [[average] * n for _ in range(n)]
    rest = (rows - average - skew * average) / (n - 2)

    def block(src: int, dst: int) -> float:
        return average if dst == src else skew * average if dst == (src + 1) % n else rest

    return [[block(src, dst) for dst in range(n)] for src in range(n)]


def moe_sites_ring_s(model: MoeShape, routing: list[list[float]], p: Profile) -> float:
    """The two sites on the ring's pairwise steps (``ring.exchange_in_steps`` then
    ``exchange_out_steps``) with each block's own rows, the SwiGLU between them on all
    of a rank's rows. With balanced ``routing`` it is the simulator's ring."""
    n, row_bytes = len(routing), model.hidden * model.dtype_bytes
    ring = by_name("ring")
    sends: list[list[list[steps.Message]]] = [[] for _ in range(n)]
    compute: list[list[list[steps.Work]]] = [[] for _ in range(n)]
    for r in range(n):
        for step in ring.steps(Direction.EXCHANGE_IN, r, n, 0):
            sends[r].append(
                [((r + t.peer) % n, routing[r][t.block] * row_bytes) for t in step.sends]
            )
            compute[r].append(
                [
                    (f"gate/up {b}", p.matmul_s(_gate_up_flops(model, routing[b][r])))
                    for b in step.compute
                ]
            )
    dispatch = steps.gather_like("ring", p, sends, compute).end_s
    sends, compute = [[] for _ in range(n)], [[] for _ in range(n)]
    for r in range(n):
        for step in ring.steps(Direction.EXCHANGE_OUT, r, n, 0):
            # block b: the down projection of the rows rank b sent here, sent back to b
            sends[r].append(
                [((r + t.peer) % n, routing[t.block][r] * row_bytes) for t in step.sends]
            )
            compute[r].append(
                [(f"down {b}", p.matmul_s(_down_flops(model, routing[b][r]))) for b in step.blocks]
            )
    combine = steps.reduce_like("ring", p, sends, compute).end_s
    received = max(sum(routing[src][r] for src in range(n)) for r in range(n))
    return dispatch + moe_activation_s(model, received, p) + combine


def moe_fused_s(model: MoeShape, routing: list[list[float]], p: Profile) -> float:
    """The fused site, the pass's ``moe`` site as the cost model times it
    (``steps.round_trip``, the program its lowering runs): in the pairwise order, step s
    in 1..n-1 runs the whole expert MLP (gate/up, SwiGLU, down) on the block from rank
    r - s while the block for step s + 1 arrives and the result of step s - 1 goes back to
    its sender. The rank's own block is split in halves, run in step 0 (under the first
    block's arrival: the head) and in step n (under the last result's return: the tail)."""
    row_bytes = model.hidden * model.dtype_bytes
    sent = [[rows * row_bytes for rows in row] for row in routing]
    returned = [list(column) for column in zip(*sent, strict=True)]  # [dst][src]

    def experts_s(r: int, src: int, part: float) -> float:
        rows = routing[src][r] * part
        return (
            p.matmul_s(_gate_up_flops(model, rows))
            + moe_activation_s(model, rows, p)
            + p.matmul_s(_down_flops(model, rows))
        )

    return steps.round_trip(p, sent, returned, experts_s).end_s


def moe_limit_s(model: MoeShape, routing: list[list[float]], p: Profile) -> float:
    """The overlap limit: per rank, the larger of its link time (its busier direction's
    bytes at the link's bandwidth, no latency; with a link per peer, its busiest link's)
    and its compute (the expert MLP on all its
    rows, unsplit: the fewest calls); the slowest rank's. No schedule beats it here."""
    n, row_bytes = len(routing), model.hidden * model.dtype_bytes
    worst = 0.0
    for r in range(n):
        out = sum(routing[r][d] + routing[d][r] for d in range(n) if d != r) * row_bytes
        into = sum(routing[s][r] + routing[r][s] for s in range(n) if s != r) * row_bytes
        rows = sum(routing[s][r] for s in range(n))
        compute = (
            p.matmul_s(_gate_up_flops(model, rows))
            + moe_activation_s(model, rows, p)
            + p.matmul_s(_down_flops(model, rows))
        )
        if p.duplex_neighbours:  # a link per peer: the busiest one
            out = into = max(routing[r][d] + routing[d][r] for d in range(n) if d != r) * row_bytes
        worst = max(worst, max(out, into) / p.link_bytes_per_s, compute)
    return worst


@dataclasses.dataclass
class MoeResult:
    """One MoE layer's routed experts on ``n`` ranks, forward, every row in seconds;
    all are projections of the cost model."""

    tokens: int
    n: int
    baseline_s: float  # dispatch all-to-all, expert MLP, combine all-to-all, serialized
    sites_ring_s: float  # the pass's two sites (a2a_mm, mm_a2a) on the ring
    fused_s: float  # dispatch -> experts -> combine per peer, one site (projection)
    limit_s: float  # max(comm, compute)
    skew_padded_s: float  # skewed routing, the two sites with blocks padded to the largest
    skew_ring_s: float  # skewed routing, the two sites with uneven blocks
    skew_fused_s: float  # skewed routing, the fused site with uneven blocks
    skew_limit_s: float
    shared_s: float  # the shared expert(s), apart: the same in every row

    def rows(self) -> list[tuple[str, float]]:
        """(label, seconds) in printing order."""
        return [
            ("baseline: a2a, experts, a2a (serialized)", self.baseline_s),
            ("sites a2a_mm + mm_a2a, ring", self.sites_ring_s),
            ("fused dispatch-experts-combine per peer", self.fused_s),
            ("overlap limit max(comm, compute)", self.limit_s),
            (f"skew {MOE_SKEW:g}x: ring, padded to largest", self.skew_padded_s),
            (f"skew {MOE_SKEW:g}x: ring, uneven blocks", self.skew_ring_s),
            (f"skew {MOE_SKEW:g}x: fused, uneven blocks", self.skew_fused_s),
            (f"skew {MOE_SKEW:g}x: overlap limit", self.skew_limit_s),
        ]


def simulate_moe(model: MoeShape, n: int, profile: Profile) -> MoeResult:
    """Every MOE row of ``model`` on ``n`` ranks (``MoeResult``). The baseline and the
    balanced ring are the simulator's own (``simulate`` of ``moe_sites``); the skewed and
    fused rows time the same steps with each block's own rows. Skewed routing keeps every
    rank's load and bytes (``moe_routing``): the baseline's all-to-alls, timed by a rank's
    bytes, stay as balanced."""
    dispatch, combine = moe_sites(model, n)
    act = moe_activation_s(model, model.rows, profile)
    balanced = moe_routing(n, model.rows)
    skewed = moe_routing(n, model.rows, MOE_SKEW)
    largest = max(max(row) for row in skewed)
    padded_in, padded_out = moe_sites(model, n, largest)
    return MoeResult(
        tokens=model.tokens,
        n=n,
        baseline_s=simulate(dispatch, "collective", profile).end_s
        + act
        + simulate(combine, "collective", profile).end_s,
        sites_ring_s=simulate(dispatch, "ring", profile).end_s
        + act
        + simulate(combine, "ring", profile).end_s,
        fused_s=moe_fused_s(model, balanced, profile),
        limit_s=moe_limit_s(model, balanced, profile),
        skew_padded_s=simulate(padded_in, "ring", profile).end_s
        + moe_activation_s(model, n * largest, profile)
        + simulate(padded_out, "ring", profile).end_s,
        skew_ring_s=moe_sites_ring_s(model, skewed, profile),
        skew_fused_s=moe_fused_s(model, skewed, profile),
        skew_limit_s=moe_limit_s(model, skewed, profile),
        shared_s=moe_shared_s(model, profile),
    )


def format_moe(model: MoeShape, profile: Profile, results: list[MoeResult]) -> str:
    """The MOE section: per (tokens, n), every row in us with its speedup over the
    baseline, each marked a projection."""
    lines = [
        f"{model.name} under EXPERT PARALLELISM (MOE), profile {profile.name}: one MoE "
        "layer's routed experts, forward, in us (speedup over the baseline).",
        "  PROJECTIONS of the cost model, not measurements; two sites: a capacity "
        "layer's (a2a_mm, mm_a2a); fused: a dropless layer's (the moe site).",
        f"  {model.source}; bf16 rows of [tokens x top_k, hidden] dispatched and combined;",
        f"  skew: each rank sends {MOE_SKEW:g}x the average rows to one peer, the average to "
        "itself, the rest evenly (every rank's bytes and rows unchanged: so are the baseline "
        "and the limit)",
    ]
    for r in results:
        block = model.rows / r.n * model.hidden * model.dtype_bytes
        lines += [
            "",
            f"tokens {r.tokens} per rank, n = {r.n} ({model.experts // r.n} experts per rank, "
            f"a2a block {block / 2**20:.1f} MiB per peer, shared expert {r.shared_s * 1e6:.1f} "
            "us apart)",
        ]
        for label, t in r.rows():
            lines.append(f"  {label:<44}{t * 1e6:>10.1f} us ({r.baseline_s / t:4.2f}x)  projection")
    return "\n".join(lines)
