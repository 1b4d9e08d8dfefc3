"""The sites ``commfuse bench`` measures, built on each rank: one site at one size.

A site is a TP+SP linear's all-gather -> matmul or matmul -> reduce-scatter, a
Ulysses projection's matmul -> all-to-all or all-to-all -> matmul, or plain tensor
parallelism's row-parallel matmul -> all-reduce -> residual add + RMSNorm -> the next
column-parallel matmul (``mm_ar_mm``: the pass splits it into an ``mm_rs`` and an
``ag_mm`` site), or a capacity MoE's dispatch all-to-all -> batched experts -> combine
all-to-all (``a2a_experts_a2a``: an ``a2a_mm`` and an ``mm_a2a`` site, ``bmm``), or a
dropless MoE's token counts exchanged, ``.tolist()`` splits, uneven dispatch all-to-all
-> grouped-GEMM SwiGLU experts -> combine all-to-all (``a2a_gmm_a2a``: one ``moe`` site),
written as DTensor, Ulysses, DeepSpeed's ``MOELayer`` or torchtitan writes it and traced
to aten (the dropless one by Dynamo and AOTAutograd, its scalars captured). A linear's
weight is ``[out, in]``, read transposed, as ``nn.Linear`` holds it and ``F.linear`` reads
it (on this project's CI machine a few-row matmul reads a weight so laid out at half a
row-major one's rate: the decode cells are bound by it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...passes.fx.matmuls import rate_class
from .config import DROPLESS_KIND, EXPERTS_PER_RANK, MOE_KIND, SiteShape

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
GROUPED_MM = aten._grouped_mm.default


@dataclasses.dataclass
class SiteProgram:
    """A cell's site on this rank: its traced graph, and its parts alone."""

    graph: torch.fx.GraphModule  # the site as DTensor writes it, traced to aten
    inputs: list[torch.Tensor]
    matmul: Callable[[], object]  # the site's matmul alone, unsplit
    collective: Callable[[], object]  # the site's collective alone (gloo's own algorithm)
    message: torch.Tensor  # the bytes the collective must send per rank, as one tensor
    flops: float  # of this rank's matmul
    # the bytes of the operands its calls read whole (each B), and its calls
    weight_bytes: float = 0.0
    calls: int = 1
    matmul_class: str | None = None  # ``Profile.matmul_rates``


@dataclasses.dataclass
class _Parts:
    """What a kind's builder makes of a shape; ``build_site`` derives the rest."""

    program: Callable[..., tuple[torch.Tensor]]  # the site as DTensor or Ulysses writes it
    inputs: list[torch.Tensor]
    operands: tuple[torch.Tensor, torch.Tensor]  # the site's matmul alone, unsplit: a @ b
    # (``mm``, or ``bmm`` of 3-D operands)
    collective: Callable[[], object]
    block: int  # elements of one rank's block (a shard, a partial sum, a peer's heads)
    more: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # the site's other matmuls
    rounds: int = 1  # n-1 blocks leave a rank this many times (an all-reduce: 2)
    # the dropless MoE: traced by Dynamo (``.tolist()``), not ``make_fx``; its grouped
    # matmuls alone, their FLOPs and the bytes the busiest rank sends, given as they are
    captured: bool = False
    matmul: Callable[[], object] | None = None
    flops: float | None = None
    calls: int | None = None  # the matmul calls of ``matmul``
    message: torch.Tensor | None = None
    grouped: bool = False  # ``matmul`` runs grouped matmuls (their rate class)


def _exchanged(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    """``all_to_all_single`` of n equal blocks of dim 0 (block j to rank j), as Ulysses."""
    m = [x.shape[0] // n] * n
    return c10d.wait_tensor(c10d.all_to_all_single(x, m, m, group))


def _ag_mm(s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str) -> _Parts:
    x, w = rand(1, s // n, d), rand(f // n, d)

    def program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group))
        g = torch.cat(torch.split(g, 1), dim=1)  # DTensor's gather on the sequence dim
        return (torch.mm(g.reshape(-1, d), w.t()),)

    def collective() -> object:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group))

    return _Parts(program, [x, w], (rand(s, d), w.t()), collective, (s // n) * d)


def _mm_rs(s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str) -> _Parts:
    a, w = rand(s, f // n), rand(d, f // n)
    product = rand(n, s // n, d)

    def program(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        z = torch.mm(a, w.t()).view(1, s, d)
        z = torch.cat(torch.split(z, s // n, dim=1), dim=0)  # DTensor's scatter on dim 1
        return (c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", n, group)),)

    def collective() -> object:
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(product, "sum", n, group))

    return _Parts(program, [a, w], (a, w.t()), collective, (s // n) * d)


def _mm_a2a(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str
) -> _Parts:
    """Ulysses' q projection: this rank's s/n tokens times W (d -> f = heads x head
    dim), its head groups sent one to each rank (heads scattered, the sequence whole)."""
    m = s // n
    x, w = rand(m, d), rand(f, d)
    heads = rand(n, m, f // n)

    def program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        q = torch.mm(x, w.t()).view(m, n, f // n).permute(1, 0, 2).contiguous()
        return (_exchanged(q, n, group).view(s, f // n),)

    exchange = functools.partial(_exchanged, heads, n, group)
    return _Parts(program, [x, w], (x, w.t()), exchange, m * (f // n))


def _a2a_mm(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str
) -> _Parts:
    """Ulysses' attention output into the output projection: the whole sequence of this
    rank's heads, each rank's tokens sent to it (heads gathered), then @ Wo (f -> d),
    contracting over the heads."""
    m = s // n
    a, w = rand(s, f // n), rand(d, f)

    def program(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        g = _exchanged(a.view(n, m, f // n), n, group)  # block j: rank j's heads
        return (torch.mm(g.permute(1, 0, 2).reshape(m, f), w.t()),)

    def collective() -> object:
        return _exchanged(a.view(n, m, f // n), n, group)

    return _Parts(program, [a, w], (rand(m, f), w.t()), collective, m * (f // n))


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: statistics in float32, the weight applied last."""
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _mm_ar_mm(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str
) -> _Parts:
    """Plain TP (DTensor's ``RowwiseParallel`` with its replicated output): the
    down-projection's partial sums (f/n -> d) all-reduced, the residual added and
    RMSNorm'd on every token, then the next up-projection (d -> f/n, column-parallel).
    The pass splits the all-reduce: reduce-scatter, add and norm on s/n tokens,
    all-gather into the next matmul (an ``mm_rs`` and an ``ag_mm`` site)."""
    a, w_down, w_up = rand(s, f // n), rand(d, f // n), rand(f // n, d)
    residual, norm_w = rand(1, s, d), 1 + 0.1 * rand(d)
    product = rand(s, d)

    def program(
        a: torch.Tensor,
        w_down: torch.Tensor,
        residual: torch.Tensor,
        norm_w: torch.Tensor,
        w_up: torch.Tensor,
    ) -> tuple[torch.Tensor]:
        z = c10d.wait_tensor(c10d.all_reduce(torch.mm(a, w_down.t()), "sum", group))
        h = residual + z.view(1, s, d)
        return (torch.mm(_rms_norm(h, norm_w).view(s, d), w_up.t()),)

    def collective() -> object:
        return c10d.wait_tensor(c10d.all_reduce(product, "sum", group))

    inputs = [a, w_down, residual, norm_w, w_up]
    return _Parts(
        program,
        inputs,
        (a, w_down.t()),
        collective,
        (s // n) * d,
        more=((product, w_up.t()),),
        rounds=2,
    )


def _a2a_experts_a2a(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str
) -> _Parts:
    """A capacity MoE's experts under expert parallelism (GShard, DeepSpeed's
    ``MOELayer``, Tutel): this rank's ``s = n x E_local x C`` token slots ``[s, d]`` (the
    dispatch einsum's output, block j for rank j's ``E_local`` experts) all-to-all'd,
    viewed ``[n, E_local, C, d]`` and regrouped to ``[E_local, n C, d]``, the batched
    experts (``bmm`` with ``w1 [E_local, d, f]``, SiLU, ``bmm`` with ``w2 [E_local, f,
    d]``), regrouped back and combined (all-to-all to the slots' ranks). The pass makes
    it an ``a2a_mm`` site (the dispatched blocks are rows of the first ``bmm``) and an
    ``mm_a2a`` site (the second ``bmm`` computed block by block)."""
    e = EXPERTS_PER_RANK
    c = s // (n * e)
    slots, w1, w2 = rand(s, d), rand(e, d, f), rand(e, f, d)
    returned = rand(s, d)

    def program(slots: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor]:
        g = _exchanged(slots, n, group)  # block j: rank j's slots for this rank's experts
        x = g.view(n, e, c, d).permute(1, 0, 2, 3).reshape(e, n * c, d)
        y = torch.bmm(torch.nn.functional.silu(torch.bmm(x, w1)), w2)
        y = y.view(e, n, c, d).permute(1, 0, 2, 3).reshape(n * e * c, d)
        return (_exchanged(y, n, group),)

    def collective() -> object:
        return _exchanged(slots, n, group), _exchanged(returned, n, group)

    return _Parts(
        program,
        [slots, w1, w2],
        (rand(e, n * c, d), w1),
        collective,
        e * c * d,  # one peer's block: its slots of this rank's experts
        more=((rand(e, n * c, f), w2),),
        rounds=2,  # dispatch, then combine
    )


def dropless_routing(n: int, rows: int, skew: float = 1.0) -> list[list[int]]:
    """``routing[src][dst]``: the rows rank ``src`` dispatches to rank ``dst`` (each
    rank ``rows``). Balanced: ``rows / n`` each. Skewed on n >= 3 (the simulator's
    ``moe_routing``): each rank sends ``skew`` x the average to the next rank, keeps the
    average and shares the rest evenly among its other peers (every rank sends, receives
    and computes the rows it would balanced). On 2 ranks (one peer): every rank sends
    ``skew`` times as many rows to rank 1 as to rank 0, so rank 1's experts run ``skew`` x
    rank 0's rows; the rows on the link, both directions together, are those of the
    balanced routing (rank 0 sends more, rank 1 less)."""
    average = rows / n
    if skew == 1.0:
        shares = [[average] * n for _ in range(n)]
    elif n == 2:
        shares = [[rows / (1 + skew), rows * skew / (1 + skew)]] * 2
    else:
        rest = (rows - average - skew * average) / (n - 2)
        shares = [
            [average if d == s else skew * average if d == (s + 1) % n else rest for d in range(n)]
            for s in range(n)
        ]
    routing = []
    for share in shares:  # whole rows, the remainder on the last ranks
        row = [int(x) for x in share]
        for j in range(rows - sum(row)):
            row[-1 - j % n] += 1
        routing.append(row)
    return routing


def _per_expert(block: int, e: int) -> list[int]:
    """A block's rows over ``e`` experts, as evenly as whole rows go."""
    return [block // e + (i < block % e) for i in range(e)]


def _a2a_gmm_a2a(
    s: int, d: int, f: int, n: int, rand: Callable[..., torch.Tensor], group: str, skew: float
) -> _Parts:
    """A dropless MoE's experts under expert parallelism, as torchtitan's
    ``ExpertParallel`` and ``GroupedExperts`` write them: this rank's ``s`` routed rows
    ``[s, d]`` (bfloat16, sorted by expert, rank j's experts' rows block j) and its
    tokens per expert ``[n E_local]``; the counts exchanged, the splits by
    ``.view(n, -1).sum(1).tolist()``, the uneven dispatch all-to-all, the rows permuted
    from (source rank, expert) order to expert order (``argsort`` of the repeated
    expert ids), the SwiGLU experts (``torch._grouped_mm`` with ``w1``, ``w3 [E_local,
    f, d]``, ``w2 [E_local, d, f]``, each transposed, and ``offs`` the cumulative rows per
    expert), the rows put back (``new_empty(...)[perm] = out``) and the combine all-to-all
    (splits swapped). Routing: :func:`dropless_routing`. The pass makes it one ``moe`` site."""
    e = EXPERTS_PER_RANK
    rank, world = dist.get_rank(), dist.group.WORLD
    assert world is not None
    routing = dropless_routing(n, s, skew)
    counts = torch.tensor([c for dst in routing[rank] for c in _per_expert(dst, e)])

    def bf16(*size: int) -> torch.Tensor:
        return rand(*size).to(torch.bfloat16)

    x = bf16(s, d)
    # torchtitan's weights: [E, out, in], read transposed (``_run_experts_grouped_mm``)
    w1, w3 = ((bf16(e, f, d) / d**0.5).transpose(-2, -1) for _ in range(2))
    w2 = (bf16(e, d, f) / f**0.5).transpose(-2, -1)
    # what this rank receives: rows per (source rank, expert), and per expert
    received = [c for src in range(n) for c in _per_expert(routing[src][rank], e)]
    per_expert = torch.tensor(received).view(n, e).sum(0)
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
    rows_in = sum(received)

    def program(
        x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
    ) -> tuple[torch.Tensor]:
        import torch.distributed._functional_collectives as funcol

        counts_group = c10d.wait_tensor(funcol.all_to_all_single(counts, None, None, world))
        input_splits = counts.view(n, -1).sum(dim=1).tolist()
        output_splits = counts_group.view(n, -1).sum(dim=1).tolist()
        recv = funcol.all_to_all_single(x, output_splits, input_splits, world)
        expert_of_row = torch.arange(e).repeat(n)
        expert_of_row = expert_of_row.repeat_interleave(counts_group, output_size=recv.shape[0])
        perm = torch.argsort(expert_of_row, stable=True)
        offs = torch.cumsum(counts_group.view(n, e).sum(dim=0), dim=0, dtype=torch.int32)
        h = recv[perm]
        h = F.silu(torch._grouped_mm(h, w1, offs=offs)) * torch._grouped_mm(h, w3, offs=offs)
        out = torch._grouped_mm(h, w2, offs=offs)
        back = out.new_empty(out.shape)
        back[perm] = out
        # waited where read (``AsyncCollectiveTensor``), as torchtitan leaves them
        return (funcol.all_to_all_single(back, input_splits, output_splits, world),)

    splits_in = routing[rank]
    splits_out = [routing[src][rank] for src in range(n)]
    rows = bf16(rows_in, d)
    returned = bf16(rows_in, d)

    def collective() -> object:
        go = c10d.all_to_all_single(x, splits_out, splits_in, group)
        back = c10d.all_to_all_single(returned, splits_in, splits_out, group)
        return c10d.wait_tensor(go), c10d.wait_tensor(back)

    def matmul() -> object:
        h = F.silu(torch._grouped_mm(rows, w1, offs=offs)) * torch._grouped_mm(rows, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)

    # the busiest rank's rows to its peers, twice (dispatch, combine): one message
    sent = max(sum(r) - r[src] for src, r in enumerate(routing))
    return _Parts(
        program,
        [x, counts, w1, w3, w2],
        (x, w1),  # ``matmul`` given: their dtype only
        collective,
        sent * d,
        rounds=2,
        captured=True,
        matmul=matmul,
        calls=3,  # w1, w3, w2
        grouped=True,
        flops=3 * 2.0 * rows_in * d * f,
        message=bf16(2 * sent * d),
    )


def _captured(
    program: Callable[..., tuple[torch.Tensor]], inputs: list[torch.Tensor]
) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``program`` traced as ``torch.compile`` traces it for a backend (Dynamo, then
    AOTAutograd's inference graph), ``.item()`` and ``.tolist()`` captured as unbacked
    sizes (``capture_scalar_outputs``); runs it once on ``inputs`` (every rank). Returns
    the aten graph and its inputs in its placeholders' order."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []
    order: list[torch.Tensor] = []

    def grab(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm)

    aot = aot_autograd(fw_compiler=grab, inference_compiler=grab)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        order.extend(example_inputs)
        return aot(gm, example_inputs)

    traced = functools.wraps(program)(lambda *a: program(*a))  # a code object of its own
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        torch.compile(traced, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    (gm,) = graphs
    by_id = {id(t): t for t in inputs}
    return gm, [by_id[id(t)] for t in order]


_BUILDERS = {
    "ag_mm": _ag_mm,
    "mm_rs": _mm_rs,
    "mm_a2a": _mm_a2a,
    "a2a_mm": _a2a_mm,
    "mm_ar_mm": _mm_ar_mm,
    MOE_KIND: _a2a_experts_a2a,
}


def build_site(kind: str, shape: SiteShape, n: int, rank: int) -> SiteProgram:
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD.group_name  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(1000 + rank)
    shape = shape.fitted(n, kind)  # the same shape where n divides it (n = 2)
    rand = functools.partial(torch.randn, generator=gen)
    if kind == DROPLESS_KIND:
        parts = _a2a_gmm_a2a(shape.seq, shape.dim, shape.ffn, n, rand, group, shape.skew)
    else:
        parts = _BUILDERS[kind](shape.seq, shape.dim, shape.ffn, n, rand, group)
    operands = (parts.operands, *parts.more)
    if parts.captured:
        graph, inputs = _captured(parts.program, parts.inputs)
    else:
        graph, inputs = make_fx(parts.program, tracing_mode="fake")(*parts.inputs), parts.inputs
    return SiteProgram(
        graph=graph,
        inputs=inputs,
        # mm, or bmm if 3-D
        matmul=parts.matmul or (lambda: [torch.matmul(a, b) for a, b in operands]),
        collective=parts.collective,
        # n-1 blocks leave a rank (an all-reduce's ring: twice, reduce-scatter then gather;
        # the MoEs: the dispatch's, then the combine's)
        message=(
            parts.message
            if parts.message is not None
            else torch.randn(parts.rounds * (n - 1) * parts.block, generator=gen)
        ),
        flops=parts.flops or sum(2.0 * a.numel() * b.shape[-1] for a, b in operands),
        weight_bytes=0.0
        if parts.matmul
        else sum(b.numel() * b.element_size() for _, b in operands),
        calls=parts.calls or len(operands),
        matmul_class=rate_class(parts.operands[0].dtype, parts.grouped),
    )
