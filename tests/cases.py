"""Small programs with all-gather -> matmul and matmul -> reduce-scatter, as DTensor emits them.

Each ``Case`` builds a function over functional collectives and its inputs for one
rank; ``trace`` turns it into the aten graph the pass sees (fake values, like
AOTAutograd's). Graph tests run them on torch's fake process group, numerical tests on
real gloo ranks, with the same builders.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse_compile
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.passes.fx import custom_ops
from commfuse_compile.passes.kinds.unclaimed import COLLECTIVES as ALL_COLLECTIVES

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
COLLECTIVES = (
    c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_to_all_single.default,
)


def examples(default: int, thorough: int) -> list:
    """A property's example counts: ``default`` in the default run, ``thorough`` under
    ``-m matrix`` (the first examples again, then more)."""
    return [
        pytest.param(default, id=f"{default}-examples"),
        pytest.param(thorough, id=f"{thorough}-examples", marks=pytest.mark.matrix),
    ]


def gathered(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """all_gather along ``dim`` the way DTensor writes it (dim 0 gather + split/cat)."""
    group = dist.group.WORLD.group_name
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group))
    if dim == 0:
        return out
    return torch.cat(torch.split(out, x.shape[0]), dim=dim)


def scattered(z: torch.Tensor, n: int, dim: int, op: str = "sum") -> torch.Tensor:
    """reduce_scatter along ``dim`` the way DTensor writes it (split/cat + dim 0 scatter)."""
    group = dist.group.WORLD.group_name
    if dim != 0:
        z = torch.cat(torch.split(z, z.shape[dim] // n, dim=dim), dim=0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, op, n, group))


@dataclasses.dataclass(frozen=True)
class AgMm:
    """Y_i = AG(x, dim) viewed [M, K] @ W_i (+ b_i), for ``consumers`` matmuls, and
    dW_j = (AG(x) viewed [M, K])^T @ X_j for ``contract`` weight-gradient-like ones."""

    shard: tuple[int, ...] = (2, 3, 8)
    dim: int = 1
    n_out: int = 6
    consumers: int = 2
    bias: bool = True
    extra_user: bool = False
    contract: int = 0  # weight-gradient-like consumers: t(AG(x) viewed [M, K]) @ X_i
    columns: int = 0  # gathered-weight consumers: Z_i @ t(AG(x) viewed [M, K]) (dim 0 only)
    left: int = 0  # Y_i @ AG(x) viewed [M, K]
    dtype: torch.dtype = torch.float32

    def inputs(self, rank: int, seed: int, n: int = 1) -> list[torch.Tensor]:
        """This rank's shard and the parameters (``n``: group size, for the X_i rows)."""
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        k = self.shard[-1] * (n if self.dim == len(self.shard) - 1 else 1)  # K gathered too
        xs = [torch.randn(self.shard, generator=gen)]
        for i in range(self.consumers):
            wgen = torch.Generator().manual_seed(seed * 1000 + 999 - i)  # same on every rank
            xs.append(torch.randn(k, self.n_out + i, generator=wgen))
            if self.bias:
                xs.append(torch.randn(self.n_out + i, generator=wgen))
        rows = math.prod(self.shard[:-1]) * n  # M: rows of the gathered tensor viewed 2-D
        xs += [torch.randn(rows, 3 + i, generator=gen) for i in range(self.contract)]
        xs += [torch.randn(2 + i, k, generator=gen) for i in range(self.columns)]
        xs += [torch.randn(2 + i, rows, generator=gen) for i in range(self.left)]
        return [x.to(self.dtype) for x in xs]

    def fn(self, n: int):
        def program(x, *params):
            g = gathered(x, n, self.dim)
            a = g.reshape(-1, g.shape[-1])
            outs = []
            step = 2 if self.bias else 1
            for i in range(self.consumers):
                w = params[i * step]
                if self.bias:
                    outs.append(torch.addmm(params[i * step + 1], a, w))
                else:
                    outs.append(torch.mm(a, w))
            xs = params[self.consumers * step :]
            contract, xs = xs[: self.contract], xs[self.contract :]
            outs += [torch.mm(a.t(), x) for x in contract]
            outs += [torch.mm(z, a.t()) for z in xs[: self.columns]]
            outs += [torch.mm(y, a) for y in xs[self.columns :]]
            if self.extra_user:
                outs.append(g * 2)
            return tuple(outs)

        return program


@dataclasses.dataclass(frozen=True)
class MmRs:
    """RS(view(A @ W (+ b), lead + [N]), dim)."""

    lead: tuple[int, ...] = (2, 4)
    k: int = 8
    n_out: int = 6
    dim: int = 1
    bias: bool = True
    op: str = "sum"
    dtype: torch.dtype = torch.float32
    terms: int = 1  # RS(A_1 @ W_1 (+ b) + A_2 @ W_2 + ...)
    transposed: bool = False  # A_i given as [K, M] and used as t(A_i) (weight gradients)

    def inputs(self, rank: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        rows = math.prod(self.lead)
        xs = []
        for i in range(self.terms):
            k = self.k + i
            xs.append(torch.randn((k, rows) if self.transposed else (rows, k), generator=gen))
            xs.append(torch.randn(k, self.n_out, generator=gen))
        if self.bias:
            xs.append(torch.randn(self.n_out, generator=gen))
        return [x.to(self.dtype) for x in xs]

    def fn(self, n: int):
        def program(*xs):
            z = None
            for i in range(self.terms):
                a, w = xs[2 * i], xs[2 * i + 1]
                a = a.t() if self.transposed else a
                bias = xs[2 * self.terms] if self.bias and i == 0 else None
                term = torch.addmm(bias, a, w) if bias is not None else torch.mm(a, w)
                z = term if z is None else z + term
            return (scattered(z.view(*self.lead, self.n_out), n, self.dim, self.op),)

        return program


FP8 = torch.float8_e4m3fn


def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, fast_accum=False):
    """``torch._scaled_mm`` as float8 training calls it (a row-wise ``scale_a`` may come
    laid out like A's leading dims: viewed [M, 1] first)."""
    if scale_a.dim() > 2:
        scale_a = scale_a.reshape(-1, 1)
    return torch._scaled_mm(
        a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


def float8_gathered(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``gathered`` of float8 data as its bytes (gloo refuses float8 collectives; NCCL
    moves them as uint8 too): view -> gather -> view back."""
    return gathered(x.view(torch.uint8), n, dim).view(x.dtype)


@dataclasses.dataclass(frozen=True)
class Scaled:
    """Float8 sites, as PyTorch's async-TP tests write them (``test_micro_pipeline_tp``'s
    fp8 cases): ``side="gather"``: A = AG(A_shard, dim) (float8, gathered as bytes unless
    ``as_bytes`` is False), C = _scaled_mm(A viewed [M, K], B, scale_a, scale_b) viewed
    like A, returning (A, C); ``"scatter"``: RS(_scaled_mm(A viewed [M, K], B, ...)
    viewed like A, dim, op). B is [K, N] column-major (float8 training's weight layout);
    ``scaling``: "tensor" (0-d scales), "row" (scale_a per row of A, laid out like A's
    leading dims, scale_b [1, N]) or "row_gathered" (the shard's rows' scale_a, gathered
    beside it on the same dim). ``a`` is the shard (gather) or the whole A (scatter)."""

    side: str = "gather"
    a: tuple[int, ...] = (2, 4, 32)
    dim: int = 0
    n_out: int = 16
    scaling: str = "tensor"
    bias: bool = False
    out_dtype: torch.dtype = torch.bfloat16
    fast_accum: bool = False
    as_bytes: bool = True
    op: str = "sum"

    def a_shape(self, n: int) -> list[int]:
        """A's shape as the matmul reads it (the shard gathered on ``dim``)."""
        shape = list(self.a)
        shape[self.dim] *= n if self.side == "gather" else 1
        return shape

    def inputs(self, rank: int, seed: int, n: int = 1) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        wgen = torch.Generator().manual_seed(seed * 1000 + 999)  # same on every rank
        shape = self.a_shape(n)
        a = (torch.rand(self.a, generator=gen) * 4 - 2).to(FP8)
        b = (torch.rand(self.n_out, shape[-1], generator=wgen) * 4 - 2).to(FP8).t()
        if self.scaling == "tensor":
            scales = [torch.rand((), generator=wgen) + 0.5, torch.rand((), generator=wgen) + 0.5]
        else:  # "row": the gathered rows' scales on every rank (scatter: this rank's A's);
            # "row_gathered": this shard's rows' scales, gathered beside it
            everywhere = self.side == "gather" and self.scaling == "row"
            lead = shape[:-1] if self.scaling == "row" else self.a[:-1]
            scale_a = torch.rand([*lead, 1], generator=wgen if everywhere else gen) + 0.5
            scales = [scale_a, torch.rand(1, self.n_out, generator=wgen) + 0.5]
        bias = [torch.randn(self.n_out, generator=wgen).to(self.out_dtype)] if self.bias else []
        return [a, b, *scales, *bias]

    def fn(self, n: int):
        def program(a, b, scale_a, scale_b, *bias):
            if self.side == "gather":
                gather = float8_gathered if self.as_bytes else gathered
                a = gather(a, n, self.dim)
            if self.scaling == "row_gathered":
                scale_a = gathered(scale_a, n, self.dim)
            a2d, bias = a.reshape(-1, a.shape[-1]), bias[0] if bias else None
            c = scaled_mm(a2d, b, scale_a, scale_b, bias, self.out_dtype, self.fast_accum)
            c = c.view(*a.shape[:-1], c.shape[-1])
            if self.side == "gather":
                return a, c
            return (scattered(c, n, self.dim, self.op),)

        return program


def exchanged(x: torch.Tensor, n: int) -> torch.Tensor:
    """all_to_all_single of n equal blocks of dim 0 (block j to rank j), as Ulysses does."""
    group = dist.group.WORLD.group_name
    m = x.shape[0] // n
    return c10d.wait_tensor(c10d.all_to_all_single(x, [m] * n, [m] * n, group))


@dataclasses.dataclass(frozen=True)
class Ulysses:
    """Ulysses attention's two all-to-alls around a projection: ``side="in"``: q = x @ Wq
    (+ b), heads scattered and the sequence gathered (matmul -> all-to-all); ``"out"``:
    attention output [B, S, h/n, d], the sequence scattered and the heads gathered, then
    @ Wo (all-to-all -> matmul, contracting over the heads); ``"grad"``: the weight
    gradient x^T @ dQ of a gathered dQ (all-to-all -> matmul, columns).
    ``sequence_first``: "in" sends its blocks laid out [s, b, h/n, d] (DeepSpeed's, from
    a batch-first model's [b, s] rows: each block is copied before it is sent)."""

    side: str = "in"
    batch: int = 2
    seq_per_rank: int = 2
    heads_per_rank: int = 2
    head_dim: int = 3
    dim: int = 5
    bias: bool = False
    dtype: torch.dtype = torch.float32
    sequence_first: bool = False

    def inputs(self, rank: int, seed: int, n: int = 1) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        wgen = torch.Generator().manual_seed(seed * 1000 + 999)  # same weights on every rank
        b, s, h, d = self.batch, self.seq_per_rank, self.heads_per_rank * n, self.head_dim
        if self.side == "in":
            xs = [
                torch.randn(b * s, self.dim, generator=gen),
                torch.randn(self.dim, h * d, generator=wgen),
            ]
            xs += [torch.randn(h * d, generator=wgen)] if self.bias else []
        elif self.side == "out":
            xs = [torch.randn(b, s * n, self.heads_per_rank, d, generator=gen)]
            xs += [torch.randn(h * d, self.dim, generator=wgen)]
        else:
            xs = [torch.randn(b, s * n, self.heads_per_rank, d, generator=gen)]
            xs += [torch.randn(b * s, self.dim, generator=gen)]
        return [x.to(self.dtype) for x in xs]

    def fn(self, n: int):
        b, s, hl, d = self.batch, self.seq_per_rank, self.heads_per_rank, self.head_dim

        def heads_gathered(t: torch.Tensor) -> torch.Tensor:
            """[B, S, h/n, d] (the sequence whole) to [B*S/n, h*d] (the heads whole)."""
            v = t.reshape(b, n, s, hl, d).permute(1, 0, 2, 3, 4).contiguous()
            return exchanged(v, n).permute(1, 2, 0, 3, 4).reshape(b * s, n * hl * d)

        def program(*xs):
            if self.side == "in":
                q = torch.addmm(xs[2], xs[0], xs[1]) if self.bias else xs[0] @ xs[1]
                first = self.sequence_first  # sends [n, s, b, ...], else [n, b, s, ...]
                v = q.view(b, s, n, hl, d).permute((2, 1, 0, 3, 4) if first else (2, 0, 1, 3, 4))
                o = exchanged(v.contiguous(), n).permute(
                    (2, 0, 1, 3, 4) if first else (1, 0, 2, 3, 4)
                )
                o = o.reshape(b, n * s, hl, d)
                return (o * 2,)
            if self.side == "out":
                return (heads_gathered(xs[0]) @ xs[1],)
            return (xs[1].t() @ heads_gathered(xs[0]),)

        return program


@dataclasses.dataclass(frozen=True)
class Experts:
    """A capacity-style MoE's experts with expert parallelism (GShard, DeepSpeed's
    ``MOELayer``, Tutel): [E * C, D] token slots dispatched (all-to-all, block j to rank
    j, which holds its ``experts`` of the E), the batched experts ``bmm`` on
    [experts, n * C, D], and the results combined back (all-to-all). ``side="forward"``:
    dispatch -> bmm -> relu -> bmm -> combine; ``"backward"``: its gradient, as
    AOTAutograd writes it: the combine's gradient exchanged, into dH = dY @ W2^T (rows)
    and dW2 = H^T @ dY (blocks along K), dX = dH1 @ W1^T exchanged back."""

    side: str = "forward"
    experts: int = 2  # per rank
    capacity: int = 3
    dim: int = 4
    hidden: int = 6
    dtype: torch.dtype = torch.float32

    def inputs(self, rank: int, seed: int, n: int = 1) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        e, c, d, f = self.experts, self.capacity, self.dim, self.hidden
        slots = torch.randn(n * e * c, d, generator=gen)
        w1, w2 = torch.randn(e, d, f, generator=gen), torch.randn(e, f, d, generator=gen)
        if self.side == "forward":
            xs = [slots, w1, w2]
        else:
            xs = [slots, w1, w2, torch.randn(e, n * c, f, generator=gen)]  # dY; H
        return [x.to(self.dtype) for x in xs]

    def fn(self, n: int):
        e, c, d = self.experts, self.capacity, self.dim

        def by_expert(slots: torch.Tensor) -> torch.Tensor:
            """[n * E * C, *] as this rank's experts see it: [E, n * C, *]."""
            exchanged_slots = exchanged(slots, n)
            return exchanged_slots.view(n, e, c, -1).permute(1, 0, 2, 3).reshape(e, n * c, -1)

        def by_source(out: torch.Tensor) -> torch.Tensor:
            """[E, n * C, D] back to the ranks the slots came from."""
            return exchanged(out.view(e, n, c, d).permute(1, 0, 2, 3).reshape(n * e * c, d), n)

        def program(*xs):
            if self.side == "forward":
                slots, w1, w2 = xs
                return (by_source(torch.bmm(torch.bmm(by_expert(slots), w1).relu(), w2)),)
            dy, w1, w2, h = xs
            g = by_expert(dy)
            dh = torch.bmm(g, w2.transpose(1, 2)) * (h > 0)
            return by_source(torch.bmm(dh, w1.transpose(1, 2))), torch.bmm(h.transpose(1, 2), g)

        return program


@dataclasses.dataclass(frozen=True)
class Uneven:
    """An all-to-all of uneven blocks next to a matmul: rank r sends ``base[(j - r) % n]``
    rows to rank j (heads, or tokens, that the group does not divide evenly), so every
    rank sends and receives ``sum(base)`` and the ranks' graphs have one shape.

    a2a -> matmul (``a2a_mm``): ``"rows"`` o @ W; ``"contract"`` o^T @ W (a weight
    gradient); ``"columns"`` X @ o^T; ``"contract_left"`` Y @ o; ``"heads_out"``: o
    [H, t, d] of uneven head blocks, laid out [t, H*d], @ Wo (contracting the heads).
    matmul -> a2a (``mm_a2a``): ``"in"`` the product's rows; ``"heads"``: x @ Wq [t, H*d]
    laid out [H, t, d] (DeepSpeed's uneven-heads scatter), uneven column blocks."""

    side: str = "rows"
    base: tuple[int, ...] = (1, 2, 3)  # one size per offset: the n of the group
    width: int = 3  # columns of a row, or head_dim
    tokens: int = 4  # t of the head sides
    m: int = 5
    dtype: torch.dtype = torch.float32

    def splits(self, rank: int) -> tuple[list[int], list[int]]:
        """(received, sent) by this rank."""
        n = len(self.base)
        return (
            [self.base[(rank - j) % n] for j in range(n)],
            [self.base[(j - rank) % n] for j in range(n)],
        )

    def inputs(self, rank: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        wgen = torch.Generator().manual_seed(seed * 1000 + 999)
        rows, c, m, t = sum(self.base), self.width, self.m, self.tokens
        shapes = {
            "rows": ((rows, c), (c, m)),
            "contract": ((rows, c), (rows, m)),
            "columns": ((rows, c), (m, c)),
            "contract_left": ((rows, c), (m, rows)),
            "heads_out": ((rows, t, c), (rows * c, m)),
            "in": ((rows, m), (m, c)),
            "heads": ((t, m), (m, rows * c)),
        }[self.side]
        x, other = shapes
        return [
            torch.randn(x, generator=gen).to(self.dtype),
            torch.randn(other, generator=wgen).to(self.dtype),
        ]

    def fn(self, n: int):
        assert n == len(self.base), "one size per rank"
        rows, c, t = sum(self.base), self.width, self.tokens

        def exchange(x: torch.Tensor) -> torch.Tensor:
            received, sent = self.splits(dist.get_rank())
            group = dist.group.WORLD.group_name
            return c10d.wait_tensor(c10d.all_to_all_single(x, received, sent, group))

        def program(x, w):
            if self.side == "in":
                return (exchange(x @ w) * 2,)
            if self.side == "heads":
                q = (x @ w).view(t, rows, c).permute(1, 0, 2).contiguous()
                return (exchange(q) * 2,)
            o = exchange(x)
            if self.side == "rows":
                return (o @ w,)
            if self.side == "contract":
                return (o.t() @ w,)
            if self.side == "columns":
                return (w @ o.t(),)
            if self.side == "contract_left":
                return (w @ o,)
            return (o.permute(1, 0, 2).reshape(t, rows * c) @ w,)  # heads_out

        return program


@dataclasses.dataclass(frozen=True)
class FusedQkv(Ulysses):
    """One projection for q, k and v (``kv_heads`` k/v heads per rank: GQA when fewer):
    ``side="in"``: x @ Wqkv split on its columns, each part's heads scattered by its own
    all-to-all; ``"grad"``: the backward's dq, dk, dv, each gathered by its all-to-all and
    concatenated, into dX = dQKV @ Wqkv^T and dW = dQKV^T @ x."""

    kv_heads_per_rank: int = 1

    def widths(self, n: int) -> list[int]:
        d = self.head_dim * n
        return [self.heads_per_rank * d, self.kv_heads_per_rank * d, self.kv_heads_per_rank * d]

    def inputs(self, rank: int, seed: int, n: int = 1) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        wgen = torch.Generator().manual_seed(seed * 1000 + 999)  # same weights on every rank
        b, s, d, width = self.batch, self.seq_per_rank, self.head_dim, sum(self.widths(n))
        x = torch.randn(b * s, self.dim, generator=gen)
        w = torch.randn(self.dim, width, generator=wgen)
        if self.side == "in":
            xs = [x, w, *([torch.randn(width, generator=wgen)] if self.bias else [])]
        else:
            heads = (self.heads_per_rank, self.kv_heads_per_rank, self.kv_heads_per_rank)
            xs = [*(torch.randn(b, s * n, h, d, generator=gen) for h in heads), x, w]
        return [t.to(self.dtype) for t in xs]

    def fn(self, n: int):
        b, s, d = self.batch, self.seq_per_rank, self.head_dim

        def program(*xs):
            if self.side == "in":
                x, w = xs[0], xs[1]
                qkv = (torch.addmm(xs[2], x, w) if self.bias else x @ w).view(b, s, -1)
                outs = []
                for part in qkv.split(self.widths(n), dim=-1):
                    v = part.reshape(b, s, n, -1, d).permute(2, 0, 1, 3, 4).contiguous()
                    outs.append(exchanged(v, n) * 2)
                return tuple(outs)
            *grads, x, w = xs
            dqkv = self.concatenated(grads, n)
            return dqkv @ w.t(), dqkv.t() @ x

        return program

    def concatenated(self, grads: list[torch.Tensor], n: int) -> torch.Tensor:
        """dq, dk, dv ([B, S, heads/n, d] each) all-to-all'd and joined: [B*S/n, width]."""
        b, s, d = self.batch, self.seq_per_rank, self.head_dim
        parts = []
        for g in grads:
            hl = g.shape[2]
            v = g.reshape(b, n, s, hl, d).permute(1, 0, 2, 3, 4).contiguous()
            parts.append(exchanged(v, n).permute(1, 2, 0, 3, 4).reshape(b, s, n * hl * d))
        return torch.cat(parts, dim=-1).view(b * s, -1)


def trace(
    case, n: int, inputs: list[torch.Tensor], tracing_mode: str = "fake"
) -> torch.fx.GraphModule:
    """``tracing_mode="symbolic"``: every size a symbol, as under dynamic shapes."""
    return make_fx(case.fn(n), tracing_mode=tracing_mode)(*inputs)


def run_case(
    rank: int,
    n: int,
    case,
    seed: int,
    options: dict,
    tracing_mode: str = "fake",
    inner: str = "eager",
) -> dict:
    """On one gloo rank: original vs rewritten program outputs, and what the pass left.

    ``inner="eager"``: the traced aten graph rewritten by ``apply`` and run as it is;
    ``"inductor"``: the program compiled with ``backend="commfuse"`` (Inductor after the
    pass; ``tracing_mode="symbolic"`` compiles with dynamic shapes)."""
    takes_n = isinstance(case, AgMm | Ulysses | Scaled | Experts)
    inputs = case.inputs(rank, seed, n) if takes_n else case.inputs(rank, seed)
    # gloo has no "avg": the reference is the sum, divided by n as the collective would
    averaged = getattr(case, "op", "sum") == "avg"
    reference = dataclasses.replace(case, op="sum") if averaged else case
    if inner == "inductor":
        commfuse_compile.report.reset()
        torch._dynamo.reset()
        expected = reference.fn(n)(*inputs)
        compiled = torch.compile(
            case.fn(n),
            backend="commfuse",
            options={**options, "inner": "inductor"},
            dynamic=tracing_mode == "symbolic",
        )
        actual = compiled(*inputs)
        records = commfuse_compile.report.REPORT.sites
        assert records and all(r.decision == "rewritten" for r in records), records
        sliced = options.get("schedule") == "slicing"
        collectives_left = sum(options.get("slices", 2) if sliced else 0 for _ in records)
        p2p = sum(r.p2p_ops for r in records)
    else:
        gm = trace(case, n, inputs, tracing_mode)
        expected = trace(reference, n, inputs, tracing_mode)(*inputs) if averaged else gm(*inputs)
        commfuse_compile.report.reset()
        rewritten = commfuse_compile.apply(copy.deepcopy(gm), **options)
        records = commfuse_compile.report.REPORT.sites
        actual = rewritten(*inputs)
        kinds = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
        collectives_left = sum(k in COLLECTIVES for k in kinds)
        p2p = sum(k is torch.ops.commfuse.p2p.default for k in kinds)
    if averaged:
        expected = [t / n for t in expected]
    return {
        "expected": [t.float() for t in expected],
        "actual": [t.float() for t in actual],
        "collectives_left": collectives_left,
        "p2p": p2p,
        # what was not rewritten, and why (for a failing assertion's message)
        "declined": [
            (r.kind, r.decline_code, r.reason) for r in records if r.decision != "rewritten"
        ],
    }


def collective_names(gm: torch.fx.GraphModule) -> list[str]:
    """The collectives of ``gm``: functional ones, and framework ops that take a group."""
    return [
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (n.target in ALL_COLLECTIVES or custom_ops.group_argument(n.target) is not None)
    ]


def records_of(gm: torch.fx.GraphModule) -> list[commfuse_compile.report.SiteRecord]:
    """The graph rewritten (ring, eager); every collective it had named by one record (a
    framework's op read as a functional collective: by that collective's name)."""
    names = collections.Counter(collective_names(gm))
    records = rewrite_graph(gm, "forward", commfuse_compile.Options(schedule="ring", inner="eager"))
    named = collections.Counter(n for r in records for n in r.match["collectives"])
    replaced, new = names - named, named - names
    assert replaced.total() == new.total(), [(r.kind, r.reason) for r in records]
    assert all(name.startswith(("all_", "reduce_scatter")) for name in new), new
    return records
