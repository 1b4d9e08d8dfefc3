"""Logging inside compiled code runs after the graph, as it would have run in place.

``print``, ``warnings.warn`` and ``logging`` calls with Python values only do not break
the graph (``commfuse_compile/deferred_logging.py``): a message that only rank 0 logs
(``if rank == 0: warnings.warn(...)``, Megatron-Core's ``RowParallelLinear`` path) then
gives every rank the same graph, and the pass keeps its rewrites. Each case compares what
the program prints, warns (message, category, file, line) and logs (logger, level, file,
line, function, message) compiled and uncompiled, and counts Dynamo's graphs: one where
the call waits, two where it cannot (a tensor argument, a stream, ``exc_info``) and
breaks the graph as without commfuse. The rank-only case runs on torch's fake process
group (ranks 0 and 1 in one process) and on 3 gloo ranks with ``backend="commfuse"``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import CommfuseOptionError, deferred_logging, report

logger = logging.getLogger("tests.deferred")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[object, ...]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "commfuse":  # the pass's own log (test_said_in_the_log)
            return
        where = (os.path.basename(record.pathname), record.lineno, record.funcName)
        self.seen.append((record.name, record.levelname, *where, record.getMessage()))


def megatron_group_if_none(group):
    """Megatron-Core's ``get_tensor_model_parallel_group_if_none``: rank 0 warns, with a
    category and ``stacklevel=2`` (the caller's line), from a frame Dynamo inlines."""
    if group is None and (dist.get_rank() if dist.is_initialized() else 0) == 0:
        warnings.warn("tp_group is None, using default tp group", DeprecationWarning, stacklevel=2)
    return group


def log_single_rank(log, *args, rank=0, **kwargs):
    """Megatron-Core's ``log_single_rank``: ``logger.log`` on one rank."""
    if (dist.get_rank() if dist.is_initialized() else 0) == rank:
        log.log(*args, **kwargs)


def helper(y, n):
    print("inner", n, sep="-", end="|\n")
    warnings.warn(f"step {n} of {type(y).__name__}", stacklevel=1)
    logger.warning("logger %s", n, stacklevel=2)
    logging.info("root info %d", n)
    log_single_rank(logger, logging.INFO, "single rank %s", n)
    megatron_group_if_none(None)
    return y + 1


def waits_inlined(x):
    return helper(x + 1, 3) * 2


def waits_in_the_compiled_frame(x):
    y = x + 1
    print("compiled frame", 7, flush=True)
    warnings.warn("a category", UserWarning, stacklevel=1)
    logger.info("info %s %s", "a", 1.5)
    logger.debug("below the level: not made")
    return y * 2


def breaks_on_a_tensor(x):
    y = x + 1
    print("sum", y.sum())
    warnings.warn(f"mean {y.mean()}", stacklevel=1)
    return y * 2


def breaks_on_a_stream(x):
    print("to stderr", file=sys.stderr)
    return x + 1


def breaks_on_exc_info(x):
    logger.warning("with exc_info", exc_info=True)
    return x + 1


class OwnRecords(logging.Logger):
    def makeRecord(self, *args, **kwargs):  # noqa: N802 - logging's name
        record = super().makeRecord(*args, **kwargs)
        record.msg = f"[own] {record.msg}"
        return record


own_logger = OwnRecords("tests.deferred.own")


def breaks_on_a_logger_class_of_its_own(x):
    own_logger.warning("made by the class")
    return x + 1


def run(fn, compiled, calls=1, action="always"):
    """What ``fn`` prints, warns and logs over ``calls`` calls, and Dynamo's graphs."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    call = torch.compile(fn, backend=recording(graphs)) if compiled else fn
    records = Records()
    loggers = [logger, logging.getLogger(), own_logger]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(records)
    logger.setLevel(logging.INFO)
    logging.getLogger().setLevel(logging.INFO)
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter(action)
            for _ in range(calls):
                call(torch.ones(3))
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.removeHandler(records)
            log.setLevel(level)
    warned = [(str(w.message), w.category, os.path.basename(w.filename), w.lineno) for w in caught]
    seen = {"out": out.getvalue(), "err": err.getvalue(), "warned": warned, "logs": records.seen}
    return seen, graphs


def test_calls_with_python_values_run_after_the_graph_as_in_place():
    """Every argument kept (``sep``, ``end``, a category, ``stacklevel``, %-arguments), the
    location of each warning and record as uncompiled, inside inlined frames too (where
    torch's own reorderable logging functions drop the call)."""
    for fn in (waits_inlined, waits_in_the_compiled_frame):
        want, _ = run(fn, compiled=False)
        got, graphs = run(fn, compiled=True)
        assert got == want, fn.__name__
        assert len(graphs) == 1, fn.__name__
    got, _ = run(waits_inlined, compiled=True)
    assert got["out"] == "inner-3|\n"
    assert ("tp_group is None, using default tp group", DeprecationWarning) in [
        w[:2] for w in got["warned"]
    ]
    assert got["logs"][0][:3] == ("tests.deferred", "WARNING", "test_deferred_logging.py")
    assert got["logs"][0][4] == "waits_inlined"  # stacklevel=2: the caller's frame


@pytest.mark.parametrize(
    "fn",
    [
        breaks_on_a_tensor,
        breaks_on_a_stream,
        breaks_on_exc_info,
        breaks_on_a_logger_class_of_its_own,
    ],
)
def test_calls_that_cannot_wait_break_the_graph_as_before(fn, monkeypatch):
    """A tensor argument (read after the graph, and returned by it on the logging rank
    only), a stream, ``exc_info``, a logger class that makes its own records: the call
    runs where it is written, after a graph break, as with the deferral off."""
    want, _ = run(fn, compiled=False)
    got, graphs = run(fn, compiled=True)
    monkeypatch.setenv(deferred_logging.ENV, "0")
    _, graphs_without = run(fn, compiled=True)
    assert got == want
    assert [g.code for g in graphs] == [g.code for g in graphs_without]


def test_once_per_location_as_uncompiled():
    """The warnings registry of the line the call is written on: "default" shows a
    message once, "always" at every call."""
    for action, times in (("default", 1), ("always", 3)):
        want, _ = run(waits_in_the_compiled_frame, compiled=False, calls=3, action=action)
        got, graphs = run(waits_in_the_compiled_frame, compiled=True, calls=3, action=action)
        assert got == want and len(got["warned"]) == times and len(graphs) == 1


def test_the_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv(deferred_logging.ENV, "0")
    want, _ = run(waits_in_the_compiled_frame, compiled=False)
    got, graphs = run(waits_in_the_compiled_frame, compiled=True)
    assert len(graphs) == 2  # broken at each call: x + 1 before them, y * 2 after
    # what Dynamo's graph breaks do: the same messages, the calls after the first made
    # in its resume functions (their funcName)
    assert (got["out"], got["warned"]) == (want["out"], want["warned"])
    assert [r[-1] for r in got["logs"]] == [r[-1] for r in want["logs"]]
    assert {r[4] for r in got["logs"]} == {
        "torch_dynamo_resume_in_waits_in_the_compiled_frame_at_78"
    }
    monkeypatch.setenv(deferred_logging.ENV, "sometimes")
    with pytest.raises(CommfuseOptionError, match="COMMFUSE_DEFER_LOGGING='sometimes'"):
        deferred_logging.enabled()


def test_said_in_the_log(monkeypatch, caplog):
    monkeypatch.setattr(deferred_logging, "_announced", False)
    with caplog.at_level(logging.INFO, logger="commfuse"):
        run(waits_in_the_compiled_frame, compiled=True)
    (line,) = (r.getMessage() for r in caplog.records if r.name == "commfuse")
    assert "runs after the graph instead of breaking it" in line
    assert "COMMFUSE_DEFER_LOGGING=0 turns this off" in line


def test_a_function_the_user_lists_keeps_dynamos_own_reordering():
    def note(message):
        pass

    torch._dynamo.config.reorderable_logging_functions.add(note)
    try:
        graphs = []

        def fn(x):
            note("here")
            return x + 1

        torch._dynamo.reset()
        torch.compile(fn, backend=recording(graphs))(torch.ones(2))
        assert len(graphs) == 1
    finally:
        torch._dynamo.config.reorderable_logging_functions.discard(note)


def recording(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def rank_0_warns(x, w):
    a = funcol.all_gather_tensor(x, 0, dist.group.WORLD) @ w
    if dist.get_rank() == 0:
        warnings.warn("rank 0 logs here", stacklevel=1)
        logger.info("rank 0 step %d", 1)
    return funcol.all_gather_tensor(torch.tanh(x), 0, dist.group.WORLD) @ w + a


@pytest.mark.parametrize("n", [3])
def test_logging_on_rank_0_only_gives_every_rank_the_same_graph(n):
    """On torch's fake process group, as rank 0, 1 and 2 of 3: one graph each, the same
    code; the message only on rank 0."""
    codes, warned = [], []
    for rank in range(n):
        dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
        try:
            torch._dynamo.reset()
            graphs: list[torch.fx.GraphModule] = []
            fn = torch.compile(rank_0_warns, backend=recording(graphs))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn(torch.randn(2, 4), torch.randn(4, 3))
        finally:
            dist.destroy_process_group()
        (graph,) = graphs
        codes.append(graph.code)
        warned.append([str(w.message) for w in caught])
    assert all(code == codes[0] for code in codes)
    assert warned == [["rank 0 logs here"]] + [[]] * (n - 1)


# ----------------------------------------------------------------------------------------
# backend="commfuse" on gloo ranks


def rank_0_warning_job(rank, n, inner):
    """Two gather -> matmul sites with a warning on rank 0 between them, 3 training steps
    under commfuse and uncompiled: the numbers, the warnings, the site records."""
    torch.set_num_threads(1)
    group = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=120))

    def fn(x, w1, w2):
        a = funcol.all_gather_tensor_autograd(x, 0, group) @ w1
        if dist.get_rank() == 0:
            warnings.warn("rank 0 logs here", stacklevel=1)
        b = funcol.all_gather_tensor_autograd(torch.tanh(x), 0, group) @ w2
        return (a * b).sum()

    torch.manual_seed(rank)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(100)
    w1, w2 = torch.randn(8, 6, requires_grad=True), torch.randn(8, 6, requires_grad=True)
    runs = {}
    for name in ("uncompiled", "commfuse"):
        torch._dynamo.reset()
        report.reset()
        options = {"schedule": "ring", "inner": inner}
        step = (
            torch.compile(fn, backend="commfuse", options=options) if name != "uncompiled" else fn
        )
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for p in (x, w1, w2):
                    p.grad = None
                loss = step(x, w1, w2)
                loss.backward()
                losses.append(loss.item())
        runs[name] = {
            "losses": losses,
            "grads": [p.grad.clone() for p in (x, w1, w2)],
            # the user's (eager runs also warn torch's deprecations of these collectives)
            "warned": [str(w.message) for w in caught if "logs here" in str(w.message)],
            "commfuse": [str(w.message) for w in caught if "commfuse" in str(w.message)],
            "sites": [(r.graph, r.kind, r.decision) for r in report.REPORT.sites],
        }
    dist.destroy_process_group(group)
    return runs


@pytest.mark.parametrize(
    ("n", "inner"),
    [
        (3, "eager"),
        pytest.param(3, "inductor", marks=pytest.mark.matrix),
        pytest.param(2, "eager", marks=pytest.mark.matrix),
        pytest.param(4, "eager", marks=pytest.mark.matrix),
    ],
)
def test_a_warning_on_rank_0_keeps_every_rewrite(ranks, n, inner):
    """The ranks compile one graph each, alike: every site rewritten, forward and
    backward, no commfuse warning; the user's warning once per step, on rank 0 only."""
    for rank, runs in enumerate(ranks(n).run(rank_0_warning_job, inner)):
        want, got = runs["uncompiled"], runs["commfuse"]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for g, w in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        assert got["warned"] == want["warned"] == (["rank 0 logs here"] * 3 if rank == 0 else [])
        assert got["commfuse"] == []
        assert {(graph, kind) for graph, kind, _ in got["sites"]} == {
            ("forward", "ag_mm"),
            ("backward", "mm_rs"),
        }
        assert {decision for *_, decision in got["sites"]} == {"rewritten"}
