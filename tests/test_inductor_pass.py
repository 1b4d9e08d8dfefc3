"""The pass inside ``backend="inductor"`` (``commfuse_compile.install_inductor_pass``).

Installing and uninstalling Inductor's ``post_grad_custom_pre_pass`` (twice, next to a
user's own pass, options from the environment); the graphs Inductor hands it (forward,
backward, inference), an internal error that keeps the graph, a graph that
``backend="commfuse"`` rewrote already; then a DTensor TP+SP MLP on 3 gloo ranks (4 with
``-m matrix``) under ``torch.compile(model, backend="inductor")``: forward and backward
equal to the uncompiled model, every site rewritten, Inductor's programs keep every
transfer's memory and run together on the ranks; uninstalled, Inductor compiles the
model as it is.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models import mlp_train_step
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes.control_dependencies import control_deps
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import inductor_pass
from commfuse_compile.inductor_pass import SLOT
from commfuse_compile.passes import PASSED, match
from commfuse_compile.passes.fx.declines import decline
from commfuse_compile.passes.ranks import agree, program, sequence
from commfuse_compile.runtime import groups

c10d = torch.ops._c10d_functional


class UserPass(CustomGraphPass):
    """A pass of the user's own, already in the slot."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return "user"


@pytest.fixture
def slot(monkeypatch):
    """Inductor's slot, empty, restored after the test."""
    monkeypatch.setattr(inductor_config, SLOT, None)
    return lambda: getattr(inductor_config, SLOT)


def test_install_twice_is_one_pass_with_the_latest_options(slot):
    first = commfuse_compile.install_inductor_pass(schedule="ring")
    assert slot() is first and first.options.inner == "inductor"
    second = commfuse_compile.install_inductor_pass({"schedule": "bidir"})
    assert slot() is second and second.options.schedule == "bidir"
    assert commfuse_compile.installed_inductor_pass() is second
    assert commfuse_compile.uninstall_inductor_pass() is True
    assert slot() is None and commfuse_compile.installed_inductor_pass() is None
    assert commfuse_compile.uninstall_inductor_pass() is False


def test_a_users_pass_runs_first_and_stays(slot, monkeypatch):
    user = UserPass()
    monkeypatch.setattr(inductor_config, SLOT, user)
    ours = commfuse_compile.install_inductor_pass()
    assert slot() == [user, ours]
    commfuse_compile.install_inductor_pass()
    assert slot()[0] is user and len(slot()) == 2
    commfuse_compile.uninstall_inductor_pass()
    assert slot() is user
    monkeypatch.setattr(inductor_config, SLOT, (user, print))
    commfuse_compile.install_inductor_pass()
    commfuse_compile.uninstall_inductor_pass()
    assert slot() == [user, print]


def test_options_from_the_environment_and_bad_ones(slot, monkeypatch):
    monkeypatch.setenv("COMMFUSE_SCHEDULE", "push")
    installed = commfuse_compile.install_inductor_pass()
    assert installed.options.schedule == "push"
    assert installed.options.described()["schedule"]["from"] == (
        "environment variable COMMFUSE_SCHEDULE"
    )
    assert installed.uuid() is None  # Inductor's caches would skip the ranks' agreement
    monkeypatch.setenv("COMMFUSE_SCHEDULE", "fast")
    with pytest.raises(commfuse_compile.CommfuseOptionError, match="COMMFUSE_SCHEDULE"):
        commfuse_compile.install_inductor_pass()
    with pytest.raises(commfuse_compile.CommfuseOptionError, match="'inner' cannot be 'eager'"):
        commfuse_compile.install_inductor_pass(inner="eager")
    with pytest.raises(commfuse_compile.CommfuseOptionError, match="not both"):
        commfuse_compile.install_inductor_pass({"schedule": "ring"}, slices=4)
    assert slot() is installed  # a refused install leaves the installed pass


def _linear_roles(monkeypatch, backend: str = "inductor") -> tuple[list[str], float]:
    """Compile a linear layer's forward and backward, then its inference, with
    ``backend``; the roles the Inductor pass ran on and the largest difference to eager."""
    roles: list[str] = []

    def spy(gm, graph_role, options):
        roles.append(graph_role)
        return rewrite_graph(gm, graph_role, options)

    rewrite_graph = inductor_pass.rewrite_graph
    monkeypatch.setattr(inductor_pass, "rewrite_graph", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    compiled = torch.compile(layer, backend=backend)
    out = compiled(x)
    out.sum().backward()
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).sum().backward()
    with torch.no_grad():
        inferred = compiled(x)
    diff = max((out - layer(x)).abs().max(), (grad - layer.weight.grad).abs().max())
    return roles, max(diff.item(), (inferred - layer(x)).abs().max().item())


def test_each_graph_inductor_compiles_an_internal_error_keeps_it(slot, monkeypatch):
    def broken(graph):
        raise RuntimeError("broken matcher")

    monkeypatch.setattr(match, "find_sites", broken)
    monkeypatch.setenv("COMMFUSE_STRICT", "0")  # the fall-back, not the error
    commfuse_compile.install_inductor_pass()
    bypassed = counters["inductor"]["fxgraph_cache_bypass"]
    with pytest.warns(UserWarning, match="graph left as it was: internal error"):
        roles, diff = _linear_roles(monkeypatch)
    assert roles == ["forward", "backward", "inference"]
    assert diff < 1e-6
    assert counters["inductor"]["fxgraph_cache_bypass"] > bypassed


def test_a_graph_the_backend_rewrote_is_left_alone(slot, monkeypatch):
    commfuse_compile.install_inductor_pass()
    roles, diff = _linear_roles(monkeypatch, backend="commfuse")
    assert roles == [] and diff < 1e-6


@pytest.fixture
def fake_world():
    """Rank 1 of 4 on torch's fake process group: sites are rewritten, nothing is sent."""
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


def row_parallel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    group = dist.group.WORLD.group_name
    return c10d.wait_tensor(c10d.all_reduce(torch.relu(x) @ w, "sum", group))


def test_the_hook_is_the_pipeline_with_inductors_order(slot, fake_world):
    gm = make_fx(row_parallel, tracing_mode="fake")(torch.randn(8, 6), torch.randn(6, 5))
    installed = commfuse_compile.install_inductor_pass(schedule="ring")
    installed(gm.graph, is_inference=False)
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.commfuse.p2p.default in targets  # the ring
    assert control_deps in targets  # one order of starts, kept through Inductor
    assert gm.meta[PASSED] >= 0
    before = gm.graph.python_code("self").src
    installed(gm.graph, is_inference=False)  # a graph the pass saw is left alone
    assert gm.graph.python_code("self").src == before


def test_inductors_own_comm_passes_leave_the_graph_as_it_is(slot, fake_world, monkeypatch):
    """Bucketing after the slot would change the transfers the ranks agreed on."""
    monkeypatch.setattr(inductor_config, "bucket_all_reduces_fx", "all")
    gm = make_fx(row_parallel, tracing_mode="fake")(torch.randn(8, 6), torch.randn(6, 5))
    before = gm.graph.python_code("self").src
    commfuse_compile.report.reset()
    with pytest.warns(UserWarning, match="Inductor's bucket_all_reduces_fx would change"):
        commfuse_compile.install_inductor_pass(schedule="ring")(gm.graph, is_inference=False)
    assert gm.graph.python_code("self").src == before
    (site,) = commfuse_compile.REPORT.sites
    assert (site.kind, site.decline_code) == ("mm_ar", "compiler.comm_passes")


def test_a_fall_back_inside_inductor_compiles_the_graph_as_it_came(slot, fake_world, monkeypatch):
    """The ranks' agreement says no: the restored graph goes on through Inductor."""
    monkeypatch.setattr(
        agree, "agree", lambda *args: decline("compiler.rank_deadlock", detail="forced")
    )
    commfuse_compile.install_inductor_pass(schedule="ring")
    commfuse_compile.report.reset()
    torch._dynamo.reset()
    x, w = torch.randn(8, 6), torch.randn(6, 5)
    with pytest.warns(UserWarning, match="would hang: forced; compiling the original graph"):
        out, (code,) = run_and_get_code(torch.compile(row_parallel, backend="inductor"), x, w)
    assert torch.allclose(out, row_parallel(x, w))
    assert "commfuse.p2p" not in code and "all_reduce" in code
    (site,) = commfuse_compile.REPORT.sites
    assert (site.decision, site.decline_code) == ("declined", "compiler.rank_deadlock")
    # the record tells what runs: the collective's predicted timeline, no rewrite's nodes
    assert (site.nodes, site.steps, site.p2p_ops) == ([], 0, 0)
    assert [e["name"] for e in site.timeline] == ["matmul", "reduce_scatter", "all_gather"]


def hooked_mlp_step(rank: int, n: int, options: dict | None, debug_dir: str) -> dict:
    """One rank: the TP+SP MLP under ``backend="inductor"``, the pass installed with
    ``options`` (None: not installed); Inductor's programs checked as the backend checks
    them, their sequences of transfers returned."""
    torch.set_num_threads(1)
    if options is not None:
        commfuse_compile.install_inductor_pass({**options, "debug_dir": debug_dir})
    try:
        result = mlp_train_step(rank, n, {}, debug_dir, backend="inductor")
    finally:
        commfuse_compile.uninstall_inductor_pass()
    checked = [program.check(code, groups.ranks_of) for code in result.pop("programs")]
    result["violations"] = [v for c in checked for v in c.violations]
    result["sequences"] = [c.sequence for c in checked]
    return result


@pytest.mark.parametrize("n", [3, pytest.param(4, marks=pytest.mark.matrix)])
def test_tp_sp_mlp_under_backend_inductor(ranks, tmp_path, n):
    pool = ranks(n)
    results = pool.run(hooked_mlp_step, {"schedule": "ring"}, str(tmp_path / "on"))
    for rank, res in enumerate(results):
        assert res["out_diff"] <= 1e-5, rank
        assert max(res["grad_diff"].values()) <= 1e-5, res["grad_diff"]
        assert res["leaked_works"] == 0 and res["violations"] == []
        sites = res["report"]["sites"]
        assert {s["decision"] for s in sites} == {"rewritten"}
        assert {(s["graph"], s["kind"]) for s in sites} == {
            ("forward", "ag_mm"),
            ("forward", "mm_rs"),
            ("backward", "ag_mm"),
            ("backward", "mm_rs"),
        }
        assert all(s["steps"] == n and s["p2p_ops"] == n - 1 for s in sites)
        assert {"graph000_forward_after.py", "graph001_backward_after.py"} <= set(res["files"])
        assert all(any(e.tag is not None for e in s) for s in res["sequences"])  # P2P steps
    for graph in range(2):  # forward, backward: the ranks' programs run together
        programs = {rank: res["sequences"][graph] for rank, res in enumerate(results)}
        # site ids counted from each graph's first: a pool's ranks compiled other graphs before
        digests = {rank: sequence.digest(p) for rank, p in programs.items()}
        assert sequence.first_divergence(digests) is None
        assert sequence.simulate(programs) is None

    off = pool.run(hooked_mlp_step, None, str(tmp_path / "off"))
    for res in off:
        assert res["out_diff"] <= 1e-5 and max(res["grad_diff"].values()) <= 1e-5
        assert res["report"] is None and res["files"] == []
        assert res["violations"] == [] and all(e.tag is None for s in res["sequences"] for e in s)
