"""Transformer blocks written the way Megatron-LM and DeepSpeed write them (our own code,
from their documented behaviour), so that the pass is tested on the graphs that code
gives, not only on DTensor's and functional collectives'.

Both are sequence-first (activations ``[s, b, h]``) and call the in-place c10d API into
preallocated buffers inside ``autograd.Function``s:

* :class:`MegatronBlock`: Megatron's sequence parallelism. Column-parallel linears gather
  their input along the sequence (``dist.all_gather_into_tensor(out, x)`` into
  ``torch.empty``; the backward reduce-scatters the gradient); row-parallel linears
  reduce-scatter their output (``dist.reduce_scatter_tensor``; the backward gathers).
  Sharded parameters carry ``tensor_model_parallel = True``, as Megatron marks them;
  the others (norms, row-parallel biases) are replicated, their gradients summed over
  the group after the backward.
* :class:`DeepSpeedUlyssesBlock`: DeepSpeed-Ulysses. Every weight is whole on every rank;
  q, k and v ``[s/n, b, heads, d]`` go through ``SeqAllToAll`` (scatter the heads, gather
  the sequence: ``dist.all_to_all_single(out, x)`` into ``torch.empty_like``), local
  attention sees ``[s, b, heads/n, d]``, and the output goes back the other way. Grouped
  query attention (``kv_heads``) and one fused q/k/v linear (``fused_qkv``) as options.
* :class:`MegatronCoreBlock`: the same block with Megatron-Core's linears
  (``megatron/core/tensor_parallel/layers.py``): the column-parallel linear gathers its
  input inside its own ``autograd.Function`` into the persistent global memory buffer
  (:func:`get_global_memory_buffer`), and its backward gathers the input again and
  reduce-scatters the input gradient with ``async_op=True``, waiting only after the next
  matmul (overlap by hand); linears return ``(output, bias)``. Optionally, Megatron-Core's
  warning on rank 0 only on the row-parallel path (``rank0_warning``: its
  ``RowParallelLinear`` passes no group, and ``get_tensor_model_parallel_group_if_none``
  warns on rank 0).
* :func:`simple_fsdp`: torchtitan's SimpleFSDP: every parameter a DTensor sharded on dim 0
  over the data-parallel mesh, read through a parametrization whose forward redistributes
  it to replicated (the all-gather, in ``param_dtype``) with gradients reduced to
  ``Partial("avg")`` in ``reduce_dtype`` (the reduce-scatter): all in the graph.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .models import UlyssesBlock

# ----------------------------------------------------------------------------------------
# Megatron-style sequence parallelism


def _gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along dim 0 (the sequence) into a preallocated buffer."""
    shape = list(x.shape)
    shape[0] *= dist.get_world_size(group)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group and keep this rank's block of dim 0, into a preallocated buffer."""
    shape = list(x.shape)
    shape[0] //= dist.get_world_size(group)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: gather the sequence; backward: reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence; backward: gather the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group), None


def _shard(full: torch.Tensor, n: int, rank: int, dim: int) -> nn.Parameter:
    param = nn.Parameter(full.chunk(n, dim=dim)[rank].clone())
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y = gather(x) @ W_r^T + b_r``: this rank's rows of W (its output columns)."""

    def __init__(self, inputs: int, outputs: int, group: Any, bias: bool) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = _shard(nn.Linear(inputs, outputs).weight.detach(), n, rank, 0)
        self.bias = _shard(torch.zeros(outputs), n, rank, 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(
            GatherFromSequenceParallelRegion.apply(x, self.group), self.weight, self.bias
        )


class RowParallelLinear(nn.Module):
    """``y = reduce_scatter(x_r @ W_r^T) + b``: this rank's columns of W (its inputs); the
    bias is added after the reduction, once."""

    def __init__(self, inputs: int, outputs: int, group: Any, bias: bool) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = _shard(nn.Linear(inputs, outputs).weight.detach(), n, rank, 1)
        self.bias = nn.Parameter(torch.zeros(outputs)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceScatterToSequenceParallelRegion.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class MegatronBlock(nn.Module):
    """A GPT block as Megatron's sequence parallelism runs it, on ``[s/n, b, dim]``:
    LayerNorm -> fused q/k/v (column-parallel, this rank's heads) -> causal attention ->
    output projection (row-parallel); LayerNorm -> fused gate/up SwiGLU (column-parallel)
    -> down (row-parallel); both residual."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        group: Any,
        bias: bool = True,
        column: Callable[..., nn.Module] = ColumnParallelLinear,
        row: Callable[..., nn.Module] = RowParallelLinear,
    ) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if heads % n or hidden % n:
            raise ValueError(f"{n} ranks must divide heads={heads} and hidden={hidden}")
        self.local_heads, self.head_dim = heads // n, dim // heads
        self.input_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = column(dim, 3 * dim, group, bias)
        self.proj = row(dim, dim, group, bias)
        self.fc1 = column(dim, 2 * hidden, group, bias)
        self.fc2 = row(hidden, dim, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self._attention(self.qkv(self.input_norm(x))))
        gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's heads: ``[s, b, 3 * heads/n * d]`` (fused q/k/v)
        to ``[s, b, heads/n * d]``."""
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.local_heads, 3 * self.head_dim).chunk(3, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/n, s, d]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.permute(2, 0, 1, 3).reshape(s, b, -1)


# ----------------------------------------------------------------------------------------
# DeepSpeed-Ulysses


def single_all_to_all(x: torch.Tensor, scatter: int, gather: int, group: Any) -> torch.Tensor:
    """Scatter dim ``scatter`` of ``x`` over the group and gather dim ``gather``: one
    in-place ``all_to_all_single`` into ``torch.empty_like``. Sequence-first
    ``[s, b, heads, d]``: (2, 0) trades sequence shards for head shards, (0, 2) back."""
    n = dist.get_world_size(group)
    shape = list(x.shape)
    if scatter == 2 and gather == 0:  # [s/n, b, h, d] -> [s, b, h/n, d]
        blocks = x.reshape(shape[0] * shape[1], n, shape[2] // n, shape[3])
        sent = blocks.transpose(0, 1).contiguous()  # [n, s/n * b, h/n, d]
    elif scatter == 0 and gather == 2:  # [s, b, h/n, d] -> [s/n, b, h, d]
        sent = x.reshape(n, shape[0] // n, *shape[1:]).contiguous()  # [n, s/n, b, h/n, d]
    else:
        raise ValueError(f"scatter {scatter} / gather {gather}: only (2, 0) and (0, 2)")
    out = torch.empty_like(sent)
    dist.all_to_all_single(out, sent, group=group)
    if gather == 0:  # block j: rank j's tokens, this rank's heads
        return out.reshape(shape[0] * n, shape[1], shape[2] // n, shape[3])
    # block j: rank j's heads of this rank's tokens
    return out.permute(1, 2, 0, 3, 4).reshape(shape[0] // n, shape[1], shape[2] * n, shape[3])


class SeqAllToAll(torch.autograd.Function):
    """DeepSpeed's ``_SeqAllToAll``: the backward is the same exchange the other way."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return single_all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, single_all_to_all(grad, ctx.gather, ctx.scatter, ctx.group), None, None


class DeepSpeedUlyssesBlock(UlyssesBlock):
    """:class:`UlyssesBlock`'s weights, with DeepSpeed-Ulysses attention on ``[s/n, b, dim]``:
    RMSNorm -> q, k, v (or one fused linear) -> ``SeqAllToAll`` -> causal attention over
    every token of this rank's heads -> ``SeqAllToAll`` back -> output projection;
    RMSNorm -> SwiGLU; both residual. Every weight whole on every rank."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        group: Any,
        kv_heads: int = 0,
        fused_qkv: bool = False,
    ) -> None:
        super().__init__(dim, heads, hidden, kv_heads, fused_qkv, "rms", False, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, dim = x.shape
        q, k, v = self.project(self.attention_norm(x))
        q, k, v = (
            SeqAllToAll.apply(self.group, t.view(s, b, -1, self.head_dim), 2, 0) for t in (q, k, v)
        )
        o = self.attend(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))  # [b, heads/n, s, d]
        o = SeqAllToAll.apply(self.group, o.permute(2, 0, 1, 3), 0, 2)  # [s/n, b, heads, d]
        x = x + self.wo(o.reshape(s, b, dim))
        return x + self.mlp(self.ffn_norm(x))


# ----------------------------------------------------------------------------------------
# Megatron-Core's linears (megatron/core/tensor_parallel/layers.py)


class GlobalMemoryBuffer:
    """Megatron-Core's global memory buffer: one flat tensor per (name, dtype), kept across
    calls and grown when a larger view is asked for; callers get views of it."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self, shape: list[int], dtype: torch.dtype, name: str, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            self.buffer[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.buffer[key][0:numel].view(shape)


_GLOBAL_MEMORY_BUFFER: GlobalMemoryBuffer | None = None


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The process's buffer (``parallel_state.get_global_memory_buffer``), made on first use."""
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is None:
        _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    return _GLOBAL_MEMORY_BUFFER


class LinearWithAsyncCommunication(torch.autograd.Function):
    """Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication`` with sequence
    parallelism: the forward gathers the input into the global buffer and multiplies; the
    backward starts the same gather (``async_op=True``), computes the input gradient,
    waits, starts the reduce-scatter of the input gradient (``async_op=True``), computes
    the weight gradient and only then waits. Without sequence parallelism it is a plain
    linear (the row-parallel linear's matmul)."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        sequence_parallel: bool,
        group: Any,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.sequence_parallel, ctx.group = sequence_parallel, group
        total_input = input
        if sequence_parallel:
            shape = list(input.size())
            shape[0] *= dist.get_world_size(group)
            total_input = get_global_memory_buffer().get_tensor(
                shape, input.dtype, "mpu", input.device
            )
            dist.all_gather_into_tensor(total_input, input, group=group)
        output = torch.matmul(total_input, weight.t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight = ctx.saved_tensors
        group = ctx.group
        total_input, handle = input, None
        if ctx.sequence_parallel:
            shape = list(input.size())
            shape[0] *= dist.get_world_size(group)
            total_input = get_global_memory_buffer().get_tensor(
                shape, input.dtype, "mpu", input.device
            )
            handle = dist.all_gather_into_tensor(total_input, input, group=group, async_op=True)
        grad_input = grad_output.matmul(weight)
        if handle is not None:
            handle.wait()
        # Megatron's prepare_input_tensors_for_wgrad_compute: 2-D operands
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        total_input_2d = total_input.reshape(-1, total_input.shape[-1])
        if ctx.sequence_parallel:
            sub_grad_input = torch.empty(input.size(), dtype=input.dtype, device=input.device)
            handle = dist.reduce_scatter_tensor(
                sub_grad_input, grad_input, group=group, async_op=True
            )
        grad_weight = grad_output_2d.t().matmul(total_input_2d)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        if ctx.sequence_parallel:
            assert handle is not None
            handle.wait()
            return sub_grad_input, grad_weight, grad_bias, None, None
        return grad_input, grad_weight, grad_bias, None, None


class CoreColumnParallelLinear(nn.Module):
    """Megatron-Core's ``ColumnParallelLinear`` with sequence parallelism: the gather is
    inside the linear's own function; returns ``(output, None)`` (the bias is added)."""

    def __init__(self, inputs: int, outputs: int, group: Any, bias: bool) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = _shard(nn.Linear(inputs, outputs).weight.detach(), n, rank, 0)
        self.bias = _shard(torch.zeros(outputs), n, rank, 0) if bias else None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        output = LinearWithAsyncCommunication.apply(
            input_, self.weight, self.bias, True, self.group
        )
        return output, None


def group_if_none(group: Any, default: Any) -> Any:
    """Megatron-Core's ``get_tensor_model_parallel_group_if_none``: no group given is the
    default one, with a ``DeprecationWarning`` on rank 0 only (``stacklevel=2``: the
    caller's line)."""
    if group is None:
        if dist.get_rank() == 0:
            warnings.warn(
                "Warning: tp_group is None, using default tp group. Passing tp_group will be "
                "mandatory soon",
                DeprecationWarning,
                stacklevel=2,
            )
        return default
    return group


class CoreRowParallelLinear(nn.Module):
    """Megatron-Core's ``RowParallelLinear`` with sequence parallelism: the matmul through
    the same function (no communication), then ``reduce_scatter_to_sequence_parallel_region``
    and the bias; returns ``(output, None)``. ``rank0_warning``: its matmul is given no
    group (Megatron-Core's ``tp_group=None``), which warns on rank 0 only
    (:func:`group_if_none`): without ``deferred_logging``, rank 0's graph breaks there
    and the others' do not."""

    def __init__(
        self, inputs: int, outputs: int, group: Any, bias: bool, rank0_warning: bool = False
    ) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = _shard(nn.Linear(inputs, outputs).weight.detach(), n, rank, 1)
        self.bias = nn.Parameter(torch.zeros(outputs)) if bias else None
        self.rank0_warning = rank0_warning

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = group_if_none(None if self.rank0_warning else self.group, self.group)
        output_parallel = LinearWithAsyncCommunication.apply(
            input_, self.weight, None, False, group
        )
        output = ReduceScatterToSequenceParallelRegion.apply(output_parallel, self.group)
        return (output if self.bias is None else output + self.bias), None


class MegatronCoreBlock(MegatronBlock):
    """:class:`MegatronBlock`'s GPT block with Megatron-Core's linears
    (:class:`CoreColumnParallelLinear`, :class:`CoreRowParallelLinear`)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        group: Any,
        bias: bool = True,
        rank0_warning: bool = False,
    ) -> None:
        row = functools.partial(CoreRowParallelLinear, rank0_warning=rank0_warning)
        super().__init__(dim, heads, hidden, group, bias, CoreColumnParallelLinear, row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(self.input_norm(x))  # [s, b, 3 * heads/n * d]
        out, _ = self.proj(self._attention(qkv))
        x = x + out
        fc1, _ = self.fc1(self.mlp_norm(x))
        gate, up = fc1.chunk(2, dim=-1)
        out, _ = self.fc2(F.silu(gate) * up)
        return x + out


# ----------------------------------------------------------------------------------------
# torchtitan's SimpleFSDP (torchtitan/experiments/simple_fsdp)


class ReplicateComputation(nn.Module):
    """SimpleFSDP's parametrization: the stored dim-0 shard (a DTensor) redistributed to
    replicated in ``param_dtype`` (the all-gather), its local tensor returned with
    gradients ``Partial("avg")`` cast to ``reduce_dtype`` (the reduce-scatter)."""

    def __init__(self, mesh: Any, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        super().__init__()
        from torch.distributed.tensor import Partial, Replicate

        self.mesh = mesh
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.compute_placements = [Replicate()]
        self.grad_placements = [Partial(reduce_op="avg")]

    def forward(self, x: Any) -> torch.Tensor:
        replicated = x.redistribute(
            placements=self.compute_placements,
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        return replicated.to_local(grad_placements=self.grad_placements)


def _parametrize(module: nn.Module, names: list[str], parametrization: nn.Module) -> None:
    """SimpleFSDP's own parametrization: a subclass of the module's class whose properties
    read each parameter through ``parametrization`` (the state dict keeps the shards)."""

    def read(name: str) -> property:
        return property(lambda self: parametrization(self._parameters[name]))

    properties = {name: read(name) for name in names}
    module.__class__ = type(f"SimpleFSDP{type(module).__name__}", (type(module),), properties)


def simple_fsdp(
    model: nn.Module,
    mesh: Any,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """torchtitan's ``data_parallel(model, mesh, mode="fully_shard", mp_policy=...)``:
    every parameter distributed ``Shard(0)`` over ``mesh`` and read through
    :class:`ReplicateComputation`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in list(model.modules()):
        params = dict(module.named_parameters(recurse=False))
        for name, param in params.items():
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            )
        if params:
            _parametrize(
                module, list(params), ReplicateComputation(mesh, param_dtype, reduce_dtype)
            )
    return model
