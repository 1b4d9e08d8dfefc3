"""Fuzzing the CommFuse pass on random programs: graph properties on torch's fake process
group (1-6), numbers on a sample of real gloo ranks (7).

A drawn ``Recipe`` is a world size (1..8), a rank, a dtype (float32/bfloat16/float16/
float64/int64), a first shard shape (sizes 0..12) and a short list of ops, each with a
few small ints read modulo what fits. ``Builder`` turns it into a program mixing
DTensor-style all-gathers (dims 0..2, the same shard gathered again, a wrong group size)
and reduce-scatters ("sum"/"avg"), all-to-alls of dim 0 (equal splits as lists or the
funcol API's ``None``, uneven ones; laid out as Ulysses does, [B, S/n, h, d] <-> [B, S,
h/n, d] with the heads or the sequence moved to dim 0, or interleaved, and a projection
matmul before, after or on both sides), mm/addmm in every operand role (biases of every
shape, beta/alpha, weights transposed with ``.t()``, operands swapped, A @ A^T), float8
``_scaled_mm`` in the same four roles (per-tensor or per-row scales, bias, fast
accumulation, bfloat16/float32/float8 outputs) on float8 inputs gathered as their uint8
bytes or as themselves, sums of matmuls, views/reshapes, transposes (cancelling pairs
included), casts, relu/mul/add, copies, values with several users or none, and
unsupported neighbours (slices, reductions, bmm, matmul, softmax, in-place ops, cat).
The ops run once on meta tensors for the inputs' shapes, then the program is traced with
``make_fx(tracing_mode="fake")`` on the fake process group of that world size; recipes
that fail to build or trace are skipped.
For schedules ring and bidir:

1. ``rewrite_graph`` never raises, warns of no internal error, and declines no site with
   an ``internal...`` reason (an exception in the pass, or its verifier catching the
   lowering);
2. the graph lints and recompiles afterwards;
3. declined sites keep their collectives (and, if nothing is rewritten, ``gm.code`` is
   byte-identical) and record no nodes;
4. a rewritten site's collectives are gone, the graph has exactly the P2P ops its records
   claim, every received tensor is unpacked by one getitem that one ``wait_tensor`` reads,
   and every sent buffer is waited after its P2P op; a rewritten all-to-all (``mm_a2a``,
   ``a2a_mm``) is n - 1 pairwise exchanges of one block (1/n of its dim 0) in n steps;
5. the rewritten graph runs on fake tensors (``FakeTensorProp``) to the original outputs'
   shapes and dtypes, and every node's ``meta["val"]`` agrees with what it computes;
6. every collective next to a mm/addmm through view/transpose/copy/cast/reassembly/
   slice/pad ops (an all-gather's value flowing into one, a reduce-scatter's input
   flowing out of one, an all-to-all either way) is in exactly one record, of its kind
   (an all-to-all whose value flows into one: ``a2a_mm``): no silent misses;
7. on real gloo ranks (a sample: world sizes 2-4, programs the pass rewrites something
   in and that gloo can run, half of them drawn with an all-to-all next to matmuls), the
   rewritten graph computes the original's values up to summation order.

A failure prints the program as code that reproduces it. ``COMMFUSE_FUZZ_EXAMPLES`` sets
the number of graph examples of the default run (default 200, about 30 s; the gloo
sample runs 1 in 25 of that, at least 20); ``pytest -m matrix`` draws 1000 more graph
examples and 40 more gloo programs (another seed: other programs than the default
run's); ``COMMFUSE_FUZZ_SEED=N``
draws other examples than the default (fixed) ones; ``COMMFUSE_FUZZ_SHRINK=1`` shrinks a
failure to a minimal program first (from seconds to minutes).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import math
import operator
import os
import re
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from cases import FP8, exchanged, float8_gathered, gathered, scaled_mm, scattered
from hypothesis import HealthCheck, Phase, assume, event, example, given, note, seed, settings
from hypothesis import strategies as st
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, SiteRecord, report
from commfuse_compile.passes import rewrite_graph

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
WAIT = c10d.wait_tensor.default
ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_TO_ALL = c10d.all_to_all_single.default
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
A2A_KINDS = ("mm_a2a", "a2a_mm")
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten._scaled_mm.default})
# what a collective reaches a matmul through (property 6): layout, copy, cast, reassembly, pad
NEXT_TO = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.t.default,
        aten.permute.default,
        aten.transpose.int,
        aten.clone.default,
        aten.contiguous.default,
        aten._to_copy.default,
        aten.split.Tensor,
        aten.cat.default,
        operator.getitem,
        aten.slice.Tensor,  # DTensor's unpadding of uneven shards
        aten.constant_pad_nd.default,  # and its padding
        aten.view.dtype,  # float8 gathered as bytes
        aten.detach.default,  # (make_fx's companion of a dtype view)
    }
)

SCHEDULES = ("ring", "bidir")
EXAMPLES = int(os.environ.get("COMMFUSE_FUZZ_EXAMPLES", "120"))
MATRIX_EXAMPLES = 1000  # pytest -m matrix: more graph examples, drawn with another seed
# the same examples on every run unless a seed asks for others
SEED = os.environ.get("COMMFUSE_FUZZ_SEED", "")
# shrinking a failure re-runs the pass thousands of times (minutes): opt in
SHRINK = os.environ.get("COMMFUSE_FUZZ_SHRINK", "") not in ("", "0")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
PROGRAM_DTYPES = (torch.float32, *DTYPES)  # float32 twice as often
SIZES = (2, 4, 3, 8, 1, 6, 5, 12, 0)  # op_input: the first 8 only
INTERNAL = re.compile(r"^commfuse: .*: internal error: ")  # ``declines.failed``'s warning
NAME = re.compile(r"\b[vx]\d+\b")  # a value of a built program


# ----------------------------------------------------------------------------------------
# recipes: what is drawn

OPS = (
    *("gather", "mm", "scatter", "matsum", "view", "transpose", "cast", "copy", "eltwise"),
    *("neighbour", "input", "output", "all_to_all", "scaled", "float8"),
)
# between a collective and its matmul: mostly what the pass sees through
CHAIN_OPS = ("view",) * 3 + ("transpose",) * 2 + ("cast", "copy", "eltwise", "neighbour")
CHAIN_OPS += ("in_place",) * 2  # Megatron- and DeepSpeed-style code
WORLDS = (2, 4, 3, 8, 1, 5, 6, 7)

Step = tuple[str, tuple[int, int, int, int]]
Layout = tuple[str, Callable[[torch.Tensor], torch.Tensor]]  # code ("{}": the value), function


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What ``Builder`` makes a program of: ops run in order on a growing list of values."""

    world: int
    rank: int
    dtype: torch.dtype
    shard: tuple[int, ...]
    steps: tuple[Step, ...]
    dead: bool  # leave values nothing reads in the graph (else the program returns them)


PARAM = st.integers(0, 7)
LATEST = st.sampled_from((0, 0, 0, 1, 2, 3))  # mostly the value just made
NEWEST = st.sampled_from((0,) * 7 + (1,))  # all but always


def step(ops: tuple[str, ...], src: st.SearchStrategy[int] = PARAM) -> st.SearchStrategy[Step]:
    return st.tuples(st.sampled_from(ops), st.tuples(src, PARAM, PARAM, PARAM))


CHAIN = st.lists(step(CHAIN_OPS, LATEST), max_size=3)
LAYOUT_CHAIN = st.lists(step(("view", "view", "transpose"), LATEST), max_size=2)


@st.composite
def segments(draw: st.DrawFn) -> list[Step]:
    """A few ops: a random one, or a collective next to a matmul (or both kinds around one)
    through random chains."""
    kinds = ("ag_mm", "mm_rs", "ag_mm_rs", "a2a", "float8", "float8", "any", "any")
    kind = draw(st.sampled_from(kinds))
    if kind == "any":
        return [draw(step(OPS))]
    if kind == "float8":
        return draw(float8_segments())

    def chain() -> list[Step]:
        return draw(CHAIN)

    if kind == "a2a":
        return draw(exchanges())

    if kind == "mm_rs":  # usually from a new input, its rows a multiple of the world size
        rows = draw(st.tuples(st.integers(3, 7), PARAM, PARAM, PARAM))
        before = [("input", rows)] if draw(st.integers(0, 3)) else []
    else:
        before = [draw(step(("gather",), LATEST)), *chain()]
    mm = draw(step(("mm", "mm", "matsum"), LATEST))
    after = [*chain(), draw(step(("scatter",), LATEST))] if kind != "ag_mm" else []
    return [*before, mm, *after]


@st.composite
def float8_segments(draw: st.DrawFn) -> list[Step]:
    """A new float8 input gathered (as its bytes or as itself) into a scaled matmul, or
    multiplied by one into a reduce-scatter, through random chains."""
    shape = ("float8", draw(st.tuples(st.integers(3, 7), PARAM, PARAM, PARAM)))
    scaled = draw(step(("scaled",), NEWEST))
    chain = draw(st.sampled_from((CHAIN, LAYOUT_CHAIN, LAYOUT_CHAIN)))  # (no float8 arithmetic)
    if draw(st.booleans()):
        return [shape, draw(step(("gather",), NEWEST)), *draw(chain), scaled]
    return [shape, scaled, *draw(chain), draw(step(("scatter",), LATEST))]


@st.composite
def exchanges(draw: st.DrawFn, chains: st.SearchStrategy[list[Step]] = CHAIN) -> list[Step]:
    """An all-to-all next to matmuls through random chains: a projection before it (mm_a2a:
    Ulysses' q/k/v), after it (a2a_mm: the output projection, a weight gradient), or both."""
    kind = draw(st.sampled_from(("mm_a2a", "a2a_mm", "a2a_mm", "mm_a2a_mm")))
    a2a, mm = step(("all_to_all",), NEWEST), step(("mm", "mm", "matsum"), NEWEST)
    projection = step(("mm",), NEWEST)  # a sum of matmuls is no block of one
    chains = draw(st.sampled_from((chains, chains, st.just([]))))  # or the layouts alone
    # a new input, its first dim a multiple of the world size
    shape = draw(st.tuples(st.integers(3, 7), PARAM, PARAM, PARAM))
    before = [("input", shape)] if draw(st.integers(0, 2)) else []
    if kind == "a2a_mm":
        return [*before, *draw(chains), draw(a2a), *draw(chains), draw(mm)]
    after = [draw(mm)] if kind == "mm_a2a_mm" else []
    return [*before, draw(projection), *draw(chains), draw(a2a), *draw(chains), *after]


@st.composite
def recipes(draw: st.DrawFn, worlds: tuple[int, ...] = WORLDS, exchange: bool = False) -> Recipe:
    """``exchange``: the first segment is an all-to-all next to matmuls."""
    world = draw(st.sampled_from(worlds))
    steps = draw(st.lists(segments(), min_size=1, max_size=4))
    if exchange:
        steps[0] = draw(exchanges(st.lists(step(CHAIN_OPS, NEWEST), max_size=2)))
    return Recipe(
        world=world,
        rank=draw(st.integers(0, world - 1)),
        dtype=draw(st.sampled_from(PROGRAM_DTYPES)),
        shard=tuple(draw(st.sampled_from(SIZES)) for _ in range(draw(st.sampled_from((2, 3, 1))))),
        steps=tuple(s for segment in steps for s in segment),
        dead=draw(st.booleans()),
    )


# ----------------------------------------------------------------------------------------
# programs: what a recipe builds


class Builder:
    """Runs a recipe's ops on tensors, writing each as a line of Python.

    ``take(shape, dtype)`` supplies every new input, so the same recipe builds the same
    program on meta tensors (to learn the input shapes) and under ``make_fx``.
    """

    def __init__(
        self, recipe: Recipe, take: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    ):
        self.recipe, self.n, self.take = recipe, recipe.world, take
        self.values: list[torch.Tensor] = []
        self.names: list[str] = []
        self.lines: list[str] = []
        self.inputs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.outputs: list[int] = []

    # -- bookkeeping

    def run(self) -> tuple[torch.Tensor, ...]:
        self.fresh(self.recipe.shard, self.recipe.dtype)
        for op, params in self.recipe.steps:
            getattr(self, f"op_{op}")(*params)
        return tuple(self.values[i] for i in self.returned())

    def returned(self) -> list[int]:
        """The last value, those marked as outputs and, unless the recipe keeps dead
        values, every value no op reads."""
        read = {name for line in self.lines for name in NAME.findall(line.split(" = ", 1)[1])}
        leaves = (
            []
            if self.recipe.dead
            else [i for i, name in enumerate(self.names) if name[0] == "v" and name not in read]
        )
        return list(dict.fromkeys([*self.outputs, *leaves, len(self.values) - 1]))

    def fresh(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        name = f"x{len(self.values)}"
        self.inputs.append((name, tuple(shape), dtype))
        return self._add(name, self.take(tuple(shape), dtype))

    def emit(self, code: str, value: torch.Tensor) -> int:
        name = f"v{len(self.values)}"
        self.lines.append(f"{name} = {code}")
        return self._add(name, value)

    def _add(self, name: str, value: torch.Tensor) -> int:
        self.values.append(value)
        self.names.append(name)
        return len(self.values) - 1

    def pick(self, i: int) -> int:
        """A value made earlier, not a scalar: 0 is the latest."""
        made = [j for j, x in enumerate(self.values) if x.dim()]
        return made[-1 - i % len(made)]

    def v(self, i: int) -> torch.Tensor:
        return self.values[i]

    def source(self) -> str:
        """The program as code that reproduces it."""
        args = ", ".join(name for name, _, _ in self.inputs)
        outs = ", ".join(self.names[i] for i in self.returned())
        body = [*self.lines, f"return ({outs},)"]
        inputs = ", ".join(f"torch.zeros({list(s)}, dtype={d})" for _, s, d in self.inputs)
        init = f"rank={self.recipe.rank}, world_size={self.n}, store=FakeStore()"
        return "\n".join(
            [
                f'dist.init_process_group("fake", {init})',
                "import torch.distributed._functional_collectives as funcol",
                "from cases import exchanged, float8_gathered, gathered, scaled_mm, scattered",
                "c10d = torch.ops._c10d_functional",
                "aten = torch.ops.aten",
                f"def program({args}):",
                *(f"    {line}" for line in body),
                f"gm = make_fx(program, tracing_mode='fake')({inputs})",
            ]
        )

    def as2d(self, i: int) -> int:
        x = self.v(i)
        if x.dim() == 2:
            return i
        shape = [math.prod(x.shape[:-1]), x.shape[-1]]  # no -1: sizes may be 0
        method = "view" if x.dim() == 1 else "reshape"
        return self.emit(f"{self.names[i]}.{method}({shape})", getattr(x, method)(shape))

    def operand(self, shape: tuple[int, ...], dtype: torch.dtype, avoid: int, i: int) -> int:
        """A value of ``shape`` made earlier (``i`` odd: if any), else a new input."""
        if i % 2:
            for j in reversed(range(len(self.values))):
                x = self.v(j)
                if j != avoid and tuple(x.shape) == shape and x.dtype == dtype:
                    return j
        return self.fresh(shape, dtype)

    # -- collectives

    def op_gather(self, src: int, dim: int, size: int, first: int) -> None:
        """``first`` 6 or 7: gathers the first input again (DTensor gathers a shard once per
        consumer: one ring, if on the same dim). Float8 is gathered as its bytes (``size``
        even) or as itself."""
        i = 0 if first >= 6 else self.pick(src)
        dim %= self.v(i).dim()
        n = self.n + 1 if size == 7 else self.n  # 7: names a group size it does not have
        fn = float8_gathered if self.v(i).dtype == FP8 and size % 2 == 0 else gathered
        self.emit(f"{fn.__name__}({self.names[i]}, {n}, {dim})", fn(self.v(i), n, dim))

    def op_scatter(self, src: int, dim: int, op: int, _: int) -> None:
        """Scatters ``dim``, or the first dim that divides (DTensor pads uneven shards, so
        its split + cat never has uneven parts); if none does, dim 0: the collective sees
        an uneven dim 0 as is, for the pass to decline."""
        i = self.pick(src)
        shape = self.v(i).shape
        fits = [d for d in range(len(shape)) if shape[d] % self.n == 0]
        dim %= len(shape)
        dim = dim if dim in fits else (fits or [0])[0]
        op_name = "avg" if op == 7 else "sum"
        self.emit(
            f"scattered({self.names[i]}, {self.n}, {dim}, {op_name!r})",
            scattered(self.v(i), self.n, dim, op_name),
        )

    def op_all_to_all(self, src: int, layout: int, splits: int, form: int) -> None:
        """``all_to_all_single`` of dim 0, laid out first and after as ``layout`` says:
        0: as it is (the first dim that divides moved to dim 0); 1: Ulysses' q/k/v side,
        [M, C] viewed [b, s, n, C/n] (or [b, s, n, h, d]), the heads to dim 0 and back as
        [b, n*s, C/n]; 2: its output side, [b, S, R] viewed [b, n, S/n, R], the sequence to
        dim 0 and back as [b*S/n, n*R]; 3: every n-th element in one block (interleaved).
        ``splits`` 6: the funcol API's ``None`` splits; 7 (``form`` odd): uneven; else equal
        lists (uneven where dim 0 does not divide). Where a layout does not fit the shape,
        plain (0)."""
        i = self.pick(src)
        n, x, name = self.n, self.v(i), self.names[i]
        layout %= 4
        pre, post = self._exchange_layout(x, layout, form)
        if pre is None:
            pre, post = self._exchange_layout(x, 0, form)
        assert pre is not None
        code, fn = pre
        j = self.emit(code.format(name), fn(x)) if code != "{}" else i
        y, yname = self.v(j), self.names[j]
        rows = y.shape[0]
        if (splits == 7 and form % 2) or rows % n:  # uneven: dim 0 does not divide, or asked
            m = rows // n
            sizes = [rows - (n - 1) * m, *([m] * (n - 1))]
            if m and n > 1 and sizes[0] == m:
                sizes[0], sizes[1] = m + 1, m - 1
            group = "dist.group.WORLD.group_name"
            code = f"c10d.wait_tensor(c10d.all_to_all_single({yname}, {sizes}, {sizes}, {group}))"
            out = c10d.wait_tensor(
                c10d.all_to_all_single(y, sizes, sizes, dist.group.WORLD.group_name)
            )
            k = self.emit(code, out)
            post = None  # the layout's sizes are for equal blocks
        elif splits == 6:
            code = f"funcol.all_to_all_single({yname}, None, None, dist.group.WORLD)"
            value = funcol.all_to_all_single(y, None, None, dist.group.WORLD)
            k = self.emit(code, value.wait() if hasattr(value, "wait") else value)
        else:
            k = self.emit(f"exchanged({yname}, {n})", exchanged(y, n))
        if post is not None:
            code, fn = post
            self.emit(code.format(self.names[k]), fn(self.v(k)))

    def _exchange_layout(
        self, x: torch.Tensor, layout: int, form: int
    ) -> tuple[Layout | None, Layout | None]:
        """The code (``{}`` the value) and function laying ``x`` out before the all-to-all,
        and after it; (None, None) where ``layout`` does not fit ``x``'s shape."""
        n, shape = self.n, list(x.shape)
        if layout == 0:
            d = next((d for d in range(len(shape)) if shape[d] % n == 0 and shape[d]), None)
            if d is None and x.numel() % n == 0 and len(shape) > 1:  # flat, if that divides
                return ("{}.reshape(-1)", lambda t: t.reshape(-1)), None
            if not d:  # dim 0, or nothing divides: uneven blocks
                return ("{}", lambda t: t), None
            return (
                f"{{}}.transpose(0, {d}).contiguous()",
                lambda t: t.transpose(0, d).contiguous(),
            ), None
        if layout == 1:  # [M, C] -> [n, b, s, C/n] -> [b, n*s, C/n]
            m, c = math.prod(shape[:-1]), shape[-1]
            if c % n or not m:
                return None, None
            b = (1, m, next((f for f in range(2, m) if m % f == 0), 1))[form % 3]
            s, hd = m // b, c // n
            hl = next((f for f in range(2, hd) if hd % f == 0), 0) if form >= 4 else 0
            heads = [hl, hd // hl] if hl else [hd]
            rest = list(range(3, 3 + len(heads)))
            view, perm = [b, s, n, *heads], [2, 0, 1, *rest]
            back, out = [1, 0, 2, *rest], [b, n * s, *heads]
            return (
                f"{{}}.reshape({view}).permute({perm}).contiguous()",
                lambda t: t.reshape(view).permute(perm).contiguous(),
            ), (
                f"{{}}.permute({back}).reshape({out})",
                lambda t: t.permute(back).reshape(out),
            )
        if layout == 2:  # [b, S, R] -> [n, b, S/n, R] -> [b*S/n, n*R]
            b, seq, r = 1, shape[0], math.prod(shape[1:])
            if len(shape) >= 3 and shape[1] % n == 0 and form % 2:
                b, seq, r = shape[0], shape[1], math.prod(shape[2:])
            if seq % n or not seq:
                return None, None
            view, out = [b, n, seq // n, r], [b * seq // n, n * r]
            return (
                f"{{}}.reshape({view}).permute([1, 0, 2, 3]).contiguous()",
                lambda t: t.reshape(view).permute(1, 0, 2, 3).contiguous(),
            ), (
                f"{{}}.permute([1, 2, 0, 3]).reshape({out})",
                lambda t: t.permute(1, 2, 0, 3).reshape(out),
            )
        numel = x.numel()  # 3: [N] as [N/n, n], transposed: block j holds elements j, j+n, ...
        if numel % n or not numel:
            return None, None
        view = [numel // n, n]
        return (
            f"{{}}.reshape({view}).t().contiguous().view([{numel}])",
            lambda t: t.reshape(view).t().contiguous().view(numel),
        ), None

    # -- matmuls

    def op_mm(self, src: int, role: int, bias: int, other: int) -> None:
        """One matmul reading ``src`` viewed 2-D as A [M, K] in one of four roles (or as
        both operands: A @ A^T)."""
        a = self.as2d(self.pick(src))
        m, k = self.v(a).shape
        dtype, name = self.v(a).dtype, self.names[a]
        p = (self.n, 2 * self.n, 3 * self.n, 5)[other % 4]
        role %= 4
        if role == 0 and other == 7:  # A @ A^T: the same value on both sides
            lhs, rhs, out = name, f"{name}.t()", (m, m)
            lhs_v, rhs_v = self.v(a), self.v(a).t()
        elif role == 0:  # rows: A @ W, W maybe given as [P, K] and transposed
            if other >= 4:
                w = self.operand((p, k), dtype, a, other)
                lhs, rhs, out = name, f"{self.names[w]}.t()", (m, p)
                lhs_v, rhs_v = self.v(a), self.v(w).t()
            else:
                w = self.operand((k, p), dtype, a, other)
                lhs, rhs, out = name, self.names[w], (m, p)
                lhs_v, rhs_v = self.v(a), self.v(w)
        elif role == 1:  # columns: Z @ A^T
            z = self.operand((p, k), dtype, a, other)
            lhs, rhs, out = self.names[z], f"{name}.t()", (p, m)
            lhs_v, rhs_v = self.v(z), self.v(a).t()
        elif role == 2:  # contract: A^T @ X
            x = self.operand((m, p), dtype, a, other)
            lhs, rhs, out = f"{name}.t()", self.names[x], (k, p)
            lhs_v, rhs_v = self.v(a).t(), self.v(x)
        else:  # contract_left: Y @ A
            y = self.operand((p, m), dtype, a, other)
            lhs, rhs, out = self.names[y], name, (p, k)
            lhs_v, rhs_v = self.v(y), self.v(a)
        self.matmul(lhs, lhs_v, rhs, rhs_v, out, bias)

    def matmul(
        self, lhs: str, lhs_v: torch.Tensor, rhs: str, rhs_v: torch.Tensor, out: tuple, bias: int
    ) -> int:
        """``bias`` 1..5: addmm with a bias of [C], [1, C], [R, C], [] or [C] with beta and
        alpha; else mm."""
        if bias not in range(1, 6):
            return self.emit(f"torch.mm({lhs}, {rhs})", torch.mm(lhs_v, rhs_v))
        rows, cols = out
        shape = {1: (cols,), 2: (1, cols), 3: (rows, cols), 4: (), 5: (cols,)}[bias]
        b = self.fresh(shape, lhs_v.dtype)
        code = f"torch.addmm({self.names[b]}, {lhs}, {rhs}"
        if bias == 5:
            value = torch.addmm(self.v(b), lhs_v, rhs_v, beta=2, alpha=3)
            return self.emit(f"{code}, beta=2, alpha=3)", value)
        return self.emit(f"{code})", torch.addmm(self.v(b), lhs_v, rhs_v))

    def op_scaled(self, src: int, role: int, form: int, other: int) -> None:
        """``torch._scaled_mm`` reading ``src`` viewed 2-D (cast to float8 first if it is
        not) as A in one of four roles, its other operand a new float8 input (B column-
        major, as float8 training lays weights out). ``form``: scales per tensor (even) or
        per row and column (odd); fast accumulation (2, 3, 6, 7); a bias (4, 5); a float8
        output (6, 7). ``other``: the other operand's size; 7: a float32 output."""
        i = self.as2d(self.pick(src))
        if self.v(i).dtype != FP8:
            i = self.emit(f"{self.names[i]}.to({FP8})", self.v(i).to(FP8))
        a, name = self.v(i), self.names[i]
        m, k = a.shape
        p = (self.n, 2 * self.n, 3 * self.n, 5)[other % 4]
        role %= 4
        if role == 0:  # rows: A @ W
            w = self.fresh((p, k), FP8)
            lhs, rhs = (name, a), (f"{self.names[w]}.t()", self.v(w).t())
        elif role == 1:  # columns: Z @ A^T
            z = self.fresh((p, k), FP8)
            lhs, rhs = (self.names[z], self.v(z)), (f"{name}.t()", a.t())
        elif role == 2:  # contract: A^T @ X
            x = self.fresh((p, m), FP8)
            lhs, rhs = (f"{name}.t()", a.t()), (f"{self.names[x]}.t()", self.v(x).t())
        else:  # contract_left: Y @ A
            y = self.fresh((p, m), FP8)
            lhs, rhs = (self.names[y], self.v(y)), (name, a)
        rows, cols = lhs[1].shape[0], rhs[1].shape[1]
        shapes = ((rows, 1), (1, cols)) if form % 2 else ((), ())
        scales = [self.fresh(shape, torch.float32) for shape in shapes]
        out = FP8 if form >= 6 else torch.float32 if other == 7 else torch.bfloat16
        bias = self.fresh((cols,), out) if form in (4, 5) else None
        fast = form % 4 >= 2
        values = [lhs[1], rhs[1], *(self.v(j) for j in scales)]
        if a.is_meta:  # (the meta function checks CUDA's layouts on meta tensors)
            value = torch.empty((rows, cols), dtype=out, device="meta")
        else:
            value = scaled_mm(*values, None if bias is None else self.v(bias), out, fast)
        names = [lhs[0], rhs[0], *(self.names[j] for j in scales)]
        bias_name = "None" if bias is None else self.names[bias]
        self.emit(f"scaled_mm({', '.join(names)}, {bias_name}, {out}, {fast})", value)

    def op_matsum(self, src: int, src2: int, form: int, bias: int) -> None:
        """A1 @ W1 + A2 @ W2 (+ A3 @ W3): the terms share the product's shape."""
        a = self.as2d(self.pick(src))
        m, _ = self.v(a).shape
        dtype = self.v(a).dtype
        p = (self.n, 2 * self.n, 3, 6)[form % 4]
        terms = []
        for t in range(3 if bias >= 6 else 2):
            if t == 0:
                lhs, lhs_v = self.names[a], self.v(a)
            elif form >= 4:  # given as [K, M] and transposed, like a weight gradient
                x = self.operand((3 + t, m), dtype, a, src2)
                lhs, lhs_v = f"{self.names[x]}.t()", self.v(x).t()
            else:
                other = self.as2d(self.pick(src2 + t))
                if self.v(other).shape[0] != m or self.v(other).dtype != dtype:
                    other = self.fresh((m, 2 + t), dtype)
                lhs, lhs_v = self.names[other], self.v(other)
            w = self.fresh((lhs_v.shape[1], p), dtype)
            terms.append(self.matmul(lhs, lhs_v, self.names[w], self.v(w), (m, p), bias % 2))
        total = terms[0]
        for t in terms[1:]:
            code = f"{self.names[total]} + {self.names[t]}"
            total = self.emit(code, self.v(total) + self.v(t))

    # -- layout, casts, element-wise

    def op_view(self, src: int, kind: int, _: int, __: int) -> None:
        i = self.pick(src)
        x, name = self.v(i), self.names[i]
        shape, numel = list(x.shape), x.numel()
        kind %= 6
        if kind == 0:  # rows x last dim
            new = [math.prod(shape[:-1]), shape[-1]]
        elif kind == 1:  # split the first dim (or add a leading 1)
            f = next((d for d in range(2, shape[0]) if shape[0] % d == 0), 1)
            new = [f, shape[0] // f, *shape[1:]]
        elif kind == 2:
            new = [numel]
        elif kind == 3:  # a 1 before the last dim, or first dim x the rest
            new = (
                [*shape[:-1], 1, shape[-1]] if len(shape) < 3 else [shape[0], math.prod(shape[1:])]
            )
        elif kind == 4:  # merge the last two dims
            new = [*shape[:-2], shape[-2] * shape[-1]] if len(shape) >= 2 else [1, *shape]
        else:  # a column: every dim in the rows
            new = [numel, 1]
        method = "view" if x.is_contiguous() else "reshape"
        self.emit(f"{name}.{method}({new})", getattr(x, method)(new))

    def op_transpose(self, src: int, kind: int, _: int, __: int) -> None:
        i = self.pick(src)
        x, name = self.v(i), self.names[i]
        kind = 0 if x.dim() < 2 else kind % 4
        if kind == 0 and x.dim() <= 2:
            self.emit(f"{name}.t()", x.t())
        elif kind in (0, 1):
            self.emit(f"{name}.transpose(0, 1)", x.transpose(0, 1))
        elif kind == 2:
            self.emit(f"{name}.transpose(-2, -1)", x.transpose(-2, -1))
        else:
            dims = list(reversed(range(x.dim())))
            self.emit(f"{name}.permute({dims})", x.permute(dims))

    def op_cast(self, src: int, dtype: int, _: int, __: int) -> None:
        i = self.pick(src)
        to = DTYPES[dtype % len(DTYPES)]
        self.emit(f"{self.names[i]}.to({to})", self.v(i).to(to))

    def op_eltwise(self, src: int, kind: int, other: int, _: int) -> None:
        i = self.pick(src)
        x, name = self.v(i), self.names[i]
        kind %= 4
        if kind == 0:
            self.emit(f"torch.relu({name})", torch.relu(x))
        elif kind == 1:
            self.emit(f"{name} * 2", x * 2)
        else:
            j = self.pick(other)
            y = self.v(j)
            if y.dtype != x.dtype or not broadcasts_to(y.shape, x.shape):
                j, y = i, x
            sign = "+" if kind == 2 else "*"
            value = x + y if kind == 2 else x * y
            self.emit(f"{name} {sign} {self.names[j]}", value)

    def op_copy(self, src: int, kind: int, _: int, __: int) -> None:
        i = self.pick(src)
        x, name = self.v(i), self.names[i]
        if kind % 3 == 0:
            self.emit(f"{name}.clone()", x.clone())
        elif kind % 3 == 1:
            self.emit(f"{name}.contiguous()", x.contiguous())
        else:
            self.emit(f"{name}.to({x.dtype}, copy=True)", x.to(x.dtype, copy=True))

    def op_in_place(self, src: int, kind: int, _: int, __: int) -> None:
        """The in-place c10d spelling as Dynamo traces it (Megatron's and DeepSpeed's
        code): the value copied into a preallocated buffer (``torch.empty``,
        ``empty_like``, ``new_empty``), or (kind 3) split into n parts copied into buffers
        and concatenated again (``dist.all_gather`` into a list, then ``torch.cat``)."""
        i = self.pick(src)
        x, name = self.v(i), self.names[i]
        shape, kind = list(x.shape), kind % 4
        if kind == 3 and x.dim() and x.shape[0] and x.shape[0] % self.n == 0:
            parts = x.split(x.shape[0] // self.n)
            split = f"{name}.split({len(parts[0])})"
            code = f"[aten.copy.default(torch.empty_like(p), p) for p in {split}]"
            value = torch.cat([aten.copy.default(torch.empty_like(p), p) for p in parts])
            self.emit(f"torch.cat({code})", value)
            return
        buffers = (
            (
                f"torch.empty({shape}, dtype={x.dtype})",
                lambda: torch.empty(shape, dtype=x.dtype, device=x.device),
            ),
            (f"torch.empty_like({name})", lambda: torch.empty_like(x)),
            (f"{name}.new_empty({shape})", lambda: x.new_empty(shape)),
        )
        code, buffer = buffers[kind % 3]
        self.emit(f"aten.copy.default({code}, {name})", aten.copy.default(buffer(), x))

    def op_neighbour(self, src: int, kind: int, _: int, __: int) -> None:
        """An op the pass does not see through, next to whatever ``src`` is."""
        i = self.pick(src)
        x, name = self.v(i), self.names[i]
        kind %= 7
        if kind == 0:
            self.emit(f"{name}[:1]", x[:1])
        elif kind == 1:
            self.emit(f"{name}.sum(-1, keepdim=True)", x.sum(-1, keepdim=True))
        elif kind == 2:
            y = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
            code = name if x.dim() == 3 else f"{name}.reshape(1, -1, {x.shape[-1]})"
            self.emit(f"torch.bmm({code}, {code}.transpose(1, 2))", torch.bmm(y, y.transpose(1, 2)))
        elif kind == 3:
            w = self.fresh((x.shape[-1], 3), x.dtype)
            self.emit(f"torch.matmul({name}, {self.names[w]})", torch.matmul(x, self.v(w)))
        elif kind == 4:
            self.emit(f"torch.softmax({name}, -1)", torch.softmax(x, -1))
        elif kind == 5:
            self.emit(f"{name}.add_(1)", x.add_(1))
        else:
            self.emit(f"torch.cat([{name}, {name}], -1)", torch.cat([x, x], -1))

    def op_input(self, rank: int, a: int, b: int, c: int, dtype: torch.dtype | None = None) -> None:
        """A new input of rank 1..3, its first dim a multiple of the world size if ``rank``
        is 3 or more."""
        shape = [SIZES[s] for s in (a, b, c)[: 1 + rank % 3]]
        shape[0] *= self.n if rank >= 3 else 1
        self.fresh(tuple(shape), dtype or self.recipe.dtype)

    def op_float8(self, rank: int, a: int, b: int, c: int) -> None:
        """A new float8 input (``op_input``'s shapes)."""
        self.op_input(rank, a, b, c, FP8)

    def op_output(self, src: int, _: int, __: int, ___: int) -> None:
        self.outputs.append(self.pick(src))


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    if len(shape) > len(target):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(target), strict=False))


@contextlib.contextmanager
def fake_world(n: int, rank: int) -> Iterator[None]:
    """The default process group: torch's fake backend, ``n`` ranks, this one ``rank``."""
    dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(recipe: Recipe) -> tuple[Builder, GraphModule]:
    """The recipe's program (run once on meta tensors for its inputs' shapes and its code)
    and its aten graph; recipes whose ops do not fit their shapes are skipped."""
    meta = Builder(recipe, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))
    try:
        meta.run()
    except Exception as err:  # noqa: BLE001
        note(f"does not build: {type(err).__name__}: {err}")
        assume(False)
    note(meta.source())
    inputs = [torch.zeros(shape, dtype=dtype) for _, shape, dtype in meta.inputs]
    try:
        return meta, trace(recipe, inputs)
    except Exception as err:  # noqa: BLE001
        note(f"does not trace: {type(err).__name__}: {err}")
        assume(False)
        raise  # pragma: no cover - assume raised


def trace(recipe: Recipe, inputs: list[torch.Tensor]) -> GraphModule:
    """The aten graph of the recipe's program, on fake values like AOTAutograd's."""

    def program(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        supply = iter(args)
        return Builder(recipe, lambda shape, dtype: next(supply)).run()

    return make_fx(program, tracing_mode="fake")(*inputs)


# ----------------------------------------------------------------------------------------
# oracles, computed on the graph before the rewrite


def calls(gm: GraphModule, target) -> list[Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def _reaches_matmul(frontier: list[Node], step: Callable[[Node], list[Node]]) -> bool:
    """Is a mm/addmm among ``frontier`` or beyond it (``step``: users or inputs), through
    ``NEXT_TO`` ops only?"""
    seen = set()
    while frontier:
        node = frontier.pop()
        if node.op != "call_function" or node in seen:
            continue
        if node.target in MATMULS:
            return True
        if node.target in NEXT_TO or copies_a_collective(node):
            seen.add(node)
            frontier.extend(step(node))
    return False


FRESH = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default})


def copies_a_collective(node: Node) -> bool:
    """The in-place spelling (Dynamo's): a waited collective's value, or a slice of it,
    copied whole into a new buffer of its dtype (the pass must see through it)."""
    if node.target is not aten.copy.default:
        return False
    buffer, src = node.args[:2]
    while isinstance(src, Node) and src.target in (aten.slice.Tensor, operator.getitem):
        src = src.args[0]
        if src.target is aten.split.Tensor:
            src = src.args[0]
    same = node.meta["val"].dtype == src.meta["val"].dtype if isinstance(src, Node) else False
    return buffer.target in FRESH and src.target is WAIT and same


def next_to_matmul(gm: GraphModule) -> dict[str, tuple[str, ...]]:
    """Collectives that must be reported (property 6), with the kinds that may report
    them: all-gathers whose waited value flows into a mm/addmm, reduce-scatters whose
    input flows out of one, through ``NEXT_TO`` ops; all-to-alls either way (``a2a_mm``
    where the value flows into one: the pass rewrites that side)."""
    names: dict[str, tuple[str, ...]] = {}

    def into(collective: Node) -> bool:
        readers = [user for wait in collective.users for user in wait.users]
        return _reaches_matmul(readers, lambda n: list(n.users))

    def out_of(collective: Node) -> bool:
        return _reaches_matmul([collective.args[0]], lambda n: n.all_input_nodes)  # type: ignore[list-item]

    for ag in calls(gm, ALL_GATHER):
        if into(ag):
            names[ag.name] = ("ag_mm",)
    for rs in calls(gm, REDUCE_SCATTER):
        if out_of(rs):
            names[rs.name] = ("mm_rs",)
    for a2a in calls(gm, ALL_TO_ALL):
        if into(a2a):
            names[a2a.name] = ("a2a_mm",)
        elif out_of(a2a):  # a2a_mm where it feeds a bmm/matmul, which the pass counts too
            names[a2a.name] = A2A_KINDS
    return names


def internal_errors(caught: list[warnings.WarningMessage], records: list[SiteRecord]) -> list[str]:
    """Warnings of an internal error, and sites declined for one (``internal...`` reasons:
    an exception inside the pass, or the verifier catching the lowering)."""
    warned = [str(w.message) for w in caught if INTERNAL.match(str(w.message))]
    return warned + [r.reason for r in records if r.reason.startswith("internal")]


def values_of(gm: GraphModule) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {
        node.name: (tuple(value.shape), value.dtype)
        for node in gm.graph.nodes
        if isinstance(value := node.meta.get("val"), torch.Tensor)
    }


def output_values(gm: GraphModule) -> list[tuple[tuple[int, ...], torch.dtype]]:
    (outs,) = gm.graph.output_node().args
    return [(tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in outs]  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------
# the properties


def check_rewrite(gm: GraphModule, schedule: str) -> list[SiteRecord]:
    """Rewrite ``gm`` in place with ``schedule``, checking properties 1-6."""
    before, original_outputs = gm.code, output_values(gm)
    must_report = next_to_matmul(gm)

    # 1. never raises, no internal error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = rewrite_graph(gm, "forward", Options(schedule=schedule, inner="eager"))
    assert internal_errors(caught, records) == []

    # 2. well formed
    gm.graph.lint()
    gm.recompile()

    # 3. declined sites keep the graph (their collectives, and all of it if none is rewritten)
    rewritten = [r for r in records if r.decision == "rewritten"]
    left = {n.name for target in COLLECTIVES for n in calls(gm, target)}
    for record in records:
        assert record.decision in ("rewritten", "declined"), record
        if record.decision == "declined":
            assert record.reason and record.nodes == [] and record.schedule == "off", record
            assert set(record.match.get("collectives", [])) <= left, record
        else:
            assert record.schedule == schedule and record.nodes, record
    if not rewritten:
        assert gm.code == before

    # 4. rewritten sites: collectives gone, every transfer waited
    for record in rewritten:
        assert not left & set(record.match["collectives"]), record
    p2ps = calls(gm, P2P)
    assert len(p2ps) == sum(r.p2p_ops for r in rewritten)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in p2ps:
        sends, _, recv_like, *_ = node.args
        outs = list(node.users)
        assert all(o.target is operator.getitem for o in outs), node.format_node()
        indices = sorted(int(o.args[1]) for o in outs)  # type: ignore[arg-type]
        assert indices == list(range(len(recv_like))), node.format_node()  # type: ignore[arg-type]
        for out in outs:
            assert [u.target for u in out.users] == [WAIT], out.format_node()
        for sent in sends:  # type: ignore[union-attr]
            waits = [u for u in sent.users if u.target is WAIT and order[u] > order[node]]
            assert waits, f"{sent.name}, sent by {node.name}, is not waited after it"

    # 5. runs on fake tensors, to the original outputs and the recorded values (if rewritten:
    # else it is the traced graph, as 3 checked)
    if rewritten:
        recorded = values_of(gm)
        placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        prop = FakeTensorProp(gm, detect_fake_mode(placeholders))
        prop.propagate_dont_convert_inputs(*placeholders)
        assert output_values(gm) == original_outputs
        assert values_of(gm) == recorded

    # 4b. rewritten all-to-alls: n - 1 pairwise exchanges of one block each, in n steps
    for record in rewritten:
        if record.kind in A2A_KINDS:
            check_exchange(gm, record)

    # 6. every collective next to a matmul has exactly one record, of a kind that reports it
    reported = collections.Counter(c for r in records for c in r.match.get("collectives", []))
    assert {c: k for c, k in reported.items() if k > 1} == {}
    assert [c for c in must_report if c not in reported] == []
    kinds = {c: r.kind for r in records for c in r.match.get("collectives", [])}
    assert {c: kinds[c] for c, ok in must_report.items() if kinds[c] not in ok} == {}
    return records


def check_exchange(gm: GraphModule, record: SiteRecord) -> None:
    """A rewritten all-to-all (``mm_a2a``/``a2a_mm``): its p2p_ops are the site's P2P
    nodes, n - 1 of them in n steps, step s sending this rank's block for rank r + s and
    receiving rank r - s's, every block a 1/n of the exchanged shape on dim 0."""
    n, rank = record.match["group_size"], dist.get_rank()
    assert isinstance(n, int)
    created = set(record.nodes)
    p2ps = [node for node in calls(gm, P2P) if node.name in created]
    assert record.schedule == "ring", record
    assert (record.p2p_ops, record.steps) == (n - 1, n) == (len(p2ps), n), record
    exchanged_shape = list(record.match["exchanged_shape"])  # type: ignore[call-overload]
    block = [exchanged_shape[0] // n, *exchanged_shape[1:]]
    for s, node in enumerate(p2ps, start=1):
        sends, send_peers, recv_like, recv_peers, *_ = node.args
        assert (list(send_peers), list(recv_peers)) == ([(rank + s) % n], [(rank - s) % n]), (  # type: ignore[arg-type]
            node.format_node()
        )
        for buffer in (*sends, *recv_like):  # type: ignore[misc]
            assert list(buffer.meta["val"].shape) == block, node.format_node()


def float8_events(records: list[SiteRecord], prefix: str = "") -> None:
    """Sites of scaled (float8) matmuls, for --hypothesis-show-statistics."""
    for record in records:
        if any(str(m).startswith("_scaled_mm") for m in record.match.get("matmuls", [])):  # type: ignore[attr-defined]
            event(f"{prefix}float8: {record.kind} {record.decision}")


@pytest.fixture(scope="module", autouse=True)
def quiet_pass_log():
    """Thousands of sites: keep the per-site log lines out of the captured output."""
    assert not dist.is_initialized(), "the fuzzer initializes a fake process group per example"
    logger = logging.getLogger("commfuse")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
    report.reset()


# PyTorch's async-TP float8 cases, drawn every time (besides what the draw finds): a
# float8 shard [4n, 12] gathered as bytes into _scaled_mm with row-wise scales (rows), and
# _scaled_mm with row-wise scales and a bias into a reduce-scatter of its rows
FLOAT8_EXAMPLES = [
    Recipe(3, 1, torch.float32, (2,), (("float8", (4, 1, 7, 0)), ("gather", (0, 0, 0, 0)),
           ("scaled", (0, 0, 1, 0))), dead=False),
    Recipe(4, 2, torch.float32, (2,), (("float8", (4, 1, 7, 0)), ("scaled", (0, 0, 5, 1)),
           ("scatter", (0, 0, 0, 0))), dead=False),
]  # fmt: skip


def graph_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not SEED,
        database=None,
        phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if SHRINK else [])],
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@graph_settings(EXAMPLES)
@seed(int(SEED or 0))
@given(recipe=recipes())
@example(recipe=FLOAT8_EXAMPLES[0])
@example(recipe=FLOAT8_EXAMPLES[1])
def test_rewrite_graph_on_random_programs(recipe: Recipe):
    check_random_program(recipe)


@pytest.mark.matrix
@graph_settings(MATRIX_EXAMPLES)
@seed(int(SEED or 0) + 1)  # not the default run's draws again
@given(recipe=recipes())
def test_rewrite_graph_on_more_random_programs(recipe: Recipe):
    check_random_program(recipe)


def check_random_program(recipe: Recipe) -> None:
    """Properties 1-6 of one drawn program, for both schedules."""
    with fake_world(recipe.world, recipe.rank):
        _, traced = build(recipe)
        for schedule in SCHEDULES:
            note(f"schedule={schedule!r}")
            records = check_rewrite(GraphModule(traced, copy.deepcopy(traced.graph)), schedule)
            if schedule == "ring":  # --hypothesis-show-statistics
                for kind, decision in sorted({(r.kind, r.decision) for r in records}):
                    event(f"{kind} {decision}")
                float8_events(records)
                if any(copies_a_collective(n) for n in traced.graph.nodes):
                    event("in-place spelling of a collective")
    report.reset()


# ----------------------------------------------------------------------------------------
# a numerical sample on real gloo ranks

GLOO_WORLDS = (2, 3, 4)  # the rank pools test_numerics uses too
GLOO_EXAMPLES = max(12, EXAMPLES // 25)
MATRIX_GLOO_EXAMPLES = 40  # pytest -m matrix: more programs on gloo, another seed
TO_INT64 = DTYPES.index(torch.int64)


def runs_on_gloo(recipe: Recipe, gm: GraphModule) -> bool:
    """Can the traced program run on real ranks, and compare across a rewrite? Not if a
    collective names a group size it does not have, averages (gloo cannot), scatters a
    dim 0 that does not divide, exchanges uneven blocks (the same split sizes on every
    rank), or moves an empty tensor; nor with a cast to int64 (a different summation
    order can move a value across an integer); nor with float8 arithmetic, which torch
    does not run on this CPU."""
    if not runs_on_cpu(gm):
        return False
    if any(op == "cast" and params[1] % len(DTYPES) == TO_INT64 for op, params in recipe.steps):
        return False
    for node in (n for target in COLLECTIVES for n in calls(gm, target)):
        shard = node.args[0].meta["val"]  # type: ignore[union-attr]
        if shard.dtype == FP8:  # gloo moves float8 only as bytes (and adds none)
            return False
        if node.target is ALL_TO_ALL:
            splits = list(node.args[1])  # type: ignore[arg-type]
            size = len(splits)
            if len(set(splits)) != 1 or list(node.args[2]) != splits:  # type: ignore[arg-type]
                return False
        else:
            size = node.args[1 if node.target is ALL_GATHER else 2]
        if size != recipe.world or shard.numel() == 0:
            return False
        if node.target is REDUCE_SCATTER and (
            node.args[1] != "sum" or shard.shape[0] % recipe.world
        ):
            return False
    return True


# what torch runs on float8 tensors on this CPU (no element-wise arithmetic)
FLOAT8_ON_CPU = frozenset(
    {
        *NEXT_TO,
        aten.alias.default,
        aten.copy.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten._scaled_mm.default,
    }
)


def runs_on_cpu(gm: GraphModule) -> bool:
    """Does torch run every op of the program on this CPU (no float8 arithmetic)?"""
    return all(
        node.target in FLOAT8_ON_CPU
        for node in gm.graph.nodes
        if node.op == "call_function"
        for arg in node.all_input_nodes
        if getattr(arg.meta.get("val"), "dtype", None) == FP8
    )


def run_recipe_on_rank(
    rank: int, world_size: int, recipe: Recipe, schedule: str, seed: int
) -> dict | None:
    """On one gloo rank: the program and its rewrite on the same random inputs (None if
    the program overflows them). ``eps``: of the least precise float dtype in the graph."""
    logging.getLogger("commfuse").setLevel(logging.ERROR)
    recipe = dataclasses.replace(recipe, rank=rank)
    meta = Builder(recipe, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))
    meta.run()
    gen = torch.Generator().manual_seed(seed * 16 + rank)
    inputs = [
        torch.randint(-3, 4, shape, generator=gen, dtype=dtype)
        if not dtype.is_floating_point
        else (torch.randn(shape, generator=gen) / 2).to(dtype)
        for _, shape, dtype in meta.inputs
    ]
    gm = trace(recipe, inputs)
    expected = gm(*(x.clone() for x in inputs))  # clones: the program may add_ in place
    rewritten = GraphModule(gm, copy.deepcopy(gm.graph))
    records = rewrite_graph(rewritten, "forward", Options(schedule=schedule, inner="eager"))
    actual = rewritten(*(x.clone() for x in inputs))
    report.reset()

    def comparable(x: torch.Tensor) -> torch.Tensor:
        return x.float() if x.dtype == FP8 else x

    if not all(torch.isfinite(comparable(x)).all() for x in expected if x.is_floating_point()):
        return None
    # float8 operands are exact inputs of the scaled matmuls, which compute in float32:
    # their precision counts only where an output is float8
    outputs = {x.dtype for x in expected}
    floats = {
        dtype
        for _, dtype in values_of(gm).values()
        if dtype.is_floating_point and (dtype != FP8 or dtype in outputs)
    }

    return {
        "pairs": [(comparable(e), comparable(a)) for e, a in zip(expected, actual, strict=True)],
        "rewritten": sum(r.decision == "rewritten" for r in records),
        "eps": max((torch.finfo(d).eps for d in floats), default=0.0),
    }


def gloo_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not SEED,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )


GLOO_DRAWS = {
    "recipe": st.one_of(recipes(GLOO_WORLDS), recipes(GLOO_WORLDS, exchange=True)),
    "schedule": st.sampled_from(SCHEDULES),
    "data_seed": st.integers(0, 2**16),
}


@gloo_settings(GLOO_EXAMPLES)
@seed(int(SEED or 0))
@given(**GLOO_DRAWS)
@example(recipe=FLOAT8_EXAMPLES[0], schedule="ring", data_seed=1)
@example(recipe=FLOAT8_EXAMPLES[1], schedule="bidir", data_seed=2)
def test_random_programs_compute_the_same_values_on_gloo(ranks, recipe, schedule, data_seed):
    check_on_gloo(ranks, recipe, schedule, data_seed)


@pytest.mark.matrix
@gloo_settings(MATRIX_GLOO_EXAMPLES)
@seed(int(SEED or 0) + 1)  # not the default run's draws again
@given(**GLOO_DRAWS)
def test_more_random_programs_compute_the_same_values_on_gloo(ranks, recipe, schedule, data_seed):
    check_on_gloo(ranks, recipe, schedule, data_seed)


def check_on_gloo(ranks, recipe: Recipe, schedule: str, data_seed: int) -> None:
    """Rewritten graphs compute what the originals do, up to summation order: within a
    few dozen units in the last place of the least precise float dtype in the graph,
    relative to the output's largest value."""
    with fake_world(recipe.world, recipe.rank):
        _, traced = build(recipe)
        assume(runs_on_gloo(recipe, traced))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = rewrite_graph(traced, "forward", Options(schedule=schedule, inner="eager"))
        report.reset()
    assert internal_errors(caught, records) == []
    assume(any(r.decision == "rewritten" for r in records))  # the graph fuzz covers the rest
    for kind in sorted({r.kind for r in records if r.decision == "rewritten"}):
        event(f"gloo: {kind} rewritten")  # --hypothesis-show-statistics
    float8_events(records, "gloo: ")
    results = ranks(recipe.world).run(run_recipe_on_rank, recipe, schedule, data_seed)
    assume(all(result is not None for result in results))
    for rank, result in enumerate(results):
        assert result["rewritten"] == len([r for r in records if r.decision == "rewritten"])
        tolerance = 32 * result["eps"]
        for i, (expected, actual) in enumerate(result["pairs"]):
            scale = expected.abs().max().item() if expected.numel() else 0.0
            torch.testing.assert_close(
                actual,
                expected,
                rtol=tolerance,
                atol=tolerance * scale,
                equal_nan=True,
                msg=lambda m, rank=rank, i=i: f"rank {rank}, output {i}: {m}",
            )
