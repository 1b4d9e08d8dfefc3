"""``commfuse::p2p``: one batch of point-to-point sends and receives, waited per output.

Why not ``_c10d_functional.batch_p2p_ops``: in torch 2.13 it registers each send's work
twice (on the send buffer and on the returned placeholder). On gloo a work can be waited
only once, so waiting both outputs hangs, and waiting one leaves the other registered
for the life of the process (the work registry grows by one entry per send, holding the
buffer, and torch warns about unwaited collectives at exit). This op issues the batch
with ``torch.distributed.batch_isend_irecv`` (coalesced where the backend supports it,
so NCCL pairs cannot deadlock) and registers exactly one work per output, so that
``_c10d_functional.wait_tensor`` on every output waits every transfer exactly once.
Any c10d backend with point-to-point support works.

A peer that dies or stalls must not hang the others silently: each registered work is
wrapped so that a failed or timed-out transfer (the backend gives up after the process
group's ``timeout``, set with ``init_process_group(timeout=...)``) raises ``P2PError``
naming the op's ``label`` (which site and ring step), its peers and its group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work


class P2PError(RuntimeError):
    """A ring step's transfer failed: a peer died, or stalled past the group's timeout."""


class _LabelledWork(dist.Work):
    """A backend work whose failure is re-raised as ``P2PError`` with the step's label
    (``_c10d_functional.wait_tensor`` calls this ``wait``)."""

    def __init__(self, work: dist.Work, what: str) -> None:
        super().__init__()
        self._work, self._what = work, what

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        try:
            return bool(self._work.wait(timeout))
        except RuntimeError as err:  # the backend's error (DistBackendError is one too)
            raise P2PError(f"{self._what}: {err}") from err


@torch.library.custom_op("commfuse::p2p", mutates_args=())
def p2p(
    sends: list[torch.Tensor],
    send_peers: list[int],
    recv_like: list[torch.Tensor],
    recv_peers: list[int],
    tag: int,
    group_name: str,
    label: str = "",
) -> list[torch.Tensor]:
    """Start sends and receives; returns one handle per send, then the received tensors.

    Peers are global ranks. Received tensors have the shape and dtype of ``recv_like``.
    Every output must be passed to ``wait_tensor`` before use. ``label`` names the step
    in errors (e.g. ``"site 3 step 1 (ag_mm)"``).
    """
    what = (
        f"commfuse P2P {label or 'step'} (send to {send_peers}, receive from {recv_peers}, "
        f"tag {tag}, group {group_name!r}) failed; a peer died, or stalled past the "
        "process group's timeout (init_process_group(timeout=...))"
    )
    group = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
    recvs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]
    # Receives first: gloo sends once the receiver has announced its receive, and an
    # announcement queued behind this rank's own outgoing megabytes serializes the two
    # directions of an exchange (measured: 4 MiB at 1 Gbit/s, 66 ms send-first, 34 ms
    # receive-first, 33 ms one way).
    ops = [
        dist.P2POp(dist.irecv, t, peer, group, tag)
        for t, peer in zip(recvs, recv_peers, strict=True)
    ]
    ops += [
        dist.P2POp(dist.isend, t.contiguous(), peer, group, tag)
        for t, peer in zip(sends, send_peers, strict=True)
    ]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as err:
        raise P2PError(f"{what}: {err}") from err
    handles = [torch.empty(0, dtype=t.dtype, device=t.device) for t in sends]
    outputs = handles + recvs
    if len(works) == len(ops):  # one work per op, in the ops' order: receives, sends
        per_output = works[len(recvs) :] + works[: len(recvs)]
    else:  # one work for the coalesced batch (NCCL)
        per_output = [works[-1]] * len(outputs)
    for tensor, work in zip(outputs, per_output, strict=True):
        _register_work(tensor, _LabelledWork(work, what))
    return outputs


@p2p.register_fake
def _(sends, send_peers, recv_like, recv_peers, tag, group_name, label=""):  # type: ignore[no-untyped-def]
    handles = [t.new_empty(0) for t in sends]
    return handles + [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]


torch.fx.node.has_side_effect(torch.ops.commfuse.p2p.default)
