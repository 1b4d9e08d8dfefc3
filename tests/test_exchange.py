"""The exchange's rules for giving a wait up (``runtime/exchange.py``), on an in-process
store written as ranks would write it: graph level, no processes. The gloo cases of
ranks that compile different graphs are in ``tests/test_diverged.py``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from commfuse_compile.runtime import exchange

RANKS = [0, 1, 2]
A, B = "commfuse/graph/g/a.0", "commfuse/graph/g/b.0"  # two graphs' keys on group "g"


def _state(store, rank, doing, key=None, epoch=0, ranks=RANKS):
    store.set(f"{exchange.STATE}/{rank}", json.dumps([epoch, doing, key, ranks]))


def _wrote(store, key, rank, ops=("placeholder", "mm", "output")):
    store.set(f"{key}/{rank}", json.dumps({"ops": list(ops)}))


@pytest.fixture
def store():
    """Rank 0 compiled graph a, ranks 1 and 2 graph b; each waits for its own key."""
    store = dist.HashStore()
    _wrote(store, A, 0, ("placeholder", "mul", "output"))
    for rank in (1, 2):
        _wrote(store, B, rank)
    _state(store, 0, exchange.WAITING, A)
    for rank in (1, 2):
        _state(store, rank, exchange.WAITING, B)
    return store


def test_ranks_waiting_for_graphs_of_their_own_are_a_deadlock(store):
    stuck = exchange._deadlock(store, A, RANKS)
    assert stuck is not None
    assert stuck.keys == {A: (tuple(RANKS), (1, 2)), B: (tuple(RANKS), (0,))}
    detail = exchange._graphs(store, stuck, A, lambda payloads: json.dumps(sorted(payloads)))
    assert detail == "[0, 1, 2]"  # rank 0's graph against the graphs ranks 1 and 2 wait for


@pytest.mark.parametrize(
    "change",
    ["a rank compiles", "a rank runs", "a verdict is set", "a rank wrote the key", "no state"],
)
def test_no_deadlock_while_some_rank_may_still_come(store, change):
    if change == "a rank compiles":
        _state(store, 2, exchange.COMPILING, epoch=1)
    elif change == "a rank runs":
        _state(store, 1, exchange.RUNNING, epoch=1)
    elif change == "a verdict is set":
        store.set(f"{B}/verdict", exchange.COMPLETE)
    elif change == "a rank wrote the key":
        _wrote(store, A, 1)
        _wrote(store, A, 2)
    else:
        store = dist.HashStore()
        _wrote(store, A, 0)
        _state(store, 0, exchange.WAITING, A)
    assert exchange._deadlock(store, A, RANKS) is None


def test_a_state_that_changes_between_the_two_reads_is_no_deadlock(store, monkeypatch):
    """The second read sees rank 1 in another wait (it wrote a key between): not stuck."""
    reads = []
    read = exchange._state

    def state(store_, rank):
        reads.append(rank)
        if len(reads) > 3 and rank == 1:
            _state(store_, 1, exchange.WAITING, B, epoch=7)
        return read(store_, rank)

    monkeypatch.setattr(exchange, "_state", state)
    assert exchange._deadlock(store, A, RANKS) is None


def _wait(store, group_given_up_on, agreed_before=False):
    wait = exchange._Wait(store, "g", A, RANKS, agreed_before)
    wait.last = group_given_up_on
    return wait


def test_running_ranks_unmoved_since_the_last_give_up_are_given_up_at_once(store):
    _state(store, 1, exchange.RUNNING, epoch=3)
    _state(store, 2, exchange.RUNNING, epoch=3)
    last = {r: exchange._state(store, r) for r in (1, 2)}
    assert _wait(store, last)._running([1, 2]) == "again"
    assert _wait(store, None)._running([1, 2]) is None  # the group never differed: wait


def test_running_ranks_that_moved_get_the_grace(store, monkeypatch):
    _state(store, 1, exchange.RUNNING, epoch=5)
    _state(store, 2, exchange.RUNNING, epoch=5)
    wait = _wait(store, {1: None, 2: None})
    assert wait._running([1, 2]) is None  # first seen now
    monkeypatch.setattr(exchange, "GRACE_S", 0.0)
    assert wait._running([1, 2]) == "grace"
    _state(store, 2, exchange.COMPILING, epoch=6)
    assert wait._running([1, 2]) is None  # a rank that compiles is waited for


def test_a_dynamo_reset_forgets_the_give_ups_before_it(store, monkeypatch):
    """After ``torch._dynamo.reset()`` the peers read as running may be compiling (their
    callbacks are gone too): the next graph's wait is not given up ``again`` on the
    strength of a give-up before the reset (a later job of a rank pool lost its rewrites)."""
    _state(store, 1, exchange.RUNNING, epoch=3)
    _state(store, 2, exchange.RUNNING, epoch=3)
    last = {r: exchange._state(store, r) for r in (1, 2)}
    monkeypatch.setattr(exchange, "_here", exchange._Here(given_up_on={"g": last}))
    exchange.watch_compiles()  # the callbacks are there: nothing is forgotten
    assert exchange._Wait(store, "g", A, RANKS, False)._running([1, 2]) == "again"
    torch._dynamo.reset()
    exchange.watch_compiles()  # as the pass does for the first graph after the reset
    assert exchange._Wait(store, "g", A, RANKS, False)._running([1, 2]) is None


def test_a_recompile_is_taken_as_agreed_once_its_peers_are_seen_running(store, monkeypatch):
    monkeypatch.setattr(exchange, "GRACE_S", 0.0)
    _state(store, 1, exchange.RUNNING, epoch=5)
    _state(store, 2, exchange.RUNNING, epoch=5)
    assert _wait(store, None, agreed_before=True)._running([1, 2]) == exchange.AGREED
    _state(store, 2, exchange.WAITING, B, epoch=6)  # one waits for a graph of its own
    assert _wait(store, None, agreed_before=True)._running([1, 2]) is None
    # not on a group given up on before: its running peers may be in a fallen-back graph
    last = {1: None, 2: None}
    _state(store, 2, exchange.RUNNING, epoch=7)
    assert _wait(store, last, agreed_before=True)._running([1, 2]) == "grace"
