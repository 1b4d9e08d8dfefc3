"""``commfuse sim``: what decomposition buys a real model's layer, without a cluster.

A preset is a transformer's layer shapes. Under tensor + sequence parallelism on n
ranks, one layer's training step has eight sites (the same the pass finds in traced
DTensor graphs): forward, the all-gathered input into q/k/v and into the MLP's input
projections, and the attention output and MLP output projections into reduce-scatters;
backward, the gradients of the two output projections all-gathered into dX (rows) and
dW (contracted) on one ring each, and the input gradients of q/k/v and of the MLP's
input projections (sums of matmuls) into reduce-scatters. Each site is simulated for
every schedule on a machine profile.

Under Ulysses sequence parallelism (UP) every rank holds the whole model and ``S / n``
tokens, and the layer has eight all-to-all sites around attention (``ulysses_sites``):
forward, the q, k and v projections into all-to-alls (``mm_a2a``) and the attention
output's all-to-all into the output projection (``a2a_mm``, contracting over the heads);
backward, the mirror: the output projection's input gradient into an all-to-all, and the
all-to-alls of dq, dk and dv into their input (contract) and weight (columns) gradients.
Each is simulated for the collective and the schedules with all-to-all steps (the ring's
pairwise order).

Under plain tensor parallelism (no sequence parallelism: every rank holds every token,
an all-reduce after each row-parallel linear, ``plain_tp``) the layer is written with four
all-reduces (forward after the attention output and MLP output projections, backward
after the q/k/v and MLP input projections' input gradients), each followed by token-wise
work (the residual add and RMSNorm, or their backward) on all ``tokens``. The pass splits
each all-reduce into a reduce-scatter, the token-wise work on ``tokens / n`` and
all-gathers into the next matmuls, on the joint graph before AOTAutograd partitions it
(the backward's two input-gradient sums one reduce-scatter each): the same eight sites as
TP+SP, simulated above, and the region's saved activations (the norms' inputs) on
``tokens / n``. Every plain-TP row is a projection of the cost model.

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
import json
from collections.abc import Iterable
from pathlib import Path

from ..cost.profiles import Profile
from ..cost.simulator import (
    SCHEDULES,
    Event,
    Timeline,
    Work,
    _overlapped,
    matmuls_s,
    predict,
    simulate,
)
from ..passes.plan import auto_choice
from ..schedules import Direction, by_name
from .trace import Process, Span, chrome_trace

TRACE_RANKS = 8  # ranks written to a Chrome trace (all of them for n <= 8)
UP_SEQUENCES = (32768, 65536, 131072)  # the UP section's sequence lengths (32k, 64k, 128k)
UP_GROUP_SIZES = (2, 4, 8)  # Llama 3's 8 k/v heads: Ulysses needs n to divide them


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    source: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool  # SwiGLU: two input projections (gate, up) share the gathered input
    tokens: int  # sequence length x micro-batch of one step
    dtype_bytes: int = 2  # bf16


PRESETS = {
    "llama3-8b": ModelShape(
        "llama3-8b",
        "Llama 3 8B config: hidden 4096, 32 heads, 8 KV heads, head dim 128, FFN 14336 "
        "(SwiGLU), sequence 8192",
        4096,
        32,
        8,
        128,
        14336,
        True,
        8192,
    ),
    "llama3-70b": ModelShape(
        "llama3-70b",
        "Llama 3 70B config: hidden 8192, 64 heads, 8 KV heads, head dim 128, FFN 28672 "
        "(SwiGLU), sequence 8192",
        8192,
        64,
        8,
        128,
        28672,
        True,
        8192,
    ),
    "gpt3-175b": ModelShape(
        "gpt3-175b",
        "GPT-3 175B (Brown et al. 2020): hidden 12288, 96 heads of 128, FFN 4x hidden "
        "(GELU, one input projection), sequence 2048",
        12288,
        96,
        96,
        128,
        49152,
        False,
        2048,
    ),
}


def layer_sites(model: ModelShape, n: int) -> list[tuple[str, Work]]:
    """The layer's sites on a group of ``n`` ranks, as (name, Work), forward first."""
    t, d, e = model.tokens, model.hidden, model.dtype_bytes
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim
    attn = model.heads * model.head_dim
    projections = 2 if model.gated else 1

    def gather(out_features: float, matmuls: int) -> Work:
        # block: t/n rows of the gathered input times the local weight columns
        return Work(Direction.GATHER, n, 2 * (t / n) * d * out_features / n, t / n * d * e, matmuls)

    def reduce(in_features: float, terms: int) -> Work:
        # block: t/n rows of the local product, contracted over the local features
        return Work(Direction.REDUCE, n, 2 * (t / n) * in_features / n * d, t / n * d * e, terms)

    def grad_gather(features: float) -> Work:
        # dY gathered into dX = dY @ W (rows) and dW = dY^T @ X (contracted)
        return Work(Direction.GATHER, n, 2 * 2 * (t / n) * d * features / n, t / n * d * e, 2)

    return [
        ("forward attention q/k/v", gather(qkv, 3)),
        ("forward attention output", reduce(attn, 1)),
        ("forward MLP input", gather(projections * model.ffn, projections)),
        ("forward MLP output", reduce(model.ffn, 1)),
        ("backward MLP output grads", grad_gather(model.ffn)),
        ("backward MLP input grads", reduce(projections * model.ffn, projections)),
        ("backward attention output grads", grad_gather(attn)),
        ("backward q/k/v input grads", reduce(qkv, 3)),
    ]


def ulysses_problem(model: ModelShape, n: int) -> str | None:
    """Why ``model`` cannot run Ulysses on ``n`` ranks (None if it can): each all-to-all
    scatters whole heads, so n must divide the query heads and the k/v heads."""
    if model.heads % n or model.kv_heads % n:
        return (
            f"Ulysses on {n} ranks needs {n} to divide {model.name}'s {model.heads} heads "
            f"and {model.kv_heads} k/v heads"
        )
    return None


def ulysses_sites(model: ModelShape, n: int) -> list[tuple[str, Work]]:
    """The layer's Ulysses sites on ``n`` ranks, each holding ``model.tokens / n`` tokens,
    as (name, Work), forward first, counted as ``mm_a2a.work`` and ``a2a_mm.work`` count
    them: a block's FLOPs are 1/n of the site's matmuls, a message is 1/n of the exchanged
    tensor (so a rank sends (n-1)/n of it, the all-to-all's bytes)."""
    rows, d, e = model.tokens / n, model.hidden, model.dtype_bytes
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim

    def scatter_heads(columns: int) -> Work:
        # mm_a2a: the product [S/n, columns] (K = hidden) exchanged whole; block j is
        # rank j's heads, a column block
        return Work(Direction.EXCHANGE_OUT, n, 2 * rows * d * columns / n, rows * columns * e / n)

    def gather_heads(columns: int, matmuls: int) -> Work:
        # a2a_mm: the all-to-all's output [S/n, columns] (every head of this rank's tokens);
        # each matmul reading it, 2 x S/n x columns x hidden FLOPs: times the weight
        # (contract, over the heads) or, backward, x^T times it (dW, columns)
        flops = matmuls * 2 * rows * columns * d
        return Work(Direction.EXCHANGE_IN, n, flops / n, rows * columns * e / n, matmuls)

    return [
        ("forward q projection", scatter_heads(q)),
        ("forward k projection", scatter_heads(kv)),
        ("forward v projection", scatter_heads(kv)),
        ("forward attention output", gather_heads(q, 1)),
        ("backward attention output grads", scatter_heads(q)),
        ("backward q grads (dX, dW)", gather_heads(q, 2)),
        ("backward k grads (dX, dW)", gather_heads(kv, 2)),
        ("backward v grads (dX, dW)", gather_heads(kv, 2)),
    ]


@dataclasses.dataclass
class LayerResult:
    n: int
    sites: list[tuple[str, dict[str, Timeline]]]  # per site, per schedule

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules simulated at every site, in ``SCHEDULES`` order."""
        return tuple(s for s in SCHEDULES if all(s in t for _, t in self.sites))

    def total_s(self, schedule: str) -> float:
        return sum(timelines[schedule].end_s for _, timelines in self.sites)

    def auto_s(self) -> float:
        """Per site, what ``schedule="auto"`` picks on this profile (``plan.auto_choice``)."""
        total = 0.0
        for _, timelines in self.sites:
            times = {k: t.end_s for k, t in timelines.items()}
            total += times[auto_choice(times)]
        return total


def simulate_layer(model: ModelShape, n: int, profile: Profile, slices: int) -> LayerResult:
    sites = [
        (name, {s: simulate(work, s, profile, slices) for s in SCHEDULES})
        for name, work in layer_sites(model, n)
    ]
    return LayerResult(n, sites)


def simulate_ulysses(model: ModelShape, n: int, profile: Profile) -> LayerResult:
    """Each Ulysses site for the collective and every schedule with all-to-all steps."""
    return LayerResult(n, [(name, predict(w, profile)) for name, w in ulysses_sites(model, n)])


# Memory passes over a [tokens, hidden] tensor of the token-wise work after one all-reduce:
# the residual add (two reads, a write) and RMSNorm (a read for the statistics, a read and
# a write to scale); the backward's is taken to be the same.
TOKEN_WISE_PASSES = 6


def token_wise_s(model: ModelShape, tokens: float, profile: Profile) -> float:
    """The residual add and RMSNorm after one all-reduce, on ``tokens`` tokens: memory
    bound, at the profile's ``memory_bytes_per_s``."""
    nbytes = tokens * model.hidden * model.dtype_bytes
    return TOKEN_WISE_PASSES * nbytes / profile.memory_bytes_per_s


@dataclasses.dataclass
class PlainTpResult:
    """One layer under plain TP on ``n`` ranks: as written (four all-reduces, token-wise
    work on every token), with the all-reduce sites rewritten whole (``mm_ar``: the
    reduce-scatter half as a ring, then the all-gather; no split) and split (``split``:
    TP+SP's eight sites, token-wise work on 1/n of the tokens)."""

    n: int
    all_reduce_s: float  # as written: the matmuls, 4 all-reduces, token-wise on all tokens
    whole_auto_s: float  # the 4 all-reduce sites rewritten as they stand, auto per site
    token_wise_whole_s: float  # of the 4 all-reduces' token-wise work, on all tokens
    token_wise_shard_s: float  # the same on tokens / n
    split: LayerResult  # the split's eight sites (as the TP+SP section)
    saved_whole_bytes: float  # the region's activations saved for the backward, per rank
    saved_shard_bytes: float  # the same, split: this rank's tokens

    def split_s(self, schedule: str) -> float:
        return self.split.total_s(schedule) + self.token_wise_shard_s

    def split_auto_s(self) -> float:
        return self.split.auto_s() + self.token_wise_shard_s


def simulate_plain_tp(
    model: ModelShape, n: int, profile: Profile, slices: int, split: LayerResult | None = None
) -> PlainTpResult:
    """The plain-TP layer on ``n`` ranks (``split``: the TP+SP layer's result, if already
    simulated). An all-reduce is timed as the cost model times the pass's ``mm_ar``
    sites: a reduce-scatter then an all-gather of the same blocks (``then_gather``)."""
    split = split or simulate_layer(model, n, profile, slices)
    sites = [w for _, w in layer_sites(model, n)]
    reduces = [dataclasses.replace(w, then_gather=True) for w in sites if w.direction == "reduce"]
    free = sum(matmuls_s(w, profile) for w in sites if w.direction == "gather")  # no comm
    whole = [predict(w, profile, slices) for w in reduces]
    tokens_whole = len(reduces) * token_wise_s(model, model.tokens, profile)
    return PlainTpResult(
        n,
        all_reduce_s=free + sum(t["collective"].end_s for t in whole) + tokens_whole,
        whole_auto_s=free
        + sum(t[auto_choice({k: x.end_s for k, x in t.items()})].end_s for t in whole)
        + tokens_whole,
        token_wise_whole_s=tokens_whole,
        token_wise_shard_s=len(reduces) * token_wise_s(model, model.tokens / n, profile),
        split=split,
        saved_whole_bytes=region_saved_bytes(model, model.tokens),
        saved_shard_bytes=region_saved_bytes(model, model.tokens / n),
    )


# What the backward reads of a layer's token-wise region, per token and hidden unit: the
# inputs of the two RMSNorms (the residual stream before attention and before the MLP);
# their statistics (one value per token) are left out.
REGION_SAVED = 2


def region_saved_bytes(model: ModelShape, tokens: float) -> float:
    """The token-wise region's activations a layer saves for the backward, on ``tokens``."""
    return REGION_SAVED * tokens * model.hidden * model.dtype_bytes


def format_plain_tp(model: ModelShape, profile: Profile, results: list[PlainTpResult]) -> str:
    """One line per n: the plain-TP layer (fwd + bwd sites) as written, rewritten whole and
    split, in us (speedup over as written)."""
    schedules = results[0].split.schedules
    columns = ["all-reduce", "whole, auto", *(f"split {s}" for s in schedules), "split auto"]
    lines = [
        f"{model.name} under PLAIN TP (no sequence parallelism), tokens {model.tokens}, "
        f"profile {profile.name}: the layer's matmuls and 4 all-reduces (fwd + bwd) in us "
        "(speedup over the all-reduce as written); PROJECTIONS of the cost model",
        "  all-reduce = as written: each all-reduce timed as a reduce-scatter + an "
        "all-gather of the same blocks, then the residual add + RMSNorm on every token;",
        "  whole, auto = each all-reduce site rewritten as it stands (mm_ar: the "
        "reduce-scatter half overlapped, the all-gather after), auto per site;",
        "  split <schedule> = the pass's split: the TP+SP section's 8 sites with that "
        "schedule, the residual add + RMSNorm on tokens / n (split collective: no overlap)",
        f"{'n':>4}{'token-wise us':>16}" + "".join(f"{c:>22}" for c in columns),
    ]
    for r in results:
        base = r.all_reduce_s
        times = [base, r.whole_auto_s, *(r.split_s(s) for s in schedules), r.split_auto_s()]
        lines.append(
            f"{r.n:>4}{r.token_wise_whole_s * 1e6:>7.1f} -> {r.token_wise_shard_s * 1e6:<6.1f}"
            + "".join(f"{t * 1e6:>14.1f} ({base / t:4.2f}x)" for t in times)
        )
    saved = ", ".join(f"n={r.n} {r.saved_shard_bytes / 1e6:.1f}" for r in results)
    lines.append(
        f"  saved for the backward by a layer's token-wise region (the norms' inputs) per "
        f"rank: {results[0].saved_whole_bytes / 1e6:.1f} MB as written, split {saved} MB"
    )
    return "\n".join(lines)


def layer_timeline(result: LayerResult, schedule: str) -> Timeline:
    """The layer's sites one after the other on every rank (the first ``TRACE_RANKS``)."""
    events, offset = [], 0.0
    for name, timelines in result.sites:
        timeline = timelines[schedule]
        for e in timeline.events:
            if e.rank < TRACE_RANKS:
                events.append(
                    Event(
                        e.rank,
                        e.lane,
                        e.step,
                        f"{name}: {e.name}",
                        offset + e.start_s,
                        offset + e.end_s,
                    )
                )
        offset += timeline.end_s
    return Timeline(schedule, events)


def format_table(
    model: ModelShape, profile: Profile, results: list[LayerResult], title: str = "layer"
) -> str:
    lines = [f"{model.name} {title}, tokens {model.tokens}, profile {profile.name}"]
    for result in results:
        base = result.total_s("collective")
        lines.append(f"\nn = {result.n}: time per site in us (speedup over the collective)")
        header = f"{'site':<34}" + "".join(f"{s:>20}" for s in result.schedules)
        lines += [header, "-" * len(header)]
        for name, timelines in result.sites:
            coll = timelines["collective"].end_s
            cells = "".join(
                f"{t.end_s * 1e6:>12.1f} ({coll / t.end_s:4.2f}x)" for t in timelines.values()
            )
            lines.append(f"{name:<34}{cells}")
        cells = "".join(
            f"{result.total_s(s) * 1e6:>12.1f} ({base / result.total_s(s):4.2f}x)"
            for s in result.schedules
        )
        lines.append(f"{'layer (fwd + bwd sites)':<34}{cells}")
        auto = result.auto_s()
        lines.append(
            f"{'layer, auto (best per site)':<34}{auto * 1e6:>12.1f} ({base / auto:4.2f}x)"
        )
    return "\n".join(lines)


def format_ulysses_summary(
    model: ModelShape, profile: Profile, results: dict[int, list[LayerResult]]
) -> str:
    """One line per (sequence, n): the layer's Ulysses sites, fwd + bwd, per schedule and
    with ``auto``'s choice per site; ``results`` by sequence length."""
    schedules = next(iter(results.values()))[0].schedules
    lines = [
        f"{model.name} under Ulysses (UP), profile {profile.name}: the layer's all-to-all "
        "sites (fwd + bwd) in us (speedup over the collective)",
        f"{'sequence':>10}{'n':>4}" + "".join(f"{s:>20}" for s in (*schedules, "auto")),
    ]
    for seq, per_n in results.items():
        for result in per_n:
            base = result.total_s("collective")
            times = [result.total_s(s) for s in schedules] + [result.auto_s()]
            lines.append(
                f"{seq:>10}{result.n:>4}"
                + "".join(f"{t * 1e6:>12.1f} ({base / t:4.2f}x)" for t in times)
            )
    return "\n".join(lines)


def write_traces(results: list[LayerResult], out: Path, prefix: str = "trace") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for result in results:
        path = out / f"{prefix}_n{result.n}.json"
        write_trace(((s, layer_timeline(result, s)) for s in result.schedules), path)
        written.append(path)
    return written


def write_trace(timelines: Iterable[tuple[str, Timeline]], path: Path) -> None:
    """One Chrome trace of labelled timelines: a process per (label, rank), numbered
    1000 x the label's position + the rank so that the ranks of a label stay together."""
    processes = [
        Process(
            1000 * index + rank,
            f"{label} rank {rank}",
            [
                Span(e.lane, e.name, label, e.start_s * 1e6, e.end_s * 1e6, {"step": e.step})
                for e in timeline.on_rank(rank)
            ],
        )
        for index, (label, timeline) in enumerate(timelines)
        for rank in sorted({e.rank for e in timeline.events})
    ]
    path.write_text(json.dumps(chrome_trace(processes)))


# ----------------------------------------------------------------------------------------
# Mixture-of-Experts expert parallelism (MOE): projections, nothing here is measured


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


Sends = list[tuple[int, float]]  # (destination rank, bytes)


def _leaving_s(p: Profile, sizes: list[float]) -> list[float]:
    """How long each of a step's messages takes when they leave one rank together: behind
    one port they share it fairly, so a message of b bytes ends once the port has moved
    min(b, b') of every message b' (``Profile.message_s`` when all are the same size; a
    small message no longer slows a large one for its whole length)."""
    if p.duplex_neighbours:
        return [p.message_s(b) for b in sizes]
    return [p.link_alpha_s + sum(min(o, b) for o in sizes) / p.link_bytes_per_s for b in sizes]


def _steps_gather_like(
    n: int, p: Profile, sends: list[list[Sends]], compute: list[list[float]]
) -> float:
    """``_p2p_gather``'s timing with a size per message and per block: each step issues
    its messages and computes the blocks at hand under them. Returns the end."""
    now = [0.0] * n
    for s in range(len(sends[0])):
        issue = [now[r] + (p.step_overhead_s if sends[r][s] else 0.0) for r in range(n)]
        done = list(issue)
        for r in range(n):
            spans = _leaving_s(p, [nbytes for _, nbytes in sends[r][s]])
            for (dst, _), t in zip(sends[r][s], spans, strict=True):
                end = max(issue[r], issue[dst]) + t
                done[r], done[dst] = max(done[r], end), max(done[dst], end)
        for r in range(n):
            took = _overlapped(compute[r][s], done[r] - issue[r], p.overlap_slowdown)
            done[r] = max(done[r], issue[r] + took)
        now = done
    return max(now)


def _steps_reduce_like(
    n: int, p: Profile, sends: list[list[Sends]], compute: list[list[float]]
) -> float:
    """``_p2p_reduce``'s timing (no adds) with a size per message and per block: each step
    computes its block under the messages before, then sends it. Returns the end."""
    now, arrivals = [0.0] * n, [0.0] * n
    for s in range(len(sends[0])):
        ready = []
        for r in range(n):
            took = _overlapped(compute[r][s], arrivals[r] - now[r], p.overlap_slowdown)
            added = max(now[r] + took, arrivals[r])
            ready.append(added + (p.step_overhead_s if sends[r][s] else 0.0))
        arrivals = list(ready)
        for r in range(n):
            spans = _leaving_s(p, [nbytes for _, nbytes in sends[r][s]])
            for (dst, _), t in zip(sends[r][s], spans, strict=True):
                end = max(ready[r], ready[dst]) + t
                arrivals[dst], arrivals[r] = max(arrivals[dst], end), max(arrivals[r], end)
        now = ready
    return max(arrivals + now)


def moe_sites_ring_s(model: MoeShape, routing: list[list[float]], p: Profile) -> float:
    """The two sites on the ring's pairwise steps (``ring.exchange_in_steps`` then
    ``exchange_out_steps``) with each block's own rows, the SwiGLU between them on all
    of a rank's rows. With balanced ``routing`` it is the simulator's ring."""
    n, row_bytes = len(routing), model.hidden * model.dtype_bytes
    ring = by_name("ring")
    sends: list[list[Sends]] = [[] for _ in range(n)]
    compute: list[list[float]] = [[] for _ in range(n)]
    for r in range(n):
        for step in ring.steps(Direction.EXCHANGE_IN, r, n, 0):
            sends[r].append(
                [((r + t.peer) % n, routing[r][t.block] * row_bytes) for t in step.sends]
            )
            compute[r].append(
                sum(p.matmul_s(_gate_up_flops(model, routing[b][r])) for b in step.compute)
            )
    dispatch = _steps_gather_like(n, p, sends, compute)
    sends, compute = [[] for _ in range(n)], [[] for _ in range(n)]
    for r in range(n):
        for step in ring.steps(Direction.EXCHANGE_OUT, r, n, 0):
            # block b: the down projection of the rows rank b sent here, sent back to b
            sends[r].append(
                [((r + t.peer) % n, routing[t.block][r] * row_bytes) for t in step.sends]
            )
            compute[r].append(
                sum(p.matmul_s(_down_flops(model, routing[b][r])) for b in step.blocks)
            )
    combine = _steps_reduce_like(n, p, sends, compute)
    received = max(sum(routing[src][r] for src in range(n)) for r in range(n))
    return dispatch + moe_activation_s(model, received, p) + combine


def moe_fused_s(model: MoeShape, routing: list[list[float]], p: Profile) -> float:
    """The fused site, a projection (no site kind does it): in the pairwise order, step s
    in 1..n-1 runs the whole expert MLP (gate/up, SwiGLU, down) on the block from rank
    r - s while the block for step s + 1 arrives and the result of step s - 1 goes back to
    its sender. The rank's own block is split in halves, run in step 0 (under the first
    block's arrival: the head) and in step n (under the last result's return: the tail)."""
    n, row_bytes = len(routing), model.hidden * model.dtype_bytes

    def expert_mlp_s(rows: float) -> float:
        return (
            p.matmul_s(_gate_up_flops(model, rows))
            + moe_activation_s(model, rows, p)
            + p.matmul_s(_down_flops(model, rows))
        )

    sends: list[list[Sends]] = [[] for _ in range(n)]
    compute: list[list[float]] = [[] for _ in range(n)]
    for r in range(n):
        for s in range(n + 1):
            out: Sends = []
            if s <= n - 2:  # dispatch: this rank's rows for the rank s + 1 ahead
                dst = (r + s + 1) % n
                out.append((dst, routing[r][dst] * row_bytes))
            if s >= 2:  # combine: the result of step s - 1, back to its sender
                src = (r - s + 1) % n
                out.append((src, routing[src][r] * row_bytes))
            sends[r].append(out)
            own = s in (0, n)
            compute[r].append(expert_mlp_s(routing[r][r] / 2 if own else routing[(r - s) % n][r]))
    return _steps_gather_like(n, p, sends, compute)


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
