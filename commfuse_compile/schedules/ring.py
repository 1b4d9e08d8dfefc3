"""The unidirectional ring of SPEC.md: n-1 neighbour exchanges, one block matmul per step.

All-gather: the local block is multiplied first (no head latency) while it travels to
the previous rank; each later step multiplies the block that just arrived.
Reduce-scatter: the partial sum of block b travels b+1 -> b+2 -> ... -> b, so the last
step multiplies this rank's own block and nothing is sent after it (no tail latency).
"""

from __future__ import annotations

from . import GatherStep, ReduceStep, Transfer


def gather_steps(rank: int, n: int) -> list[GatherStep]:
    steps = []
    for s in range(n):
        held = (rank + s) % n
        if s < n - 1:
            send: tuple[Transfer, ...] = (Transfer(block=held, peer=-1),)
            recv: tuple[Transfer, ...] = (Transfer(block=(rank + s + 1) % n, peer=+1),)
        else:
            send, recv = (), ()
        steps.append(GatherStep(compute=(held,), sends=send, recvs=recv))
    return steps


def reduce_steps(rank: int, n: int) -> list[ReduceStep]:
    steps = []
    for s in range(n):
        block = (rank - s - 1) % n
        if s < n - 1:
            send: tuple[Transfer, ...] = (Transfer(block=block, peer=+1),)
            recv: tuple[Transfer, ...] = (Transfer(block=(rank - s - 2) % n, peer=-1),)
        else:
            send, recv = (), ()
        adds = (Transfer(block=block, peer=-1),) if s > 0 else ()
        steps.append(ReduceStep(blocks=(block,), adds=adds, sends=send, recvs=recv))
    return steps
