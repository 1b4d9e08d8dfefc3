"""``commfuse sim``: what decomposition buys a real model's dense layer, without a cluster.

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
``tokens / n``. Every plain-TP row is a projection of the cost model."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

from ...cost.profiles import Profile
from ...cost.simulator import (
    SCHEDULES,
    Event,
    Timeline,
    Work,
    matmuls_s,
    predict,
    simulate,
)
from ...passes.plan import auto_schedule
from ...schedules import Direction
from ..trace import Process, Span, chrome_trace

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
        # block: t/n rows of the gathered input times the local weight columns (read whole)
        flops, weights = 2 * (t / n) * d * out_features / n, d * out_features / n * e
        return Work(Direction.GATHER, n, flops, t / n * d * e, matmuls, whole_bytes=weights)

    def reduce(in_features: float, terms: int) -> Work:
        # block: t/n rows of the local product, contracted over the local features
        flops, weights = 2 * (t / n) * in_features / n * d, in_features / n * d * e
        return Work(Direction.REDUCE, n, flops, t / n * d * e, terms, whole_bytes=weights)

    def grad_gather(features: float) -> Work:
        # dY gathered into dX = dY @ W (rows: W read whole) and dW = dY^T @ X (contracted)
        flops, weights = 2 * 2 * (t / n) * d * features / n, d * features / n * e
        return Work(Direction.GATHER, n, flops, t / n * d * e, 2, whole_bytes=weights)

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
    x = rows * d * e  # this rank's input, which column blocks and dW blocks read whole

    def scatter_heads(columns: int) -> Work:
        # mm_a2a: the product [S/n, columns] (K = hidden) exchanged whole; block j is
        # rank j's heads, a column block (each reads the input x whole)
        flops, message = 2 * rows * d * columns / n, rows * columns * e / n
        return Work(Direction.EXCHANGE_OUT, n, flops, message, whole_bytes=x)

    def gather_heads(columns: int, matmuls: int, whole: float) -> Work:
        # a2a_mm: the all-to-all's output [S/n, columns] (every head of this rank's tokens);
        # each matmul reading it, 2 x S/n x columns x hidden FLOPs: times the weight
        # (contract, over the heads: nothing read whole) or, backward, x^T times it (dW,
        # columns: x^T, ``whole``, read whole)
        flops = matmuls * 2 * rows * columns * d
        return Work(
            Direction.EXCHANGE_IN, n, flops / n, rows * columns * e / n, matmuls, whole_bytes=whole
        )

    return [
        ("forward q projection", scatter_heads(q)),
        ("forward k projection", scatter_heads(kv)),
        ("forward v projection", scatter_heads(kv)),
        ("forward attention output", gather_heads(q, 1, 0.0)),
        ("backward attention output grads", scatter_heads(q)),
        ("backward q grads (dX, dW)", gather_heads(q, 2, x)),
        ("backward k grads (dX, dW)", gather_heads(kv, 2, x)),
        ("backward v grads (dX, dW)", gather_heads(kv, 2, x)),
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
        """Per site, what ``schedule="auto"`` picks on this profile (``plan.auto_schedule``)."""
        total = 0.0
        for _, timelines in self.sites:
            total += timelines[auto_schedule(timelines)].end_s
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
        whole_auto_s=free + sum(t[auto_schedule(t)].end_s for t in whole) + tokens_whole,
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
