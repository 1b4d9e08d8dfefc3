"""A program's compute without its communication, and its communication alone: the two
terms of the overlap limit ``max(compute, communication)``, measured on the program that
runs (``commfuse demo``, ``commfuse bench``'s block figure).

``local_backend`` compiles as ``backend="commfuse"`` with eager FX does, then replaces in
each graph every collective and every P2P batch by a local copy of the same shape
(``localize``; a wait by nothing): the same program, computing, with nothing sent and
no CPU spent in a transport. Each replaced call is recorded while ``recording``, and
``replay`` runs the calls of one step on the real group one after the other, each waited
at once, nothing computed: the communication alone. No schedule can run the program
faster than either.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from ...backend import eager
from ...options import Options

c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default

_CALLS: list[list[tuple[Any, tuple[Any, ...]]]] = []  # the open recordings, innermost last


@dataclasses.dataclass(frozen=True)
class _Like:
    """A tensor as ``replay`` rebuilds it: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _record(target: Any, args: tuple[Any, ...]) -> None:
    if _CALLS:
        like = pytree.tree_map_only(torch.Tensor, lambda t: _Like(tuple(t.shape), t.dtype), args)
        _CALLS[-1].append((target, like))


def _copied(rows: int, x: torch.Tensor) -> torch.Tensor:
    """``rows`` rows copied from ``x``'s (cycling through them)."""
    if rows == x.shape[0]:
        return x.clone()
    if x.shape[0] == 0:
        return x.new_zeros((rows, *x.shape[1:]))
    return x.index_select(0, torch.arange(rows, device=x.device) % x.shape[0])


def local_all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    _record(c10d.all_gather_into_tensor.default, (x, group_size, group_name))
    return _copied(x.shape[0] * group_size, x)


def local_reduce_scatter(
    x: torch.Tensor, op: str, group_size: int, group_name: str
) -> torch.Tensor:
    _record(c10d.reduce_scatter_tensor.default, (x, op, group_size, group_name))
    return _copied(x.shape[0] // group_size, x)


def local_all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    _record(c10d.all_reduce.default, (x, op, group_name))
    return x.clone()


def local_all_to_all(
    x: torch.Tensor, output_splits: Any, input_splits: Any, group_name: str
) -> torch.Tensor:
    """The rows this rank sends, copied into as many rows as the graph says it receives
    (an uneven exchange's counts are local copies too: what it sends itself). Recorded
    with the rows the peers do send it (asked of them: a replay must post the sizes the
    peers post), as every rank records the same step at once."""
    real = output_splits
    if _CALLS and input_splits is not None:
        sent = torch.tensor([int(rows) for rows in input_splits])
        received = torch.empty_like(sent)
        group = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
        dist.all_to_all_single(received, sent, group=group)
        real = received.tolist()
    _record(c10d.all_to_all_single.default, (x, real, input_splits, group_name))
    rows = x.shape[0] if output_splits is None else sum(output_splits)
    return _copied(rows, x)


def local_p2p(*args: Any) -> list[torch.Tensor]:
    """``commfuse::p2p``'s arguments: the received tensors, copied from their likes.
    Recorded with the shapes the peers do send (asked of them, as for ``local_all_to_all``:
    an uneven exchange's blocks have the sizes the peers computed)."""
    sends, send_peers, likes, recv_peers, tag, group_name = args[:6]
    if _CALLS:
        group = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
        shapes = [torch.empty(t.dim(), dtype=torch.int64) for t in likes]
        ops = [
            dist.P2POp(dist.irecv, t, peer, group, tag)
            for t, peer in zip(shapes, recv_peers, strict=True)
        ]
        ops += [
            dist.P2POp(dist.isend, torch.tensor(t.shape, dtype=torch.int64), peer, group, tag)
            for t, peer in zip(sends, send_peers, strict=True)
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        real = [like.new_empty(shape.tolist()) for like, shape in zip(likes, shapes, strict=True)]
        _record(P2P, (sends, send_peers, real, recv_peers, tag, group_name))
    return [t.clone(memory_format=torch.contiguous_format) for t in likes]


def local_wait(x: torch.Tensor) -> torch.Tensor:
    return x


LOCAL: dict[Any, Callable[..., Any]] = {
    c10d.all_gather_into_tensor.default: local_all_gather,
    c10d.reduce_scatter_tensor.default: local_reduce_scatter,
    c10d.all_reduce.default: local_all_reduce,
    c10d.all_to_all_single.default: local_all_to_all,
    c10d.wait_tensor.default: local_wait,
    P2P: local_p2p,
}


class UnknownCollective(ValueError):
    """A program has a collective ``LOCAL`` has no local copy of."""


def localize(gm: GraphModule) -> None:
    """Every collective and P2P batch of ``gm`` replaced by its local copy (``LOCAL``);
    a collective without one is an error (its time would count as compute)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in LOCAL:
            node.target = LOCAL[node.target]
        elif "c10d" in str(node.target):
            raise UnknownCollective(
                f"compute alone: no local copy of {node.target} ({node.name}); its time "
                "would count as compute, so this program's limit is not measured"
            )
    gm.recompile()


def local_backend(options: dict[str, Any]) -> Callable[..., Any]:
    """A ``torch.compile`` backend: the pass with ``options`` and eager FX (whatever
    ``inner`` says), every transfer replaced by a local copy."""
    opts = Options.from_mapping({**options, "inner": "eager"})
    return lambda gm, example_inputs: eager(gm, example_inputs, opts, then=localize)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Any, tuple[Any, ...]]]]:
    """The calls a localized program replaces while in the block, in order."""
    calls: list[tuple[Any, tuple[Any, ...]]] = []
    _CALLS.append(calls)
    try:
        yield calls
    finally:
        _CALLS.pop()


def replay(calls: list[tuple[Any, tuple[Any, ...]]]) -> None:
    """``calls`` on the real groups, one after the other, each waited before the next:
    the program's communication, nothing computed."""
    wait = c10d.wait_tensor.default
    for target, like in calls:
        args = pytree.tree_map_only(_Like, lambda t: torch.empty(t.shape, dtype=t.dtype), like)
        out = target(*args)
        for tensor in [
            *(out if isinstance(out, list) else [out]),
            *(args[0] if target is P2P else []),
        ]:
            wait(tensor)
