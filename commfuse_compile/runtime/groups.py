"""Process groups as the pass sees them: a name in the graph, resolved to global ranks
(the exchange through which the ranks compare a graph is ``runtime.exchange``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


class GroupError(Exception):
    """This process cannot know the group a collective names (the site is declined)."""


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's position in ``ranks``
    # group ranks in ring order (``topology.Topology.ring_order``); (): group-rank order.
    # A schedule's ring positions are places in it, its blocks those of the members there.
    order: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def position(self) -> int:
        """This process's place on the ring."""
        return self.order.index(self.rank) if self.order else self.rank

    def member(self, position: int) -> int:
        """The group rank at ring place ``position`` (whose block a schedule's block
        ``position`` is)."""
        return self.order[position] if self.order else position

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one on the ring."""
        return self.ranks[self.member((self.position + offset) % self.size)]

    def ring(self) -> list[int]:
        """The global ranks in ring order."""
        return [self.ranks[self.member(p)] for p in range(self.size)]


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
