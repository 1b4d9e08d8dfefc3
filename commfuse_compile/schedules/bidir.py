"""The bidirectional ring: both neighbours every step, ceil((n-1)/2) exchange rounds.

All-gather: the local block goes to both neighbours at once; blocks from the next rank
keep travelling backwards and blocks from the previous rank forwards, so a rank holds
every block after ceil((n-1)/2) rounds, multiplying up to two blocks per step.
Reduce-scatter: block b's partial sums travel in two half-chains, from b-f towards b and
from b+h towards b (f = ceil((n-1)/2), h = floor((n-1)/2)); rank b adds both to its own
partial in the last step, after which nothing is sent (no tail). On full-duplex links
each round moves two blocks per rank in the time of one.
"""

from __future__ import annotations

from . import GatherStep, ReduceStep, Transfer


def _halves(n: int) -> tuple[int, int]:
    """(blocks coming from the next rank's side, from the previous rank's side)."""
    return n // 2, (n - 1) // 2


def gather_steps(rank: int, n: int) -> list[GatherStep]:
    ahead, behind = _halves(n)
    steps = []
    for s in range(ahead + 1):
        compute: tuple[int, ...] = (rank,) if s == 0 else ()
        if 1 <= s <= ahead:
            compute += ((rank + s) % n,)
        if 1 <= s <= behind:
            compute += ((rank - s) % n,)
        sends, recvs = [], []
        if s < ahead:  # pass blocks from ahead backwards, fetch the next one
            sends.append(Transfer(block=(rank + s) % n, peer=-1))
            recvs.append(Transfer(block=(rank + s + 1) % n, peer=+1))
        if s < behind:  # and blocks from behind forwards
            sends.append(Transfer(block=(rank - s) % n, peer=+1))
            recvs.append(Transfer(block=(rank - s - 1) % n, peer=-1))
        steps.append(GatherStep(compute=compute, sends=tuple(sends), recvs=tuple(recvs)))
    return steps


def reduce_steps(rank: int, n: int) -> list[ReduceStep]:
    forward, backward = _halves(n)  # chain lengths towards the owner, from behind / ahead
    steps = []
    for s in range(forward + 1):
        blocks, adds, sends, recvs = [], [], [], []
        if s < forward:  # block r + forward - s travels forwards (to the next rank)
            block = (rank + forward - s) % n
            blocks.append(block)
            if s > 0:
                adds.append(Transfer(block=block, peer=-1))
            sends.append(Transfer(block=block, peer=+1))
            if s + 1 < forward:
                recvs.append(Transfer(block=(rank + forward - s - 1) % n, peer=-1))
        if s < backward:  # block r - backward + s travels backwards (to the previous rank)
            block = (rank - backward + s) % n
            blocks.append(block)
            if s > 0:
                adds.append(Transfer(block=block, peer=+1))
            sends.append(Transfer(block=block, peer=-1))
            if s + 1 < backward:
                recvs.append(Transfer(block=(rank - backward + s + 1) % n, peer=+1))
        if s == forward:  # own block: both half-chains arrive
            blocks.append(rank)
            adds += [Transfer(block=rank, peer=-1)] if forward else []
            adds += [Transfer(block=rank, peer=+1)] if backward else []
        if s + 1 == forward:
            recvs.append(Transfer(block=rank, peer=-1))
        if s + 1 == backward:
            recvs.append(Transfer(block=rank, peer=+1))
        steps.append(ReduceStep(tuple(blocks), tuple(adds), tuple(sends), tuple(recvs)))
    return steps
