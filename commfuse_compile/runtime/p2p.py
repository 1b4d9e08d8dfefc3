"""``commfuse::p2p``: one batch of point-to-point sends and receives.

The op returns the received tensors only. Every transfer's work is registered, through
c10d's functional work registry, on the tensor it uses: a receive on its output, a send
on the very buffer it was given. ``_c10d_functional.wait_tensor(x)`` waits every work
registered on ``x``'s storage, so the lowering waits each received tensor before its
first reader and each send buffer after the step's matmuls.

Why the send buffer, and not a placeholder output: a compiler that sees
``p2p(buf)`` as the last reader of ``buf`` may reuse its memory right after the call
while the transfer still reads it. Inductor plans memory that way (a buffer is reused
as soon as its last reader ran) and lowers ``wait_tensor(buf)`` as a mutation of
``buf``. With the work registered on ``buf``, that wait is both a use that keeps the
buffer alive and unwritten, and the point where the transfer is known to be done, so
no compiler can reuse or overwrite the buffer before the transfer completes. The same
holds on NCCL: the wait orders the compute stream after the communication stream, so
kernels that later write the memory, or read what was received, run after the transfer.
The program Inductor generates is checked against this (``passes/ranks/program.py``).

A send buffer that is not contiguous is sent from a contiguous copy made here; the
registered work holds that copy until it is waited, whatever the backend keeps.

Why not ``_c10d_functional.batch_p2p_ops``: in torch 2.13 it registers each send's work
twice (on the send buffer and on the returned placeholder). On gloo a work can be waited
only once, so waiting both hangs, and waiting one leaves the other registered for the
life of the process. Works here are waited at most once whatever is registered where.
The batch is issued with ``torch.distributed.batch_isend_irecv`` (coalesced where the
backend supports it, so NCCL pairs cannot deadlock); any c10d backend with
point-to-point support works.

A peer that dies or stalls must not hang the others silently: a failed or timed-out
transfer (the backend gives up after the process group's ``timeout``, set with
``init_process_group(timeout=...)``) raises ``P2PError`` naming the op's ``label``
(which site and step), its peers and its group.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work


class P2PError(RuntimeError):
    """A ring step's transfer failed: a peer died, or stalled past the group's timeout."""


# Site id -> [start, end] (perf_counter seconds) of each call of the site's steps, from
# its first P2P op's start to the end of its last wait; filled for ``timed`` ops only
# (the ``measure`` option) and read into report.json's ``measured_us``.
TIMINGS: dict[str, list[list[float]]] = {}
LABEL = re.compile(r"site (\d+\.\d+) step (\d+)")


class _LabelledWork(dist.Work):
    """A backend work, waited at most once however many tensors it is registered on
    (NCCL coalesces a batch into one work), holding the tensors it transfers until then;
    its failure is re-raised as ``P2PError`` with the step's label."""

    def __init__(self, work: dist.Work, what: str, site: str | None) -> None:
        super().__init__()
        self._work, self._what, self._site = work, what, site
        self._tensors: list[torch.Tensor] = []
        self._done = False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._done:
            return True
        try:
            result = bool(self._work.wait(timeout))
        except RuntimeError as err:  # the backend's error (DistBackendError is one too)
            raise P2PError(f"{self._what}: {err}") from err
        self._done, self._tensors = True, []
        if self._site is not None:
            span = TIMINGS[self._site][-1]
            span[1] = max(span[1], time.perf_counter())
        return result


# cudagraph_unsafe: a CUDA graph's replay would not run the works and waits made here
@torch.library.custom_op("commfuse::p2p", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def p2p(
    sends: list[torch.Tensor],
    send_peers: list[int],
    recv_like: list[torch.Tensor],
    recv_peers: list[int],
    tag: int,
    group_name: str,
    label: str = "",
    timed: bool = False,
) -> list[torch.Tensor]:
    """Start sends and receives; returns the received tensors (shape and dtype of
    ``recv_like``). Peers are global ranks. Each returned tensor, and each tensor of
    ``sends``, must be passed to ``wait_tensor``: a received one before it is read, a
    sent one before it is freed or written. ``label`` names the step in errors
    (e.g. ``"site 0.3 step 1 (ag_mm)"``: graph 0's site 3); ``timed`` records the site's
    span in ``TIMINGS``.
    """
    site = _start_timing(label) if timed else None
    what = (
        f"commfuse P2P {label or 'step'} (send to {send_peers}, receive from {recv_peers}, "
        f"tag {tag}, group {group_name!r}) failed; a peer died, or stalled past the "
        "process group's timeout (init_process_group(timeout=...))"
    )
    group = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
    recvs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]
    sent = [t.contiguous() for t in sends]
    # Receives first: gloo sends once the receiver has announced its receive, and an
    # announcement queued behind this rank's own outgoing megabytes serializes the two
    # directions of an exchange (measured: 4 MiB at 1 Gbit/s, 66 ms send-first, 34 ms
    # receive-first, 33 ms one way).
    ops = [
        dist.P2POp(dist.irecv, t, peer, group, tag)
        for t, peer in zip(recvs, recv_peers, strict=True)
    ]
    ops += [
        dist.P2POp(dist.isend, t, peer, group, tag)
        for t, peer in zip(sent, send_peers, strict=True)
    ]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as err:
        raise P2PError(f"{what}: {err}") from err
    if len(works) != len(ops):  # one work for the coalesced batch (NCCL)
        works = [works[-1]] * len(ops)
    wrapped: dict[int, _LabelledWork] = {}
    registered = [*recvs, *sends]  # where each op's work is waited: its output, its buffer
    for tensor, moved, work in zip(registered, [*recvs, *sent], works, strict=True):
        if id(work) not in wrapped:
            wrapped[id(work)] = _LabelledWork(work, what, site)
        wrapped[id(work)]._tensors.append(moved)
        _register_work(tensor, wrapped[id(work)])
    return recvs


def _start_timing(label: str) -> str | None:
    """Step 0 of a site opens a new call's span; later steps extend it."""
    found = LABEL.match(label)
    if found is None:
        return None
    site, step = found.group(1), int(found.group(2))
    now = time.perf_counter()
    spans = TIMINGS.setdefault(site, [])
    if step == 0 or not spans:
        spans.append([now, now])
    return site


@p2p.register_fake
def p2p_fake(  # type: ignore[no-untyped-def]
    sends, send_peers, recv_like, recv_peers, tag, group_name, label="", timed=False
):
    """The received tensors' values (the pass also calls it directly, in fake mode)."""
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]


torch.fx.node.has_side_effect(torch.ops.commfuse.p2p.default)
