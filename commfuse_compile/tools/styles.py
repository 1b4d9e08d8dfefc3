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
"""

from __future__ import annotations

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

    def __init__(self, dim: int, heads: int, hidden: int, group: Any, bias: bool = True) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if heads % n or hidden % n:
            raise ValueError(f"{n} ranks must divide heads={heads} and hidden={hidden}")
        self.local_heads, self.head_dim = heads // n, dim // heads
        self.input_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = ColumnParallelLinear(dim, 3 * dim, group, bias)
        self.proj = RowParallelLinear(dim, dim, group, bias)
        self.fc1 = ColumnParallelLinear(dim, 2 * hidden, group, bias)
        self.fc2 = RowParallelLinear(hidden, dim, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.input_norm(x))  # [s, b, 3 * heads/n * d]
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.local_heads, 3 * self.head_dim).chunk(3, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/n, s, d]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, -1))
        gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


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
