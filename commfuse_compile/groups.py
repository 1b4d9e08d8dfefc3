"""Process groups as the pass sees them: a name in the graph, resolved to global ranks."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from .report import decline


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
    """The group a collective node names; declines when this process cannot know it."""
    if not dist.is_available() or not dist.is_initialized():
        raise decline("torch.distributed is not initialized in this process")
    name = group_name if isinstance(group_name, str) else getattr(group_name, "group_name", None)
    if not isinstance(name, str):
        raise decline(f"collective names its group by {type(group_name).__name__}, not a name")
    try:
        pg = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]
    except (LookupError, ValueError, RuntimeError) as err:
        raise decline(f"process group {name!r} is unknown in this process ({err})") from None
    ranks = tuple(dist.get_process_group_ranks(pg))
    if len(ranks) != group_size:
        raise decline(
            f"collective says group_size={group_size} but group {name!r} has {len(ranks)} ranks"
        )
    return Group(name=name, ranks=ranks, rank=pg.rank())


def this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
