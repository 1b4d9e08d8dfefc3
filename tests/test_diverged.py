"""Ranks that compile different graphs never hang and never crash: on real gloo ranks.

Real code gives ranks different graphs: logging on rank 0 inside the model (a graph
break on rank 0 only, as Megatron-Core's ``RowParallelLinear`` path does), a guard that
fails on one rank only (a recompile), code that one rank runs uncompiled or reaches
late. Each job must finish with the numbers of ``aot_eager`` (no pass), in seconds, and
the ranks must decide alike: the sites concerned keep their collectives on every rank,
with one warning that says what differed and how to find it. Each test uses a process
group of its own, so that what it marks diverged stays with it.
"""

from __future__ import annotations

import datetime
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse_compile
from commfuse_compile import report

GROUP_TIMEOUT = datetime.timedelta(seconds=120)
SCALE = 1.0  # read by the compiled function: rank 0 changes it (a recompile on rank 0)


def two_sites_with_rank0_warning(group):
    """Two all-gather -> matmul sites with a warning on rank 0 between them: rank 0
    compiles two graphs, the others one."""

    def fn(x, w1, w2):
        a = funcol.all_gather_tensor_autograd(x, 0, group) @ w1
        if dist.get_rank() == 0:
            warnings.warn("rank 0 logs here", stacklevel=1)
        b = funcol.all_gather_tensor_autograd(torch.tanh(x), 0, group) @ w2
        return (a * b).sum()

    return fn


def one_site_scaled(group):
    def fn(x, w1, w2):
        return (funcol.all_gather_tensor_autograd(x, 0, group) @ (w1 * SCALE + w2)).sum()

    return fn


def _train(fn, rank, steps, before_step):
    """``steps`` forward + backward steps of ``fn``; the losses and the last gradients."""
    torch.manual_seed(rank)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(100)
    w1, w2 = torch.randn(8, 6, requires_grad=True), torch.randn(8, 6, requires_grad=True)
    losses = []
    for step in range(steps):
        before_step(step)
        for p in (x, w1, w2):
            p.grad = None
        loss = fn(x, w1, w2)
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in (x, w1, w2)]


# The rank-0 warning must still split rank 0's graph here: commfuse runs such a logging
# call after the graph by default (commfuse_compile/deferred_logging.py), so it is off.
@mock.patch.dict("os.environ", {"COMMFUSE_DEFER_LOGGING": "0"})
def diverging_job(rank, n, scenario, inner, options):
    """The scenario's program under ``aot_eager`` and under commfuse (ring): the
    numbers of both, commfuse's time, its warnings and its site records."""
    global SCALE
    torch.set_num_threads(1)
    group = dist.new_group(list(range(n)), timeout=GROUP_TIMEOUT)
    make = two_sites_with_rank0_warning if scenario == "rank0_warning" else one_site_scaled
    runs = {}
    for backend in ("aot_eager", "commfuse"):
        torch._dynamo.reset()
        report.reset()
        SCALE = 1.0
        fn = make(group)
        uncompiled_here = scenario == "uncompiled_on_rank_1" and rank == 1
        if backend == "aot_eager":
            fn = torch.compile(fn, backend="aot_eager")
        elif not uncompiled_here:
            given = {"schedule": "ring", "inner": inner, **options}
            fn = torch.compile(fn, backend="commfuse", options=given)

        def before_step(step, compiled=backend == "commfuse"):
            global SCALE
            if scenario == "recompile_on_rank_0" and rank == 0 and step == 1:
                SCALE = 2.0  # a guard fails on rank 0 only: it recompiles
            if scenario == "late_rank_1" and rank == 1 and step == 0 and compiled:
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
            "sites": [(r.graph, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites],
        }
    dist.destroy_process_group(group)
    return runs


def _check_numbers(runs_per_rank):
    for runs in runs_per_rank:
        want, got = runs["aot_eager"], runs["commfuse"]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for g, w in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "inner"),
    [
        (3, "eager"),
        (4, "eager"),
        (3, "inductor"),
        pytest.param(2, "eager", marks=pytest.mark.matrix),
        pytest.param(2, "inductor", marks=pytest.mark.matrix),
        pytest.param(4, "inductor", marks=pytest.mark.matrix),
    ],
)
def test_a_warning_on_rank_0_falls_back_on_every_rank_at_once(ranks, n, inner):
    """Rank 0 compiles two graphs where the others compile one: seen at the first
    exchange by the graphs' digests, not at a timeout; every site keeps its collective."""
    runs_per_rank = ranks(n).run(diverging_job, "rank0_warning", inner, {})
    _check_numbers(runs_per_rank)
    for rank, runs in enumerate(runs_per_rank):
        got = runs["commfuse"]
        assert got["seconds"] < runs["aot_eager"]["seconds"] + 60, got["seconds"]
        (warned,) = got["warnings"]  # one warning, on every rank
        assert "compiled different graphs" in warned and "first difference at op" in warned
        assert "TORCH_LOGS=graph_breaks" in warned
        assert got["sites"], "every collective gets a record"
        assert all(decision == "declined" for _, _, decision, _ in got["sites"])
        codes = {code for *_, code in got["sites"]}
        assert codes <= {"compiler.rank_graphs", "site.ranks_diverged"}, (rank, codes)
        assert "site.ranks_diverged" in codes  # the backward, without any exchange


def test_a_warning_on_rank_0_under_schedule_auto_finishes_alike_on_every_rank(ranks):
    """``schedule="auto"`` decides per site from the cost model (here: no site pays on
    these small tensors): the ranks still exchange, see their different graphs and keep
    the collectives together, with the one warning, in bounded time."""
    runs_per_rank = ranks(3).run(diverging_job, "rank0_warning", "eager", {"schedule": "auto"})
    _check_numbers(runs_per_rank)
    for runs in runs_per_rank:
        got = runs["commfuse"]
        assert got["seconds"] < runs["aot_eager"]["seconds"] + 60, got["seconds"]
        (warned,) = got["warnings"]
        assert "compiled different graphs" in warned, warned
        assert got["sites"], "every collective gets a record"
        assert all(decision == "declined" for _, _, decision, _ in got["sites"])
        codes = {code for *_, code in got["sites"]}
        assert codes <= {"plan.not_profitable", "compiler.rank_graphs", "site.ranks_diverged"}


@pytest.mark.parametrize(("n", "inner"), [(3, "eager"), (3, "inductor")])
def test_a_recompile_on_one_rank_runs_with_its_peers_graph(ranks, n, inner):
    """Rank 0 recompiles (a float it reads changed), its peers keep running their graph:
    the recompiled graph has the transfers the group agreed on, so it runs rewritten
    without waiting for peers that never compile it."""
    runs_per_rank = ranks(n).run(diverging_job, "recompile_on_rank_0", inner, {})
    _check_numbers(runs_per_rank)
    for runs in runs_per_rank:
        got = runs["commfuse"]
        assert got["warnings"] == []
        assert got["seconds"] < runs["aot_eager"]["seconds"] + 60, got["seconds"]
        assert {decision for _, _, decision, _ in got["sites"]} == {"rewritten"}
    graphs = [len(runs["commfuse"]["sites"]) for runs in runs_per_rank]
    assert graphs[0] > graphs[1], graphs  # rank 0 compiled its graphs again


def test_a_rank_that_never_compiles_the_graph_is_given_up_on_every_rank(ranks):
    """Rank 1 runs the function uncompiled: rank 0 and 2 compile one graph more than it.
    They wait ``exchange_timeout``, give up together, and run the collectives."""
    options = {"exchange_timeout": 3}
    runs_per_rank = ranks(3).run(diverging_job, "uncompiled_on_rank_1", "eager", options)
    _check_numbers(runs_per_rank)
    for rank in (0, 2):
        got = runs_per_rank[rank]["commfuse"]
        assert got["seconds"] < 3 + 30, got["seconds"]
        (warned,) = got["warnings"]
        assert "ranks [1] of group" in warned and "within 3 s" in warned
        codes = {code for *_, code in got["sites"]}
        assert codes == {"compiler.rank_absent", "site.ranks_diverged"}, codes


def test_a_rank_that_comes_after_the_others_gave_up_hears_them(ranks):
    """Rank 1 compiles the same graph, but only after rank 0 gave up on it: it takes the
    verdict from the store and runs the collectives too (its peers already do)."""
    options = {"exchange_timeout": 2}
    runs_per_rank = ranks(2).run(diverging_job, "late_rank_1", "eager", options)
    _check_numbers(runs_per_rank)
    for runs in runs_per_rank:
        got = runs["commfuse"]
        (warned,) = got["warnings"]
        assert "ranks [1] of group" in warned, warned
        assert {code for *_, code in got["sites"]} == {
            "compiler.rank_absent",
            "site.ranks_diverged",
        }


def test_exchange_timeout_option_and_variable(monkeypatch):
    assert commfuse_compile.Options.from_mapping({"exchange_timeout": 2}).exchange_timeout == 2.0
    monkeypatch.setenv("COMMFUSE_EXCHANGE_TIMEOUT", "7.5")
    assert commfuse_compile.Options.from_mapping({}).exchange_timeout == 7.5
    with pytest.raises(commfuse_compile.CommfuseOptionError, match="seconds > 0"):
        commfuse_compile.Options.from_mapping({"exchange_timeout": 0})
