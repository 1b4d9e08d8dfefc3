"""The collectives as the graph holds them: the functional collectives' ops, the pass's
own point-to-point op, a collective's wait, and an all-to-all's split sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node

from ...runtime import p2p as _registers_the_op  # noqa: F401 (commfuse::p2p)
from . import dims
from .declines import decline
from .graph import data_users, node_arg, val

c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
WAIT_TENSOR = c10d.wait_tensor.default

ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


def exchange_splits(a2a: Node) -> tuple[dims.Split, dims.Split]:
    """(the blocks ``a2a`` receives, the blocks it sends) along dim 0: n equal blocks, or
    uneven ones of int sizes (a head count or sequence the group does not divide).
    Declines sizes the graph computes that differ, sizes that do not cover the tensors,
    an empty block, and splits that give the ranks' graphs different shapes."""
    out_sizes, in_sizes = node_arg(a2a, 1, "output_split_sizes"), node_arg(a2a, 2, "")
    splits = {"out": _sizes(out_sizes), "in": _sizes(in_sizes)}
    received, sent = dims.Split.of(out_sizes), dims.Split.of(in_sizes)
    if received is None or sent is None:
        raise decline("a2a.uneven", node=a2a.name, splits=splits)
    rows = (val(node_arg(a2a, 0, "input")).shape[0], val(a2a).shape[0])
    for split, size, what in ((sent, rows[0], "input"), (received, rows[1], "output")):
        first = (in_sizes if split is sent else out_sizes)[0]
        first = first.meta["val"] if isinstance(first, Node) else first
        covered = sum(split.sizes) if split.sizes else first * split.n
        if not dims.equal(covered, size):
            problem = f"they do not add up to the {size} rows of its {what}"
            raise decline("a2a.splits", node=a2a.name, splits=splits, problem=problem)
    if any(size == 0 for split in (received, sent) for size in split.sizes or ()):
        raise decline("a2a.empty_block", node=a2a.name, splits=splits)
    if not dims.equal(*rows):
        raise decline(
            "a2a.rank_shapes", node=a2a.name, sent=rows[0], received=rows[1], splits=splits
        )
    return received, sent


def split_sizes(a2a: Node, uneven: bool) -> dict[str, object]:
    """An uneven all-to-all's split sizes, for the report (nothing for equal ones)."""
    if not uneven:
        return {}
    return {"splits": {"out": _sizes(node_arg(a2a, 1, "")), "in": _sizes(node_arg(a2a, 2, ""))}}


def check_own_block(a2a: Node, sent: dims.Size, received: dims.Size) -> None:
    """Decline an all-to-all that sends this rank a block of another size than it keeps
    (the program is wrong: the collective itself would fail)."""
    if not dims.equal(sent, received):
        splits = {"out": _sizes(node_arg(a2a, 1, "")), "in": _sizes(node_arg(a2a, 2, ""))}
        problem = f"this rank sends itself {sent} rows and receives {received} from itself"
        raise decline("a2a.splits", node=a2a.name, splits=splits, problem=problem)


def _sizes(sizes: Sequence[Any]) -> list[Any]:
    """Split sizes as the report shows them: ints, or the nodes' values."""
    return [str(s.meta.get("val", s)) if isinstance(s, Node) else s for s in sizes]


def the_wait(collective: Node) -> Node | None:
    """The collective's one ``wait_tensor``, if its other readers are only the graph's
    output: selective activation checkpointing saves a collective's unwaited result for
    the backward, which then reads the rewritten result instead (``also_replaced``)."""
    users = data_users(collective)
    waits = [u for u in users if u.target is WAIT_TENSOR]
    if len(waits) != 1 or any(u.op != "output" for u in users if u is not waits[0]):
        return None
    return waits[0]


def saved_unwaited(collective: Node) -> bool:
    """Is the collective's unwaited result an output of the graph (see ``the_wait``)?"""
    return any(user.op == "output" for user in collective.users)


def is_transfer_start(node: Node) -> bool:
    """Does ``node`` start a transfer: a P2P op, or a functional collective (not a wait)?"""
    if node.op != "call_function":
        return False
    functional = getattr(node.target, "namespace", None) == "_c10d_functional"
    return node.target is P2P or (functional and node.target is not WAIT_TENSOR)
