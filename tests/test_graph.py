"""Graph-level tests of the CommFuse pass: what it rewrites, what it declines, and why.

Everything runs in this process on torch's fake process group (rank 1 of 4, so the
ring neighbours are prev=0 and next=2): graphs are traced with fake values like
AOTAutograd's, rewritten, and inspected node by node. Numerics are checked elsewhere,
on real gloo ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import operator
import warnings

import pytest
import torch
import torch.distributed as dist
from cases import AgMm, Experts, FusedQkv, MmRs, Ulysses, exchanged, gathered, scattered, trace
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import CommfuseOptionError, Options, report
from commfuse_compile.cost.profiles import BUILTIN, save
from commfuse_compile.options import DEBUG_DIR_ENV
from commfuse_compile.passes import PASSED, resolve_options, rewrite_and_compile, rewrite_graph
from commfuse_compile.passes.kinds import KINDS, mm_a2a
from commfuse_compile.passes.kit import ring
from commfuse_compile.passes.prepare import unfuse

N, RANK = 4, 1
PREV, NEXT = (RANK - 1) % N, (RANK + 1) % N

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
CONVERT = torch.ops.prims.convert_element_type.default
WAIT = c10d.wait_tensor.default
ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
MATMULS = (aten.mm.default, aten.addmm.default)

RING = Options(schedule="ring", inner="eager")  # eager: plain node order, no control_deps


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# helpers


def build(case) -> GraphModule:
    """The aten graph of a ``cases`` builder on the world group, as rank RANK sees it."""
    return trace(case, N, case.inputs(RANK, seed=0))


def fx(fn, *shapes) -> GraphModule:
    """``fn`` traced with fake values, for graph shapes the builders cannot express."""
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def calls(gm: GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def new_nodes(gm: GraphModule, record) -> list[torch.fx.Node]:
    by_name = {node.name: node for node in gm.graph.nodes}
    return [by_name[name] for name in record.nodes]


def rewrite_one(gm: GraphModule, options: Options = RING):
    records = rewrite_graph(gm, "forward", options)
    assert len(records) == 1, [(r.kind, r.reason) for r in records]
    return records[0]


def source(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a view or slice reads from."""
    while node.target in (aten.view.default, aten.slice.Tensor):
        node = node.args[0]
    return node


def strip_values(gm: GraphModule) -> GraphModule:
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    return gm


# ----------------------------------------------------------------------------------------
# programs the ``cases`` builders cannot express


def gather_mm_on(group_name: str, group_size: int):
    def program(x, w):
        return torch.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(x, group_size, group_name)), w)

    return program


def gather_twice(x, w1, w2):
    """DTensor emits one all-gather of the same shard per consumer (gate and up)."""
    return torch.mm(gathered(x, N, 0), w1), torch.mm(gathered(x, N, 0), w2)


def gather_mm(x, w):
    return torch.mm(gathered(x, N, 0), w)


def scatter_and_reuse_product(a, w):
    z = torch.mm(a, w)
    return scattered(z, N, 0), z * 2


def gather_then_weight(x, w0):
    """The weight's transpose is traced after the gather's reassembly (as F.linear emits)."""
    g = gathered(x, N, 1)
    return torch.mm(g.reshape(-1, g.shape[-1]), w0.t())


def gather_then_gathered_weight(x, w_shard):
    """The weight is itself all-gathered after the activation's gather (FSDP + TP)."""
    g = gathered(x, N, 1)
    return torch.mm(g.reshape(-1, g.shape[-1]), gathered(w_shard, N, 0))


def gather_mm_scatter(x, w):
    return scattered(torch.mm(gathered(x, N, 0), w), N, 0)


# ----------------------------------------------------------------------------------------
# rewritten sites: structure

# (case, send peer, receive peer): the gather ring sends to prev, the reduce ring to next
REWRITES = [
    pytest.param(AgMm(), PREV, NEXT, id="ag_mm-dim1-2consumers-bias"),
    pytest.param(AgMm(dim=0, consumers=1, bias=False), PREV, NEXT, id="ag_mm-dim0-mm"),
    pytest.param(MmRs(dim=1), NEXT, PREV, id="mm_rs-rows-dim1"),
    pytest.param(MmRs(lead=(4, 2), dim=0), NEXT, PREV, id="mm_rs-rows-dim0"),
    pytest.param(MmRs(dim=2, n_out=8), NEXT, PREV, id="mm_rs-columns-dim2"),
]


@pytest.mark.parametrize(("case", "send_peer", "recv_peer"), REWRITES)
def test_site_becomes_n_minus_1_ring_steps(case, send_peer, recv_peer):
    gm = build(case)
    record = rewrite_one(gm)
    assert (record.decision, record.schedule) == ("rewritten", "ring")
    assert record.reason == "schedule 'ring' requested"
    assert len(calls(gm, P2P)) == N - 1
    assert calls(gm, ALL_GATHER) == [] and calls(gm, REDUCE_SCATTER) == []
    assert record.steps == N and record.p2p_ops == N - 1
    assert record.match["group_size"] == N
    gm.graph.lint()


def _gathers_times(k: int):
    return lambda x: [gathered(x, N, 0) * i for i in range(k)]


def test_a_site_has_the_same_id_on_every_rank():
    """A site's id is its graph's number and its place among the graph's sites as
    matched, not a count of the sites this process met before: two ranks (two fresh
    reports) whose second graphs had 2 and 1 sites give the third graph's site one id,
    which its P2P labels and nodes carry."""
    seen = []
    for unread_gathers in (2, 1):
        report.reset()
        rewrite_graph(build(MmRs()), "forward", RING)
        earlier = fx(_gathers_times(unread_gathers), (2, 3))
        rewrite_graph(earlier, "forward", RING)
        gm = build(AgMm())
        (record,) = rewrite_graph(gm, "forward", RING)
        p2ps = calls(gm, P2P)
        assert {p.meta["commfuse"]["site"] for p in p2ps} == {record.site}
        assert p2ps[0].args[6] == f"site {record.site} step 0 (ag_mm)"
        seen.append((record.site, [r.site for r in report.REPORT.sites]))
    assert seen[0][0] == seen[1][0] == "2.0"
    assert seen[0][1] == ["0.0", "1.0", "1.1", "2.0"] and seen[1][1] == ["0.0", "1.0", "2.0"]


@pytest.mark.parametrize(("case", "send_peer", "recv_peer"), REWRITES)
def test_p2p_peers_are_ring_neighbours(case, send_peer, recv_peer):
    gm = build(case)
    rewrite_one(gm)
    tags = set()
    (record,) = report.REPORT.sites[-1:]
    for step, node in enumerate(calls(gm, P2P)):
        sends, send_peers, recv_like, recv_peers, tag, group_name, label = node.args
        assert (len(sends), len(recv_like)) == (1, 1)
        assert (send_peers, recv_peers) == ([send_peer], [recv_peer])
        assert group_name == dist.group.WORLD.group_name
        assert label == f"site {record.site} step {step} ({record.kind})"  # named in errors
        tags.add(tag)
    assert len(tags) == 1  # one tag per site: the ring's messages cannot mix with another's


@pytest.mark.parametrize(("case", "send_peer", "recv_peer"), REWRITES)
def test_every_transfer_is_waited_exactly_once(case, send_peer, recv_peer):
    """The received block is waited before any use; the sent buffer, on which the send's
    work is registered, is waited after the P2P op (so no compiler reuses it earlier)."""
    gm = build(case)
    rewrite_one(gm)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in calls(gm, P2P):
        (out,) = node.users
        assert (out.target, out.args[1]) == (operator.getitem, 0)  # the received block
        assert [u.target for u in out.users] == [WAIT], out.name
        (sent,) = node.args[0]
        waits = [u for u in sent.users if u.target is WAIT]
        assert len(waits) == 1 and order[waits[0]] > order[node], sent.name


@pytest.mark.parametrize(("case", "send_peer", "recv_peer"), REWRITES)
def test_new_nodes_carry_site_step_lane_and_fake_value(case, send_peer, recv_peer):
    gm = build(case)
    record = rewrite_one(gm)
    created = new_nodes(gm, record)
    assert created
    for node in created:
        tag = node.meta["commfuse"]
        assert set(tag) == {"site", "step", "lane"}, node.name
        assert tag["site"] == record.site
        assert tag["step"] in range(N + 1)
        assert tag["lane"] in ("comm", "compute")
        assert isinstance(node.meta["val"], FakeTensor) or (
            node.target is P2P and all(isinstance(v, FakeTensor) for v in node.meta["val"])
        ), node.name
        if node.target in MATMULS:
            assert tag["lane"] == "compute", node.name
        if node.target in (P2P, WAIT, operator.getitem):
            assert tag["lane"] == "comm", node.name
    p2p_steps = sorted(n.meta["commfuse"]["step"] for n in created if n.target is P2P)
    assert p2p_steps == list(range(N - 1))


@pytest.mark.parametrize(("case", "send_peer", "recv_peer"), REWRITES)
def test_one_partial_matmul_per_step_and_consumer(case, send_peer, recv_peer):
    gm = build(case)
    record = rewrite_one(gm)
    partials = [n for n in new_nodes(gm, record) if n.target in MATMULS]
    consumers = getattr(case, "consumers", 1)
    steps = collections.Counter(n.meta["commfuse"]["step"] for n in partials)
    assert steps == {s: consumers for s in range(N)}
    # each consumer's weight (or a column block of it) is multiplied once per step
    weight_arg = 2 if case.bias else 1
    weights = collections.Counter(source(n.args[weight_arg]).name for n in partials)
    assert sorted(weights.values()) == [N] * len(weights)


@pytest.mark.parametrize(
    ("case", "scatter_dim", "blocks"),
    [
        pytest.param(MmRs(dim=1), 1, "rows", id="dim1"),
        pytest.param(MmRs(lead=(4, 2), dim=0), 0, "rows", id="dim0"),
        pytest.param(MmRs(dim=2, n_out=8), 2, "columns", id="dim2-last"),
    ],
)
def test_mm_rs_block_kind(case, scatter_dim, blocks):
    gm = build(case)
    record = rewrite_one(gm)
    assert record.match["scatter_dim"] == scatter_dim
    assert record.match["blocks"] == blocks
    slices = [n for n in new_nodes(gm, record) if n.target is aten.slice.Tensor]
    assert len(slices) == N * (2 if blocks == "columns" else 1)
    # rows slice the activation (arg0_1, viewed to the scattered shape), columns slice
    # the weight (arg1_1) and the bias (arg2_1)
    sources = {source(n.args[0]).name for n in slices}
    assert sources == ({"arg1_1", "arg2_1"} if blocks == "columns" else {"arg0_1"})


def test_ag_mm_consumers_keep_their_names_and_shapes():
    gm = build(AgMm())
    original = {n.name: n.meta["val"].shape for n in calls(gm, aten.addmm.default)}
    record = rewrite_one(gm)
    assert record.match["matmuls"] == ["addmm", "addmm_1"]
    outputs = {n.name: n for n in gm.graph.output_node().args[0]}
    assert set(outputs) == set(original)
    for name, node in outputs.items():
        assert node.target is aten.view.default
        assert node.meta["val"].shape == original[name]
        assert node.args[0].target is aten.cat.default and len(node.args[0].args[0]) == N


def test_rewritten_graph_runs_with_the_original_output_shapes():
    case = AgMm()
    inputs = case.inputs(RANK, seed=0)
    gm = build(case)
    expected = [(t.shape, t.dtype) for t in gm(*inputs)]
    rewrite_one(gm)
    assert [(t.shape, t.dtype) for t in gm(*inputs)] == expected


def wrapped(gm: GraphModule, target) -> list[torch.fx.Node]:
    """Nodes calling ``target``, directly or wrapped in ``control_deps`` (Inductor mode)."""

    def inner(node):
        if node.target is not torch.ops.higher_order.control_deps:
            return node.target
        subgraph = getattr(gm, node.args[1].target).graph
        return next(n.target for n in subgraph.nodes if n.op == "call_function")

    return [n for n in gm.graph.nodes if n.op == "call_function" and inner(n) is target]


def test_inductor_mode_orders_the_steps_with_control_deps():
    gm = build(AgMm())
    record = rewrite_one(gm, Options(schedule="ring"))
    assert record.decision == "rewritten"
    p2ps = wrapped(gm, P2P)
    assert len(p2ps) == N - 1
    deps = calls(gm, torch.ops.higher_order.control_deps)
    ordered_after = {d for node in deps for d in node.args[0]}
    assert set(p2ps) <= ordered_after  # every transfer starts before its matmuls
    for previous, start in zip(p2ps, p2ps[1:], strict=False):  # and after the one before
        assert previous in start.args[0]
    for node in new_nodes(gm, record):  # wrapped nodes keep name, tag and value
        assert node.meta["commfuse"]["site"] == record.site and "val" in node.meta


@pytest.mark.parametrize(
    ("ranks", "prev", "nxt"),
    [
        pytest.param([1, 3], 3, 3, id="size2"),
        pytest.param([0, 1, 3], 0, 3, id="size3-global-ranks"),
    ],
)
def test_sub_group_ring_uses_global_ranks(ranks, prev, nxt):
    group = dist.new_group(ranks=ranks)
    gm = fx(gather_mm_on(group.group_name, len(ranks)), (2, 8), (8, 6))
    record = rewrite_one(gm)
    assert record.decision == "rewritten" and record.match["group_size"] == len(ranks)
    p2ps = calls(gm, P2P)
    assert len(p2ps) == len(ranks) - 1
    for node in p2ps:
        assert (node.args[1], node.args[3], node.args[5]) == ([prev], [nxt], group.group_name)


def test_two_gathers_of_one_shard_share_one_ring():
    gm = fx(gather_twice, (2, 8), (8, 6), (8, 5))
    assert len(calls(gm, ALL_GATHER)) == 2
    record = rewrite_one(gm)
    assert record.decision == "rewritten"
    assert record.match["collectives"] == ["all_gather_into_tensor", "all_gather_into_tensor_1"]
    assert record.match["matmuls"] == ["mm", "mm_1"]
    assert len(calls(gm, P2P)) == N - 1
    assert calls(gm, ALL_GATHER) == []
    gm.graph.lint()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_shares_the_ring_and_accumulates_per_block(dtype):
    """dW = t(AG(dY)) @ X next to dX = AG(dY) @ W: one ring, the gathered dim contracted
    block by block (X's rows of block b with dY's block b), no gathered tensor rebuilt."""
    gm = trace(
        case := AgMm(consumers=1, contract=1, bias=False, dtype=dtype),
        N,
        case.inputs(RANK, seed=0, n=N),
    )
    record = rewrite_one(gm)
    assert record.decision == "rewritten"
    assert record.match["matmuls"] == ["mm", "mm_1"]
    assert record.match["roles"] == {"mm": "rows", "mm_1": "contract"}
    assert calls(gm, ALL_GATHER) == [] and len(calls(gm, P2P)) == N - 1
    created = new_nodes(gm, record)
    transposes = [n for n in created if n.target is aten.permute.default]
    assert len(transposes) == N  # one transposed block per step
    slices = [n for n in created if n.target is aten.slice.Tensor]
    starts = sorted(n.args[2] for n in slices)
    width = case.shard[case.dim]
    assert starts == [b * width for b in range(N)]  # X's rows of every block, once each
    first = [n for n in created if n.target is aten.mm.default and n.args[0] in transposes]
    if dtype == torch.float32:  # one running sum: mm, then an addmm per later block
        later = [n for n in created if n.target is aten.addmm.default and n.args[1] in transposes]
        assert len(first) == 1 and len(later) == N - 1
        assert [n.args[0] for n in later] == [first[0], *later[:-1]]
    else:  # half precision partials are summed in float32, cast back once
        casts = [n for n in created if n.target is CONVERT]  # what Inductor can lower
        assert len(casts) == N + 1
        assert casts[-1].args[1] == dtype
    assert not [n for n in created if n.target is aten.cat.default and n.args[1] == 0]
    gm.graph.lint()


def test_reduce_scatter_of_a_sum_of_matmuls_sums_every_term_per_block():
    """dX = dG @ Wg + dU @ Wu, then reduce-scatter: each ring step computes the block of
    both terms (SwiGLU's shared input in the backward)."""
    gm = fx(
        lambda a, b, w1, w2: scattered((a @ w1 + b @ w2).view(2, 4, 6), N, 1),
        (8, 5),
        (8, 3),
        (5, 6),
        (3, 6),
    )
    record = rewrite_one(gm)
    assert record.decision == "rewritten"
    assert record.match["matmuls"] == ["mm", "mm_1"]
    assert calls(gm, REDUCE_SCATTER) == [] and len(calls(gm, P2P)) == N - 1
    created = new_nodes(gm, record)
    assert sum(n.target is aten.mm.default for n in created) == 2 * N  # both terms, every block
    gm.graph.lint()


@pytest.mark.parametrize("schedule", ["ring", "slicing"])
def test_averaging_reduce_scatter_sums_the_blocks_and_divides_its_own_once(schedule):
    """reduce op "avg" (Partial("avg")): the sum over ranks, as for "sum", then this rank's
    block divided by n once; the slicing schedule's chunks are reduced with "sum"."""
    gm = build(MmRs(lead=(2, 8), op="avg"))
    record = rewrite_one(gm, Options(schedule=schedule))
    assert record.decision == "rewritten" and record.match["reduce_op"] == "avg"
    divisions = [n for n in new_nodes(gm, record) if n.target is aten.div.Tensor]
    assert [d.args[1] for d in divisions] == [N]
    assert all(n.args[1] == "sum" for n in calls(gm, REDUCE_SCATTER))
    gm.graph.lint()


def test_reduce_scatter_of_a_transposed_product_slices_without_copies():
    """RS(t(dY) @ X) (sharded data parallel's weight gradient): rows of t(dY) are columns of
    dY, so each block is a slice of dY transposed, never a copy."""
    gm = fx(lambda dy, x: scattered(dy.t() @ x, N, 0), (6, 8), (6, 5))
    record = rewrite_one(gm)
    assert record.decision == "rewritten" and record.match["blocks"] == "rows"
    created = new_nodes(gm, record)
    assert not [n for n in created if n.target is aten.clone.default]
    slices = [n for n in created if n.target is aten.slice.Tensor]
    assert {n.args[1] for n in slices} == {1} and len(slices) == N


def test_gathered_tensor_with_another_user_is_rebuilt_from_the_ring_blocks():
    gm = build(AgMm(extra_user=True))
    shard = next(iter(gm.graph.find_nodes(op="placeholder")))
    record = rewrite_one(gm)
    assert record.decision == "rewritten"
    assert calls(gm, ALL_GATHER) == []  # never all-gather twice
    (mul,) = calls(gm, aten.mul.Tensor)
    cat = mul.args[0]  # the reassembly chain (split + cat on dim 1) is kept for it
    split = cat.args[0][0].args[0]
    assert split.target is aten.split.Tensor
    rebuilt = split.args[0]
    assert rebuilt.target is aten.cat.default
    blocks, dim = rebuilt.args
    assert dim == 0 and len(blocks) == N
    assert blocks[RANK] is shard  # this rank's own block is its shard, never sent to itself
    assert all(b.target is WAIT for i, b in enumerate(blocks) if i != RANK)


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        pytest.param(gather_mm, [(2, 8), (8, 6)], id="one-gather"),
        pytest.param(gather_twice, [(2, 8), (8, 6), (8, 5)], id="two-gathers"),
    ],
)
def test_no_rebuilt_gather_when_only_the_matmuls_read_it(fn, shapes):
    gm = fx(fn, *shapes)
    assert rewrite_one(gm).decision == "rewritten"
    dead = [n.name for n in gm.graph.nodes if n.op == "call_function" and not n.users]
    assert all(name.startswith("wait_tensor") for name in dead), dead  # send waits only


def test_weight_computed_after_the_gather_is_hoisted_before_the_ring():
    gm = fx(gather_then_weight, (2, 3, 8), (6, 8))
    assert rewrite_one(gm).decision == "rewritten"
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    (t,) = calls(gm, aten.t.default)
    assert order[t] < min(order[p] for p in calls(gm, P2P))
    gm.graph.lint()


def test_weight_from_a_later_collective_nests_its_ring_in_the_first_window():
    """mm(AG(x), AG(w)) on one group: the activation's ring goes after the weight's gather
    (its late input); the weight's site then contracts its gathered rows inside that
    ring's first window (X_own[:, block b] @ W_b), and the other windows read the weight
    it rebuilds."""
    gm = fx(gather_then_gathered_weight, (2, 3, 8), (2, 6))
    x_site, w_site = rewrite_graph(gm, "forward", RING)
    assert (x_site.decision, w_site.decision) == ("rewritten", "rewritten")
    assert x_site.match["roles"] == {"mm": "rows"}
    assert list(w_site.match["roles"].values()) == ["contract_left"]
    assert len(w_site.match["unmatched"]) == N - 1  # x's other windows
    assert calls(gm, ALL_GATHER) == [] and len(calls(gm, P2P)) == 2 * (N - 1)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    x_first, *_ = (p for p in calls(gm, P2P) if p.meta["commfuse"]["site"] == x_site.site)
    w_p2ps = [p for p in calls(gm, P2P) if p.meta["commfuse"]["site"] == w_site.site]
    x_first_waits = [u for g in x_first.users for u in g.users if u.target is WAIT]
    assert order[x_first] < min(order[p] for p in w_p2ps)
    assert max(order[p] for p in w_p2ps) < min(order[w] for w in x_first_waits)
    gm.graph.lint()


def test_matmul_between_gather_and_reduce_scatter_is_claimed_by_the_gather():
    gm = fx(gather_mm_scatter, (2, 8), (8, 6))
    ag, rs = rewrite_graph(gm, "forward", RING)
    assert (ag.kind, ag.decision) == ("ag_mm", "rewritten")
    assert (rs.kind, rs.decision) == ("mm_rs", "declined")
    assert rs.reason.startswith("its matmul was rewritten by all-gather site ")
    assert calls(gm, ALL_GATHER) == [] and len(calls(gm, REDUCE_SCATTER)) == 1


def gather_used_by_a_matmul_and_a_reduce_scatter(x, w):
    g = gathered(x, N, 0)
    return torch.mm(g, w), scattered(g, N, 0)


def test_report_lists_only_sites_of_the_graph_as_traced():
    """Rewriting the gather rebuilds g from the ring's blocks; the reduce-scatter that
    reads it never read a matmul, so it is declined as the graph was traced (one record,
    not a site of the rewritten graph)."""
    gm = fx(gather_used_by_a_matmul_and_a_reduce_scatter, (2, 8), (8, 6))
    ag, rs = rewrite_graph(gm, "forward", RING)
    assert (ag.kind, ag.decision) == ("ag_mm", "rewritten")
    assert (rs.kind, rs.decline_code) == ("mm_rs", "rs.no_matmul")
    assert len(calls(gm, REDUCE_SCATTER)) == 1


def test_claimed_matmul_reason_holds_when_the_gather_site_declines():
    gm = fx(gather_mm_scatter, (2, 8), (8, 6))
    ag, rs = rewrite_graph(gm, "forward", Options(inner="eager", disable=frozenset({"ag_mm"})))
    assert ag.decision == "declined" and ag.reason == "ag_mm is disabled"
    assert "already rewritten" not in rs.reason


@pytest.mark.parametrize(
    "case",
    [
        # ~2 GFLOP: each ring step's matmul outweighs a step's overhead
        pytest.param(AgMm(shard=(2, 256, 512), n_out=1024, consumers=1), id="ag_mm"),
        pytest.param(MmRs(lead=(2, 1024), k=512, n_out=1024), id="mm_rs"),
    ],
)
def test_auto_rewrites_when_the_cost_model_predicts_a_win(case, tmp_path):
    """On a link as slow as the benchmark's throttled one, communication costs about what
    the matmuls do: hiding it pays (on plain loopback it is too cheap to be worth a step)."""
    slow_link = tmp_path / "slow.json"
    save(dataclasses.replace(BUILTIN["gloo-loopback"], link_bytes_per_s=1e8), slow_link)
    gm = build(case)
    record = rewrite_one(gm, Options(schedule="auto", inner="eager", profile=str(slow_link)))
    predicted = record.predicted_us
    best = min(predicted, key=predicted.get)
    assert record.decision == "rewritten" and record.schedule == best != "collective"
    assert record.reason.startswith(f"{best} predicted") and record.reason.endswith("x faster")
    assert predicted[best] * 1.05 <= predicted["collective"]
    assert len(calls(gm, P2P)) == {"ring": N - 1, "push": N - 1, "bidir": N // 2}[best]


# ----------------------------------------------------------------------------------------
# declined sites: a reason, and the graph byte for byte as it was

DECLINES = [
    pytest.param(lambda: build(AgMm()), "off", "schedule 'off' keeps every collective", id="off"),
    pytest.param(lambda: build(AgMm()), "auto", "not profitable: ", id="auto-ag"),
    pytest.param(lambda: build(MmRs()), "auto", "not profitable: ", id="auto-rs"),
    pytest.param(
        lambda: build(MmRs(op="max")),
        "ring",
        "reduce op 'max' is neither 'sum' nor 'avg'",
        id="max",
    ),
    pytest.param(
        lambda: build(MmRs(lead=(2, 4), dim=0)),
        "ring",
        "scattered dim 0 of size 2 is not divisible by 4",
        id="scatter-dim-not-divisible",
    ),
    pytest.param(
        lambda: build(AgMm(dtype=torch.int64)),
        "ring",
        "gathered shard has dtype torch.int64; only floating point is decomposed",
        id="int-ag",
    ),
    pytest.param(
        lambda: build(MmRs(dtype=torch.int64)),
        "ring",
        "matmul output has dtype torch.int64",
        id="int-rs",
    ),
    pytest.param(
        lambda: fx(gather_mm_on(dist.group.WORLD.group_name, 2), (2, 8), (8, 6)),
        "ring",
        "collective says group_size=2 but group '0' has 4 ranks",
        id="group-size-mismatch",
    ),
    pytest.param(
        lambda: fx(gather_mm_on("no-such-group", N), (2, 8), (8, 6)),
        "ring",
        "process group 'no-such-group' is unknown in this process",
        id="unknown-group",
    ),
    pytest.param(
        lambda: fx(lambda x, y: torch.mm(gathered(x, N, 0).t().contiguous(), y), (2, 8), (8, 6)),
        "ring",
        "clone (clone.default) sits between the gathered tensor and a matmul",
        id="transposed-copy",
    ),
    pytest.param(  # the gathered dim inside K, not its outermost factor: blocks interleave
        lambda: fx(lambda x, w: torch.mm(gathered(x, N, 2).reshape(2, -1), w), (2, 3, 8), (96, 6)),
        "ring",
        "mm (rows): gathered dim 2 of [2, 3, 32] does not fold into the rows of [2, 96]",
        id="contracting-dim-inner",
    ),
    pytest.param(
        lambda: fx(lambda x, y: torch.mm(y, gathered(x, N, 1)), (6, 2), (3, 6)),
        "ring",
        "mm (contract_left): gathered dim 1 of [6, 8] does not fold into the rows of [6, 8]",
        id="second-operand-columns",
    ),
    pytest.param(
        lambda: fx(
            lambda a, w1, r: scattered((a @ w1 + r).view(2, 4, 6), N, 1),
            (8, 8),
            (8, 6),
            (8, 6),
        ),
        "ring",
        "reduce-scatter input is add (add.Tensor) of a matmul, not a matmul or a sum of matmuls",
        id="matmul-plus-residual",
    ),
    pytest.param(
        lambda: fx(scatter_and_reuse_product, (8, 8), (8, 6)),
        "ring",
        "is also used outside the reduce-scatter",
        id="product-used-twice",
    ),
    pytest.param(
        lambda: fx(lambda x, w: (gathered(x, N, 0) @ w, gathered(x, N, 0).add_(1)), (2, 8), (8, 6)),
        "ring",
        "is mutated in place by add_",
        id="mutated",
    ),
    pytest.param(
        lambda: fx(
            lambda x, w1, w2: (
                gathered(x, N, 0).reshape(-1, 8) @ w1,
                gathered(x, N, 1).reshape(-1, 8) @ w2,
            ),
            (2, 3, 8),
            (8, 6),
            (8, 6),
        ),
        "ring",
        "are reassembled along different dims",
        id="two-gathers-different-dims",
    ),
    pytest.param(
        lambda: strip_values(build(AgMm(dim=0))),
        "ring",
        "has no tensor metadata (meta['val'])",
        id="no-fake-values-ag",
    ),
    pytest.param(
        lambda: strip_values(build(MmRs(lead=(4, 2), dim=0))),
        "ring",
        "has no tensor metadata (meta['val'])",
        id="no-fake-values-rs",
    ),
]


@pytest.mark.parametrize(("make", "schedule", "reason"), DECLINES)
def test_declined_site_keeps_the_graph(make, schedule, reason):
    gm = make()
    before = gm.code
    collectives = len(calls(gm, ALL_GATHER)) + len(calls(gm, REDUCE_SCATTER))
    records = rewrite_graph(gm, "forward", Options(schedule=schedule, inner="eager"))
    assert len(records) == 1
    (record,) = records
    assert record.decision == "declined" and record.schedule == "off"
    assert reason in record.reason
    assert record.nodes == []
    assert gm.code == before
    assert len(calls(gm, ALL_GATHER)) + len(calls(gm, REDUCE_SCATTER)) == collectives
    assert calls(gm, P2P) == []


@pytest.mark.parametrize(
    "case", [pytest.param(AgMm(dim=1), id="ag_mm"), pytest.param(MmRs(dim=1), id="mm_rs")]
)
def test_split_cat_site_without_fake_values_is_declined_not_raised(case):
    gm = strip_values(build(case))
    before = gm.code
    record = rewrite_one(gm)
    assert record.decision == "declined" and "has no tensor metadata" in record.reason
    assert gm.code == before


# ----------------------------------------------------------------------------------------
# an error inside the pass never breaks the compile


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("module", "function", "inner", "warning"),
    [
        pytest.param(
            "kinds.ag_mm.lower",
            "multiply",
            "eager",
            r"site \d+\.0 declined: internal error",
            id="lower",
        ),
        pytest.param(
            "verify", "check_committed", "eager", "graph left as it was", id="after-commit"
        ),
        pytest.param(
            "ranks.order", "preserve_node_ordering", "inductor", "graph left as it was", id="order"
        ),
    ],
)
def test_internal_error_declines_and_restores_the_graph(
    monkeypatch, caplog, module, function, inner, warning
):
    """Not strict: the site is declined (``internal.error``) with a warning, and the
    traceback is in its record and in the ``commfuse`` log at DEBUG."""
    # importlib: the module by its dotted name (``kinds.ag_mm.lower``)
    target = importlib.import_module(f"commfuse_compile.passes.{module}")
    monkeypatch.setattr(target, function, _boom)
    gm = build(AgMm())
    before = gm.code
    caplog.set_level("DEBUG", logger="commfuse")
    with pytest.warns(UserWarning, match=warning):
        records = rewrite_graph(gm, "forward", Options(schedule="ring", inner=inner, strict=False))
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [
        ("ag_mm", "declined", "internal.error")
    ]
    assert records[0].reason == "internal error: RuntimeError: boom"
    # the record names its graph and site, also where the whole graph was restored
    assert (records[0].graph_index, records[0].site) == (gm.meta[PASSED], f"{gm.meta[PASSED]}.0")
    assert records[0].traceback.startswith("Traceback (most recent call last)")
    assert "in _boom" in records[0].traceback and "RuntimeError: boom" in records[0].traceback
    assert records[0].traceback in caplog.text  # at DEBUG
    assert gm.code == before
    assert len(calls(gm, ALL_GATHER)) == 1 and calls(gm, P2P) == []
    gm.graph.lint()


@pytest.mark.parametrize(
    ("module", "function"),
    [
        pytest.param("kinds.ag_mm.lower", "multiply", id="lower"),
        pytest.param("plan", "predict", id="plan"),
        pytest.param("verify", "check_committed", id="after-commit"),
    ],
)
def test_strict_raises_an_internal_error(monkeypatch, module, function):
    """``strict`` (the suite's default: ``COMMFUSE_STRICT=1``) raises the error itself."""
    monkeypatch.setattr(
        importlib.import_module(f"commfuse_compile.passes.{module}"), function, _boom
    )
    assert Options().strict  # from the environment
    with pytest.raises(RuntimeError, match="^boom$"):
        rewrite_graph(build(AgMm()), "forward", Options(schedule="ring", inner="eager"))


def test_strict_comes_from_the_option_or_the_environment(monkeypatch):
    monkeypatch.setenv("COMMFUSE_STRICT", "0")
    assert not Options().strict and not resolve_options({}).strict
    assert resolve_options({"strict": True}).strict
    monkeypatch.setenv("COMMFUSE_STRICT", "1")
    assert resolve_options({}).strict and not resolve_options({"strict": False}).strict
    monkeypatch.setenv("COMMFUSE_STRICT", "maybe")
    with pytest.raises(CommfuseOptionError, match="COMMFUSE_STRICT"):
        resolve_options({})


# ----------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize(
    ("given", "named"),
    [
        pytest.param({"schedul": "ring"}, "'schedul'", id="unknown"),
        pytest.param({"schedule": "fast"}, "'schedule'", id="schedule"),
        pytest.param({"inner": "aot"}, "'inner'", id="inner"),
        pytest.param({"debug_dir": 5}, "'debug_dir'", id="debug_dir"),
    ],
)
def test_bad_option_names_the_option(given, named):
    with pytest.raises(CommfuseOptionError, match=named):
        Options.from_mapping(given)


def test_apply_rejects_a_bad_option_before_touching_the_graph():
    gm = build(AgMm())
    before = gm.code
    with pytest.raises(CommfuseOptionError, match="'schedule'"):
        commfuse_compile.apply(gm, schedule="always")
    assert gm.code == before


def test_apply_rejects_what_is_not_a_graph():
    with pytest.raises(CommfuseOptionError, match="got int"):
        commfuse_compile.apply(42)


def test_debug_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DEBUG_DIR_ENV, str(tmp_path))
    assert Options.from_mapping({}).debug_dir == str(tmp_path)
    assert Options.from_mapping({"debug_dir": tmp_path / "x"}).debug_dir == str(tmp_path / "x")
    monkeypatch.delenv(DEBUG_DIR_ENV)
    assert Options.from_mapping({}).debug_dir is None


# ----------------------------------------------------------------------------------------
# debug dump


def test_debug_dump_writes_code_and_accumulates_the_report(tmp_path):
    report.reset()
    options = Options(schedule="ring", inner="eager", debug_dir=str(tmp_path))
    rank_dir = tmp_path / f"rank{RANK}"
    graphs = [("forward", AgMm()), ("backward", MmRs())]
    for index, (kind, case) in enumerate(graphs):
        gm = build(case)
        before = gm.code
        rewrite_graph(gm, kind, options)
        assert before != gm.code
        assert (rank_dir / f"graph{index:03d}_{kind}_before.py").read_text() == before
        assert (rank_dir / f"graph{index:03d}_{kind}_after.py").read_text() == gm.code
        sites = json.loads((rank_dir / "report.json").read_text())["sites"]
        assert len(sites) == index + 1  # the report grows with every graph
    assert sorted(p.name for p in rank_dir.iterdir()) == [
        "graph000_forward_after.py",
        "graph000_forward_before.py",
        "graph001_backward_after.py",
        "graph001_backward_before.py",
        "report.json",
    ]
    required = {"kind", "graph", "decision", "schedule", "reason", "site", "nodes"}
    assert all(required <= set(site) for site in sites)
    assert [(s["kind"], s["graph"], s["decision"], s["schedule"]) for s in sites] == [
        ("ag_mm", "forward", "rewritten", "ring"),
        ("mm_rs", "backward", "rewritten", "ring"),
    ]
    assert sites[0]["matmuls"] == ["addmm", "addmm_1"] and sites[1]["blocks"] == "rows"


def test_report_reset_forgets_sites():
    rewrite_graph(build(AgMm()), "forward", RING)
    assert report.REPORT.sites and report.REPORT.graphs
    report.reset()
    assert (report.REPORT.sites, report.REPORT.graphs) == ([], 0)


# ----------------------------------------------------------------------------------------
# torch.export


class GatherLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(gathered(x, N, 0), self.weight)


def test_apply_rewrites_an_exported_program_in_place():
    try:
        ep = torch.export.export(GatherLinear(), (torch.randn(2, 8),))
    except Exception as err:  # noqa: BLE001 - an environment limit, not the pass
        pytest.skip(f"torch.export cannot export functional collectives here: {err}")
    assert len(calls(ep.graph_module, ALL_GATHER)) == 1
    out = commfuse_compile.apply(ep, schedule="ring")
    assert out is ep and isinstance(out, torch.export.ExportedProgram)
    assert len(calls(ep.graph_module, P2P)) == N - 1
    assert calls(ep.graph_module, ALL_GATHER) == []
    outputs = [n.name for n in ep.graph_module.graph.output_node().args[0]]
    assert outputs == [spec.arg.name for spec in ep.graph_signature.output_specs]
    ep.validate()
    assert ep.module()(torch.randn(2, 8)).shape == (2 * N, 6)


def test_inner_compiler_failure_falls_back_to_the_original_graph():
    """The rewritten graph is compiled; if the compiler rejects it, the original is."""
    gm = build(AgMm())
    before = gm.code
    compiled = []

    def compile_fn(g: GraphModule) -> str:
        if calls(g, P2P):
            raise RuntimeError("compiler says no")
        compiled.append(g.code)
        return "compiled"

    lenient = dataclasses.replace(RING, strict=False)
    with pytest.warns(UserWarning, match="inner compiler failed on the rewritten graph"):
        assert rewrite_and_compile(gm, "forward", lenient, compile_fn) == "compiled"
    assert compiled == [before] and gm.code == before
    (record,) = [r for r in commfuse_compile.REPORT.sites if r.graph == "forward"][-1:]
    assert record.decision == "declined" and record.schedule == "off"
    assert (
        record.reason
        == "inner compiler failed on the rewritten graph: RuntimeError: compiler says no"
    )
    assert "in compile_fn" in record.traceback
    with pytest.raises(RuntimeError, match="compiler says no"):  # strict
        rewrite_and_compile(build(AgMm()), "forward", RING, compile_fn)


def test_exchange_check_proves_the_graph_is_its_schedule_on_every_rank():
    """The graph's P2P peers must be this rank's steps of the schedule, and the schedule,
    run for all ranks, must match every receive with a send (no rank waits forever)."""
    from commfuse_compile.passes import match, verify
    from commfuse_compile.passes.fx.declines import Declined
    from commfuse_compile.passes.kit.rewrite import Taken, tag_of
    from commfuse_compile.passes.lower import lower, start
    from commfuse_compile.runtime import groups
    from commfuse_compile.schedules import (
        GatherStep,
        Schedule,
        Transfer,
        by_name,
        exchange,
        ring,
    )

    gm = build(AgMm())
    (site,) = match.find_sites(gm.graph)
    group = groups.resolve(site.group_name, site.group_size)
    rewrite = start(site, 0, tag_of(0, 0), gm.graph, Taken())
    lower(rewrite, group, by_name("ring"))
    verify.check_exchange(rewrite, group, by_name("ring"))

    class Mirrored:  # a valid ring in the other direction: not what the graph does
        __name__ = "Mirrored"

        @staticmethod
        def gather_steps(rank, n):
            flip = lambda ts: tuple(Transfer(t.block, -t.peer) for t in ts)  # noqa: E731
            return [
                GatherStep(s.compute, flip(s.sends), flip(s.recvs))
                for s in ring.gather_steps(rank, n)
            ]

    with pytest.raises(Declined, match="are not the schedule's"):
        verify.check_exchange(rewrite, group, Schedule("mirrored", Mirrored, sliced=False))
    rewrite.discard()

    class Deadlocks:  # every rank receives from the rank that sends elsewhere
        __name__ = "Deadlocks"

        @staticmethod
        def gather_steps(rank, n):
            return [GatherStep((rank,), (Transfer(rank, +1),), (Transfer((rank + 1) % n, +1),))]

    deadlocks = Schedule("Deadlocks", Deadlocks, sliced=False)
    with pytest.raises(exchange.ScheduleError, match="receives"):
        KINDS["ag_mm"].check_schedule(deadlocks, 3)


def test_p2p_tags_come_from_the_graph_and_the_site_not_from_what_was_compiled_before():
    """Every rank must tag a site's messages alike. A tag that counted the graphs this
    process compiled before would differ on a rank that compiled one graph more (a
    recompile); the tag is the graph (its ops, their shapes and dtypes) and the site's
    place in it instead, so two models of different sizes never share one."""

    def program(x, w1, w2):
        return (scattered(gathered(x, N, 0) @ w1 @ w2, N, 0),)

    def tags(gm: GraphModule) -> dict[str, int]:
        return {str(n.args[6]).split(" step")[0]: int(n.args[4]) for n in calls(gm, P2P)}

    first = fx(program, (2, 8), (8, 6), (6, 4))
    rewrite_graph(first, "forward", RING)
    other = build(MmRs())
    rewrite_graph(other, "forward", RING)
    again = fx(program, (2, 8), (8, 6), (6, 4))
    rewrite_graph(again, "forward", RING)
    assert len(tags(first)) == 2 and len(set(tags(first).values())) == 2  # a tag per site
    assert list(tags(first).values()) == list(tags(again).values())  # ids differ, tags not
    assert list(tags(first)) != list(tags(again))
    assert set(tags(other).values()).isdisjoint(tags(first).values())
    wider = fx(program, (2, 16), (16, 6), (6, 4))  # the same ops, another model's sizes
    rewrite_graph(wider, "forward", RING)
    assert set(tags(wider).values()).isdisjoint(tags(first).values())


@pytest.mark.parametrize("case", [AgMm(), MmRs()], ids=["ag_mm", "mm_rs"])
def test_bidir_exchanges_with_both_neighbours_in_half_the_rounds(case):
    gm = build(case)
    record = rewrite_one(gm, Options(schedule="bidir", inner="eager"))
    assert record.decision == "rewritten" and record.schedule == "bidir"
    p2p = calls(gm, P2P)
    assert len(p2p) == N // 2  # rounds: ceil((N-1)/2)
    first_sends, first_recvs = p2p[0].args[1], p2p[0].args[3]
    assert sorted(first_sends) == sorted(first_recvs) == [(RANK - 1) % N, (RANK + 1) % N]
    assert sum(len(node.args[0]) for node in p2p) == N - 1  # every block / sum sent once
    gm.graph.lint()


def test_auto_predicts_every_schedule_and_keeps_the_collective_when_it_is_faster():
    gm = build(AgMm())
    record = rewrite_one(gm, Options(schedule="auto", inner="eager"))
    assert set(record.predicted_us) == {"collective", "ring", "bidir", "push", "slicing"}
    best = min(record.predicted_us, key=record.predicted_us.get)
    assert best == "collective" and record.decision == "declined"


def test_a_matmul_that_needs_the_sites_own_result_keeps_the_gathered_tensor():
    """Recomputed forward + backward through a gathered weight: y = x @ W^T, then
    dX = f(y) @ W. dX's matmul cannot join W's ring (its operand comes from the ring's
    own product); it reads the gathered W rebuilt from the received shards."""

    def forward_then_backward(x, w_shard):
        w = gathered(w_shard, N, 0)
        y = torch.mm(x, w.t())
        return torch.mm(torch.relu(y), w)

    gm = fx(forward_then_backward, (3, 5), (2, 5))
    record = rewrite_one(gm)
    assert record.decision == "rewritten"
    assert record.match["roles"] == {"mm": "columns"}
    assert record.match["unmatched"] == [
        "mm_1 (contract_left): its other operand is computed from this site's own result"
    ]
    assert calls(gm, ALL_GATHER) == []
    gm.graph.lint()


@pytest.mark.parametrize(
    ("disable", "decision", "reason", "roles"),
    [
        (["ag_mm"], "declined", "ag_mm is disabled", None),
        (["contract"], "rewritten", "schedule 'ring' requested", {"mm": "rows"}),
        (["rows", "contract"], "declined", "mm (rows): disabled; mm_1 (contract): disabled", None),
        (["ring"], "declined", "schedule 'ring' is disabled", None),
    ],
)
def test_disable_switches_off_kinds_roles_and_schedules(disable, decision, reason, roles):
    case = AgMm(consumers=1, contract=1, bias=False)
    gm = trace(case, N, case.inputs(RANK, seed=0, n=N))
    before = gm.code
    record = rewrite_one(
        gm, Options.from_mapping({"schedule": "ring", "inner": "eager", "disable": disable})
    )
    assert (record.decision, record.reason) == (decision, reason)
    if roles is not None:
        assert record.match["roles"] == roles
    else:
        assert gm.code == before


def test_disable_from_the_environment_and_bad_names(monkeypatch):
    monkeypatch.setenv("COMMFUSE_DISABLE", "bidir, mm_rs")
    assert Options.from_mapping({}).disable == {"bidir", "mm_rs"}
    with pytest.raises(CommfuseOptionError, match=r"cannot disable \['ringg'\]"):
        resolve_options({"disable": ["ringg"]})
    with pytest.raises(CommfuseOptionError, match="must be a list of names"):
        Options.from_mapping({"disable": "ring"})


# ----------------------------------------------------------------------------------------
# all-to-all (Ulysses)

ALL_TO_ALL = c10d.all_to_all_single.default


def ulysses(side: str, **fields) -> GraphModule:
    case = Ulysses(side=side, **fields)
    return trace(case, N, case.inputs(RANK, 0, N))


@pytest.mark.parametrize(
    ("side", "kind", "layout"),
    [
        ("in", "mm_a2a", {"blocks": "columns"}),
        ("out", "a2a_mm", {"roles": {"mm": "contract"}}),
        ("grad", "a2a_mm", {"roles": {"mm": "columns"}}),
    ],
)
def test_all_to_all_next_to_a_projection_becomes_pairwise_steps(side, kind, layout):
    """q = x @ Wq sends each rank its heads' column block as soon as it is computed; the
    output projection adds each arriving head block's product (never a partial sum sent);
    the weight gradient fills one column block per arriving block."""
    gm = ulysses(side)
    record = rewrite_one(gm)
    assert (record.kind, record.decision) == (kind, "rewritten")
    assert {k: record.match[k] for k in layout} == layout
    assert calls(gm, ALL_TO_ALL) == [] and len(calls(gm, P2P)) == N - 1
    assert record.steps == N and record.p2p_ops == N - 1
    matmuls = [n for n in new_nodes(gm, record) if n.target in MATMULS]
    assert len(matmuls) == N  # one block per step, the same FLOPs as the one matmul
    peers = [(list(p.args[1]), list(p.args[3])) for p in calls(gm, P2P)]
    assert peers == [([(RANK + s) % N], [(RANK - s) % N]) for s in range(1, N)]
    gm.graph.lint()


def test_a_block_copied_into_its_layout_is_sent_from_one_buffer():
    """A batch-first model's [b, s] rows sent as DeepSpeed lays them out ([s, b], each
    block copied): the copy goes through ``inductor_force_stride_order``, which Inductor
    computes once, so the transfer and the wait of its buffer hold the same buffer (a
    plain ``clone`` Inductor computes for each reader: the send's buffer would be free
    before its wait, and ``program.check`` declined the site)."""
    gm = ulysses("in", sequence_first=True)
    record = rewrite_one(gm)
    assert (record.kind, record.decision) == ("mm_a2a", "rewritten")
    forced = calls(gm, ring.FORCE_STRIDES)
    assert len(forced) == N - 1 and [f.args[0].target for f in forced] == [aten.clone.default] * 3
    for p2p in calls(gm, P2P):
        (sent,) = p2p.args[0]
        assert sent in forced
        assert [u.target for u in sent.users if u is not p2p] == [c10d.wait_tensor.default]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_projection_is_split_into_one_matmul_per_all_to_all(bias):
    """x @ Wqkv split on its columns into q, k, v (GQA: k, v narrower), each part's heads
    all-to-all'd: one matmul per part (W's column slice), each its own mm_a2a site."""
    case = FusedQkv(side="in", bias=bias)
    gm = trace(case, N, case.inputs(RANK, 0, N))
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision) for r in records] == [("mm_a2a", "rewritten")] * 3
    assert calls(gm, ALL_TO_ALL) == [] and len(calls(gm, P2P)) == 3 * (N - 1)
    assert not calls(gm, aten.split_with_sizes.default)
    assert len([n for n in gm.graph.nodes if n.target in MATMULS]) == 3 * N
    gm.graph.lint()


def test_fused_qkv_backward_concatenation_is_split_per_all_to_all():
    """cat(dq, dk, dv) @ Wqkv^T is the sum of each part's product with W's rows of it, and
    cat(...)^T @ x the concatenation of each part's: each all-to-all then feeds matmuls of
    its own (contract and rows)."""
    case = FusedQkv(side="grad")
    gm = trace(case, N, case.inputs(RANK, 0, N))
    records = rewrite_graph(gm, "backward", RING)
    assert [(r.kind, r.decision) for r in records] == [("a2a_mm", "rewritten")] * 3
    assert {tuple(sorted(set(r.match["roles"].values()))) for r in records} == {
        ("contract", "rows")
    }
    assert calls(gm, ALL_TO_ALL) == []
    gm.graph.lint()


def test_fused_qkv_backward_parts_go_where_each_matmuls_operand_is():
    """The weight-gradient matmul's operand (x * 2, computed after the input gradient's
    matmul) is read where it stands: each part's matmuls go before their own matmul."""
    case = FusedQkv(side="grad")

    def late_operand(*xs):
        *grads, x, w = xs
        dqkv = case.concatenated(grads, N)
        dx = dqkv @ w.t()
        return dx, dqkv.t() @ (x * dx.sum())

    gm = fx(late_operand, *(tuple(t.shape) for t in case.inputs(RANK, 0, N)))
    records = rewrite_graph(gm, "backward", RING)
    assert {r.decision for r in records} == {"rewritten"}
    gm.graph.lint()


@pytest.mark.parametrize("side", ["in", "grad"])
def test_split_projection_keeps_every_fake_value_true(side):
    """After the split, every node's meta["val"] has the layout the node really produces
    (a part is contiguous where the split's output was a strided view): what a compiler
    below lays its buffers out by, whichever sites are then rewritten or declined."""
    case = FusedQkv(side=side)
    gm = trace(case, N, case.inputs(RANK, 0, N))
    assert unfuse.split_fused_projections(gm.graph, before_change=lambda: None)
    gm.graph.lint()
    stored = {n: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
    placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    FakeTensorProp(gm, detect_fake_mode(placeholders)).propagate_dont_convert_inputs(*placeholders)
    for node, value in stored.items():
        fresh = node.meta["val"]
        if isinstance(fresh, torch.Tensor):
            assert (value.shape, value.stride()) == (fresh.shape, fresh.stride()), node.name


def test_fused_qkv_left_fused_when_no_site_is_rewritten():
    case = FusedQkv(side="in")
    gm = trace(case, N, case.inputs(RANK, 0, N))
    before = gm.code
    records = rewrite_graph(gm, "forward", Options(schedule="off", inner="eager"))
    assert [r.decision for r in records] == ["declined"] * 3
    gm.recompile()
    assert gm.code == before


def test_all_to_all_declines_say_why():
    """A schedule with no all-to-all steps, uneven blocks that give the ranks graphs of
    different shapes (12 rows sent, 8 received: tests/test_uneven_a2a.py has the rest),
    and blocks that a reshape interleaves (no longer one block of the product) are
    declined with their codes."""
    bidir = rewrite_one(ulysses("in"), Options(schedule="bidir", inner="eager"))
    assert bidir.decline_code == "plan.schedule_not_for_kind"

    def uneven(x, w):
        group = dist.group.WORLD.group_name
        return (c10d.wait_tensor(c10d.all_to_all_single(x @ w, [2] * N, [2, 2, 2, 6], group)),)

    assert rewrite_one(fx(uneven, (12, 5), (5, 4))).decline_code == "a2a.rank_shapes"

    def interleaved(x, w):  # rows of the product interleaved across the blocks
        p = (x @ w).view(2, N, 3).permute(1, 0, 2).reshape(N * 2, 3)
        return (exchanged(p.t().contiguous().t().contiguous(), N) * 1,)

    record = rewrite_one(fx(interleaved, (2 * N, 5), (5, 3)))
    assert (record.decision, record.decline_code) == ("declined", "a2a.not_a_block")
    assert record.reason.endswith("do not stay blocks through view (view.default)")


def test_all_to_all_away_from_matmuls_is_a_declined_site():
    gm = fx(lambda x: (exchanged(x * 2, N) + 1,), (N * 2, 3))
    (record,) = rewrite_graph(gm, "forward", RING)
    assert (record.kind, record.decline_code) == ("a2a_mm", "a2a.no_matmul")
    assert len(calls(gm, c10d.all_to_all_single.default)) == 1


def test_all_to_all_between_two_matmuls_is_one_site():
    """mm -> all-to-all -> mm (found by the fuzzer): one record, the all-to-all -> matmul
    site's (it rewrites the exchange), not a second, declined matmul -> all-to-all one."""
    gm = fx(lambda x, w, v: (exchanged(x @ w, N) @ v,), (2 * N, 5), (5, 3), (3, 4))
    record = rewrite_one(gm)
    assert (record.kind, record.decision) == ("a2a_mm", "rewritten")
    assert record.match["roles"] == {"mm_1": "rows"}


@pytest.mark.parametrize("gram", ["rows", "columns"])
def test_exchanged_tensor_as_both_operands_is_declined(gram):
    """G @ G^T or G^T @ G, G one all-to-all's output read through two paths (found by the
    fuzzer: the matmul was taken as two uses, and the rewrite left a block unread, an
    internal error): no sum or concatenation of one operand's blocks."""

    def program(x):
        g = exchanged(x, N)
        return (g.view(2 * N, 3) @ g.t() if gram == "rows" else g.t() @ g.view(2 * N, 3),)

    gm = fx(program, (2 * N, 3))
    before = gm.code
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = rewrite_one(gm)
    assert record.decision == "declined" and record.decline_code == "a2a.matmuls_left_out"
    assert record.reason == "mm: reads the exchanged tensor as both operands"
    assert gm.code == before


def test_all_to_all_of_a_permuted_tensor_copies_blocks_it_cannot_view():
    """The exchanged input is a permute (not contiguous), its output reshaped 2-D for the
    matmul: this rank's own block, a slice of that input, cannot be viewed so and is copied
    first (found by the fuzzer: a fake tensor's view raises ValueError, not RuntimeError,
    and the failed view was an internal error)."""

    def program(x, w):
        return (exchanged(x.permute(2, 0, 1), N).reshape(8 * N, 6) @ w,)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = rewrite_one(fx(program, (2, 6, 4 * N), (6, 3)))
    assert (record.kind, record.decision) == ("a2a_mm", "rewritten")
    assert record.match["roles"] == {"mm": "rows"}


def test_matmul_into_an_all_to_all_nothing_reads_is_declined():
    """mm -> all-to-all whose result is dead (found by the fuzzer: the rewrite rebuilt a
    tensor nothing reads, an internal error): nothing to compute, as for a reduce-scatter."""

    def program(x, w):
        exchanged(x @ w, N)
        return (x * 2,)

    gm = fx(program, (2 * N, 5), (5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = rewrite_one(gm)
    assert (record.kind, record.decline_code) == ("mm_a2a", "site.unread")


def test_declined_matmul_to_all_to_all_site_names_what_it_would_replace():
    """A matmul -> all-to-all site declined before its blocks reach a matmul (a cast in
    between: no product) still says which nodes it stands for (found by the fuzzer:
    ``replaced`` asserted a product, an internal error for the whole graph)."""
    gm = fx(lambda x, w: (exchanged((x @ w).to(torch.float64), N) * 1,), (2 * N, 5), (5, 3))
    (site,) = mm_a2a.KIND.find(gm.graph)
    assert site.declined is not None and site.declined.code == "a2a.not_a_block"
    a2a, wait = calls(gm, ALL_TO_ALL)[0], calls(gm, c10d.wait_tensor.default)[0]
    assert list(site.replaced()) == [a2a, wait]
    assert rewrite_one(gm).decline_code == "a2a.not_a_block"


def test_batched_experts_of_a_capacity_moe_take_each_block_as_it_arrives():
    """A capacity-style MoE (2 experts per rank, ``bmm``): the dispatch's blocks are rows
    (M) of every expert's entry, and the combine's are rows of the second product; in
    the backward the combine's gradient feeds dH (rows) and dW2 (its blocks along K,
    summed). Every matmul of a block is one ``bmm`` of all the rank's experts."""
    graphs = {side: Experts(side=side) for side in ("forward", "backward")}
    graphs = {side: trace(case, N, case.inputs(RANK, 0, N)) for side, case in graphs.items()}
    forward = rewrite_graph(graphs["forward"], "forward", RING)
    backward = rewrite_graph(graphs["backward"], "backward", RING)
    assert [(r.kind, r.decision) for r in forward] == [
        ("a2a_mm", "rewritten"),
        ("mm_a2a", "rewritten"),
    ]
    assert [(r.kind, r.decision) for r in backward] == [
        ("a2a_mm", "rewritten"),
        ("mm_a2a", "rewritten"),
    ]
    assert forward[0].match["roles"] == {"bmm": "rows"}
    assert forward[1].match["blocks"] == "rows"
    assert sorted(backward[0].match["roles"].values()) == ["contract_left", "rows"]


def test_blocks_along_the_experts_of_a_batched_matmul_are_declined():
    """The all-to-all's blocks along a ``bmm``'s batch (each rank's block one expert's
    entry): a block of the batch would need the other operand's entry too, which no
    role cuts; declined with the reason, both directions."""

    def dispatched(x, w):
        return (torch.bmm(exchanged(x, N), w),)

    def combined(x, w):
        return (exchanged(torch.bmm(x, w), N) * 2,)

    (into,) = rewrite_graph(fx(dispatched, (N, 3, 5), (N, 5, 2)), "forward", RING)
    assert (into.kind, into.decline_code) == ("a2a_mm", "a2a.matmuls_left_out")
    assert "the blocks run along a batched matmul's batch" in into.reason
    (out,) = rewrite_graph(fx(combined, (N, 3, 5), (N, 5, 2)), "forward", RING)
    assert (out.kind, out.decline_code) == ("mm_a2a", "a2a.batch_blocks")


def test_gather_on_the_contracting_dim_adds_one_partial_product_per_block():
    """X gathered on its last dim, then @ W: block b of K multiplies rows K_b of W and the
    partial products are added (role ``contract_k``); a bias would be added n times."""
    gm = fx(lambda x, w: (torch.mm(gathered(x, N, 2).reshape(6, -1), w),), (2, 3, 8), (32, 5))
    record = rewrite_one(gm)
    assert record.decision == "rewritten" and record.match["roles"] == {"mm": "contract_k"}
    created = new_nodes(gm, record)
    assert sum(n.target in MATMULS for n in created) == N
    w_rows = [n for n in created if n.target is aten.slice.Tensor and n.args[1] == 0]
    assert len(w_rows) == N  # W's rows of each block
    gm.graph.lint()


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_unwaited_result_saved_for_backward_reads_the_rewritten_result(collective):
    """Selective activation checkpointing (save the collectives' outputs) returns the
    unwaited collective as a forward output: the rewrite still applies, and that output
    becomes the rewritten result (the backward's own wait of it waits for nothing)."""
    group = dist.group.WORLD.group_name
    if collective == "reduce_scatter":

        def program(a, w):
            rs = c10d.reduce_scatter_tensor(a @ w, "sum", N, group)
            return c10d.wait_tensor(rs) * 2, rs

        gm = fx(program, (4 * N, 5), (5, 6))
    else:

        def program(x, w):
            ag = c10d.all_gather_into_tensor(x, N, group)
            return c10d.wait_tensor(ag) @ w, ag

        gm = fx(program, (3, 5), (5, 6))
    record = rewrite_one(gm)
    assert record.decision == "rewritten", record.reason
    assert calls(gm, REDUCE_SCATTER) == calls(gm, ALL_GATHER) == []
    (output,) = gm.graph.find_nodes(op="output")
    saved = output.args[0][1]
    assert saved.meta["commfuse"]["site"] == record.site  # a node of the rewrite
    gm.graph.lint()
