"""``commfuse bench``'s whole-block figure: a transformer block's training step (forward +
backward), compiled with the pass and without it (the same compile with
``schedule="off"``), on a link whose rate makes the baseline's communication a given
multiple of its compute. The blocks are training's (``training.fronts``), and a
capacity-MoE layer of the bench's own (:class:`CapacityMoE`, front "moe")."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ... import report
from . import figures
from .cells import interleaved
from .config import BlockShape, Progress, Variant
from .link import MAX_RATE_TRIES, RATE_TOLERANCE, REFERENCE_RATE, LinkProfiles


@dataclasses.dataclass(frozen=True)
class BlockBench:
    """A whole-block figure: the block, its rows, how they are timed and on what ranks."""

    shape: BlockShape
    ratio: float  # communication / compute of the baseline's step (sets the link rate)
    schedules: tuple[str, ...] | None  # rows (labels of ``variants()``; None: every row)
    reps: int
    world_size: int | None = None  # ranks of its own (None: the run's)
    key: str = "block"  # in results.json, and its profile's file name


# ----------------------------------------------------------------------------------------
# The capacity-MoE layer (GShard, DeepSpeed's ``MOELayer`` with ``top2gating``, Tutel)


class _AllToAll(torch.autograd.Function):
    """DeepSpeed's ``_AllToAll``: equal splits of dim 0 over the group, into
    ``torch.empty_like``; the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def _top2(logits: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GShard's top-2 gating without noise: ``logits [S, E]`` to (load-balancing loss,
    combine weights ``[S, E, C]``); a token's slot in an expert is the count of tokens
    routed to it before (every first choice before any second), dropped at ``capacity``."""
    gates = F.softmax(logits, dim=1)
    e = gates.shape[1]
    mask1 = F.one_hot(gates.argmax(1), e)
    mask2 = F.one_hot(logits.masked_fill(mask1.bool(), float("-inf")).argmax(1), e)
    slot1 = torch.cumsum(mask1, 0) - 1
    slot2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)
    l_aux = (gates.mean(0) * mask1.float().mean(0)).mean() * e * e
    mask1, mask2 = mask1 * (slot1 < capacity), mask2 * (slot2 < capacity)
    g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    combine = torch.zeros(())
    for g, mask, slot in ((g1, mask1, slot1), (g2, mask2, slot2)):
        at = F.one_hot((slot * mask).sum(1), capacity).float()  # [S, C]
        combine = combine + torch.einsum("se,sc->sec", (g / denom)[:, None] * mask, at)
    return l_aux, combine


class CapacityMoE(nn.Module):
    """One pre-norm capacity-MoE layer under expert parallelism over the whole group, as
    DeepSpeed's ``MOELayer`` writes it, and its loss: ``forward(x, target)`` = the mean
    squared error of ``x + moe(norm(x))`` plus 0.01 x the load-balancing loss. This
    rank routes its own tokens ``[S, D]`` (top-2 softmax router, replicated, capacity
    ``C = 2S / E``), dispatches them by ``einsum("sec,sm->ecm")`` to ``[E, C, D]``,
    all-to-alls them (``_AllToAll``), regroups ``[n, E_local, C, D]`` to ``[E_local, n C,
    D]`` for its ``E_local`` experts (``bmm`` with ``w1 [E_local, D, F]``, GELU, ``bmm``
    with ``w2``), regroups back, all-to-alls the results home and combines them with the
    gate weights (``einsum("sec,ecm->sm")``). Every parameter from one seed: the router
    and norm equal on every rank, rank r's experts the r-th ``E_local`` of the set."""

    def __init__(self, shape: BlockShape, rank: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.n, self.local, self.experts = n, shape.experts, n * shape.experts
        self.capacity = max(-(-2 * shape.seq // self.experts), 1)
        self.norm = nn.LayerNorm(shape.dim)
        self.gate = nn.Linear(shape.dim, self.experts, bias=False)
        mine = slice(rank * self.local, (rank + 1) * self.local)
        d, f = shape.dim, shape.hidden
        self.w1 = nn.Parameter((torch.randn(self.experts, d, f) / math.sqrt(d))[mine].clone())
        self.w2 = nn.Parameter((torch.randn(self.experts, f, d) / math.sqrt(f))[mine].clone())

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        group, n, e, c = dist.group.WORLD, self.n, self.local, self.capacity
        tokens = self.norm(x)
        d = tokens.shape[1]
        l_aux, combine = _top2(self.gate(tokens), c)
        dispatched = torch.einsum("sec,sm->ecm", combine.bool().type_as(tokens), tokens)
        dispatched = _AllToAll.apply(group, dispatched)  # block j: rank j's tokens
        h = dispatched.reshape(n, e, c, d).transpose(0, 1).reshape(e, n * c, d)
        h = torch.bmm(F.gelu(torch.bmm(h, self.w1)), self.w2)
        h = h.reshape(e, n, c, d).transpose(0, 1).reshape(n * e, c, d)
        h = _AllToAll.apply(group, h)  # back to the tokens' ranks
        out = x + torch.einsum("sec,ecm->sm", combine.type_as(tokens), h)
        return F.mse_loss(out, target) + 0.01 * l_aux


def _moe_setup(shape: BlockShape, rank: int, n: int) -> Any:
    """The MoE layer as ``fronts.build`` gives a block: its loss module and this rank's
    (tokens, target) per step."""
    module = CapacityMoE(shape, rank, n)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(2, shape.seq, shape.dim, generator=gen).unbind(0)  # type: ignore[return-value]

    return SimpleNamespace(loss_module=module, inputs=inputs)


# ----------------------------------------------------------------------------------------
# On the ranks

_BLOCK: dict[str, Any] = {}  # this rank's compiled block variants, kept between jobs


@dataclasses.dataclass(frozen=True)
class BlockJob:
    shape: BlockShape
    rows: tuple[Variant, ...]
    profile: str | None


def block_compile(rank: int, n: int, job: BlockJob) -> dict[str, dict[str, Any]]:
    """Job: build the block once per row, compile it (eager inner compiler) and run one
    step (which compiles forward and backward); returns the pass's sites per row."""
    from ..training.fronts import TrainConfig, build
    from ..training.loop import summarize

    torch._dynamo.config.recompile_limit = 64  # one entry per row, same code objects
    shape = job.shape

    def setup_of() -> Any:
        if shape.front == "moe":
            return _moe_setup(shape, rank, n)
        cfg = TrainConfig(
            front=shape.front,
            tp=shape.tp,
            blocks=1,
            dim=shape.dim,
            heads=shape.heads,
            hidden=shape.hidden,
            batch=shape.batch,
            seq=shape.seq,
            sequence_parallel=shape.sequence_parallel,
        )
        return build(cfg, rank, n)

    sites = {}
    for row in job.rows:
        setup = setup_of()
        options = {**row.options(job.profile), "inner": "eager"}
        compiled = torch.compile(setup.loss_module, backend="commfuse", options=options)
        x, target = setup.inputs(0)

        def step(compiled: Any = compiled, x: Any = x, target: Any = target, setup: Any = setup):
            compiled(x, target).backward()
            setup.loss_module.zero_grad(set_to_none=True)

        first = len(report.REPORT.sites)
        step()
        _BLOCK[row.label] = step
        found = [s.as_json() for s in report.REPORT.sites[first:]]
        sites[row.label] = {
            "rewritten": sum(s["decision"] == "rewritten" for s in found),
            "found": len(found),
            "schedules": sorted({s["schedule"] for s in found if s["decision"] == "rewritten"}),
            "summary": [dataclasses.asdict(r) for r in summarize(found)],
        }
    return sites


def block_times(rank: int, n: int, labels: list[str], warmup: int, reps: int) -> dict[str, Any]:
    """Job: the compiled rows' steps, interleaved."""
    return interleaved({label: _BLOCK[label] for label in labels}, warmup, reps)


# ----------------------------------------------------------------------------------------
# In the parent


def run_block(
    spec: BlockBench,
    network: Any,
    ranks: Any,
    base: LinkProfiles,
    rows: list[Variant],
    out: Path,
    progress: Progress,
) -> dict[str, Any]:
    """The block's step, with and without the pass, on a link whose rate makes the
    baseline's communication ``spec.ratio`` times its compute."""

    shape = spec.shape.fitted(ranks.world_size)  # the same shape where n divides it
    block_rows = [v for v in rows if spec.schedules is None or v.label in spec.schedules]
    baseline, others = block_rows[0], block_rows[1:]
    progress.stage(
        f"{spec.key} {shape.label} ({shape.mesh(ranks.world_size)}): compiling the baseline"
    )
    network.set_rate(None)
    sites = ranks.run(block_compile, BlockJob(shape, (baseline,), None))[0]
    label = baseline.label

    def step_s(rate: float | None) -> float:
        network.set_rate(rate)
        return figures.slowest(ranks.run(block_times, [label], 0, 1))[label][0]

    rate = math.inf
    compute_s = statistics.median(step_s(None) for _ in range(3))
    if network.topology != "none":
        # The step's communication = throttled minus unthrottled step, alternated so that
        # both see the same machine; then the rate that makes it the target.
        rate = REFERENCE_RATE
        for _ in range(MAX_RATE_TRIES):
            progress.stage(f"{spec.key}: communication at {rate / 1e6:.0f} Mbit/s")
            pairs = [(step_s(None), step_s(rate)) for _ in range(3)]
            compute_s = statistics.median(free for free, _ in pairs)
            comm_s = statistics.median(slow - free for free, slow in pairs)
            target = spec.ratio * compute_s
            if abs(comm_s / target - 1) <= 2 * RATE_TOLERANCE:
                break
            rate *= min(max(comm_s / target, 1 / 8), 8)
        network.set_rate(rate)
    profile = base.file(rate, out / "profiles" / f"{spec.key}.json")
    progress.stage(f"{spec.key}: compiling {', '.join(v.label for v in others)}")
    sites.update(ranks.run(block_compile, BlockJob(shape, tuple(others), profile))[0])
    progress.stage(f"{spec.key}: {len(block_rows)} rows x 1+{spec.reps} at {rate / 1e6:.0f} Mbit/s")
    labels = [v.label for v in block_rows]
    times = figures.slowest(ranks.run(block_times, labels, 1, spec.reps))
    block = figures.block_result(
        shape, rate, compute_s, times, sites, spec.ratio, ranks.world_size, os.cpu_count()
    )
    progress.echo(figures.format_block(block))
    return block
