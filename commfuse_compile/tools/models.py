"""Small tensor+sequence-parallel models: the demo's block, the examples' and tests' MLP.

Plans follow torchtitan's: norms sequence-parallel, the projections that read the
normed activations column-parallel (gathering the sequence), the ones that write the
residual row-parallel (reduce-scattering it back to sequence shards).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """LayerNorm -> gate and up (sharing their input) -> SiLU product -> down
    (-> + x with ``residual``); gate and down have a bias, up one with ``up_bias``."""

    def __init__(
        self, dim: int = 16, hidden: int = 24, up_bias: bool = False, residual: bool = False
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, hidden)
        self.up = nn.Linear(dim, hidden, bias=up_bias)
        self.down = nn.Linear(hidden, dim)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = self.down(F.silu(self.gate(h)) * self.up(h))
        return x + y if self.residual else y


def mlp_plan(local_output: bool = True) -> dict[str, Any]:
    """Sequence-sharded in and out; ``local_output=False`` keeps down's output a DTensor
    (for a residual add to the DTensor input)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "norm": SequenceParallel(),
        "gate": ColwiseParallel(input_layouts=Shard(1)),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=local_output),
    }


class Block(nn.Module):
    """Llama-style by default (RMSNorm, no biases). ``norm="layer"`` uses LayerNorm (weight
    and bias); ``bias=True`` gives q, v, w1 and w3 a bias (k, wo and w2 keep none), so one
    block has norms with affine parameters and linears with and without bias. (A bias on
    k shifts every score of a query by the same amount: softmax cancels it, its gradient
    is zero, and a comparison of that gradient compares rounding noise.)"""

    def __init__(
        self, dim: int, heads: int, hidden: int, norm: str = "rms", bias: bool = False
    ) -> None:
        super().__init__()
        norm_class = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}[norm]
        self.head_dim = dim // heads
        self.attention_norm = norm_class(dim)
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = norm_class(dim)
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def block_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    col = ColwiseParallel(input_layouts=Shard(1))
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "wq": col,
        "wk": col,
        "wv": col,
        "wo": row,
        "w1": col,
        "w3": col,
        "w2": row,
    }
