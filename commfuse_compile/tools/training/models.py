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


def block_plan(sequence_parallel: bool = True) -> dict[str, Any]:
    """TP+SP (the norms on the sequence shard), or plain TP: DTensor's default layouts,
    the block's input whole on every rank and an all-reduce after each row-parallel
    linear, as Hugging Face's ``tp_plan`` shards a Llama."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    col = ColwiseParallel(input_layouts=Shard(1))
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    norms: dict[str, Any] = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    if not sequence_parallel:
        col, row, norms = ColwiseParallel(), RowwiseParallel(), {}
    return {
        **norms,
        "wq": col,
        "wk": col,
        "wv": col,
        "wo": row,
        "w1": col,
        "w3": col,
        "w2": row,
    }


# ----------------------------------------------------------------------------------------
# Ulysses sequence parallelism (DeepSpeed-Ulysses): activations sharded on the sequence,
# weights whole on every rank; attention all-to-alls heads <-> sequence around SDPA.


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, S/n, h, d]`` (this rank's tokens, every head) -> ``[B, S, h/n, d]`` (every
    token, this rank's block of heads): one ``all_to_all_single`` of n equal dim-0 blocks.

    Block j of the input (heads ``j*h/n ...``) goes to rank j; block j of the output comes
    from rank j, that is, holds the tokens ``j*S/n ...``. As DeepSpeed-Ulysses lays it out:
    ``[B, s, h, d] -> [B, s, n, h/n, d] -> [n, B, s, h/n, d]`` (copy) -> all-to-all ->
    ``[n, B, s, h/n, d] -> [B, n, s, h/n, d] -> [B, S, h/n, d]``.
    """
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n = _group_size(group)
    b, s, h, d = x.shape
    if n == 1:
        return x
    blocks = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    out = all_to_all_single_autograd(blocks, None, None, group)
    return out.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, S, h/n, d] -> [B, S/n, h, d]``.

    ``[B, S, h/n, d] -> [B, n, s, h/n, d] -> [n, B, s, h/n, d]`` (copy; block j: the tokens
    of rank j) -> all-to-all -> ``[n, B, s, h/n, d]`` (block j: the heads of rank j) ->
    ``[B, s, n, h/n, d] -> [B, s, h, d]``.
    """
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n = _group_size(group)
    b, seq, hn, d = x.shape
    if n == 1:
        return x
    blocks = x.reshape(b, n, seq // n, hn, d).permute(1, 0, 2, 3, 4).contiguous()
    out = all_to_all_single_autograd(blocks, None, None, group)
    return out.permute(1, 2, 0, 3, 4).reshape(b, seq // n, n * hn, d)


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size(group))


class UlyssesBlock(nn.Module):
    """A Llama-style block (like :class:`Block`) for Ulysses sequence parallelism over
    ``group`` (None: one rank, no communication): the input is this rank's ``S/n`` tokens
    ``[B, S/n, D]``; q, k, v are projected locally, all-to-all'd to ``[B, S, h/n, d]``
    (every token, this rank's heads), attended (causal), all-to-all'd back to
    ``[B, S/n, h*d]`` and projected by ``wo``. The SwiGLU MLP and the norms are local.

    ``kv_heads`` (0: ``heads``) < ``heads`` is grouped-query attention (n must divide
    ``kv_heads``); ``fused_qkv`` makes q, k, v one linear ``wqkv`` whose output is split.
    ``bias=True`` gives q, v (or ``wqkv``), w1 and w3 a bias.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        kv_heads: int = 0,
        fused_qkv: bool = False,
        norm: str = "rms",
        bias: bool = False,
        group: Any = None,
    ) -> None:
        super().__init__()
        kv_heads = kv_heads or heads
        n = _group_size(group)
        if dim % heads or heads % kv_heads:
            raise ValueError(f"heads={heads} must divide dim={dim}, kv_heads={kv_heads} heads")
        if kv_heads % n:
            raise ValueError(f"{n} ranks do not divide the {kv_heads} k/v heads")
        norm_class = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}[norm]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.group = group
        self.fused_qkv = fused_qkv
        kv_dim = kv_heads * self.head_dim
        self.attention_norm = norm_class(dim)
        if fused_qkv:
            self.wqkv = nn.Linear(dim, dim + 2 * kv_dim, bias=bias)
        else:
            self.wq = nn.Linear(dim, dim, bias=bias)
            self.wk = nn.Linear(dim, kv_dim, bias=False)
            self.wv = nn.Linear(dim, kv_dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = norm_class(dim)
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        q, k, v = self.project(self.attention_norm(x))
        # [B, S/n, heads, d] -> [B, S, heads/n, d] -> [B, heads/n, S, d]
        q, k, v = (
            seq_to_heads(t.view(b, s, -1, self.head_dim), self.group).transpose(1, 2)
            for t in (q, k, v)
        )
        o = heads_to_seq(self.attend(q, k, v).transpose(1, 2), self.group)  # [B, S/n, h, d]
        x = x + self.wo(o.reshape(b, s, dim))
        return x + self.mlp(self.ffn_norm(x))

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of the normed input (one fused linear, split; or three)."""
        if self.fused_qkv:
            kv_dim = self.kv_heads * self.head_dim
            q, k, v = self.wqkv(h).split([h.shape[-1], kv_dim, kv_dim], dim=-1)
            return q, k, v
        return self.wq(h), self.wk(h), self.wv(h)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over ``[B, heads/n, S, d]`` (grouped-query where k/v have fewer)."""
        gqa = self.kv_heads != self.heads
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)) * self.w3(h))
