"""Process groups as the pass sees them: a name in the graph, resolved to global ranks;
and the check that every rank of a group rewrote a graph alike."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist


class GroupError(Exception):
    """This process cannot know the group a collective names (the site is declined)."""


class RankMismatchError(RuntimeError):
    """The ranks of a group did not decide alike on one graph: rewritten on some ranks and
    not on others, their P2P steps would wait for messages that are never sent."""


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


def this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_checks: dict[str, itertools.count[int]] = {}  # group name -> graphs checked on it


def agree(group: Group, inputs: Mapping[str, Any], decisions: list[Any]) -> None:
    """Raise ``RankMismatchError`` unless every rank of ``group`` decided ``decisions``
    from the same ``inputs`` (options and profile) for this graph.

    Each rank writes both to the job's c10d store (any backend has one) and reads the
    others': one exchange per graph and group, at compile time, before any P2P is issued.
    Ranks compile the same graphs in the same order (SPMD), so the n-th check of a group
    is the same graph on every rank. Skipped on torch's fake process group (no peers)."""
    if group.size < 2 or dist.get_backend() == "fake":
        return
    store = dist.distributed_c10d._get_default_store()
    check = next(_checks.setdefault(group.name, itertools.count()))
    prefix = f"commfuse/agree/{group.name}/{check}"
    mine = json.dumps({"inputs": inputs, "decisions": decisions}, sort_keys=True)
    store.set(f"{prefix}/{group.ranks[group.rank]}", mine)
    keys = [f"{prefix}/{r}" for r in group.ranks]
    try:
        store.wait(keys)
    except RuntimeError as err:  # the store's timeout (the process group's)
        raise RankMismatchError(
            f"commfuse: a rank of group {group.name!r} did not compile this graph within the "
            f"store's timeout (compiled a different program?): {err}"
        ) from None
    seen = {r: json.loads(store.get(k)) for r, k in zip(group.ranks, keys, strict=True)}
    if all(s["inputs"] == seen[group.ranks[0]]["inputs"] for s in seen.values()):
        if all(s["decisions"] == seen[group.ranks[0]]["decisions"] for s in seen.values()):
            return
        raise RankMismatchError(
            f"commfuse: the ranks of group {group.name!r} rewrote a graph differently from "
            "the same options and profile (a bug: please report it with the debug dumps): "
            + "; ".join(f"rank {r}: {s['decisions']}" for r, s in seen.items())
        )
    raise RankMismatchError(
        f"commfuse: the ranks of group {group.name!r} were given different options or cost "
        "profiles, so they could decide differently and hang in mismatched P2P steps; give "
        "every rank the same (options, COMMFUSE_PROFILE, COMMFUSE_DISABLE): "
        + "; ".join(f"rank {r}: {s['inputs']}" for r, s in seen.items())
    )
