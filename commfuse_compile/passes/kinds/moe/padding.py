"""torchtitan's alignment padding around a ``moe`` site (``models/moe/utils.py``:
``_permute``, ``generate_permute_indices``, ``TOKEN_GROUP_ALIGN_SIZE_M``).

Before the permutation a zero row is appended to the R received rows
(``torch.vstack((x, x.new_zeros(dim)))``: P = R + 1 rows) and ``perm`` takes L slots,
each expert's padded to a multiple of the alignment: a padding slot's index is -1, the
zero row. After the experts the L slots are put back into P rows and the last dropped
(``out_unpermuted[perm] = out; out_unpermuted[:-1]``). In the backward the same shape:
the gradient laid into P rows of zeros (``slice_backward``, or ``slice_scatter`` into
zeros), read through ``perm``, accumulated back into P rows and sliced to R.

Why the blocks still compute the program's numbers: each real row i < R is read by the
one slot q_i with ``perm[q_i] = i`` (mod P) and put back from it (a row read by no slot
would be left unwritten, one read twice written twice: the program's own put-back
defines it only so), so it goes through expert ``bucketize(q_i, offs, right=True)`` as
in the unpadded case. Every other slot reads an appended row and is put back into an
appended row, which the slice drops: it reaches no real row. Those slots' values matter
only where the graph reads an expert value whole (saved for the backward, a weight
gradient summed over every slot); there they are computed by the same ops from the
appended rows, as one more block (its slots, their groups), so the whole values are the
program's. The appended rows must not come from the tokens (they are read, not
received): zeros, or any tensor computed without the tokens' values.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from ...fx import dims
from ...fx.graph import SIZE_READERS, data_users, node_arg, region, val

aten = torch.ops.aten

# allocations that read a tensor's dtype and device only (their sizes are arguments)
ALLOCATE_NEW = frozenset(
    {aten.new_empty.default, aten.new_zeros.default, aten.new_empty_strided.default}
)


@dataclasses.dataclass(frozen=True)
class Pad:
    """The dispatched tokens with ``rows`` rows appended: ``node`` the padded tensor;
    ``extra`` the appended rows' values (None: zeros, a gradient laid into zeros);
    ``unpad`` the slice that drops them after the put-back (set once found)."""

    node: Node
    rows: int
    extra: Node | None
    unpad: Node | None = None


def padded(read: Node, wait: Node) -> Pad | None:
    """``read`` as the received tokens ``wait`` with rows appended after them, none of
    them from the tokens; else None."""
    received = val(wait).shape[0]
    extra: Node | None = None
    if read.target is aten.cat.default and node_arg(read, 1, "dim", 0) == 0:
        parts = node_arg(read, 0, "tensors")
        if len(parts) != 2 or parts[0] is not wait or not independent(parts[1], wait):
            return None
        extra = parts[1]
    elif read.target is aten.slice_backward.default:
        dim, start, end, step = (node_arg(read, i, "") for i in range(2, 6))
        rows = val(read).shape[0]
        end = end + rows if isinstance(end, int) and end < 0 else end
        if read.args[0] is not wait or (dim, start, step) != (0, 0, 1):
            return None
        if not dims.equal(end, received):
            return None
    elif read.target is aten.slice_scatter.default:
        written = region(read)
        buffer = node_arg(read, 0, "self")
        if node_arg(read, 1, "src") is not wait or written is None or written.dim != 0:
            return None
        if not (dims.equal(written.start, 0) and dims.equal(written.step, 1)):
            return None
        if not independent(buffer, wait):
            return None
        extra = buffer
    else:
        return None
    appended = dims.sizes([val(read).shape[0] - received])[0]
    if not isinstance(appended, int) or appended < 1:
        return None
    return Pad(read, appended, extra)


def independent(node: Node, wait: Node) -> bool:
    """Is ``node`` computed without the values of ``wait`` (reading at most its dtype and
    device, through an allocation with explicit sizes, or its sizes)?"""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is wait:
            return False
        if current in seen:
            continue
        seen.add(current)
        if current.target in ALLOCATE_NEW or current.target in SIZE_READERS:
            stack += [a for a in current.all_input_nodes if a is not node_arg(current, 0, "")]
        else:
            stack += current.all_input_nodes
    return True


def unpadded(put_back: Node, pad: Pad) -> tuple[Pad, Node] | str:
    """The pad with its ``unpad``, the slice of the P rows put back that keeps the R
    received ones, and what reads it; or why the appended rows are not dropped."""
    after = data_users(put_back)
    received = val(pad.node).shape[0] - pad.rows
    unpad = after[0] if len(after) == 1 else None
    kept = region(unpad) if unpad is not None and unpad.target is aten.slice.Tensor else None
    if unpad is None or kept is None:
        return f"{put_back.name} is read by {', '.join(u.name for u in after) or 'nothing'}"
    if kept.dim != 0 or not all(
        dims.equal(a, b) for a, b in ((kept.start, 0), (kept.end, received), (kept.step, 1))
    ):
        return f"{unpad.name} keeps {kept}"
    readers = data_users(unpad)
    if len(readers) != 1:
        return f"{unpad.name} is read by {len(readers)} nodes"
    return dataclasses.replace(pad, unpad=unpad), readers[0]
