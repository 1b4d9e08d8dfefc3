"""Ranks that compile different graphs: only those graphs keep their collectives, the
graphs every rank compiled alike are still rewritten; never a hang or a crash. On gloo.

One program, three all-gather -> matmul sites in two graphs on every rank (a graph break
after the second site): graph A with sites 1 and 2, graph B with site 3, and their
backward graphs (two and one matmul -> reduce-scatter). Each case makes the ranks differ
as real code does, with differences that stay different (not logging, which the backend
keeps out of the graph):

* ``branch``: a branch on the rank inside graph A (rank 0 multiplies by 1.0): rank 0's A
  and its backward differ from its peers';
* ``graph_break``: a graph break on rank 0 only, between sites 1 and 2: rank 0 compiles
  A1, A2, B where its peers compile A, B (positions no longer pair);
* ``recompile``: a guard fails on rank 0 only at step 1 (a float it reads changed), so
  rank 0 compiles B and its backward again;
* ``uncompiled``: rank 1 runs the function uncompiled: its peers compile graphs it never
  does;
* ``late``: rank 1 compiles the same graphs, but only after its peers gave up on A.

Each job must finish with the numbers of ``aot_eager`` (no pass), in seconds, with the
ranks deciding alike. Each test uses a process group of its own. ``diverging_job``
also returns each rank's time, decisions per graph and warnings (what docs/internals.md
reports).
"""

from __future__ import annotations

import datetime
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse_compile
from commfuse_compile import report

GROUP_TIMEOUT = datetime.timedelta(seconds=120)
SCALE = 1.0  # read by graph B: rank 0 changes it in ``recompile``
AG = funcol.all_gather_tensor_autograd


def three_sites(group, rank, case):
    """Graph A (sites 1 and 2), a graph break on every rank, graph B (site 3)."""

    def fn(x, w1, w2, w3):
        a = AG(x, 0, group) @ w1
        if case == "branch" and rank == 0:
            a = a * 1.0  # one op more in rank 0's graph A and its backward
        if case == "graph_break" and rank == 0:
            torch._dynamo.graph_break()  # rank 0 compiles A as A1, A2
        a2 = AG(torch.sin(x), 0, group) @ w2
        torch._dynamo.graph_break()  # every rank: graph B from here
        b = AG(torch.tanh(x), 0, group) @ w3
        return (a * a2).sum() + (b * SCALE).sum()

    return fn


def _train(fn, rank, steps, before_step):
    """``steps`` forward + backward steps of ``fn``; the losses and the last gradients."""
    torch.manual_seed(rank)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(100)
    ws = [torch.randn(8, 6, requires_grad=True) for _ in range(3)]
    losses = []
    for step in range(steps):
        before_step(step)
        for p in (x, *ws):
            p.grad = None
        loss = fn(x, *ws)
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in (x, *ws)]


def diverging_job(rank, n, case, inner, options):
    """The case's program under ``aot_eager`` and under commfuse (ring): the numbers of
    both; commfuse's time, warnings and decisions per graph."""
    global SCALE
    torch.set_num_threads(1)
    group = dist.new_group(list(range(n)), timeout=GROUP_TIMEOUT)
    runs = {}
    for backend in ("aot_eager", "commfuse"):
        torch._dynamo.reset()
        report.reset()
        SCALE = 1.0
        fn = three_sites(group, rank, case)
        if backend == "aot_eager":
            fn = torch.compile(fn, backend="aot_eager")
        elif not (case == "uncompiled" and rank == 1):
            given = {"schedule": "ring", "inner": inner, **options}
            fn = torch.compile(fn, backend="commfuse", options=given)

        def before_step(step, compiled=backend == "commfuse"):
            global SCALE
            if case == "recompile" and rank == 0 and step == 1:
                SCALE = 2.0  # a guard fails on rank 0 only: it recompiles B
            if case == "late" and rank == 1 and step == 0 and compiled:
                time.sleep(2 * options["exchange_timeout"])

        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses, grads = _train(fn, rank, 3, before_step)
        runs[backend] = {
            "losses": losses,
            "grads": grads,
            "seconds": time.monotonic() - started,
            "warnings": [str(w.message) for w in caught if "commfuse" in str(w.message)],
            "graphs": _graphs(report.REPORT.sites),
        }
    dist.destroy_process_group(group)
    return runs


def _graphs(records):
    """Each graph with a site, in compile order: (role, its sites' decisions: "rewritten"
    or the decline code), and the reasons given."""
    graphs = {}
    for r in records:
        role, decisions, reasons = graphs.setdefault(r.graph_index, (r.graph, [], set()))
        decisions.append(r.decision if r.decision == "rewritten" else r.decline_code)
        if r.reason and r.decision != "rewritten":
            reasons.add(r.reason)
    return [(role, sorted(set(d)), sorted(why)) for _, (role, d, why) in sorted(graphs.items())]


def _decisions(runs):
    return [(role, decisions) for role, decisions, _ in runs["commfuse"]["graphs"]]


def _check_numbers(runs_per_rank):
    for runs in runs_per_rank:
        want, got = runs["aot_eager"], runs["commfuse"]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for g, w in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _check_bounded(runs_per_rank, seconds):
    for runs in runs_per_rank:
        got = runs["commfuse"]["seconds"]
        assert got < runs["aot_eager"]["seconds"] + seconds, got


RW, GRAPHS, ABSENT = ["rewritten"], ["compiler.rank_graphs"], ["compiler.rank_absent"]
DIFFERING = [("forward", GRAPHS), ("forward", RW), ("backward", RW), ("backward", GRAPHS)]
CELLS = [(3, "inductor")] + [
    pytest.param(n, inner, marks=pytest.mark.matrix)
    for n, inner in [(2, "eager"), (3, "eager"), (4, "eager"), (2, "inductor"), (4, "inductor")]
]


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_a_branch_on_the_rank_falls_back_in_that_graph_only(ranks, n, inner):
    """Rank 0's graph A (and its backward) differs: every rank gives A up at once (each
    waits for a graph the others never publish) and rewrites B, forward and backward;
    one warning on every rank, naming the first op that differs."""
    runs_per_rank = ranks(n).run(diverging_job, "branch", inner, {})
    _check_numbers(runs_per_rank)
    _check_bounded(runs_per_rank, 60)
    for runs in runs_per_rank:
        assert _decisions(runs) == DIFFERING
        (warned,) = runs["commfuse"]["warnings"]
        assert "compiled different graphs" in warned and "first difference at op" in warned
        assert "still rewritten" in warned and "TORCH_LOGS=graph_breaks" in warned


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_a_graph_break_on_one_rank_keeps_the_graphs_after_it(ranks, n, inner):
    """Rank 0 compiles A1, A2, B where its peers compile A, B: A1 and A are given up at
    once (each waits for the other's), A2 soon (its peers run A, blocked in the gather
    that A2's needs), and B, compiled alike, is rewritten forward and backward."""
    runs_per_rank = ranks(n).run(diverging_job, "graph_break", inner, {})
    _check_numbers(runs_per_rank)
    _check_bounded(runs_per_rank, 60)
    assert _decisions(runs_per_rank[0]) == [
        ("forward", GRAPHS),
        ("forward", ABSENT),
        ("forward", RW),
        ("backward", RW),
        ("backward", GRAPHS),
        ("backward", ABSENT),
    ]
    for runs in runs_per_rank[1:]:
        assert _decisions(runs) == DIFFERING
    for runs in runs_per_rank:
        (warned,) = runs["commfuse"]["warnings"]
        assert "compiled different graphs" in warned, warned


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_a_recompile_on_one_rank_runs_with_its_peers_graph(ranks, n, inner):
    """Rank 0 recompiles B and its backward (a float it reads changed), its peers keep
    running theirs: each recompiled graph has the transfers the group agreed on, so once
    its peers are seen running (``exchange.GRACE_S``), it runs rewritten with them."""
    runs_per_rank = ranks(n).run(diverging_job, "recompile", inner, {})
    _check_numbers(runs_per_rank)
    _check_bounded(runs_per_rank, 60)
    for runs in runs_per_rank:
        assert runs["commfuse"]["warnings"] == []
        assert {d for _, decisions in _decisions(runs) for d in decisions} == {"rewritten"}
    graphs = [len(runs["commfuse"]["graphs"]) for runs in runs_per_rank]
    assert graphs[0] == graphs[1] + 2, graphs  # rank 0 compiled B and its backward again


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_a_rank_that_never_compiles_is_given_up_on_once(ranks, n, inner):
    """Rank 1 runs the function uncompiled: its peers wait ``exchange_timeout`` for it at
    their first graph, then give up on each later graph at once (it has not moved
    since), and run the collectives it runs."""
    options = {"exchange_timeout": 3}
    runs_per_rank = ranks(n).run(diverging_job, "uncompiled", inner, options)
    _check_numbers(runs_per_rank)
    _check_bounded(runs_per_rank, 3 + 30)
    assert runs_per_rank[1]["commfuse"]["graphs"] == []
    for rank in (0, *range(2, n)):
        runs = runs_per_rank[rank]
        expected = [("forward", ABSENT), ("forward", ABSENT), ("backward", ABSENT)]
        assert _decisions(runs) == [*expected, ("backward", ABSENT)]
        (warned,) = runs["commfuse"]["warnings"]
        assert "ranks [1] of group" in warned and "not within 3 s" in warned, warned


@pytest.mark.parametrize(
    ("n", "inner"), [(3, "eager"), pytest.param(2, "eager", marks=pytest.mark.matrix)]
)
def test_a_rank_that_comes_after_the_others_gave_up_hears_them(ranks, n, inner):
    """Rank 1 compiles the same graphs, but only after its peers gave up on A: it takes
    their verdict from the store; the later graphs, which it compiles with them, are
    rewritten on every rank, A's backward too."""
    options = {"exchange_timeout": 2}
    runs_per_rank = ranks(n).run(diverging_job, "late", inner, options)
    _check_numbers(runs_per_rank)
    for runs in runs_per_rank:
        assert _decisions(runs) == [
            ("forward", ABSENT),
            ("forward", RW),
            ("backward", RW),
            ("backward", RW),
        ]
        (warned,) = runs["commfuse"]["warnings"]
        assert "ranks [1] of group" in warned, warned


def test_a_branch_under_schedule_auto_finishes_alike_on_every_rank(ranks):
    """``schedule="auto"`` decides per site from the cost model (here: no site pays on
    these small tensors): the ranks still exchange, give up graph A together with the one
    warning, in bounded time."""
    runs_per_rank = ranks(3).run(diverging_job, "branch", "eager", {"schedule": "auto"})
    _check_numbers(runs_per_rank)
    _check_bounded(runs_per_rank, 60)
    for runs in runs_per_rank:
        (warned,) = runs["commfuse"]["warnings"]
        assert "compiled different graphs" in warned, warned
        assert {d for _, decisions in _decisions(runs) for d in decisions} == {
            "plan.not_profitable"
        }


def test_exchange_timeout_option_and_variable(monkeypatch):
    assert commfuse_compile.Options.from_mapping({"exchange_timeout": 2}).exchange_timeout == 2.0
    monkeypatch.setenv("COMMFUSE_EXCHANGE_TIMEOUT", "7.5")
    assert commfuse_compile.Options.from_mapping({}).exchange_timeout == 7.5
    with pytest.raises(commfuse_compile.CommfuseOptionError, match="seconds > 0"):
        commfuse_compile.Options.from_mapping({"exchange_timeout": 0})
