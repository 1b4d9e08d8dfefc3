"""Matmul -> all-reduce (plain tensor parallelism's row-parallel output, and the
column-parallel input's gradient): every all-reduce is a site, rewritten as the
reduce-scatter ring of its product's rows and one all-gather of the reduced rows, or
declined with a reason.

Graph level on torch's fake process group (rank 1 of 4); numbers on 3 and 4 gloo ranks,
forward and backward, eager and Inductor, against the uncompiled program: a functional
all-reduce after a matmul, DTensor's ColwiseParallel + RowwiseParallel MLP with their
default layouts, and Megatron-style linears without sequence parallelism (in-place
``dist.all_reduce`` in autograd.Functions).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from models import in_place_sum, tensor_parallel_regions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.cost.profiles import BUILTIN
from commfuse_compile.cost.simulator import Work, predict
from commfuse_compile.passes import rewrite_graph

N, RANK = 4, 1
PREV, NEXT = (RANK - 1) % N, (RANK + 1) % N
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
ALL_REDUCE = c10d.all_reduce.default
ALL_GATHER = c10d.all_gather_into_tensor.default
RING = Options(schedule="ring", inner="eager")
MATRIX = pytest.mark.matrix


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def reduced(y: torch.Tensor, op: str = "sum") -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(y, op, dist.group.WORLD.group_name))


def fx(fn, *shapes, tracing_mode: str = "fake") -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode=tracing_mode)(*(torch.randn(s) for s in shapes))


def calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def row_parallel(x, w):
    return reduced(x @ w)


def row_parallel_3d(x, w):
    """A linear on [batch, tokens, hidden]: view -> mm -> view, as aten writes it."""
    return reduced(torch.nn.functional.linear(x, w))


# ----------------------------------------------------------------------------------------
# graph level


@pytest.mark.parametrize(
    ("fn", "shapes", "rows"),
    [
        pytest.param(row_parallel, ((8, 6), (6, 5)), 8, id="2d"),
        pytest.param(row_parallel_3d, ((2, 4, 6), (5, 6)), 8, id="3d"),
    ],
)
def test_all_reduce_becomes_a_reduce_ring_then_one_all_gather(fake_world, fn, shapes, rows):
    gm = fx(fn, *shapes)
    (record,) = rewrite_graph(gm, "forward", RING)
    assert (record.kind, record.decision, record.schedule) == ("mm_ar", "rewritten", "ring")
    assert record.match["product_shape"] == [rows, 5] and record.match["blocks"] == "rows"
    assert calls(gm, ALL_REDUCE) == []
    p2p = calls(gm, P2P)
    assert len(p2p) == N - 1
    assert all(node.args[1] == [NEXT] and node.args[3] == [PREV] for node in p2p)
    (gather,) = calls(gm, ALL_GATHER)
    assert list(gather.args[0].meta["val"].shape) == [rows // N, 5]  # this rank's rows
    assert gather.args[1:] == (N, dist.group.WORLD.group_name)
    assert len(calls(gm, aten.mm.default)) == N  # one block's partial per step


def test_averaging_all_reduce_divides_this_ranks_rows_once(fake_world):
    gm = fx(lambda x, w: reduced(x @ w, "avg"), (8, 6), (6, 5))
    (record,) = rewrite_graph(gm, "forward", RING)
    assert record.decision == "rewritten"
    (div,) = calls(gm, aten.div.Tensor)
    assert div.args[1] == N
    assert all(node.args[1] == "sum" for node in calls(gm, c10d.reduce_scatter_tensor.default))


def test_sliced_all_reduce_reduce_scatters_chunks_then_gathers_once(fake_world):
    gm = fx(row_parallel, (16, 6), (6, 5))
    (record,) = rewrite_graph(gm, "forward", Options(schedule="slicing", inner="eager"))
    assert (record.decision, record.schedule) == ("rewritten", "slicing")
    assert len(calls(gm, c10d.reduce_scatter_tensor.default)) == 2
    assert len(calls(gm, ALL_GATHER)) == 1


def product_read_twice(x, w):
    y = x @ w
    return reduced(y), y


def cast_then_reduced(x, w):
    return reduced((x.bfloat16() @ w.bfloat16()).float())


@pytest.mark.parametrize(
    ("fn", "shapes", "code", "reason"),
    [
        pytest.param(
            lambda x: reduced(x.relu()),
            ((8, 6),),
            "ar.not_matmul",
            "all-reduce input is relu (relu.default), not a matmul",
            id="not-matmul",
        ),
        pytest.param(
            lambda x, w: reduced((x @ w).relu()),
            ((8, 6), (6, 5)),
            "ar.not_matmul",
            "all-reduce input is relu",
            id="activation-after-matmul",
        ),
        pytest.param(
            product_read_twice,
            ((8, 6), (6, 5)),
            "ar.product_shared",
            "is also used outside the all-reduce",
            id="product-shared",
        ),
        pytest.param(
            lambda x, w: reduced(x @ w, "max"),
            ((8, 6), (6, 5)),
            "ar.not_sum",
            "reduce op 'max' is neither 'sum' nor 'avg'",
            id="max",
        ),
        pytest.param(
            row_parallel,
            ((6, 6), (6, 5)),
            "ar.indivisible",
            "the product's 6 rows (tokens) are not divisible by the group size 4",
            id="indivisible",
        ),
        pytest.param(
            lambda x, w: reduced(x.long() @ w.long()),
            ((8, 6), (6, 5)),
            "site.dtype",
            "matmul output has dtype torch.int64",
            id="integer",
        ),
    ],
)
def test_declined_all_reduce_is_recorded_and_kept(fake_world, fn, shapes, code, reason):
    gm = fx(fn, *shapes)
    before = gm.code
    (record,) = rewrite_graph(gm, "forward", RING)
    assert (record.kind, record.decision, record.decline_code) == ("mm_ar", "declined", code)
    assert reason in record.reason
    assert gm.code == before


def in_place_spelling(x, w):
    """``dist.all_reduce(y)`` as AOTAutograd writes it: the result copied over y."""
    y = x @ w
    return aten.copy.default(y, reduced(y))


def test_in_place_all_reduce_is_read_as_the_functional_one(fake_world):
    gm = fx(in_place_spelling, (8, 6), (6, 5))
    (record,) = rewrite_graph(gm, "forward", RING)
    assert record.decision == "rewritten", record.reason
    assert calls(gm, aten.copy.default) == calls(gm, ALL_REDUCE) == []


def test_in_place_all_reduce_of_a_graph_input_keeps_its_copy(fake_world):
    gm = fx(lambda y: aten.copy.default(y, reduced(y)), (8, 5))
    (record,) = rewrite_graph(gm, "forward", RING)
    assert record.decline_code == "ar.not_matmul"
    assert len(calls(gm, aten.copy.default)) == 1


def test_rows_not_provably_divisible_under_dynamic_shapes(fake_world):
    gm = fx(row_parallel, (8, 6), (6, 5), tracing_mode="symbolic")
    (record,) = rewrite_graph(gm, "forward", RING)
    assert record.decline_code == "ar.not_provably_divisible", record.reason


def test_cast_between_matmul_and_all_reduce_joins_the_site(fake_world):
    gm = fx(cast_then_reduced, (8, 6), (6, 5))
    (record,) = rewrite_graph(gm, "forward", RING)
    assert record.decision == "rewritten", record.reason
    (gather,) = calls(gm, ALL_GATHER)
    assert gather.args[0].meta["val"].dtype == torch.float32  # partials added in float32


def test_auto_keeps_the_all_reduce_for_few_tokens(fake_world):
    gm = fx(row_parallel, (8, 6), (6, 5))
    (record,) = rewrite_graph(gm, "forward", Options(schedule="auto", inner="eager"))
    assert (record.kind, record.decline_code) == ("mm_ar", "plan.not_profitable")
    assert len(calls(gm, ALL_REDUCE)) == 1


def test_cost_of_an_all_reduce_site_adds_one_all_gather_to_every_schedule():
    """The reduce half as mm_rs's, then the same all-gather after the collective and
    after each schedule: the all-reduce is timed as reduce-scatter + all-gather."""
    profile = BUILTIN["gloo-loopback"]
    work = Work("reduce", 4, 1e9, 1e6, 1)
    alone = predict(work, profile)
    gathered = predict(dataclasses.replace(work, then_gather=True), profile)
    collective = predict(Work("gather", 4, 0.0, 1e6, 1), profile)["collective"]
    (gather,) = {e.end_s - e.start_s for e in collective.events if e.lane == "comm"}
    assert set(gathered) == set(alone)
    for schedule, timeline in gathered.items():
        assert timeline.end_s > alone[schedule].end_s
        assert timeline.end_s == pytest.approx(alone[schedule].end_s + gather, rel=1e-6), schedule


# ----------------------------------------------------------------------------------------
# numbers on gloo ranks: a two-linear MLP, column- then row-parallel, no sequence
# parallelism (the row-parallel output all-reduced; the column-parallel input's
# gradient all-reduced in the backward)

HIDDEN, FFN, TOKENS = 8, 12, (2, 6)  # 12 tokens: divisible by 3 and 4 ranks


def functional_sum(t: torch.Tensor) -> torch.Tensor:
    """The functional all-reduce, as DTensor and hand-written functional code sum."""
    from torch.distributed._functional_collectives import all_reduce

    return all_reduce(t, "sum", dist.group.WORLD)


def hand_written_mlp(copy, reduce):
    def mlp(x, w1, b1, w2):
        h = torch.nn.functional.gelu(torch.nn.functional.linear(copy.apply(x), w1, b1))
        return reduce.apply(torch.nn.functional.linear(h, w2))

    return mlp


def shards(rank: int, n: int) -> list[torch.Tensor]:
    """This rank's rows of w1 and b1 (column-parallel), columns of w2 (row-parallel)."""
    torch.manual_seed(0)
    w1, b1, w2 = torch.randn(FFN * n, HIDDEN), torch.randn(FFN * n), torch.randn(HIDDEN, FFN * n)
    rows = slice(rank * FFN, (rank + 1) * FFN)
    return [w1[rows], b1[rows], w2[:, rows]]


class Mlp(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(HIDDEN, FFN * n)
        self.down = torch.nn.Linear(FFN * n, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def dtensor_mlp(n: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (n,))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(Mlp(n), mesh, plan)


HAND_WRITTEN = {
    "functional": hand_written_mlp(*tensor_parallel_regions(functional_sum)),
    "megatron": hand_written_mlp(*tensor_parallel_regions(in_place_sum)),
}


def mlp_step(rank: int, n: int, program: str, inner: str, schedule: str = "ring") -> dict:
    """One forward and backward of ``program``, uncompiled and compiled: the relative
    errors of the output and every gradient, and the sites."""
    import torch._inductor.config
    from models import relative_error

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    report.reset()
    options = {"schedule": schedule, "inner": inner}
    torch.manual_seed(1)
    x = torch.randn(*TOKENS, HIDDEN)  # replicated: the same on every rank
    results = []
    for compiled in (False, True):
        leaf = x.clone().requires_grad_()
        if program == "dtensor":
            model = dtensor_mlp(n)
            run = torch.compile(model, backend="commfuse", options=options) if compiled else model
            params = list(model.parameters())
            out = run(leaf)
        else:
            fn = HAND_WRITTEN[program]
            params = [p.requires_grad_() for p in shards(rank, n)]
            run = (
                torch.compile(fn, backend="commfuse", options=options, fullgraph=True)
                if compiled
                else fn
            )
            out = run(leaf, *params)
        (out * out).sum().backward()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        results.append([out.detach(), leaf.grad, *grads])
    expected, actual = results
    return {
        "errors": [relative_error(a, e) for a, e in zip(actual, expected, strict=True)],
        "sites": [(r.graph, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites],
        "p2p_ops": [r.p2p_ops for r in report.REPORT.sites],
    }


REWRITTEN = [("forward", "mm_ar", "rewritten", ""), ("backward", "mm_ar", "rewritten", "")]


# the rest: matrix (Megatron's in-place all-reduce in training: test_plain_tp by default)
DEFAULT_CELLS = {(3, "dtensor", "inductor")}
CELLS = [
    pytest.param(n, program, inner, marks=() if (n, program, inner) in DEFAULT_CELLS else MATRIX)
    for n in (3, 4)
    for program in ("functional", "megatron", "dtensor")
    for inner in ("eager", "inductor")
]


@pytest.mark.parametrize(("n", "program", "inner"), CELLS)
def test_tensor_parallel_mlp_matches_on_gloo_ranks(ranks, n, program, inner):
    for r in ranks(n).run(mlp_step, program, inner):
        print(n, program, inner, "relative errors (out, dx, grads...):", r["errors"])
        assert max(r["errors"]) < 1e-5, r["errors"]  # summation order only
        assert r["sites"] == REWRITTEN, r["sites"]
        assert r["p2p_ops"] == [n - 1, n - 1]  # the reduce-scatter half's ring steps
