"""Process groups as the pass sees them: a name in the graph, resolved to global ranks;
and the exchange through which the ranks of a job compare what they made of a graph."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class GroupError(Exception):
    """This process cannot know the group a collective names (the site is declined)."""


class RankMismatchError(RuntimeError):
    """The ranks of a job cannot compare what they made of one graph: given different
    inputs, or one of them never compiled it."""


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
# The exchange waits for every rank to finish compiling this graph: ranks sharing two
# cores can take minutes longer than each other, far more than a group timeout set short
# for a fast deadlock error, so it waits at least this long.
EXCHANGE_WAIT_S = 600.0


def exchanging() -> bool:
    """Are there peers to exchange with (not torch's fake process group, or none)?"""
    return dist.is_initialized() and dist.get_backend() != "fake"


def exchange(
    mine: Mapping[str, Any], member_of: Mapping[str, tuple[int, ...]]
) -> dict[int, dict[str, Any]] | None:
    """Every rank's ``mine`` for this graph, by global rank: this rank's, and that of every
    rank reachable from it through the groups of this graph (``member_of``: group name ->
    global ranks), so that every rank of a job whose groups connect (a 2-D mesh's rows
    and columns) reads the same set and decides alike. None on torch's fake process group
    or without peers.

    Each rank writes to the job's c10d store (any backend has one) under each of its
    groups, then reads the others': one exchange per graph, at compile time, before any
    transfer of the graph starts. Ranks compile the same graphs in the same order (SPMD),
    so the n-th exchange on a group is the same graph on every rank of it."""
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
    seen: dict[int, dict[str, Any]] = {me: payload}
    visited: set[tuple[str, int]] = set()
    todo = list(groups)
    timeout = max(timedelta(seconds=EXCHANGE_WAIT_S), store.timeout)  # type: ignore[attr-defined]
    while todo:
        name, index, ranks = todo.pop()
        if (name, index) in visited:
            continue
        visited.add((name, index))
        missing = [r for r in ranks if r not in seen]
        keys = [f"commfuse/graph/{name}/{index}/{r}" for r in missing]
        try:
            store.wait(keys, timeout)
        except RuntimeError as err:  # a rank never compiled this graph
            raise RankMismatchError(
                f"commfuse: a rank of group {name!r} did not compile this graph within "
                f"{timeout.total_seconds():.0f} s (compiled a different program?): {err}"
            ) from None
        for rank, key in zip(missing, keys, strict=True):
            seen[rank] = json.loads(store.get(key))
            todo += [(g[0], g[1], g[2]) for g in seen[rank]["groups"]]
    return dict(sorted(seen.items()))


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
