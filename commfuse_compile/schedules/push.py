"""The push baseline: async-TP's decomposition without symmetric memory.

All-gather: step s sends this rank's own shard straight to rank r-s-1 and receives
rank r+s+1's, while multiplying the shard received the step before (direct copies,
no relay through neighbours).
Reduce-scatter: step s computes the partial of block r+s+1 and sends it straight to
its owner; the last step computes the rank's own partial and adds the n-1 partials it
received: the final copy and the n-way reduction are the tail that the ring avoids.
"""

from __future__ import annotations

from . import GatherStep, ReduceStep, Transfer


def gather_steps(rank: int, n: int) -> list[GatherStep]:
    steps = []
    for s in range(n):
        if s < n - 1:
            send: tuple[Transfer, ...] = (Transfer(block=rank, peer=-(s + 1)),)
            recv: tuple[Transfer, ...] = (Transfer(block=(rank + s + 1) % n, peer=s + 1),)
        else:
            send, recv = (), ()
        steps.append(GatherStep(compute=((rank + s) % n,), sends=send, recvs=recv))
    return steps


def reduce_steps(rank: int, n: int) -> list[ReduceStep]:
    steps = []
    for s in range(n - 1):
        block = (rank + s + 1) % n
        steps.append(
            ReduceStep(
                blocks=(block,),
                sends=(Transfer(block=block, peer=s + 1),),
                recvs=(Transfer(block=rank, peer=-(s + 1)),),
            )
        )
    adds = tuple(Transfer(block=rank, peer=-(s + 1)) for s in range(n - 1))
    steps.append(ReduceStep(blocks=(rank,), adds=adds))
    return steps
