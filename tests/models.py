"""DTensor tensor+sequence-parallel models for end-to-end tests (and the demo's shapes)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._distributed_c10d import _get_work_registry_size
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import commfuse_compile
from commfuse_compile.tools.training.models import MLP, mlp_plan


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the expected tensor's largest magnitude."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def mlp_train_step(
    rank: int,
    n: int,
    options: dict,
    debug_dir: str,
    seq: int = 6,
    residual: bool = False,
    backend: str = "commfuse",
) -> dict:
    """Compiled (commfuse) vs eager TP+SP MLP: outputs, the input's and every parameter's
    gradient (relative errors), plus the report. ``residual``: the SwiGLU block of a real
    model (gate and up with bias, a residual add, LayerNorm with random affine
    parameters, loss sum(y^2)). ``backend="inductor"``: compiled by Inductor as it is
    (the Inductor pass installed or not; ``options`` unused), with the programs it
    generated and no report unless the pass wrote one."""
    commfuse_compile.report.reset()
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = MLP(up_bias=residual, residual=residual)
    if residual:
        with torch.no_grad():
            model.norm.weight.uniform_(0.5, 1.5)
            model.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, seq * n, 16)
    ref = copy.deepcopy(model)
    plan = mlp_plan(local_output=not residual)
    parallelize_module(model, mesh, plan)
    parallelize_module(ref, mesh, plan)
    if backend == "commfuse":
        options = {**options, "debug_dir": debug_dir}
        compiled = torch.compile(model, backend="commfuse", options=options, fullgraph=True)
    else:
        compiled = torch.compile(model, backend=backend, fullgraph=True)
    x_local = x.chunk(n, dim=1)[rank].contiguous()
    registered = _get_work_registry_size()

    def step(module: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        leaf = x_local.clone().requires_grad_()
        out = module(DTensor.from_local(leaf, mesh, [Shard(1)]))
        (out * out if residual else out).sum().backward()
        grads = {
            k: p.grad.full_tensor()
            for k, p in (module._orig_mod if module is compiled else module).named_parameters()
        }
        grads["input"] = leaf.grad
        if isinstance(out, DTensor):
            out = out.to_local()
        return out.detach(), grads

    (out_c, grads_c), programs = run_and_get_code(step, compiled)
    out_r, grads_r = step(ref)
    dump = Path(debug_dir) / f"rank{rank}"
    report = dump / "report.json"
    return {
        "leaked_works": _get_work_registry_size() - registered,
        "out_diff": relative_error(out_c, out_r),
        "grad_diff": {k: relative_error(grads_c[k], grads_r[k]) for k in grads_r},
        "report": json.loads(report.read_text()) if report.exists() else None,
        "files": sorted(os.listdir(dump)) if dump.exists() else [],
        "programs": programs,
    }


class SequenceParallelBlock(torch.nn.Module):
    """A transformer block as torchtitan writes one, sequence-first shards in and out:
    LayerNorm -> q/k/v (no bias) -> causal attention -> o; LayerNorm -> SwiGLU with
    biases; both residual. Heads of 8."""

    def __init__(self, dim: int = 96, hidden: int = 96) -> None:
        super().__init__()
        linear = torch.nn.Linear
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q, self.k = linear(dim, dim, bias=False), linear(dim, dim, bias=False)
        self.v, self.o = linear(dim, dim, bias=False), linear(dim, dim, bias=False)
        self.gate, self.up = linear(dim, hidden), linear(dim, hidden)
        self.down = linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        batch, seq, width = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, 8).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(batch, seq, width))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def sequence_parallel_blocks(n: int, blocks: int = 2) -> torch.nn.Module:
    """``blocks`` of :class:`SequenceParallelBlock` (seed 0) with DTensor TP+SP over a
    1-D mesh of the world: activations enter and leave sharded on the sequence."""
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[SequenceParallelBlock() for _ in range(blocks)])
    columns = ColwiseParallel(input_layouts=Shard(1))
    rows = RowwiseParallel(output_layouts=Shard(1))
    plan = {"q": columns, "k": columns, "v": columns, "o": rows}
    for block in model:
        parallelize_module(block, mesh, {**plan, "gate": columns, "up": columns, "down": rows})
    return model


def in_place_sum(t: torch.Tensor) -> torch.Tensor:
    """Megatron's spelling: ``dist.all_reduce`` in place."""
    torch.distributed.all_reduce(t)
    return t


def tensor_parallel_regions(summed):
    """Megatron's copy-to and reduce-from tensor-parallel regions, summing with
    ``summed``: the column-parallel input (whole on every rank, its gradient summed) and
    the row-parallel output (summed, its gradient passed through)."""

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return summed(grad)

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return summed(y)

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Copy, Reduce


# ----------------------------------------------------------------------------------------
# plain tensor parallelism: a Llama-style decoder written as Hugging Face writes it,
# sharded with DTensor's defaults (transformers' ``tp_plan``) or as Megatron's layers


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: statistics in float32, the weight applied last."""
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


HIDDEN, HEADS, FFN, LAYERS, TOKENS = 24, 12, 48, 2, (2, 6)  # 12 heads, 12 tokens: 3 and 4


class Attention(torch.nn.Module):
    """Hugging Face's LlamaAttention, shape for shape: heads from the local projection."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = (*h.shape[:-1], -1, self.head_dim)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(h).view(shape).transpose(1, 2) for p in projections)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*h.shape[:-1], -1).contiguous())


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.weight)


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = Norm(), Attention()
        self.post_attention_layernorm, self.mlp = Norm(), Mlp()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(torch.nn.Module):
    """The layers and a final norm; with ``checkpointing`` each layer under selective
    activation checkpointing (torchtitan's op-level policy: matmuls and attention saved,
    the rest recomputed)."""

    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = Norm()
        self.checkpointing = checkpointing
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.1 * torch.randn_like(p))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        from commfuse_compile.tools.training.checkpointing import (
            save_matmuls_and_reduce_scatters,
        )

        for layer in self.layers:
            if self.checkpointing:
                policy = save_matmuls_and_reduce_scatters
                h = checkpoint(layer, h, use_reentrant=False, context_fn=policy)
            else:
                h = layer(h)
        return self.norm(h)


def tensor_parallel(model: Decoder, n: int) -> Decoder:
    """transformers' Llama ``base_model_tp_plan``, default layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for i in range(LAYERS):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, init_device_mesh("cpu", (n,)), plan)


class ColumnParallel(torch.nn.Module):
    """Megatron-Core's ColumnParallelLinear without sequence parallelism: the input
    copied into the tensor-parallel region (its gradient all-reduced in place), this
    rank's rows of the weight."""

    def __init__(self, linear: torch.nn.Linear, rank: int, n: int, copy) -> None:
        super().__init__()
        rows = linear.out_features // n
        self.weight = torch.nn.Parameter(linear.weight[rank * rows : (rank + 1) * rows].detach())
        self.copy = copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.copy.apply(x), self.weight)


class RowParallel(torch.nn.Module):
    """Megatron-Core's RowParallelLinear without sequence parallelism: this rank's
    columns of the weight, the output reduced from the region (``dist.all_reduce``)."""

    def __init__(self, linear: torch.nn.Linear, rank: int, n: int, reduce) -> None:
        super().__init__()
        cols = linear.in_features // n
        self.weight = torch.nn.Parameter(linear.weight[:, rank * cols : (rank + 1) * cols].detach())
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce.apply(torch.nn.functional.linear(x, self.weight))


def megatron_parallel(model: Decoder, n: int) -> Decoder:
    """The decoder's linears as Megatron's tensor-parallel layers, in-place all-reduces."""
    copy, reduce = tensor_parallel_regions(in_place_sum)
    rank = dist.get_rank()
    for layer in model.layers:
        for parent, names, parallel, region in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj"), ColumnParallel, copy),
            (layer.self_attn, ("o_proj",), RowParallel, reduce),
            (layer.mlp, ("gate_proj", "up_proj"), ColumnParallel, copy),
            (layer.mlp, ("down_proj",), RowParallel, reduce),
        ):
            for name in names:
                setattr(parent, name, parallel(getattr(parent, name), rank, n, region))
    return model


PROGRAMS = {"dtensor": tensor_parallel, "megatron": megatron_parallel}
