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
