"""A matmul fed by two collectives (2-D: data parallel x tensor parallel): both are hidden.

Three shapes of it, as a 2 x 2 mesh's training step writes them:
* ``x @ AG_dp(w).t()`` with ``x = AG_tp(activation)``: the later site (the weight's ring,
  column blocks) is rewritten first; the activation's ring runs inside its first window,
  under the weight's first transfer; the other windows read the rebuilt activation;
* ``RS_tp(x @ AG_dp(w).t())``: the reduce-scatter's ring first; the weight's ring runs in
  its first window, computing that block's columns as the weight's blocks arrive;
* ``RS_dp(dy.t() @ AG_tp(x))`` (a weight gradient): the same, with a contracted product.

Graph level on torch's fake process group (rank 1 of a 2 x 2 mesh: tp group {0, 1}, dp
group {1, 3}), numbers on 4 real gloo ranks, eager and through Inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import Options
from commfuse_compile.passes import rewrite_graph

c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
WAIT = c10d.wait_tensor.default
COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
RING = Options(schedule="ring", inner="eager")


def gather(x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, group))
    return out if dim == 0 else torch.cat(torch.split(out, x.shape[0]), dim=dim)


def scatter(z: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", 2, group))


def programs(tp: str, dp: str) -> dict:
    """name -> (program, input shapes, kinds in the order the pass rewrites them)."""

    def product(x, w, weight_group):
        g = gather(x, tp, dim=1)
        return g.reshape(-1, g.shape[-1]) @ gather(w, weight_group).t()

    def gathered_times_gathered(x, w):
        return product(x, w, dp)

    def gathered_times_gathered_on_one_group(x, w):
        return product(x, w, tp)

    def scattered_product_of_gathered_weight(x, w):
        return scatter(x @ gather(w, dp).t(), tp)

    def weight_gradient_of_gathered_input(dy, x):
        return scatter(dy.t() @ gather(x, tp), dp)

    return {
        "ag_tp-ag_dp": (gathered_times_gathered, [(2, 3, 8), (3, 8)], ["ag_mm", "ag_mm"]),
        # one group: the activation's ring goes after the weight's gather, which nests
        "ag_tp-ag_tp": (gathered_times_gathered_on_one_group, [(2, 3, 8), (3, 8)], ["ag_mm"] * 2),
        "ag_dp-rs_tp": (scattered_product_of_gathered_weight, [(4, 8), (3, 8)], ["mm_rs", "ag_mm"]),
        "ag_tp-rs_dp": (weight_gradient_of_gathered_input, [(8, 6), (4, 5)], ["mm_rs", "ag_mm"]),
    }


# ----------------------------------------------------------------------------------------
# graph level


@pytest.fixture(scope="module")
def groups():
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    yield mesh["tp"].get_group().group_name, mesh["dp"].get_group().group_name
    dist.destroy_process_group()


def p2ps_of(gm: GraphModule, site: int) -> list[Node]:
    return [n for n in gm.graph.find_nodes(op="call_function", target=P2P) if _site(n) == site]


def _site(node: Node) -> int:
    return node.meta["commfuse"]["site"]


def position(gm: GraphModule, node: Node) -> int:
    return list(gm.graph.nodes).index(node)


@pytest.mark.parametrize("name", ["ag_tp-ag_dp", "ag_tp-ag_tp", "ag_dp-rs_tp", "ag_tp-rs_dp"])
def test_both_collectives_of_a_2d_matmul_are_rewritten(groups, name):
    program, shapes, kinds = programs(*groups)[name]
    gm = make_fx(program, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    outer, inner = rewrite_graph(gm, "forward", RING)
    assert [outer.kind, inner.kind] == kinds
    assert [outer.decision, inner.decision] == ["rewritten", "rewritten"], inner.reason
    assert not any(gm.graph.find_nodes(op="call_function", target=t) for t in COLLECTIVES)
    gm.graph.lint()
    # the inner ring keeps one matmul of the outer's (its first window); the outer's other
    # window reads the tensor the inner ring rebuilt
    assert len(inner.match["matmuls"]) == 1
    assert [u.split(" (")[0] for u in inner.match["unmatched"]] != []
    assert all("in another window of site" in u for u in inner.match["unmatched"])
    (outer_p2p,) = p2ps_of(gm, outer.site)
    (inner_p2p,) = p2ps_of(gm, inner.site)
    if outer.kind == "ag_mm":
        # nested: the inner ring runs while the outer's first transfer is in flight
        outer_waits = [u for g in outer_p2p.users for u in g.users if u.target is WAIT]
        assert position(gm, outer_p2p) < position(gm, inner_p2p)
        assert position(gm, inner_p2p) < min(position(gm, w) for w in outer_waits)
    else:
        # the reduce ring sends its first block once the inner ring has computed it
        assert position(gm, inner_p2p) < position(gm, outer_p2p)


def test_three_projections_of_one_gathered_activation_nest_in_the_first(groups):
    """q, k, v = x @ AG_dp(wq).t(), ...: the activation's ring nests in q's first window;
    k's and v's windows each keep their own matmul to hide their weight's transfer."""
    tp, dp = groups

    def qkv(x, wq, wk, wv):
        g = gather(x, tp, dim=1).reshape(-1, 8)
        return tuple(g @ gather(w, dp).t() for w in (wq, wk, wv))

    weights = [torch.randn(3, 8) for _ in range(3)]
    gm = make_fx(qkv, tracing_mode="fake")(torch.randn(2, 3, 8), *weights)
    records = rewrite_graph(gm, "forward", RING)
    assert [r.decision for r in records] == ["rewritten"] * 4
    activation = records[-1]
    assert activation.match["group"] == tp and len(activation.match["matmuls"]) == 1
    assert len(activation.match["unmatched"]) == 5  # q's second window, k's and v's two
    gm.graph.lint()


# ----------------------------------------------------------------------------------------
# numbers on 4 gloo ranks


def run_on_rank(rank: int, n: int, name: str, inner: str) -> dict:
    torch.manual_seed(rank)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"].get_group().group_name, mesh["dp"].get_group().group_name
    program, shapes, _ = programs(tp, dp)[name]
    inputs = [torch.randn(s) for s in shapes]
    expected = program(*inputs)
    commfuse_compile.report.reset()
    if inner == "inductor":
        torch._dynamo.reset()
        compiled = torch.compile(program, backend="commfuse", options={"schedule": "ring"})
        actual = compiled(*inputs)
    else:
        gm = make_fx(program, tracing_mode="fake")(*inputs)
        actual = commfuse_compile.apply(copy.deepcopy(gm), schedule="ring")(*inputs)
    decisions = [r.decision for r in commfuse_compile.report.REPORT.sites]
    return {"expected": expected, "actual": actual, "decisions": decisions}


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("name", ["ag_tp-ag_dp", "ag_tp-ag_tp", "ag_dp-rs_tp", "ag_tp-rs_dp"])
def test_2d_matmul_computes_the_same_values_on_gloo(ranks, name, inner):
    for out in ranks(4).run(run_on_rank, name, inner):
        assert out["decisions"] == ["rewritten", "rewritten"]
        torch.testing.assert_close(out["actual"], out["expected"], rtol=1e-5, atol=1e-5)
