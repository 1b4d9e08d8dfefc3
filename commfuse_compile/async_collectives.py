"""Hand-overlapped collectives in the graph: ``async_op=True`` and a later ``.wait()``.

torch 2.13's Dynamo remaps the in-place c10d calls to functional collectives
(``traceable_collective_remaps``), but with ``async_op=True`` it stops: the check is in
``CollectiveFunctionRewriteVariable.call_function``
(``torch/_dynamo/variables/functions.py``), before any remap is looked up, and is a graph
break. Megatron-Core's linear backward issues its input all-gather and its gradient
reduce-scatter that way, so the whole ``autograd.Function`` around it ran uncompiled.

:func:`install` registers, with torch's public ``torch.compiler.substitute_in_graph``,
what Dynamo traces in place of ``dist.all_gather_into_tensor``,
``dist.reduce_scatter_tensor`` and ``dist.all_to_all_single``. Without ``async_op`` they
trace exactly as torch's own remap does (the functional collective, its wait, a copy into
the output). With ``async_op=True`` the functional collective is issued where the call
is and a :class:`PendingCollective` stands for the ``Work``: its ``.wait()`` waits for
the collective and copies the result into the output tensor, where the user waits. The
graph then holds the collective, the work in between and the wait, as the user
overlapped them by hand, and the pass can rewrite the site.

Outside tracing nothing changes: eager code calls c10d and gets its ``Work``. A handle
that leaves the graph (a graph break between the call and its ``.wait()``) is the same
object in eager code, and its ``.wait()`` waits there. The handle has ``.wait()`` only
(its ``timeout`` is not used), the one method these frameworks call. The registration is
Dynamo's, for the whole process: every backend traces these calls so once
``commfuse_compile`` is imported (as ``torch.compile(backend="commfuse")`` does).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

_installed = False


class PendingCollective:
    """A functional collective issued and not yet waited for: the traced stand-in for
    c10d's ``Work``. ``wait()`` waits and writes the result into ``output``."""

    def __init__(self, output: torch.Tensor, result: torch.Tensor) -> None:
        self.output = output
        self.result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.output.copy_(torch.ops._c10d_functional.wait_tensor(self.result))
        return True


def _group_name(group: Any) -> str:
    resolved = group or dist.group.WORLD
    assert resolved is not None, "the default process group is not initialized"
    return resolved.group_name


def install() -> None:
    """Register the traced forms (once per process; torch keeps them for its lifetime)."""
    global _installed
    if _installed or not dist.is_available():
        return
    _installed = True
    import torch.distributed._functional_collectives as fc

    @torch.compiler.substitute_in_graph(dist.all_gather_into_tensor)
    def all_gather_into_tensor(
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any = None,
        async_op: bool = False,
    ) -> PendingCollective | None:
        if not async_op:
            fc.all_gather_tensor_inplace(output_tensor, input_tensor, group)
            return None
        size = dist.get_world_size(group)
        result = torch.ops._c10d_functional.all_gather_into_tensor(
            input_tensor, size, _group_name(group)
        )
        return PendingCollective(output_tensor, result)

    @torch.compiler.substitute_in_graph(dist.reduce_scatter_tensor)
    def reduce_scatter_tensor(
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> PendingCollective | None:
        reduce_op = fc.REDUCE_OP_TO_STR[op]
        if not async_op:
            fc.reduce_scatter_tensor_inplace(output, input, reduce_op, group)
            return None
        size = dist.get_world_size(group)
        result = torch.ops._c10d_functional.reduce_scatter_tensor(
            input, reduce_op, size, _group_name(group)
        )
        return PendingCollective(output, result)

    @torch.compiler.substitute_in_graph(dist.all_to_all_single)
    def all_to_all_single(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> PendingCollective | None:
        if not async_op:
            fc.all_to_all_inplace(output, input, output_split_sizes, input_split_sizes, group)
            return None
        if output_split_sizes is None or input_split_sizes is None:
            size = dist.get_world_size(group)
            output_split_sizes = input_split_sizes = [input.shape[0] // size] * size
        result = torch.ops._c10d_functional.all_to_all_single(
            input, output_split_sizes, input_split_sizes, _group_name(group)
        )
        return PendingCollective(output, result)
