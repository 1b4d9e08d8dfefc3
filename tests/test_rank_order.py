"""One order of transfers on every rank (``passes/ranks/order.py``), checked across the ranks
(``passes/ranks/sequence.py``).

Inductor compiles each rank's graph on its own and may order independent work
differently on different ranks; two ranks that start two independent rings in opposite
orders wait for each other forever. The pass chains every transfer start in graph order,
and compares what each rank's compiler produced before anything runs: the order of
starts, and the ranks' sequences run together under the transport's matching rule.

* graph level (fake process group): the chain across independent sites, the slicing
  schedule's collectives and collectives the pass left; the simulator on small
  sequences; the sequence of an eager graph;
* 4 gloo ranks, the shape that hung: a 2-block DTensor TP+SP transformer with Inductor,
  ``schedule="ring"``, forward, backward and an AdamW step: every site rewritten, the
  losses equal, each rank's generated programs read back (they differ) with one order
  of starts that completes when run together; without the chain, rank 3's program
  starts two rings in the other order and every rank falls back together, naming them;
* graphs with independent sites in one backward (two reduce-scatters side by side; a
  gather and a reduce-scatter with no path between them) on 3, 4 and 5 ranks with
  Inductor, every schedule (the default run: ring on 4; ``pytest -m matrix`` the rest).

Every multi-rank test runs on pools whose process group times out after
``conftest.GROUP_TIMEOUT_S``: a deadlock fails in seconds, naming its site and step.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import relative_error, sequence_parallel_blocks
from test_graph import calls, fx, wrapped

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.passes.ranks import program, sequence
from commfuse_compile.passes.ranks.sequence import START, WAIT, Event

N, RANK = 4, 1
P2P = torch.ops.commfuse.p2p.default
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# graph level


def two_reduce_scatters(a, w1, b, w2):
    """Two matmul -> reduce-scatter sites with no path between them, and an all-reduce
    the pass leaves (declined: no matmul)."""
    name = dist.group.WORLD.group_name
    x = c10d.wait_tensor(c10d.reduce_scatter_tensor(a @ w1, "sum", N, name))
    y = c10d.wait_tensor(c10d.reduce_scatter_tensor(b @ w2, "sum", N, name))
    z = c10d.wait_tensor(c10d.all_reduce(a.sum(0), "sum", name))
    return x, y, z


SHAPES = ((8, 6), (6, 4), (8, 5), (5, 4))


@pytest.mark.parametrize(
    ("schedule", "p2ps", "chunks"), [("ring", 2 * (N - 1), 0), ("slicing", 0, 4)]
)
def test_every_start_follows_the_previous_one_across_sites(fake_world, schedule, p2ps, chunks):
    """Every P2P op, the slicing schedule's chunk reduce-scatters and the all-reduce the
    pass left, in one chain through both sites."""
    gm = fx(two_reduce_scatters, *SHAPES)
    records = rewrite_graph(gm, "forward", Options(schedule=schedule, slices=2))
    assert [(r.kind, r.decision) for r in records] == [("mm_rs", "rewritten")] * 2 + [
        ("mm_ar", "declined")  # a sum, no matmul
    ]
    kinds = (P2P, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)
    found = {op: wrapped(gm, op) for op in kinds}
    assert [len(found[op]) for op in kinds] == [p2ps, chunks, 1]
    starts = [n for n in gm.graph.nodes if any(n in nodes for nodes in found.values())]
    for previous, start in zip(starts, starts[1:], strict=False):
        assert start.target is torch.ops.higher_order.control_deps
        assert previous in start.args[0], (previous.name, start.name)


def test_an_eager_graphs_sequence_is_its_node_order(fake_world):
    gm = fx(two_reduce_scatters, *SHAPES)
    records = rewrite_graph(gm, "forward", Options(schedule="ring", inner="eager"))
    events = sequence.from_graph(gm.graph, lambda name: tuple(range(N)))
    starts = [e for e in events if e.action == START]
    p2ps = calls(gm, P2P)
    assert [e.label for e in starts[: len(p2ps)]] == [p.args[6] for p in p2ps]
    assert starts[-1].label == "all_reduce" and starts[-1].ranks == tuple(range(N))
    for p2p, event in zip(p2ps, starts, strict=False):
        assert (event.sends, event.recvs) == (tuple(p2p.args[1]), tuple(p2p.args[3]))
        assert event.tag == p2p.args[4]
    waited = [e.transfer for e in events if e.action == WAIT]
    assert set(waited) == {e.transfer for e in starts}  # each waited (once per tensor)
    site_ids = {r.site for r in records if r.decision == "rewritten"}
    assert {e.label.split()[1] for e in starts[:-1]} == site_ids


def test_a_forward_graph_that_falls_back_compiles_again_with_inductor(fake_world, monkeypatch):
    """A fallback compiles the original graph in the same tracing context as the first
    compile (Inductor asserts the context's output strides were not reported yet)."""
    from commfuse_compile.passes.ranks import program as program_module

    def violated(code, group_ranks=None):
        return program_module.Result(["line 1: a made-up violation"], [], 0, [])

    monkeypatch.setattr(program_module, "check", violated)
    torch._dynamo.reset()
    report.reset()
    w = torch.randn(16, 8, requires_grad=True)

    def gather_matmul(x):
        name = dist.group.WORLD.group_name
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, N, name)) @ w

    compiled = torch.compile(gather_matmul, backend="commfuse", options={"schedule": "ring"})
    with pytest.warns(UserWarning, match="breaks a transfer's buffer"):
        out = compiled(torch.randn(2, 16))
    assert out.shape == (2 * N, 8)
    forward = [s for s in report.REPORT.sites if s.graph == "forward"]
    assert [s.decline_code for s in forward] == ["compiler.breaks_buffer"]


def ring(site: int, rank: int, n: int, steps: int | None = None) -> list[Event]:
    """One ring site's P2P steps as ``rank`` runs them: start, then wait, each step."""
    events = []
    for step in range((n - 1) if steps is None else steps):
        transfer = 100 * site + step
        label = f"site 0.{site} step {step} (mm_rs)"
        sends, recvs = ((rank + 1) % n,), ((rank - 1) % n,)
        events.append(Event(START, transfer, label, "0", 1000 + site, sends, recvs))
        events.append(Event(WAIT, transfer, label, "0", 1000 + site, sends, recvs))
    return events


def test_the_same_order_on_every_rank_completes():
    programs = {r: ring(1, r, 4) + ring(2, r, 4) for r in range(4)}
    assert sequence.simulate(programs) is None
    digests = {r: sequence.digest(p) for r, p in programs.items()}
    assert sequence.first_divergence(digests) is None


def test_two_rings_in_opposite_orders_deadlock_and_are_named():
    """The hang found at 4 ranks: rank 3 runs the two sites' steps the other way round."""
    programs = {r: ring(9, r, 4) + ring(10, r, 4) for r in range(3)}
    programs[3] = ring(10, 3, 4) + ring(9, 3, 4)
    stuck = sequence.simulate(programs)
    assert stuck is not None
    assert stuck.waiting[3].startswith("site 0.10 step 0")
    assert stuck.waiting[0].startswith("site 0.9")
    digests = {r: sequence.digest(p) for r, p in programs.items()}
    where = sequence.first_divergence(digests)
    assert where == (0, 0, 3)
    text = sequence.divergence_text(digests, where)
    assert "rank 0 starts 'site 0.9 step 0 (mm_rs)'" in text
    assert "rank 3 starts 'site 0.10 step 0 (mm_rs)'" in text


def test_starts_in_one_order_complete_whatever_order_the_waits_take():
    """Waits may move (Inductor orders them by their readers); starts never block, so
    one order of starts suffices: rank 2 starts both rings before waiting either."""
    programs = {r: ring(1, r, 3) + ring(2, r, 3) for r in range(3)}
    first, second = ring(1, 2, 3), ring(2, 2, 3)
    starts = [e for e in first + second if e.action == START]
    waits = [e for e in second + first if e.action == WAIT]
    programs[2] = starts + waits
    assert sequence.simulate(programs) is None


def test_a_collective_waits_for_every_rank_of_its_group():
    def collective(transfer: int, ranks: tuple[int, ...]) -> list[Event]:
        return [
            Event(START, transfer, "all_reduce", "g", ranks=ranks),
            Event(WAIT, transfer, "all_reduce", "g", ranks=ranks),
        ]

    both = {0: collective(0, (0, 1)), 1: collective(0, (0, 1))}
    assert sequence.simulate(both) is None
    # rank 1 waits on a ring step with rank 0 first; rank 0 waits in the collective first
    programs = {0: collective(0, (0, 1)) + ring(1, 0, 2), 1: ring(1, 1, 2) + collective(0, (0, 1))}
    stuck = sequence.simulate(programs)
    assert stuck is not None and stuck.waiting == {0: "all_reduce", 1: "site 0.1 step 0 (mm_rs)"}


def test_a_transfer_no_peer_posts_never_completes():
    programs = {0: ring(1, 0, 2), 1: []}
    stuck = sequence.simulate(programs)
    assert stuck is not None and list(stuck.waiting) == [0]


def test_events_survive_the_exchange():
    event = ring(3, 1, 4)[0]
    assert Event.from_json(json.loads(json.dumps(event.as_json()))) == event


# ----------------------------------------------------------------------------------------
# gloo ranks


def read_programs(debug_dir: str, rank: int) -> dict[str, dict]:
    """Each graph's Inductor program this rank wrote to the dump, read back: its size
    and its transfer sequence (global ranks as this process resolves them)."""
    from commfuse_compile.runtime.groups import ranks_of

    found = {}
    for path in sorted((Path(debug_dir) / f"rank{rank}").glob("graph*_inductor.py")):
        code = path.read_text()
        events = program.check(code, ranks_of).sequence
        found[path.name] = {"lines": code.count("\n"), "sequence": [e.as_json() for e in events]}
    return found


def train_blocks(rank: int, n: int, options: dict, debug_dir: str, chained: bool = True) -> dict:
    """The shape that hung: 2 TP+SP blocks, forward, backward, AdamW step, twice; with
    the pass and without (eager, the same initialization and data)."""
    import torch._inductor.config

    from commfuse_compile.passes.ranks import order

    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    report.reset()
    transfer_starts = order.transfer_starts
    if not chained:
        order.transfer_starts = lambda graph: []  # the pass as it was before the chain
    ref, model = sequence_parallel_blocks(n), sequence_parallel_blocks(n)
    compiled = torch.compile(model, backend="commfuse", options={**options, "debug_dir": debug_dir})
    torch.manual_seed(1 + rank)
    xs = [torch.randn(2, 8, 96) for _ in range(2)]
    losses = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for module, run in ((ref, ref), (model, compiled)):
                optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
                losses.append([])
                for x in xs:
                    loss = run(x).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses[-1].append(loss.item())
    finally:
        order.transfer_starts = transfer_starts
    return {
        "losses": losses,
        "sites": [
            [r.graph, r.kind, r.decision, r.decline_code, r.reason] for r in report.REPORT.sites
        ],
        "warnings": [str(w.message) for w in caught if "commfuse" in str(w.message)],
        "programs": read_programs(debug_dir, rank),
    }


def assert_one_order_that_completes(results: list[dict]) -> None:
    """Every graph's programs, as each rank's compiler wrote them: one order of starts,
    and run together they complete."""
    for name in results[0]["programs"]:
        programs = {
            rank: [Event.from_json(e) for e in r["programs"][name]["sequence"]]
            for rank, r in enumerate(results)
        }
        digests = {rank: sequence.digest(events) for rank, events in programs.items()}
        assert sequence.first_divergence(digests) is None, name
        assert digests[0], name
        assert sequence.simulate(programs) is None, name


def test_tp_sp_blocks_on_4_ranks_with_inductor_finish_and_match(ranks, tmp_path):
    """The regression: this hung in the first backward (rank 3 ran sites 9 and 10 of the
    backward in the other order)."""
    results = ranks(4).run(train_blocks, {"schedule": "ring"}, str(tmp_path))
    for r in results:
        compiled, eager = r["losses"][1], r["losses"][0]
        assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager, strict=True)) < 1e-5
        decisions = [(graph, decision) for graph, _, decision, _, _ in r["sites"]]
        assert decisions == [("forward", "rewritten")] * 8 + [("backward", "rewritten")] * 14
        assert r["warnings"] == []
    assert_one_order_that_completes(results)
    lines = {rank: [p["lines"] for p in r["programs"].values()] for rank, r in enumerate(results)}
    print("lines of each rank's generated programs:", lines)


@pytest.mark.parametrize("n", [pytest.param(3, marks=pytest.mark.matrix), 4])
def test_tp_sp_blocks_with_default_options_finish_and_match(ranks, tmp_path, n):
    """The same shape with ``backend="commfuse"`` and nothing else (Inductor, ``auto``):
    every rank decides alike, nothing falls back, the losses match."""
    results = ranks(n).run(train_blocks, {}, str(tmp_path))
    for r in results:
        compiled, eager = r["losses"][1], r["losses"][0]
        assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager, strict=True)) < 1e-5
        assert [s[:4] for s in r["sites"]] == [s[:4] for s in results[0]["sites"]]
        assert len(r["sites"]) == 22
        assert {s[3] for s in r["sites"] if s[2] == "declined"} <= {"plan.not_profitable"}
        assert r["warnings"] == []
    if any(s[2] == "rewritten" for s in results[0]["sites"]):
        assert_one_order_that_completes(results)


# The check of the check (the default run keeps the chained path users run, above; the
# check itself on small sequences at graph level): under -m matrix
@pytest.mark.matrix
def test_without_the_chain_every_rank_falls_back_together(ranks, tmp_path):
    """The check alone: Inductor's own order differs on rank 3; no rank may run it."""
    results = ranks(4).run(train_blocks, {"schedule": "ring"}, str(tmp_path), False)
    fell_back = [
        [s for s in r["sites"] if s[3] in ("compiler.rank_order", "compiler.rank_deadlock")]
        for r in results
    ]
    assert fell_back[0], "rank 3's order no longer differs: this test checks nothing"
    for r, declined in zip(results, fell_back, strict=True):
        assert declined == fell_back[0]  # every rank, the same sites, the same reason
        compiled, eager = r["losses"][1], r["losses"][0]
        assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager, strict=True)) < 1e-5
        named = [w for w in r["warnings"] if "different orders" in w or "would hang" in w]
        assert len(named) == 1 and "site" in named[0], r["warnings"]
    print("fell back:", fell_back[0][0][4])


# Independent sites in one backward, written with functional collectives with autograd:
# "two_rs": two gathered activations, each into its own matmul (the backward has two
# matmul -> reduce-scatter sites side by side); "ag_rs": a gathered activation and a
# reduce-scattered product (the backward has a gather and a reduce-scatter with no path
# between them).
INDEPENDENT = ("two_rs", "ag_rs")


def independent_sites(rank: int, n: int, kind: str, options: dict, debug_dir: str) -> dict:
    import torch._inductor.config
    from torch.distributed._functional_collectives import (
        all_gather_single_autograd,
        reduce_scatter_single_autograd,
    )

    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    report.reset()
    group = dist.group.WORLD

    def fn(x1, x2, w1, w2):
        a = all_gather_single_autograd(x1, 0, group) @ w1
        if kind == "two_rs":
            b = all_gather_single_autograd(x2, 0, group) @ w2
        else:
            b = reduce_scatter_single_autograd(x2 @ w2, "sum", 0, group)
        return a.pow(2).sum() + b.pow(2).sum()

    torch.manual_seed(0)
    weights = [torch.randn(8, 6), torch.randn(8, 5)]
    torch.manual_seed(1 + rank)
    x1 = torch.randn(2, 8)
    x2 = torch.randn(2 if kind == "two_rs" else 2 * n, 8)
    compiled = torch.compile(
        fn, backend="commfuse", options={**options, "debug_dir": debug_dir}, fullgraph=True
    )
    grads = []
    for run in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (x1, x2, *weights)]
        run(*leaves).backward()
        grads.append([t.grad for t in leaves])
    return {
        "errors": [relative_error(c, e) for c, e in zip(grads[1], grads[0], strict=True)],
        "sites": [[r.graph, r.kind, r.decision, r.reason, r.schedule] for r in report.REPORT.sites],
        "programs": read_programs(debug_dir, rank),
    }


def independent_cells():
    for n in (3, 4, 5):
        for kind in INDEPENDENT:
            for schedule in ("ring", "bidir", "push", "slicing"):
                default = n == 4 and schedule == "ring"
                marks = () if default else (pytest.mark.matrix,)
                yield pytest.param(kind, n, schedule, id=f"{kind}-{schedule}-n{n}", marks=marks)


@pytest.mark.parametrize(("kind", "n", "schedule"), list(independent_cells()))
def test_independent_sites_in_one_backward(ranks, tmp_path, kind, n, schedule):
    options = {"schedule": schedule}
    results = ranks(n).run(independent_sites, kind, options, str(tmp_path))
    for r in results:
        assert max(r["errors"]) < 1e-5, r["errors"]
        backward = [s for s in r["sites"] if s[0] == "backward"]
        assert all(s[2] == "rewritten" and s[4] == schedule for s in r["sites"]), r["sites"]
        kinds = sorted(s[1] for s in backward)
        assert kinds.count("mm_rs") == (2 if kind == "two_rs" else 1), kinds
        if kind == "ag_rs":
            assert "ag_mm" in kinds
    assert_one_order_that_completes(results)
