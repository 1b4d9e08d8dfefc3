"""The unidirectional ring of SPEC.md: n-1 neighbour exchanges, one block matmul per step.

All-gather: the local block is multiplied first (no head latency) while it travels to
the previous rank; each later step multiplies the block that just arrived.
Reduce-scatter: the partial sum of block b travels b+1 -> b+2 -> ... -> b, so the last
step multiplies this rank's own block and nothing is sent after it (no tail latency).
All-to-all, either way: the pairwise order (``exchange_in_steps``, ``exchange_out_steps``).
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


# All-to-all has no ring to forward along: every pair exchanges once, at offset s in
# step s (the pairwise order, the ring's analogue). ``Transfer.block`` names a message
# by the block of the sender's tensor it carries: the receiver's index.


def exchange_in_steps(rank: int, n: int) -> list[GatherStep]:
    """All-to-all -> matmul: this rank's own block first, under the first transfer; then
    each step multiplies the block that arrived in the step before (``compute`` names the
    source rank, the block's place in the all-to-all's output)."""
    steps = []
    for s in range(n):
        if s < n - 1:
            send: tuple[Transfer, ...] = (Transfer(block=(rank + s + 1) % n, peer=s + 1),)
            recv: tuple[Transfer, ...] = (Transfer(block=rank, peer=-(s + 1)),)
        else:
            send, recv = (), ()
        steps.append(GatherStep(compute=((rank - s) % n,), sends=send, recvs=recv))
    return steps


def exchange_out_steps(rank: int, n: int) -> list[ReduceStep]:
    """Matmul -> all-to-all: each step computes the block for the rank s+1 ahead and sends
    it while the next is computed; this rank's own block is computed last, under the final
    transfer (nothing is sent after it). Received blocks are final: nothing is added."""
    steps = []
    for s in range(n):
        if s < n - 1:
            block = (rank + s + 1) % n
            send: tuple[Transfer, ...] = (Transfer(block=block, peer=s + 1),)
            recv: tuple[Transfer, ...] = (Transfer(block=rank, peer=-(s + 1)),)
        else:
            block, send, recv = rank, (), ()
        steps.append(ReduceStep(blocks=(block,), sends=send, recvs=recv))
    return steps
