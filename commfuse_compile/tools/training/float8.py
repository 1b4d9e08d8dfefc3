"""A Megatron-style TP+SP block whose linears compute in float8 (our own small scaled
linear, in the manner of float8 training with tensor parallelism; not torchao).

Each linear casts its input and its weight to ``float8_e4m3fn`` with a per-tensor scale
from the tensor's largest magnitude (amax scaling), multiplies with ``torch._scaled_mm``
(float32 accumulation, output in the activations' dtype) and keeps the backward in the
activations' precision (the weight and the input dequantized):

* column-parallel: the sequence shard is quantized first, with one scale for the whole
  gathered tensor (its amax all-reduced over the group, max), then all-gathered as its
  uint8 bytes (gloo moves no float8; NCCL moves it as bytes too) and viewed back: the
  float8 all-gather -> scaled matmul that the pass decomposes (``ag_mm``, rows); the
  backward reduce-scatters the input gradient (``mm_rs``);
* row-parallel: the partial product of this rank's features is a scaled matmul of its
  own input (its own scale), reduce-scattered along the sequence (``mm_rs``); the
  backward all-gathers the output gradient (``ag_mm``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .styles import MegatronBlock

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max
c10d = torch.ops._c10d_functional


def quantized(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in float8 scaled so that ``amax`` is the largest finite value, and the scale
    that undoes it (float32, 0-d: what ``_scaled_mm`` multiplies the product by)."""
    scale = FLOAT8_MAX / amax.float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8), scale.reciprocal()


def _gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along dim 0 (the sequence)."""
    n, name = dist.get_world_size(group), group.group_name
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), n, name))


def _reduce_scattered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group, this rank's block of dim 0 (the sequence)."""
    n, name = dist.get_world_size(group), group.group_name
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x.contiguous(), "sum", n, name))


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax()


def _scaled(
    a: torch.Tensor, w: torch.Tensor, a_descale: torch.Tensor, w_descale: torch.Tensor, dtype: Any
) -> torch.Tensor:
    """``a`` [..., K] (float8) @ ``w`` [N, K]^T (float8, column-major as float8 training
    lays weights out): [..., N] in ``dtype``."""
    a2d = a.reshape(-1, a.shape[-1])
    out = torch._scaled_mm(a2d, w.t(), a_descale, w_descale, out_dtype=dtype)
    return out.view(*a.shape[:-1], w.shape[0])


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
        amax = c10d.wait_tensor(c10d.all_reduce(_amax(x), "max", group.group_name))
        x8, x_descale = quantized(x, amax)
        gathered = _gathered(x8.view(torch.uint8), group).view(FLOAT8)
        w8, w_descale = quantized(weight, _amax(weight))
        ctx.save_for_backward(gathered, x_descale, weight)
        ctx.group, ctx.dtype = group, x.dtype
        return _scaled(gathered, w8, x_descale, w_descale, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gathered, x_descale, weight = ctx.saved_tensors
        x = gathered.to(ctx.dtype) * x_descale.to(ctx.dtype)
        grad_x = _reduce_scattered(grad @ weight, ctx.group)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
        x8, x_descale = quantized(x, _amax(x))
        w8, w_descale = quantized(weight, _amax(weight))
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return _reduce_scattered(_scaled(x8, w8, x_descale, w_descale, x.dtype), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        grad = _gathered(grad, ctx.group)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ weight, grad_w, None


class Float8Linear(nn.Module):
    """A Megatron-style column- or row-parallel linear (``styles``), computing in float8:
    the same sharded weight (and bias), the scaled matmul in place of ``F.linear``."""

    def __init__(self, linear: nn.Module, column: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.group = linear.weight, linear.bias, linear.group
        self.function = _ColumnParallel if column else _RowParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.function.apply(x, self.weight, self.group)
        return y if self.bias is None else y + self.bias


class Float8MegatronBlock(MegatronBlock):
    """:class:`styles.MegatronBlock` with its four linears in float8 (``Float8Linear``)."""

    def __init__(self, dim: int, heads: int, hidden: int, group: Any, bias: bool = True) -> None:
        super().__init__(dim, heads, hidden, group, bias)
        for name, column in (("qkv", True), ("proj", False), ("fc1", True), ("fc2", False)):
            setattr(self, name, Float8Linear(getattr(self, name), column))
