"""Edge cases, each with the decision the pass must take and its reason.

Graphs are traced on torch's fake process group (rank 1 of 4, and a 2 x 2 mesh over the
same ranks), like tests/test_graph.py, which already covers: sub-groups named by
``new_group`` (``test_sub_group_ring_uses_global_ranks``), a group size the group does not
have, unknown groups, int64 (declined), a scattered dim the group does not divide, and
gathers of one shard on different dims. Rewritten non-contiguous inputs are also run on
real gloo ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import gathered, scattered
from torch._guards import detect_fake_mode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import Options
from commfuse_compile.passes import rewrite_graph

N, RANK = 4, 1
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
RING = Options(schedule="ring", inner="eager")
REWRITTEN = "schedule 'ring' requested"
UNEVEN_SCATTER = (
    "mm_rs",
    "declined",
    "uneven shards: the product is padded to a multiple of the group size",
)


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world_mesh():
    """The world as a 1-D mesh, for DTensor programs."""
    return init_device_mesh("cpu", (N,))


@pytest.fixture(scope="module")
def mesh():
    """2 x 2 (dp, tp) over ranks [[0, 1], [2, 3]]: rank 1's tp group is {0, 1}, its dp
    group {1, 3}."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def fx(fn, *inputs: torch.Tensor) -> GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def calls(gm: GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def rand(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(shape) for shape in shapes]


def output_values(gm: GraphModule) -> list[tuple[torch.Size, torch.dtype]]:
    outs = gm.graph.output_node().args[0]
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [(out.meta["val"].shape, out.meta["val"].dtype) for out in outs]


def rewrite(gm: GraphModule) -> list[tuple[str, str, str]]:
    """(kind, decision, reason) per site; a graph with nothing rewritten must be left
    byte-identical, a rewritten one must run on fake tensors to the original outputs."""
    before, outputs = gm.code, output_values(gm)
    records = rewrite_graph(gm, "forward", RING)
    if all(r.decision == "declined" for r in records):
        assert gm.code == before
    else:
        placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        prop = FakeTensorProp(gm, detect_fake_mode(placeholders))
        prop.propagate_dont_convert_inputs(*placeholders)
        assert output_values(gm) == outputs
    return [(r.kind, r.decision, r.reason) for r in records]


def on(group: dist.ProcessGroup):
    """All-gather (dim 0) and reduce-scatter (dim 0, sum) on ``group``."""
    n, name = group.size(), group.group_name

    def gather(x: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, name))

    def scatter(z: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", n, name))

    return gather, scatter


# ----------------------------------------------------------------------------------------
# groups


def test_group_of_size_one_is_declined():
    gather, scatter = on(dist.new_group([RANK]))
    gm = fx(lambda x, w, a: (gather(x) @ w, scatter(a @ w)), *rand((2, 8), (8, 6), (4, 8)))
    assert rewrite(gm) == [
        ("ag_mm", "declined", "group of size 1: nothing to communicate"),
        ("mm_rs", "declined", "group of size 1: nothing to communicate"),
    ]


@pytest.mark.parametrize(("dim", "peer"), [("tp", 0), ("dp", 3)])
def test_mesh_sub_group_rings_over_its_own_global_ranks(mesh, dim, peer):
    group = mesh[dim].get_group()
    gather, scatter = on(group)
    gm = fx(lambda x, w, a: (gather(x) @ w, scatter(a @ w)), *rand((2, 8), (8, 6), (4, 8)))
    assert rewrite(gm) == [("ag_mm", "rewritten", REWRITTEN), ("mm_rs", "rewritten", REWRITTEN)]
    p2ps = calls(gm, P2P)
    assert len(p2ps) == 2  # one step each on a group of 2
    assert {(tuple(p.args[1]), tuple(p.args[3]), p.args[5]) for p in p2ps} == {
        ((peer,), (peer,), group.group_name)
    }


def test_two_groups_in_one_graph_each_site_keeps_its_group(mesh):
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()
    (gather_tp, _), (gather_dp, scatter_dp) = on(tp), on(dp)

    def program(x, w, v, a):
        """The same shard gathered on both groups (two values: two rings), and a
        reduce-scatter on one of them."""
        return gather_tp(x) @ w, gather_dp(x) @ v, scatter_dp(a @ w)

    gm = fx(program, *rand((2, 8), (8, 6), (8, 5), (4, 8)))
    assert rewrite(gm) == [("ag_mm", "rewritten", REWRITTEN)] * 2 + [
        ("mm_rs", "rewritten", REWRITTEN)
    ]
    assert not calls(gm, COLLECTIVES[0]) and not calls(gm, COLLECTIVES[1])
    groups = [(p.args[5], tuple(p.args[1])) for p in calls(gm, P2P)]
    assert sorted(groups) == sorted(
        [(tp.group_name, (0,)), (dp.group_name, (3,)), (dp.group_name, (3,))]
    )


# ----------------------------------------------------------------------------------------
# the gathered tensor on both sides of one matmul


def test_gathered_tensor_as_both_operands_is_declined():
    """G @ G^T is no sum or concatenation of one operand's blocks."""
    gm = fx(lambda x: gathered(x, N, 0) @ gathered(x, N, 0).t(), torch.randn(2, 8))
    assert rewrite(gm) == [("ag_mm", "declined", "mm: reads the gathered tensor as both operands")]


# ----------------------------------------------------------------------------------------
# uneven shards: DTensor pads them to a multiple of the group size


def test_uneven_gather_is_reported_declined(world_mesh):
    """DTensor gathers 7 rows over 4 ranks as 4 x 2 and slices the padding off."""

    def program(x, w):
        rows = DTensor.from_local(
            x, world_mesh, [Shard(0)], shape=torch.Size([7, 8]), stride=(8, 1), run_check=False
        )
        return rows.redistribute(world_mesh, [Replicate()]).to_local() @ w

    gm = fx(program, *rand((2, 8), (8, 6)))
    assert calls(gm, torch.ops.aten.slice.Tensor)
    ((kind, decision, reason),) = rewrite(gm)
    assert (kind, decision) == ("ag_mm", "declined")
    assert reason.endswith("(slice.Tensor) sits between the gathered tensor and a matmul")


def test_uneven_reduce_scatter_is_reported_declined(world_mesh):
    """DTensor reduce-scatters a 7-row product over 4 ranks padded to 8 rows."""

    def program(a, w):
        partial = DTensor.from_local(a @ w, world_mesh, [Partial()], run_check=False)
        return partial.redistribute(world_mesh, [Shard(0)]).to_local()

    gm = fx(program, *rand((7, 8), (8, 6)))
    assert rewrite(gm) == [UNEVEN_SCATTER]


def test_padded_product_without_dtensor_is_declined_the_same():
    gm = fx(lambda a, w: scattered(F.pad(a @ w, (0, 0, 0, 1)), N, 0), *rand((7, 8), (8, 6)))
    assert rewrite(gm) == [UNEVEN_SCATTER]


# ----------------------------------------------------------------------------------------
# non-contiguous inputs: rewritten (blocks are sliced and viewed, copied only where a view
# cannot be: a local shard that is not 2-D rows already is copied once)


def noncontiguous_programs(n: int) -> dict:
    """name -> (program, input makers): every matmul role, and both reduce-scatter forms,
    with one input given transposed (non-contiguous)."""

    def t(*shape: int):
        return lambda gen: torch.randn(*reversed(shape), generator=gen).t()

    def c(*shape: int):
        return lambda gen: torch.randn(*shape, generator=gen)

    return {
        "shard": (lambda x, w: gathered(x, n, 0) @ w, [t(2, 8), c(8, 6)]),
        "shard-3d-dim1": (
            lambda x, w: gathered(x, n, 1).reshape(-1, 8) @ w,
            [lambda gen: torch.randn(3, 2, 8, generator=gen).transpose(0, 1), c(8, 6)],
        ),
        "weight": (lambda x, w: gathered(x, n, 0) @ w, [c(2, 8), t(8, 6)]),
        "contract": (lambda x, y: gathered(x, n, 0).t() @ y, [c(2, 8), t(2 * n, 5)]),
        "contract_left": (lambda x, y: y @ gathered(x, n, 0), [c(2, 8), t(3, 2 * n)]),
        "columns": (lambda x, z: z @ gathered(x, n, 0).t(), [c(2, 8), t(3, 8)]),
        "rs-rows": (lambda a, w: scattered(a @ w, n, 0), [t(2 * n, 8), c(8, 6)]),
        "rs-rows-dim1": (
            lambda a, w: scattered((a @ w).view(2, 2 * n, 6), n, 1),
            [t(4 * n, 8), c(8, 6)],
        ),
        "rs-columns": (lambda a, w: scattered(a @ w, n, 1), [c(4, 8), t(8, 2 * n)]),
    }


def make_inputs(makers, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [make(gen) for make in makers]


@pytest.mark.parametrize("name", list(noncontiguous_programs(N)))
def test_noncontiguous_inputs_are_rewritten(name):
    program, makers = noncontiguous_programs(N)[name]
    inputs = make_inputs(makers, seed=0)
    assert not all(x.is_contiguous() for x in inputs)
    ((kind, decision, reason),) = rewrite(fx(program, *inputs))
    assert (decision, reason) == ("rewritten", REWRITTEN)


def noncontiguous_on_rank(rank: int, n: int, name: str) -> dict:
    """On one gloo rank: the original and the rewritten program, same non-contiguous inputs."""
    program, makers = noncontiguous_programs(n)[name]
    inputs = make_inputs(makers, seed=rank)
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    rewritten = commfuse_compile.apply(copy.deepcopy(gm), schedule="ring", inner="eager")
    return {
        "p2p": len(calls(rewritten, P2P)),
        "expected": gm(*inputs),
        "actual": rewritten(*inputs),
    }


@pytest.mark.parametrize("name", list(noncontiguous_programs(2)))
def test_noncontiguous_inputs_compute_the_same_values_on_gloo(ranks, name):
    for result in ranks(2).run(noncontiguous_on_rank, name):
        assert result["p2p"] == 1
        torch.testing.assert_close(result["actual"], result["expected"], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# zero-size dims: nothing to overlap


def gather_mm(x, w):
    return gathered(x, N, 0) @ w


def mm_scatter(a, w):
    return scattered(a @ w, N, 0)


AG_EMPTY = ("ag_mm", "declined", "mm (rows): a zero-size dim: nothing to overlap")
RS_EMPTY = ("mm_rs", "declined", "mm has a zero-size dim: nothing to overlap")


@pytest.mark.parametrize(
    ("program", "shapes", "expected"),
    [
        pytest.param(gather_mm, ((0, 8), (8, 6)), AG_EMPTY, id="ag-no-rows"),
        pytest.param(gather_mm, ((2, 0), (0, 6)), AG_EMPTY, id="ag-no-k"),
        pytest.param(gather_mm, ((2, 8), (8, 0)), AG_EMPTY, id="ag-no-columns"),
        pytest.param(mm_scatter, ((0, 8), (8, 6)), RS_EMPTY, id="rs-no-rows"),
        pytest.param(mm_scatter, ((8, 0), (0, 6)), RS_EMPTY, id="rs-no-k"),
        pytest.param(mm_scatter, ((8, 3), (3, 0)), RS_EMPTY, id="rs-no-columns"),
    ],
)
def test_zero_size_dims_are_declined(program, shapes, expected):
    assert rewrite(fx(program, *rand(*shapes))) == [expected]


# ----------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize(
    ("dtype", "decision", "reason"),
    [
        pytest.param(torch.float16, "rewritten", REWRITTEN, id="float16"),
        pytest.param(torch.bfloat16, "rewritten", REWRITTEN, id="bfloat16"),
        pytest.param(torch.float32, "rewritten", REWRITTEN, id="float32"),
        pytest.param(torch.float64, "rewritten", REWRITTEN, id="float64"),
        pytest.param(
            torch.int32,
            "declined",
            "has dtype torch.int32; only floating point is decomposed",
            id="int32",
        ),
    ],
)
def test_dtypes(dtype, decision, reason):
    """Float dtypes are rewritten, integers declined (int64: test_graph.py)."""
    x, w, a = (t.to(dtype) for t in rand((2, 8), (8, 6), (4 * N, 8)))
    gm = fx(lambda x, w, a: (gather_mm(x, w), mm_scatter(a, w)), x, w, a)
    records = rewrite(gm)
    assert [(kind, d) for kind, d, _ in records] == [("ag_mm", decision), ("mm_rs", decision)]
    assert all(reason in r for _, _, r in records), records
    assert {value_dtype for _, value_dtype in output_values(gm)} == {dtype}
