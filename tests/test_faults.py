"""Faults on real gloo ranks: a peer that dies or stalls in the middle of a rewritten
site, and ranks given different options or profiles.

Every rank rewrites and runs a gather -> matmul site once (the ring works), then one rank
dies (exits) or stalls (sleeps) instead of running it again. The surviving ranks must
raise ``P2PError`` naming the site and the ring step once the process group's timeout
(``init_process_group(timeout=...)``) has passed, never hang. Ranks whose profiles
differ could decide differently: every rank raises ``RankMismatchError`` while compiling,
before any P2P op exists.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch.multiprocessing as mp
from cases import AgMm, trace

import commfuse_compile
from commfuse_compile.runtime.p2p import P2PError
from commfuse_compile.tools.ranks import free_port, join_gloo

TIMEOUT_S = 5.0  # the process group's timeout
FAULTY = 1  # the rank that dies or stalls
STEP_LABEL = re.compile(r"site \d+\.\d+ step \d+ \(ag_mm\)")  # each P2P op's label


def _rank(rank: int, world_size: int, port: int, fault: str, conn) -> None:
    """One rank: a good run, then the fault (on ``FAULTY``) or a run that must fail."""
    join_gloo(rank, world_size, f"tcp://127.0.0.1:{port}", TIMEOUT_S)
    case = AgMm(shard=(2, 4), dim=0, consumers=1, bias=False)
    inputs = case.inputs(rank, seed=0, n=world_size)
    gm = commfuse_compile.apply(trace(case, world_size, inputs), schedule="ring", inner="eager")
    gm(*inputs)
    if rank == FAULTY:
        if fault == "dies":
            os._exit(1)
        time.sleep(10 * TIMEOUT_S)  # stalls: the test kills it first
    start = time.monotonic()
    try:
        gm(*inputs)
        outcome = "no error"
    except P2PError as err:
        outcome = str(err)
    conn.send((outcome, time.monotonic() - start))
    os._exit(0)  # no teardown handshake with a dead peer


@pytest.mark.parametrize(("fault", "world_size"), [("dies", 3), ("stalls", 2)])
def test_surviving_ranks_raise_naming_site_and_step_within_the_timeout(fault, world_size):
    ctx = mp.get_context("spawn")
    port, procs, conns = free_port(), [], {}
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(rank, world_size, port, fault, child))
        proc.start()
        procs.append(proc)
        conns[rank] = parent
    try:
        for rank, conn in conns.items():
            if rank == FAULTY:
                continue
            assert conn.poll(120), f"rank {rank} hangs after its peer {fault}"
            outcome, _ = conn.recv()
            assert STEP_LABEL.search(outcome), outcome
            assert f"[{FAULTY}]" in outcome  # every ring step of 2 or 3 ranks involves it
            assert "init_process_group(timeout=...)" in outcome
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def _compile_with(rank: int, world_size: int, variable: str, values: list[str]) -> str:
    """Compile (with ``auto``) a gather -> matmul site with this rank's value of the
    environment variable ``variable``; the error's type and message, or "compiled"."""
    import torch

    case = AgMm(shard=(2, 4), dim=0, consumers=1, bias=False)
    old = os.environ.get(variable)
    os.environ[variable] = values[rank]
    try:
        torch._dynamo.reset()
        fn = torch.compile(case.fn(world_size), backend="commfuse", options={"inner": "eager"})
        fn(*case.inputs(rank, 0, world_size))
        return "compiled"
    except Exception as err:  # noqa: BLE001 - Dynamo wraps the backend's error
        inner = getattr(err, "inner_exception", err)  # BackendCompilerFailed's
        return f"{type(inner).__name__}: {inner}"
    finally:
        os.environ.pop(variable)
        if old is not None:
            os.environ[variable] = old


def test_ranks_given_different_profiles_raise_before_any_transfer(ranks):
    outcomes = ranks(2).run(_compile_with, "COMMFUSE_PROFILE", ["gloo-loopback", "h100-nvlink4"])
    for outcome in outcomes:
        assert outcome.startswith("RankMismatchError: commfuse: the ranks were given"), outcome
        assert "different options or cost profiles" in outcome
        assert "gloo-loopback" in outcome and "h100-nvlink4" in outcome
    assert ranks(2).run(_compile_with, "COMMFUSE_PROFILE", ["h100-nvlink4"] * 2) == ["compiled"] * 2


def test_ranks_seeing_different_topologies_raise_before_any_transfer(ranks):
    """Ranks that disagree on which ranks share a node would price a group differently
    (tests/test_nodes.py): the agreement refuses them, naming both topologies."""
    for outcome in ranks(2).run(_compile_with, "COMMFUSE_TOPOLOGY", ["1", "2"]):
        assert outcome.startswith("RankMismatchError: commfuse: the ranks were given"), outcome
        assert "see different topologies" in outcome
        assert "1 ranks per node" in outcome and "2 ranks per node" in outcome
