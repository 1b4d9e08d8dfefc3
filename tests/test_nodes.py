"""Jobs that span nodes: links by level, each site priced by its own group's level, rings
ordered by node, ``commfuse sim``'s clusters, and a real 2-node job.

Graph level on torch's fake process group (a 2 x 2 mesh: tp groups inside a node, dp
groups across two nodes of 2 ranks); numbers of a ring in node order on 4 gloo ranks; 2
nodes x 2 ranks in network namespaces, launched by torchrun's multi-node launch (root).
The agreement refusing ranks that see different topologies: tests/test_faults.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
from cases import AgMm, MmRs, run_case
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options
from commfuse_compile.cost import profiles
from commfuse_compile.cost.profiles import BUILTIN, Level, ProfileError
from commfuse_compile.cost.simulator import simulate
from commfuse_compile.options import CommfuseOptionError
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.runtime.topology import ACROSS, INSIDE, Topology, TopologyError, from_launcher
from commfuse_compile.tools import calibrate as cal
from commfuse_compile.tools import profile_fit as fit

c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default

# a gloo job of 2 nodes: loopback inside a node, a 200 Mbit/s link per node (shared by
# its 2 ranks) across, as the bench's namespaces build it
TWO_NODES = dataclasses.replace(
    BUILTIN["gloo-loopback"],
    name="gloo-2-nodes",
    across_nodes=Level(alpha_s=2e-4, bytes_per_s=2.5e7, ranks_per_nic=2),
)


# ----------------------------------------------------------------------------------------
# profiles and topologies


def test_cluster_profile_prices_the_nic_shared_by_its_senders():
    h100 = BUILTIN["h100-ib400"]
    assert h100.across(1).link_bytes_per_s == 4.5e10  # a NIC per GPU
    assert h100.across(4).link_bytes_per_s == 4.5e10 / 4
    assert h100.across(1).link_alpha_s == 1e-5 and not h100.across(1).duplex_neighbours
    half = dataclasses.replace(h100, across_nodes=Level(1e-5, 4.5e10, duplex=False))
    assert half.across(1).link_bytes_per_s == 4.5e10 / 2
    # inside a node, the NVLink profile's numbers
    assert dataclasses.replace(h100, across_nodes=None, ranks_per_node=0, name="x", source="") == (
        dataclasses.replace(BUILTIN["h100-nvlink4"], name="x", source="")
    )
    assert BUILTIN["gloo-loopback"].across(2) is BUILTIN["gloo-loopback"]  # one level


def test_a_ring_across_nodes_pays_the_nics_fixed_costs_where_measured():
    """A level's step overhead and slowdown (``commfuse calibrate`` measures them across
    the nodes) replace the node's in a group across them; unset, the node's hold."""
    inside = TWO_NODES.across(2)
    assert (inside.step_overhead_s, inside.overlap_slowdown) == (
        TWO_NODES.step_overhead_s,
        TWO_NODES.overlap_slowdown,
    )
    nic = dataclasses.replace(TWO_NODES.across_nodes, step_overhead_s=4e-4, overlap_slowdown=0.0)
    across = dataclasses.replace(TWO_NODES, across_nodes=nic).across(2)
    assert (across.step_overhead_s, across.overlap_slowdown) == (4e-4, 0.0)
    # what calibrate derives it from: the step site's ring on the nodes' ranks
    probe = fit.FixedCostProbe(
        ring_site_s=simulate(fit.gather_site_work(fit.STEP_SITE, 3), "ring", across).end_s,
        collective_site_s=0.0,
        overlap_slowdown=0.0,
    )
    assert fit.step_costs(probe, 3, across) == pytest.approx((across.link_alpha_s, 4e-4))
    # a latency fitted too high gives back what the step site does not show
    high = dataclasses.replace(across, link_alpha_s=across.link_alpha_s + 1e-3)
    assert fit.step_costs(probe, 3, high) == pytest.approx((across.link_alpha_s + 4e-4, 0.0))


def test_profile_files_with_and_without_levels_load(tmp_path):
    for profile in (TWO_NODES, BUILTIN["gloo-loopback"]):
        profiles.save(profile, tmp_path / "p.json")
        assert profiles.load(tmp_path / "p.json") == profile
    # a file written before levels: no across_nodes, no ranks_per_node
    flat = json.loads(json.dumps(BUILTIN["gloo-loopback"].as_json()))
    del flat["across_nodes"], flat["ranks_per_node"]
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    assert profiles.load(tmp_path / "flat.json").across_nodes is None
    # a level without its own fixed costs (null, or a file written before them)
    unset = json.loads(json.dumps(TWO_NODES.as_json()))
    assert unset["across_nodes"]["step_overhead_s"] is None
    assert profiles.from_json(unset) == TWO_NODES
    del unset["across_nodes"]["step_overhead_s"], unset["across_nodes"]["overlap_slowdown"]
    assert profiles.from_json(unset) == TWO_NODES
    unset["step_overhead_s"] = None  # the node's own fixed costs are numbers
    with pytest.raises(ProfileError, match="step_overhead_s must be a finite number"):
        profiles.from_json(unset)
    wrong = json.loads(json.dumps(TWO_NODES.as_json()))
    wrong["across_nodes"]["bytes_per_s"] = 0
    with pytest.raises(ProfileError, match="across_nodes: bytes_per_s must be positive"):
        profiles.from_json(wrong)
    del wrong["across_nodes"]["alpha_s"]
    with pytest.raises(ProfileError, match=r"across_nodes: fields missing \['alpha_s'\]"):
        profiles.from_json(wrong)


def test_topology_from_option_environment_and_launcher(monkeypatch):
    assert Options(topology=2).topology == Topology(ranks_per_node=2)
    assert Options.from_mapping({"topology": [0, 1, 0, 1]}).topology == Topology(nodes=(0, 1, 0, 1))
    monkeypatch.setenv("COMMFUSE_TOPOLOGY", "0,0,1,1")
    options = Options.from_mapping({})
    assert options.described()["topology"] == {
        "value": "nodes 0,0,1,1",
        "from": "environment variable COMMFUSE_TOPOLOGY",
    }
    monkeypatch.setenv("COMMFUSE_TOPOLOGY", "two")
    with pytest.raises(CommfuseOptionError, match="COMMFUSE_TOPOLOGY .* ranks per node"):
        Options.from_mapping({})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert from_launcher() == Topology(ranks_per_node=8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert from_launcher().describe() == "one node"


def test_ring_order_keeps_a_nodes_ranks_adjacent():
    interleaved = Topology(nodes=(0, 1, 0, 1, 2, 2))
    ranks = [0, 1, 2, 3, 4, 5]
    order = interleaved.ring_order(ranks)
    assert order == (0, 2, 1, 3, 4, 5)
    assert interleaved.crossings(ranks, order) == 3  # once per node
    assert interleaved.crossings(ranks, range(6)) == 5
    contiguous = Topology(ranks_per_node=4)
    assert contiguous.ring_order(range(8)) == tuple(range(8))  # already in node order
    # a 16-rank group on 2 nodes of 8 with a NIC per GPU: one rank per node sends across;
    # with all 8 on one NIC, still one; exchanging with every member, all 8
    assert contiguous.level([0, 3]) == INSIDE and contiguous.level([3, 4]) == ACROSS
    eight = Topology(ranks_per_node=8)
    sixteen = list(range(16))
    assert eight.senders_per_nic(sixteen, sixteen, 1, all_pairs=False) == 1
    assert eight.senders_per_nic(sixteen, sixteen, 8, all_pairs=False) == 1
    assert eight.senders_per_nic(sixteen, sixteen, 8, all_pairs=True) == 8
    # a dp group with one member per node: every rank of the node is in a copy of it
    assert eight.senders_per_nic([0, 8], [0, 1], 8, all_pairs=False) == 8


# ----------------------------------------------------------------------------------------
# graph level


@pytest.fixture
def mesh_groups():
    """(tp group, dp group) of rank 1 of a 2 x 2 mesh: tp {0, 1}, dp {1, 3}."""
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    yield mesh["tp"].get_group().group_name, mesh["dp"].get_group().group_name
    dist.destroy_process_group()


def test_a_node_list_must_name_every_rank(mesh_groups):
    """A node list shorter than the job is a user error, not ranks put on node 0."""
    assert Options(topology=[0, 0, 1, 1]).topology == Topology(nodes=(0, 0, 1, 1))
    with pytest.raises(CommfuseOptionError, match="names the node of 3 ranks, but the job has 4"):
        Options(topology=[0, 0, 1])
    with pytest.raises(TopologyError, match="rank 3 is not in it"):
        Topology(nodes=(0, 0, 1)).level([1, 3])


def two_products(tp: str, dp: str):
    def program(x, w, v):
        on_tp = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, tp)) @ w
        on_dp = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, dp)) @ v
        return on_tp, on_dp

    return program


def test_each_site_is_priced_and_decided_by_its_groups_level(mesh_groups, tmp_path):
    profiles.save(TWO_NODES, tmp_path / "two-nodes.json")
    gm = make_fx(two_products(*mesh_groups), tracing_mode="fake")(
        torch.randn(64, 512), torch.randn(512, 4096), torch.randn(512, 4096)
    )
    options = Options(inner="eager", profile=str(tmp_path / "two-nodes.json"), topology=2)
    on_tp, on_dp = rewrite_graph(gm, "forward", options)
    assert (on_tp.level, on_tp.ring) == ("node", [0, 1])
    assert (on_dp.level, on_dp.ring) == ("nodes", [1, 3])
    # inside the node, loopback: the collective is cheap and kept; across, both dp groups
    # share the node's link: the ring hides the transfer under the matmuls
    assert on_tp.decline_code == "plan.not_profitable", on_tp.reason
    assert on_dp.decision == "rewritten", on_dp.reason
    assert on_dp.predicted_us["collective"] > 2 * on_tp.predicted_us["collective"]
    # one node: both sites priced alike, both kept
    gm = make_fx(two_products(*mesh_groups), tracing_mode="fake")(
        torch.randn(64, 512), torch.randn(512, 4096), torch.randn(512, 4096)
    )
    one_node = dataclasses.replace(options, topology=Topology(ranks_per_node=4))
    on_tp, on_dp = rewrite_graph(gm, "forward", one_node)
    assert on_tp.predicted_us == on_dp.predicted_us and on_dp.level == "node"
    assert on_dp.decline_code == "plan.not_profitable"


def sent_to(rank: int, nodes: tuple[int, ...], schedule: str, case) -> list[list[int]]:
    """The peers each P2P op of rank ``rank`` sends to, its world group's ring in node order."""
    dist.init_process_group("fake", rank=rank, world_size=len(nodes), store=FakeStore())
    try:
        inputs = case.inputs(rank, 0, 4) if isinstance(case, AgMm) else case.inputs(rank, 0)
        gm = make_fx(case.fn(len(nodes)), tracing_mode="fake")(*inputs)
        options = Options(schedule=schedule, inner="eager", topology=list(nodes))
        (record,) = rewrite_graph(gm, "forward", options)
        assert record.decision == "rewritten", record.reason
        assert record.ring == [0, 2, 1, 3] and record.level == "nodes"
        return [list(n.args[1]) for n in gm.graph.find_nodes(op="call_function", target=P2P)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", [AgMm(shard=(2, 4), dim=0, consumers=1), MmRs(lead=(2, 8))])
def test_ring_runs_in_node_order_on_every_rank(case):
    nodes = (0, 1, 0, 1)  # ranks 0 and 2 on one node: the ring 0 -> 2 -> 1 -> 3 -> 0
    following = {0: 2, 2: 1, 1: 3, 3: 0}
    preceding = {v: k for k, v in following.items()}
    ring = {rank: sent_to(rank, nodes, "ring", case) for rank in range(4)}
    one_way = {rank: peers[0][0] for rank, peers in ring.items()}
    assert one_way in (following, preceding), ring  # each rank sends to one neighbour
    assert all(peers == [[one_way[rank]]] * 3 for rank, peers in ring.items()), ring
    for rank in range(4):
        bidir = sent_to(rank, nodes, "bidir", case)
        assert sorted(bidir[0]) == sorted([following[rank], preceding[rank]])


# The sharded-DP rows' node counts: the default run projects the two smallest (a ring of
# n ranks simulates in about n^2 events: 128 nodes alone take most of a minute on 2
# cores); ``-m matrix`` projects every one, as ``commfuse sim --parallelism cluster`` does.
@pytest.mark.parametrize(
    "dp_nodes",
    [pytest.param((16, 32), id="dp16-32"), pytest.param(None, id="all", marks=pytest.mark.matrix)],
)
def test_sim_projects_each_group_by_its_level(monkeypatch, dp_nodes):
    from commfuse_compile.tools.sim import cluster

    if dp_nodes is not None:
        monkeypatch.setattr(cluster, "DP_NODES", dp_nodes)
    rows = {r.job: r for r in cluster.cluster_rows(BUILTIN["h100-ib400"])}
    inside = rows["llama3-70b layer, TP+SP 8"]
    over_two = rows["llama3-70b layer, TP+SP 16"]
    assert (inside.level, inside.link) == ("node", "10 us, 360.0 GB/s")  # NVLink
    assert (over_two.level, over_two.link) == ("nodes", "10 us, 45.0 GB/s")  # a NIC per GPU
    assert over_two.collective_s > 2 * inside.collective_s
    nodes = cluster.DP_NODES[-1]
    assert sum("sharded DP over" in job for job in rows) == len(cluster.DP_NODES)
    dp = rows[f"llama3-70b layer, sharded DP over {nodes} nodes (TP 8 inside)"]
    assert (dp.group, dp.level) == (f"{nodes} ranks on {nodes} nodes", "nodes")
    ep = rows["deepseek-v3-moe routed experts, EP 64"]
    assert (ep.group, ep.level) == ("64 ranks on 8 nodes", "nodes")
    for row in rows.values():  # auto never loses more than its margin to the collective
        assert row.auto_s <= row.collective_s * 1.0001, row


def test_sim_cluster_needs_links_across_nodes(capsys):
    from commfuse_compile.tools.cli import main

    with pytest.raises(SystemExit):
        main(["sim", "--parallelism", "cluster", "--profile", "h100-nvlink4"])
    assert "h100-nvlink4 has no links across nodes" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# on gloo ranks


@pytest.mark.parametrize("schedule", ["ring", "bidir"])
def test_ring_in_node_order_matches_on_gloo_ranks(ranks, schedule):
    options = {"schedule": schedule, "topology": [0, 1, 0, 1]}
    for case in (AgMm(shard=(2, 4), dim=0, consumers=1), MmRs(lead=(2, 8))):
        for out in ranks(4).run(run_case, case, 3, options):
            assert out["collectives_left"] == 0, out["declined"]
            for a, e in zip(out["actual"], out["expected"], strict=True):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_calibrate_by_level_gives_the_nic_its_own_fixed_costs(ranks, tmp_path):
    """``calibrate.measure_levels`` on 2 "nodes" of 2 local gloo ranks, as under a
    multi-node launch: one profile from rank 0 with both levels, the collectives across
    the nodes by group size and the NIC's own fixed costs (its step site run one ring at
    a time); the file loads back."""
    out = ranks(4).run(cal.measure_levels, 1, 2)
    profile, others = out[0], out[1:]
    assert others == [None, None, None]
    nic = profile.across_nodes
    assert (profile.ranks_per_node, nic.ranks_per_nic) == (2, 2)
    assert nic.step_overhead_s is not None and nic.step_overhead_s >= 0
    assert nic.overlap_slowdown is not None and nic.overlap_slowdown >= 0
    assert profile.across(1).step_overhead_s == nic.step_overhead_s
    assert sorted(nic.collectives["all_gather"]) == [2, 3, 4]
    profiles.save(profile, tmp_path / "levels.json")
    assert profiles.load(tmp_path / "levels.json") == profile


# ----------------------------------------------------------------------------------------
# two nodes in network namespaces, launched as on a cluster


def test_two_nodes_of_two_ranks_train_the_2d_example_alike(tmp_path):
    """``train_fsdp_style.py --tp 2`` on 2 nodes x 2 ranks (tp inside a node, dp across),
    each node's torchrun joining by c10d rendezvous, the ring forced: the losses are
    those of plain eager, and the dp sites run their ring across the nodes."""
    from test_exit import GROUP_TIMEOUT_S, LAUNCHER

    from commfuse_compile.tools.bench.netns import can_throttle
    from commfuse_compile.tools.bench.nodes import run_nodes

    why_not = can_throttle()
    if why_not is not None:
        pytest.skip(f"2 nodes need network namespaces: {why_not}")
    launcher = tmp_path / "short_group_timeout.py"
    launcher.write_text(LAUNCHER)
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_fsdp_style.py")
    script = [str(launcher), str(GROUP_TIMEOUT_S), example, "--tp", "2", "--steps", "2"]
    script += ["--blocks", "1", "--compare", "--inner", "eager", "--schedule", "ring"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root, "OMP_NUM_THREADS": "1", "COMMFUSE_DEBUG_DIR": str(tmp_path)}
    (code0, out0), (code1, out1) = run_nodes(2, 2, script, rate_bits_per_s=1e9, env=env)
    assert (code0, code1) == (0, 0), out0[-3000:] + out1[-3000:]
    difference = float(out0.split("largest relative loss difference over 2 steps:")[1].split()[0])
    assert difference < 1e-5, out0[-3000:]
    levels = {}
    for rank in range(4):
        sites = json.loads((tmp_path / f"rank{rank}" / "report.json").read_text())["sites"]
        for site in sites:
            if site["decision"] == "rewritten":
                levels.setdefault(site["level"], set()).add(tuple(site["ring"]))
    assert levels == {"node": {(0, 1), (2, 3)}, "nodes": {(0, 2), (1, 3)}}, levels


# ----------------------------------------------------------------------------------------
# commfuse bench --nodes and demo --nodes: the parts that need no launch


def test_bench_link_at_a_rate_scales_only_the_link_across_nodes():
    from commfuse_compile.tools.bench.config import LOW_RATE, REFERENCE_RATE
    from commfuse_compile.tools.bench.link import LinkProfiles

    curve = profiles.Curve(1e-4, 8 / REFERENCE_RATE)  # a byte as the reference rate sends it
    reference = dataclasses.replace(
        TWO_NODES,
        across_nodes=Level(
            2e-4,
            REFERENCE_RATE / 8,
            collectives={"all_gather": {2: curve}},
            overlap_slowdown=0.25,
        ),
    )
    low_curve = profiles.Curve(1e-4, 4 * 8 / REFERENCE_RATE)  # a wire at LOW_RATE
    low = dataclasses.replace(
        TWO_NODES,
        across_nodes=Level(2e-4, LOW_RATE / 8, collectives={"all_gather": {2: low_curve}}),
    )
    free_curve = profiles.Curve(1e-4, 0.0)
    free = dataclasses.replace(
        TWO_NODES, across_nodes=Level(2e-4, 1e12, collectives={"all_gather": {2: free_curve}})
    )
    assert LOW_RATE == REFERENCE_RATE / 4
    at = LinkProfiles(reference, low, free).at(REFERENCE_RATE / 4)
    assert at.link_bytes_per_s == reference.link_bytes_per_s  # inside a node: no tbf
    assert at.collectives == reference.collectives
    assert at.overlap_slowdown == reference.overlap_slowdown
    # the NIC's share of the core (0.2 at the reference rate) at a quarter of its rate
    assert at.across_nodes.overlap_slowdown == pytest.approx(0.05 / 0.95, rel=1e-3)
    assert at.across_nodes.bytes_per_s == pytest.approx(REFERENCE_RATE / 8 / 4, rel=1e-3)
    scaled = at.across_nodes.collectives["all_gather"][2]
    assert scaled.seconds_per_byte == pytest.approx(4 * 8 / REFERENCE_RATE)
    assert scaled.latency_s == curve.latency_s


def _node_cell(name: str, medians_ms: dict[str, float], link_ratio: float | None):
    from commfuse_compile.tools.bench.config import BlockShape
    from commfuse_compile.tools.bench.figures import block_result

    times = {label: [ms / 1e3] * 3 for label, ms in medians_ms.items()}
    sites = {
        label: {
            "rewritten": 0 if label == "baseline" else 2,
            "found": 2,
            "schedules": [] if label == "baseline" else ["ring"],
            "summary": [],
            "levels": {"node": [0, 1], "nodes": [0 if label == "baseline" else 2, 2]},
        }
        for label in times
    }
    alone = {label: (0.05, 0.05) for label in times}
    shape = BlockShape(seq=8, dim=8, heads=2, hidden=8, front="fsdp", tp=2)
    block = block_result(shape, 1e8, alone, times, sites, 1.0, 4, 2)
    return block | {"cell": name, "key": name, "link_ratio": link_ratio}


def test_bench_nodes_judges_auto_against_the_best_fixed_row_and_off():
    from commfuse_compile.tools.bench.multinode import markdown
    from commfuse_compile.tools.bench.targets import nodes_targets

    near = _node_cell("near", {"baseline": 200, "ring": 100, "auto": 104}, 1.0)
    far = _node_cell("far", {"baseline": 200, "ring": 100, "auto": 160}, 1.0)
    # off the fastest: auto keeping the collectives is its best (the baseline's program,
    # judged as it whatever its median); link time not measured
    kept = _node_cell("kept", {"baseline": 100, "ring": 120, "auto": 107}, None)
    kept["rows"][-1]["sites"] = kept["rows"][0]["sites"]
    near_best, fast = nodes_targets([near, kept])
    assert near_best["reached"] and fast["reached"]
    assert len(fast["figures"]) == 1  # "kept" not judged: its link time is unknown
    near_best, fast = nodes_targets([near, far])
    assert near_best["misses"] == [near_best["figures"][1]] and not fast["reached"]
    assert "far: auto (ring) 160.0 ms, best fixed ring 100.0 ms (1.60x" in near_best["misses"][0]
    results = {
        "meta": {
            "nodes": 2,
            "ranks_per_node": 2,
            "command": "commfuse bench --nodes 2",
            "date": "today",
            "machine_before": {"cpu": "cpu", "cores": 2, "torch": "2", "load_average": [1, 1, 1]},
            "machine_after": {"load_average": [2, 2, 2]},
            "network": {"description": "2 nodes"},
            "launch": ["torchrun node 0", "torchrun node 1"],
            "profile": {"link_bytes_per_s": 1e9, "across_nodes": {"bytes_per_s": 1.25e8}},
        },
        "cells": [near, far],
        "targets": nodes_targets([near, far]),
    }
    text = markdown(results)
    row = "| near | dp=2 x tp=2 | 100 | 1.00 | 200.0 | 100.0 (ring) | 104.0 (ring) | 1.04 | 1.92x |"
    assert row in text
    assert "* `torchrun node 1`" in text and "; node 0/1, nodes 2/2" in text
    assert text.count("on 2 nodes x 2 ranks: training step") == 2


def test_nodes_flags_refuse_what_they_cannot_run(capsys):
    from commfuse_compile.tools.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--nodes", "2", "--quick"])
    assert "--nodes: its own cells, no --quick" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--nodes", "4", "--world-size", "2"])
    assert "--world-size 2 is no multiple of 4" in capsys.readouterr().err


@pytest.mark.matrix
def test_launched_ranks_serve_jobs_on_two_nodes(tmp_path, monkeypatch):
    """2 nodes x 2 ranks launched by torchrun serve jobs: torchrun's topology, one gloo
    group across the nodes, a failing job reported with its traceback."""
    here = os.path.dirname(os.path.abspath(__file__))  # the ranks import this module's jobs
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    from commfuse_compile.tools.bench.netns import can_throttle
    from commfuse_compile.tools.bench.nodes import launched_ranks
    from commfuse_compile.tools.ranks import RankError

    why_not = can_throttle()
    if why_not is not None:
        pytest.skip(f"2 nodes need network namespaces: {why_not}")
    with launched_ranks(2, 2, tmp_path) as (network, ranks, _):
        network.set_rate(1e9)
        assert ranks.run(_where_am_i) == [(r, 4, "2", str(r // 2), 6.0) for r in range(4)]
        with pytest.raises(RankError, match="ZeroDivisionError"):
            ranks.run(_divide_by_zero)


def _where_am_i(rank: int, n: int):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, n, os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"], total.item()


def _divide_by_zero(rank: int, n: int):
    return 1 / 0


def test_block_rate_search_settles_where_the_link_hides_its_first_bytes():
    from commfuse_compile.tools.bench.block import next_rate

    def link_s(rate: float) -> float:  # 10 MB's time, less 80 ms the transfers cover
        return max(0.0, 8e7 / rate - 0.08)

    tries: list[dict[str, float]] = []
    rate = 1e9
    for _ in range(3):
        tries.append({"rate_bits_per_s": rate, "link_s": link_s(rate)})
        rate = next_rate(tries, 0.1)
    assert [t["rate_bits_per_s"] for t in tries][:2] == [1e9, 1.25e8]  # 8x down at most
    assert link_s(rate) == pytest.approx(0.1, rel=0.05)
