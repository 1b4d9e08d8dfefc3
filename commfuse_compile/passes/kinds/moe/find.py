"""Finding ``moe`` sites: the dispatch's tokens read through a permutation into grouped
matmuls, every op from there to the put-back row-wise, the put-back and the combine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node

from ...fx import dims
from ...fx.collectives import ALL_TO_ALL, the_wait
from ...fx.declines import Declined, decline
from ...fx.graph import (
    ALLOCATE_LIKE,
    SIZE_READERS,
    cast_to,
    check_tensor,
    data_users,
    in_graph_order,
    is_transpose_2d,
    node_arg,
    op_name,
    position,
    val,
)
from .padding import padded, unpadded
from .site import GROUPED_MM, MoeSite

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def match(dispatch: Node) -> MoeSite | None:
    """The site of ``dispatch`` if its tokens are read through a permutation into grouped
    matmuls (else None: another kind's, or no site's, see ``unclaimed``)."""
    wait = the_wait(dispatch)
    readers = data_users(wait) if wait is not None else []
    if wait is None or wait.target is not c10d.wait_tensor.default or len(readers) != 1:
        return None
    permuted, pad = readers[0], padded(readers[0], wait)
    if pad is not None:  # torchtitan's alignment padding: a zero row appended
        after = data_users(pad.node)
        if len(after) != 1:
            return None
        permuted = after[0]
    perm = _permutation(permuted, pad.node if pad else wait, padded=pad is not None)
    if perm is None or not any(n.target is GROUPED_MM for n in _reached(permuted)):
        return None
    n = len(node_arg(dispatch, 1, "output_split_sizes"))
    site = MoeSite(
        dispatch=dispatch,
        dispatch_wait=wait,
        pad=pad,
        permuted=permuted,
        perm=perm,
        group_name=str(node_arg(dispatch, 3, "group_name")),
        group_size=n,
    )
    try:
        if n < 2:
            raise decline("site.group_of_one")
        check_tensor(wait, "dispatched tokens")
        return _with_experts(site)
    except Declined as why:
        return _declined(site, why)


def _permutation(read: Node, source: Node, padded: bool) -> Node | None:
    """The index tensor of ``read`` if it reorders the rows of ``source`` (all of them,
    once each by the count: ``recv[perm]``, ``index_select(recv, 0, perm)``; with the
    rows ``padded``, any number of slots: see ``padding``)."""
    if read.target is aten.index.Tensor and read.args[0] is source:
        indices = node_arg(read, 1, "indices")
        perm = indices[0] if len(indices) == 1 else None
    elif read.target is aten.index_select.default and node_arg(read, 1, "dim") == 0:
        perm = node_arg(read, 2, "index") if read.args[0] is source else None
    else:
        return None
    if not isinstance(perm, Node):
        return None
    index = perm.meta.get("val")
    rows = val(source).shape[0]
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
        return None
    return perm if padded or dims.equal(index.shape[0], rows) else None


def _reached(start: Node) -> list[Node]:
    """Every node computed from ``start``, in graph order."""
    reached, stack = {start}, [start]
    while stack:
        for user in stack.pop().users:
            if user not in reached:
                reached.add(user)
                stack.append(user)
    return in_graph_order(reached)


def _with_experts(site: MoeSite) -> MoeSite:
    """``site`` with its experts (every op row-wise from the permuted tokens to the
    put-back), the put-back and the combine, or declined with the op that is not."""
    assert site.permuted is not None and site.dispatch_wait is not None
    rows = val(site.permuted).shape[0]  # the slots (the received rows, unpadded)
    reached = _reached(site.permuted)
    walk = _Walk(rows, [site.permuted], set(reached))
    put_back: Node | None = None
    writes: list[Node] = []  # in-place ops on what comes from the tokens (non-functional graphs)
    for node in reached[1:]:
        inside = [arg for arg in node.all_input_nodes if arg in walk.experts]
        if _writes(node):
            writes.append(node)
            walk.saved += inside  # after the site, on the values put back together
            continue
        if not inside and not set(node.all_input_nodes) & set(walk.transposes):
            continue
        if node.op == "output":
            walk.saved += inside
        elif node.target in SIZE_READERS or (
            node.target in ALLOCATE_LIKE and set(node.users) <= set(_put_backs(node))
        ):
            continue  # a size (the lowering's to replace), or the put-back's buffer
        elif _puts_back(node, site.perm, walk.experts) and put_back is None:
            put_back = node
        elif node.target is GROUPED_MM:
            walk.grouped(node)
        elif is_transpose_2d(node) and all(u.target is GROUPED_MM for u in node.users):
            walk.transposes.append(node)  # an operand of a sum over the rows
        elif _row_wise(node, walk):
            walk.experts.append(node)
        elif node.is_impure():
            raise decline("moe.side_effect", node=node.name, op=op_name(node))
        else:  # reads whole values (a transpose saved for the backward): rebuilt for it
            walk.saved += inside
    if put_back is None:  # (an in-place op may have taken the experts' output)
        if not writes:
            raise decline("moe.no_put_back")
        back = [n for n in reached if n.target is ALL_TO_ALL and _reverses(n, site.dispatch)]
        site = dataclasses.replace(site, combine=next(iter(back), None))
        return _declined(
            site, decline("moe.side_effect", node=writes[0].name, op=op_name(writes[0]))
        )
    buffer = node_arg(put_back, 0, "self")
    combine = next(iter(data_users(put_back)), None)
    if site.pad is not None:  # the appended rows dropped after the put-back
        if not dims.equal(val(buffer).shape[0], val(site.pad.node).shape[0]):
            raise decline("moe.pad_kept", node=put_back.name, why=f"{buffer.name}'s rows")
        dropped = unpadded(put_back, site.pad)
        if isinstance(dropped, str):
            raise decline("moe.pad_kept", node=put_back.name, why=dropped)
        pad, combine = dropped
        site = dataclasses.replace(site, pad=pad)
    elif len(data_users(put_back)) != 1:
        combine = None
    if combine is None or combine.target is not ALL_TO_ALL or not _reverses(combine, site.dispatch):
        raise decline("moe.no_combine", node=put_back.name)
    site = dataclasses.replace(site, combine=combine)  # its record names both collectives
    combine_wait = the_wait(combine)
    if combine_wait is None or combine_wait.target is not c10d.wait_tensor.default:
        return _declined(site, decline("site.wait", node=combine.name))
    for node in writes:  # one before the combine may change what the blocks compute
        if position(node) < position(combine_wait):
            return _declined(site, decline("moe.side_effect", node=node.name, op=op_name(node)))
    return dataclasses.replace(
        site,
        combine_wait=combine_wait,
        offs=walk.offs,
        experts=tuple(walk.experts[1:]),
        put_back=put_back,
        buffer=buffer if buffer.target in BUFFERS else None,
        saved=tuple(dict.fromkeys(walk.saved)),
        sums=tuple(walk.sums),
        transposes=tuple(walk.transposes),
        paired=tuple(in_graph_order(walk.paired)),
    )


@dataclasses.dataclass
class _Walk:
    """What the walk from the permuted tokens found: ``experts``, the values computed row
    by row from them; ``reached``, everything computed from them. A tensor of as many
    rows that is not (a saved activation, in the backward) pairs its row q with the
    experts' row q, the way the program pairs them: a block takes those rows of it."""

    rows: Any
    experts: list[Node]
    reached: set[Node]
    saved: list[Node] = dataclasses.field(default_factory=list)
    sums: list[Node] = dataclasses.field(default_factory=list)
    transposes: list[Node] = dataclasses.field(default_factory=list)
    offs: Node | None = None

    paired: set[Node] = dataclasses.field(default_factory=set)

    def aligned(self, node: Node) -> bool:
        """Rows of its own paired with the experts' rows: computed row-wise from the
        tokens, or independent of them with as many rows (``paired``)."""
        if node in self.experts:
            return True
        value = node.meta.get("val")
        independent = (
            node not in self.reached
            and isinstance(value, torch.Tensor)
            and value.dim() >= 1
            and dims.equal(value.shape[0], self.rows)
        )
        if independent:
            self.paired.add(node)
        return independent

    def grouped(self, mm: Node) -> None:
        """``mm`` as a grouped matmul of the experts: rows by a weight per group (an
        expert row), or the transpose of rows by rows, summed per group (a weight's
        gradient); else declined."""
        a, b = node_arg(mm, 0, "self"), node_arg(mm, 1, "mat2")
        offs, bias = node_arg(mm, 2, "offs"), node_arg(mm, 3, "bias")
        if bias is not None or not isinstance(offs, Node) or offs is not (self.offs or offs):
            raise decline("moe.grouped_form", node=mm.name)
        self.offs = offs
        if a in self.experts and b not in self.reached and val(b).dim() == 3:
            self.experts.append(mm)
        elif self._transposed_rows(a) and self.aligned(b):
            self.sums.append(mm)  # over every row at once, after the last block
            self.saved += [node for node in (*a.args[:1], b) if node in self.experts]
        else:
            raise decline("moe.grouped_form", node=mm.name)

    def _transposed_rows(self, a: Node) -> bool:
        """Is ``a`` [K, rows], the transpose of rows paired with the experts' (of the
        experts' own, or independent of the tokens: a saved activation's transpose)?"""
        if is_transpose_2d(a) and self.aligned(a.args[0]):  # type: ignore[arg-type]
            return True
        value = a.meta.get("val")
        if a in self.reached or not isinstance(value, torch.Tensor) or value.dim() != 2:
            return False
        return dims.equal(value.shape[1], self.rows)


# the buffers an expert output is put back into: each row is written once
BUFFERS = ALLOCATE_LIKE | {aten.empty.memory_format, aten.zeros.default, aten.full.default}


def _declined(site: MoeSite, why: Declined) -> MoeSite:
    return dataclasses.replace(site, declined=why.kept())


def _writes(node: Node) -> bool:
    """Does ``node`` write into one of its arguments (an in-place op)?"""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and any(
        a.alias_info is not None and a.alias_info.is_write for a in getattr(schema, "arguments", ())
    )


def _put_backs(buffer: Node) -> list[Node]:
    return [
        u for u in buffer.users if u.target in (aten.index_put.default, aten.index_copy.default)
    ]


def _puts_back(node: Node, perm: Node | None, experts: Sequence[Node]) -> bool:
    """``buffer.index_put([perm], value)`` (or ``index_copy(buffer, 0, perm, value)``)
    of an expert value into a buffer of its own (every row written once)."""
    if node.target is aten.index_put.default:
        buffer, indices, value = (node_arg(node, i, name) for i, name in _PUT_ARGS)
        # accumulating into zeros (an index's gradient) writes each row once, too
        adds = node_arg(node, 3, "accumulate", False)
        zeros = buffer.target in (
            aten.new_zeros.default,
            aten.zeros_like.default,
            aten.zeros.default,
        ) or (buffer.target is aten.full.default and node_arg(buffer, 1, "fill_value") == 0)
        ok = list(indices) == [perm] and (not adds or zeros)
    elif node.target is aten.index_copy.default:
        buffer, value = node_arg(node, 0, "self"), node_arg(node, 3, "source")
        ok = node_arg(node, 1, "dim") == 0 and node_arg(node, 2, "index") is perm
    else:
        return False
    return ok and value in experts and buffer not in experts


_PUT_ARGS = ((0, "self"), (1, "indices"), (2, "values"))


def _row_wise(node: Node, walk: _Walk) -> bool:
    """Does ``node`` compute each row of its result from that row of its inputs alone (a
    cast, or an element-wise op whose other operands are scalars, broadcast over the
    rows, or rows paired with the experts' rows)?"""
    if cast_to(node) is not None:
        return True
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return False
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not dims.equal(value.shape[0], walk.rows):
        return False
    for arg in node.all_input_nodes:
        other = arg.meta.get("val")
        if not isinstance(other, torch.Tensor):
            continue
        if other.dim() == value.dim() and walk.aligned(arg):
            continue  # row q with row q
        if arg in walk.reached:
            return False  # computed from the tokens, not row by row
        if other.dim() == value.dim() and not dims.equal(other.shape[0], 1):
            return False  # rows of another count
    return True


def _reverses(combine: Node, dispatch: Node) -> bool:
    """Does ``combine`` send back what ``dispatch`` received (splits swapped, one group)?"""
    same_group = node_arg(combine, 3, "group_name") == node_arg(dispatch, 3, "group_name")
    swapped = list(node_arg(combine, 1, "")) == list(node_arg(dispatch, 2, "")) and list(
        node_arg(combine, 2, "")
    ) == list(node_arg(dispatch, 1, ""))
    return same_group and swapped
