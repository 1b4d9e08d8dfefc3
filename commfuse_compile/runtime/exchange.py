"""The compile-time exchange through which the ranks of a job compare what they made of
one graph, before any transfer of it runs.

Ranks need not compile the same graphs (a branch or a graph break on one rank, a recompile
on one rank, a rank running the code uncompiled), so an exchange pairs graphs by what they
are, not by how many graphs each rank compiled before: each rank writes its view under the
key of the graph as it came, ``commfuse/graph/<group>/<digest>.<n>`` (its n-th graph of
that digest with a site on the group), and reads its peers' under the same key. The graphs
the ranks compile alike pair as ever; a graph that only some ranks compile is given up on.

Each rank also publishes what it is doing (``commfuse/state/<rank>``: compiling, from
Dynamo's compile-start callback on, lazy backward compiles included; waiting for a key;
running), so that a wait that cannot end is given up soon rather than at the timeout:

* at once when every rank it waits for waits in turn, directly or through others, for a
  key that cannot complete, and none of them moved while this was read (a deadlock of
  exchanges: each compiled a graph the others did not); every key of it is given up;
* after ``GRACE_S`` when the group's ranks were given up on before and the ranks waited
  for run (they neither compile nor wait: perhaps blocked in a collective that needs this
  rank), at once if none of them moved since this rank last gave up on them (a rank that
  runs the code uncompiled);
* else after the wait the caller gives (its ``exchange_timeout``).

A graph with the transfers of one the group agreed on (a recompile on this rank only) is
taken as agreed (``AGREED``) once the ranks waited for were seen running, not compiling,
for ``GRACE_S``: they run that graph, blocked in it until this rank comes; not on a group
given up on before, where they may as well be blocked in a graph that fell back.

A key's verdict is set once, with the store's compare-and-set, by the first rank that
decides it, and every rank that reads the key, then or later, takes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler

GRAPH, STATE = "commfuse/graph", "commfuse/state"
COMPILING, WAITING, RUNNING = "compiling", "waiting", "running"
COMPLETE = "complete"  # a key's verdict when every rank came; else AGREED or a GivenUp's JSON
AGREED = "agreed"  # the ranks that came run the graph agreed on before with its transfers
POLL_S = 0.25  # at most this long between two looks of a waiting rank
GRACE_S = 2.0  # how long ranks that run are waited for, once the group was given up on

Payload = dict[str, Any]
Differ = Callable[[dict[int, Payload]], str]  # payloads by rank -> where the graphs differ


class RankMismatchError(RuntimeError):
    """The ranks of a job were given different inputs (options, profiles, torch builds),
    so they could decide differently: a user error, raised on every rank."""


@dataclasses.dataclass
class GivenUp:
    """A key's verdict when some of its ranks did not come: which (``missing``) and by
    which rule: ``graphs`` (they wait for graphs of their own; ``detail`` says where
    those differ), ``timeout`` (``waited_s``, the caller's wait), ``grace`` (they ran
    ``GRACE_S`` after the group was given up on) or ``again`` (they did not move since)."""

    missing: list[int]
    rule: str
    waited_s: float
    detail: str = ""


@dataclasses.dataclass
class Exchanged:
    """What one exchange read: every rank's payload (``seen``, by global rank), and the
    groups whose key was given up on (``given_up``: group name -> the key's verdict).
    The same for every rank that visited a group's key: its verdict is set once."""

    seen: dict[int, Payload]
    given_up: dict[str, GivenUp]
    agreed: bool = False  # a key's verdict was AGREED: run the graph agreed on before


@dataclasses.dataclass
class _Here:
    """This process's side of the exchange."""

    compiling: bool = False  # inside a compile (Dynamo's callbacks)
    epochs: itertools.count[int] = dataclasses.field(default_factory=itertools.count)
    # (group, digest) -> how many graphs of that digest this rank exchanged on the group
    graphs: dict[tuple[str, int], itertools.count[int]] = dataclasses.field(default_factory=dict)
    # group -> the published states of the ranks it last gave up on there (a group whose
    # last exchange completed is not in it)
    given_up_on: dict[str, dict[int, str | None]] = dataclasses.field(default_factory=dict)


_here = _Here()


def exchanging() -> bool:
    """Are there peers to exchange with (not torch's fake process group, or none)?"""
    return dist.is_initialized() and dist.get_backend() != "fake"


def _publish(doing: str, key: str | None = None, ranks: tuple[int, ...] = ()) -> None:
    """Tell the peers what this rank does now; never fails a compile."""
    with contextlib.suppress(Exception):  # a store that fails now fails the exchange
        if exchanging():
            state = json.dumps([next(_here.epochs), doing, key, list(ranks)])
            dist.distributed_c10d._get_default_store().set(f"{STATE}/{dist.get_rank()}", state)


def _compile_started(_: CallbackArgs) -> None:
    _here.compiling = True
    _publish(COMPILING)


def _compile_ended(_: CallbackArgs) -> None:
    _here.compiling = False
    _publish(RUNNING)


def watch_compiles(compiling: bool = False) -> None:
    """Have Dynamo tell the peers when this rank compiles: its callbacks run around each
    compile (the outermost; lazy backward compiles too), so from the start of tracing a
    peer knows this rank may yet come to a graph. Called at import, and by the pass for
    every graph it sees (``compiling``: from inside its compile), since
    ``torch._dynamo.reset()`` clears the callbacks: the compile that finds them gone is
    marked from there on. Found gone, the give-ups before are forgotten: until each
    peer's next graph reaches the pass, its state is the one it had before its own
    reset (running), so the rules for a group given up on before would give up, at
    once or after ``GRACE_S``, a graph the peers are compiling (in a pool of ranks that
    serves many jobs: every later job's graphs on that group)."""
    if _compile_started in callback_handler.start_callbacks:
        return
    _here.given_up_on.clear()
    callback_handler.register_start_callback(_compile_started)
    callback_handler.register_end_callback(_compile_ended)
    if compiling:
        _compile_started(CallbackArgs(CallbackTrigger.DYNAMO, ""))


watch_compiles()


def exchange(
    mine: Payload,
    digest: int,
    member_of: Mapping[str, tuple[int, ...]],
    wait_s: float,
    differ: Differ,
    agreed_before: bool = False,
) -> Exchanged | None:
    """Every rank's ``mine`` for the graph of ``digest``, by global rank: this rank's, and
    that of every rank reachable from it through the groups of this graph (``member_of``:
    group name -> global ranks), so that every rank of a job whose groups connect (a 2-D
    mesh's rows and columns) reads the same set and decides alike. None on torch's fake
    process group or without peers. Each rank writes to the job's c10d store under each
    of its groups' keys for the graph, then reads the others' (the module's rules say how
    long it waits); ``differ`` names what differs between graphs given up on.
    ``agreed_before``: the graph has the transfers of one the group agreed on (a
    recompile on this rank): peers that run, not compiling, are taken to run that one."""
    if not exchanging() or all(len(ranks) < 2 for ranks in member_of.values()):
        return None
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    keys = [
        (name, f"{GRAPH}/{name}/{digest:016x}.{_occurrence(name, digest)}", list(ranks))
        for name, ranks in sorted(member_of.items())
    ]
    payload = {**mine, "groups": keys}
    text = json.dumps(payload, sort_keys=True)
    for _, key, _ in keys:
        store.set(f"{key}/{me}", text)
    result = Exchanged({me: payload}, {})
    deadline = time.monotonic() + wait_s
    todo, visited = list(keys), set()
    try:
        while todo:
            name, key, ranks = todo.pop()
            if key in visited:
                continue
            visited.add(key)
            missing = [r for r in ranks if r not in result.seen]
            wait = _Wait(store, name, key, ranks, agreed_before)
            verdict = wait.until(missing, deadline, differ)
            if verdict == AGREED:
                result.agreed = True
            elif verdict != COMPLETE:
                result.given_up[name] = GivenUp(**json.loads(verdict))
            else:
                for rank in missing:
                    result.seen[rank] = json.loads(store.get(f"{key}/{rank}"))
                    todo += [(g[0], g[1], g[2]) for g in result.seen[rank]["groups"]]
    finally:
        _publish(COMPILING if _here.compiling else RUNNING)
    result.seen = dict(sorted(result.seen.items()))
    return result


def _occurrence(group: str, digest: int) -> int:
    return next(_here.graphs.setdefault((group, digest), itertools.count()))


class _Wait:
    """This rank's wait for its peers under one key of a group."""

    def __init__(
        self, store: dist.Store, group: str, key: str, ranks: list[int], agreed_before: bool
    ) -> None:
        self.store, self.group, self.key, self.ranks = store, group, key, ranks
        self.agreed_before = agreed_before
        # the states of the ranks this rank last gave up on in the group (None: never, or
        # the group's last exchange completed)
        self.last = _here.given_up_on.get(group)
        self.states: dict[int, str | None] | None = None  # of the ranks waited for, since
        self.since = 0.0

    def until(self, missing: list[int], deadline: float, differ: Differ) -> str:
        """Wait until every rank in ``missing`` has written under the key, a verdict is
        set, or a rule of the module's decides; then settle the key's verdict once for
        everyone (the store's compare-and-set keeps the first) and return it: COMPLETE,
        AGREED or a GivenUp's JSON. Polls with ``check`` (a timed-out ``wait`` logs a
        warning in c10d), every millisecond at first."""
        store, key = self.store, self.key
        verdict_key = f"{key}/verdict"
        _publish(WAITING, key, tuple(self.ranks))
        started = time.monotonic()
        proposal, pause = COMPLETE, 0.001
        while still := [r for r in missing if not store.check([f"{key}/{r}"])]:
            if store.check([verdict_key]):
                break  # decided by another rank (a complete verdict needs every key)
            stuck = _deadlock(store, key, self.ranks)
            if stuck is not None:
                for other, (_, waiting) in stuck.keys.items():  # each key of it
                    detail = _graphs(store, stuck, other, differ)
                    given_up = GivenUp(list(waiting), "graphs", 0.0, detail)
                    store.compare_set(
                        f"{other}/verdict", "", json.dumps(dataclasses.asdict(given_up))
                    )
                break
            rule = self._running(still)
            if rule is None and time.monotonic() >= deadline:
                rule = "timeout"
            if rule is not None:
                waited = time.monotonic() - started
                given_up = GivenUp(still, rule, waited)
                proposal = AGREED if rule == AGREED else json.dumps(dataclasses.asdict(given_up))
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
        verdict = store.compare_set(verdict_key, "", proposal).decode()
        if verdict == COMPLETE:
            _here.given_up_on.pop(self.group, None)
        elif verdict != AGREED:
            missing = json.loads(verdict)["missing"]
            _here.given_up_on[self.group] = {r: _state(store, r) for r in missing}
        return verdict

    def _running(self, still: list[int]) -> str | None:
        """The rule for ranks waited for that neither compile nor wait for this rank's
        graph. On a group given up on before: at once if none of them moved since
        (``again``), else after ``GRACE_S`` of not moving (``grace``). Else, for a graph
        agreed on before, after ``GRACE_S`` of running (``AGREED``: they run that one,
        blocked in it until this rank comes)."""
        states = {r: _state(self.store, r) for r in still}
        if any(_doing(s) == COMPILING for s in states.values()):
            self.states = None
            return None
        if self.last is not None and all(self.last.get(r, "") == s for r, s in states.items()):
            return "again"
        now = time.monotonic()
        if states != self.states:
            self.states, self.since = states, now
        if now - self.since < GRACE_S:
            return None
        if self.last is not None:
            return "grace"
        if self.agreed_before and all(_doing(s) == RUNNING for s in states.values()):
            return AGREED
        return None


def _state(store: dist.Store, rank: int) -> str | None:
    """What ``rank`` last published it does (None: nothing yet)."""
    key = f"{STATE}/{rank}"
    return store.get(key).decode() if store.check([key]) else None


def _doing(state: str | None) -> str:
    return RUNNING if state is None else str(json.loads(state)[1])


@dataclasses.dataclass(frozen=True)
class _Waits:
    """Ranks waiting for keys: each rank reached with its published state, each key
    with its ranks and those of them that have not written under it."""

    states: dict[int, str]
    keys: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    def on(self, rank: int) -> str:
        """The key ``rank`` waits for."""
        return str(json.loads(self.states[rank])[2])


def _deadlock(store: dist.Store, key: str, ranks: list[int]) -> _Waits | None:
    """The deadlock of exchanges this rank's wait for ``key`` is part of; None if any
    rank concerned may still come. Read twice and the same both times: every rank
    reached waits, both times in the same wait, for a key some of whose ranks have not
    written, each of them waiting too; so when the first read ended every one of them
    waited for ranks that wait, and none can write a key before a verdict frees it."""
    first = _waits(store, key, ranks)
    return first if first is not None and _waits(store, key, ranks) == first else None


def _waits(store: dist.Store, key: str, ranks: list[int]) -> _Waits | None:
    """The ranks this rank's wait for ``key`` waits for, directly or through the keys
    they wait for; None unless every one waits for a key that is neither complete nor
    decided."""
    waits = _Waits({}, {})
    todo = [(key, tuple(ranks))]
    while todo:
        theirs, members = todo.pop()
        if theirs in waits.keys:
            continue
        if store.check([f"{theirs}/verdict"]):
            return None
        waiting = tuple(r for r in members if not store.check([f"{theirs}/{r}"]))
        if not waiting:
            return None
        waits.keys[theirs] = (members, waiting)
        for rank in waiting:
            state = waits.states.get(rank) or _state(store, rank)
            if state is None or json.loads(state)[1] != WAITING:
                return None
            waits.states[rank] = state
            todo.append((waits.on(rank), tuple(json.loads(state)[3])))
    return waits


def _graphs(store: dist.Store, waits: _Waits, key: str, differ: Differ) -> str:
    """Where the graph of ``key`` (its lowest rank's) differs from those the ranks it
    waits for wait for."""
    ranks, waiting = waits.keys[key]
    first = min(r for r in ranks if r not in waiting)
    payloads = {first: json.loads(store.get(f"{key}/{first}"))}
    for rank in waiting:
        payloads[rank] = json.loads(store.get(f"{waits.on(rank)}/{rank}"))
    return differ(payloads)


def check_inputs(seen: Mapping[int, Mapping[str, Any]]) -> None:
    """Raise ``RankMismatchError`` unless every rank decided from the same inputs
    (options, profile, torch): with different ones they could rewrite differently."""
    first = next(iter(seen.values()))["inputs"]
    if all(s["inputs"] == first for s in seen.values()):
        return
    raise RankMismatchError(
        "commfuse: the ranks were given different options or cost profiles (or torch builds, "
        "or see different topologies), so they could decide differently and hang in "
        "mismatched P2P steps; give every rank the same (options, COMMFUSE_PROFILE, "
        "COMMFUSE_DISABLE, COMMFUSE_TOPOLOGY or the launcher's LOCAL_WORLD_SIZE): "
        + "; ".join(f"rank {r}: {s['inputs']}" for r, s in seen.items())
    )
