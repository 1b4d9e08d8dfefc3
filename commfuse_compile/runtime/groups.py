"""Process groups as the pass sees them: a name in the graph, resolved to global ranks;
and the exchange through which the ranks of a job compare what they made of a graph."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


class GroupError(Exception):
    """This process cannot know the group a collective names (the site is declined)."""


class RankMismatchError(RuntimeError):
    """The ranks of a job were given different inputs (options, profiles, torch builds),
    so they could decide differently: a user error, raised on every rank."""


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's position in ``ranks``

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one on the ring."""
        return self.ranks[(self.rank + offset) % self.size]


def resolve(group_name: object, group_size: int) -> Group:
    """The group a collective node names; ``GroupError`` when this process cannot know it."""
    if not dist.is_available() or not dist.is_initialized():
        raise GroupError("torch.distributed is not initialized in this process")
    name = group_name if isinstance(group_name, str) else getattr(group_name, "group_name", None)
    if not isinstance(name, str):
        raise GroupError(f"collective names its group by {type(group_name).__name__}, not a name")
    try:
        pg = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]
    except (LookupError, ValueError, RuntimeError) as err:
        raise GroupError(f"process group {name!r} is unknown in this process ({err})") from None
    ranks = tuple(dist.get_process_group_ranks(pg))
    if len(ranks) != group_size:
        raise GroupError(
            f"collective says group_size={group_size} but group {name!r} has {len(ranks)} ranks"
        )
    return Group(name=name, ranks=ranks, rank=pg.rank())


def ranks_of(group_name: str) -> tuple[int, ...]:
    """The global ranks of the group named ``group_name``; () if this process cannot know."""
    try:
        pg = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
        return tuple(dist.get_process_group_ranks(pg))
    except (LookupError, ValueError, RuntimeError, AttributeError):
        return ()


def this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_checks: dict[str, itertools.count[int]] = {}  # group name -> graphs checked on it
_diverged: dict[str, str] = {}  # group name -> why its ranks stopped comparing graphs
COMPLETE = "complete"  # the verdict of a group's n-th exchange; else the ranks given up on
POLL_S = 0.25  # at most this long between two looks of a waiting rank


@dataclasses.dataclass
class Exchanged:
    """What one exchange read: every rank's payload (``seen``, by global rank), and the
    groups whose ranks did not all arrive within the wait (``absent``: group name ->
    the ranks missing when it was given up). The same for every rank that visited a
    group: a group's verdict is set once, in the store, by whichever rank came first."""

    seen: dict[int, dict[str, Any]]
    absent: dict[str, list[int]]


def exchanging() -> bool:
    """Are there peers to exchange with (not torch's fake process group, or none)?"""
    return dist.is_initialized() and dist.get_backend() != "fake"


def diverged(name: str) -> str | None:
    """Why the ranks of group ``name`` no longer compare graphs, or None."""
    return _diverged.get(name)


def mark_diverged(name: str, why: str) -> bool:
    """From now on the sites on group ``name`` keep their collectives on this rank, as on
    every rank of the group (each marks it from the same exchange). True if new."""
    return _diverged.setdefault(name, why) is why


def group_timeout_s(name: str) -> float:
    """The process group's own timeout (how long a peer blocked in one of its
    collectives waits for this rank); the store's if the group does not say."""
    store_s = dist.distributed_c10d._get_default_store().timeout.total_seconds()  # type: ignore[attr-defined]
    try:
        pg = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]
    except (LookupError, ValueError, RuntimeError):
        return store_s
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return store_s


def exchange(
    mine: Mapping[str, Any], member_of: Mapping[str, tuple[int, ...]], wait_s: float
) -> Exchanged | None:
    """Every rank's ``mine`` for this graph, by global rank: this rank's, and that of every
    rank reachable from it through the groups of this graph (``member_of``: group name ->
    global ranks), so that every rank of a job whose groups connect (a 2-D mesh's rows
    and columns) reads the same set and decides alike. None on torch's fake process group
    or without peers.

    Each rank writes to the job's c10d store (any backend has one) under each of its
    groups, then reads the others': one exchange per graph, at compile time, before any
    transfer of the graph starts. The n-th exchange on a group is the n-th graph with a
    site on it that each rank compiled; a rank that compiled another graph (a graph
    break or recompile that depends on the rank) is seen by its digest, and one that
    never comes is waited for ``wait_s`` at most: then the first rank to give up sets the
    group's verdict, and every rank that reads that exchange, before or after, takes it."""
    if not exchanging() or all(len(ranks) < 2 for ranks in member_of.values()):
        return None
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    groups: list[tuple[str, int, list[int]]] = [
        (name, next(_checks.setdefault(name, itertools.count())), list(ranks))
        for name, ranks in sorted(member_of.items())
    ]
    payload = {**mine, "groups": groups}
    text = json.dumps(payload, sort_keys=True)
    for name, index, _ in groups:
        store.set(f"commfuse/graph/{name}/{index}/{me}", text)
    result = Exchanged({me: payload}, {})
    deadline = time.monotonic() + wait_s
    visited: set[tuple[str, int]] = set()
    todo = list(groups)
    while todo:
        name, index, ranks = todo.pop()
        if (name, index) in visited:
            continue
        visited.add((name, index))
        prefix = f"commfuse/graph/{name}/{index}"
        missing = [r for r in ranks if r not in result.seen]
        absent = _arrived(store, prefix, missing, deadline)
        if absent:
            result.absent[name] = absent
            continue
        for rank in missing:
            result.seen[rank] = json.loads(store.get(f"{prefix}/{rank}"))
            todo += [(g[0], g[1], g[2]) for g in result.seen[rank]["groups"]]
    result.seen = dict(sorted(result.seen.items()))
    return result


def _arrived(store: dist.Store, prefix: str, missing: list[int], deadline: float) -> list[int]:
    """Wait until every rank in ``missing`` has written under ``prefix``, another rank
    gave up on them, or ``deadline`` passes; then settle the verdict once for everyone
    (the store's compare-and-set keeps the first): ``[]`` if all came, else the ranks
    that had not come when the first rank gave up. Polls with ``check`` (a timed-out
    ``wait`` logs a warning in c10d), every millisecond at first."""
    keys = [f"{prefix}/{r}" for r in missing]
    verdict_key = f"{prefix}/verdict"
    proposal, pause = COMPLETE, 0.001
    while keys and not store.check(keys):
        if store.check([verdict_key]):
            break  # another rank gave up (a complete verdict needs every key)
        if time.monotonic() >= deadline:
            proposal = json.dumps(
                [r for r, k in zip(missing, keys, strict=True) if not store.check([k])]
            )
            break
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    verdict = store.compare_set(verdict_key, "", proposal).decode()
    return [] if verdict == COMPLETE else json.loads(verdict)


def check_inputs(seen: Mapping[int, Mapping[str, Any]]) -> None:
    """Raise ``RankMismatchError`` unless every rank decided from the same inputs
    (options, profile, torch): with different ones they could rewrite differently."""
    first = next(iter(seen.values()))["inputs"]
    if all(s["inputs"] == first for s in seen.values()):
        return
    raise RankMismatchError(
        "commfuse: the ranks were given different options or cost profiles (or torch builds), "
        "so they could decide differently and hang in mismatched P2P steps; give every "
        "rank the same (options, COMMFUSE_PROFILE, COMMFUSE_DISABLE): "
        + "; ".join(f"rank {r}: {s['inputs']}" for r, s in seen.items())
    )
