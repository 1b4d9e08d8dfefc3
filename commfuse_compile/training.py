"""Small training runs that feed the pass real forward and backward graphs.

Shared by ``examples/train_tp_transformer.py``, ``examples/train_fsdp_style.py`` and
``tests/test_training.py``. Two front ends put collectives next to matmuls:

* ``"tp"``: a stack of :class:`~commfuse_compile.models.Block` sharded with DTensor's
  ``parallelize_module`` (tensor + sequence parallel over the whole world): activations
  are all-gathered into the column-parallel projections and reduce-scattered out of the
  row-parallel ones.
* ``"fsdp"``: every parameter is sharded on dim 0 over a data-parallel group and
  all-gathered in forward by a functional collective with autograd, so the backward
  reduce-scatters its gradient; ``tp > 1`` adds TP+SP on the second dim of a
  ``(dp, tp)`` mesh, with the gather over the ``"dp"`` group.

:func:`train` runs the same steps with the pass (``torch.compile(backend="commfuse")``)
or without it (plain eager), from the same initialization and data.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import report
from .models import Block, block_plan

FRONT_ENDS = ("tp", "fsdp")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run; sizes are global (batch over dp ranks, sequence over tp ranks)."""

    front: str = "tp"  # "tp" or "fsdp"
    blocks: int = 2
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    batch: int = 2
    seq: int = 16
    steps: int = 3
    lr: float = 1e-2
    seed: int = 0
    tp: int = 1  # fsdp only: size of the "tp" mesh dim (1: pure sharded data parallel)
    activation_checkpointing: bool = False
    device: str = "cpu"


@dataclasses.dataclass
class TrainResult:
    """Per step: the loss averaged over data-parallel ranks, and the wall time."""

    losses: list[float]
    step_s: list[float]
    sites: list[dict[str, Any]]  # the report's sites recorded during this run (as JSON)


class Transformer(nn.Module):
    """``blocks`` Llama-style blocks, a final RMSNorm and a linear head (no embedding)."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.hidden) for _ in range(cfg.blocks)
        )
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.activation_checkpointing = cfg.activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.activation_checkpointing:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.norm(x))


class MSELoss(nn.Module):
    """The compiled unit: model forward and the MSE to a target, in one graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), target)


class GatherShard(nn.Module):
    """Parametrization: the module stores this rank's dim-0 shard of a parameter; reading
    the parameter all-gathers it (so the backward reduce-scatters the gradient).

    With ``tp_placements``, the gathered tensor is this rank's TP shard of a DTensor
    parameter and is wrapped back into that DTensor.
    """

    def __init__(self, group: dist.ProcessGroup, tp: tuple[Any, tuple[Any, ...]] | None) -> None:
        super().__init__()
        self.group = group
        self.tp = tp  # (tp mesh, placements) of the original DTensor parameter, if any

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        full = all_gather_single_autograd(shard, 0, self.group)
        if self.tp is None:
            return full
        from torch.distributed.tensor import DTensor

        mesh, placements = self.tp
        return DTensor.from_local(full, mesh, placements, run_check=False)

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        local = value.to_local() if hasattr(value, "to_local") else value
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if local.shape[0] % size:
            raise ValueError(f"dim 0 of {tuple(local.shape)} is not divisible by {size}")
        return local.detach().chunk(size, dim=0)[rank].clone()


def shard_parameters(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Shard every parameter of ``model`` on dim 0 over ``group`` (FSDP-style, in graph)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import parametrize

    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            tp = (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None
            parametrize.register_parametrization(module, name, GatherShard(group, tp), unsafe=True)


@dataclasses.dataclass
class Setup:
    """What :func:`build` makes for one rank."""

    loss_module: MSELoss
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> (x, target)
    dp: int  # data-parallel ranks (1 for "tp")
    dp_group: dist.ProcessGroup | None  # None when dp == 1


def build(cfg: TrainConfig, rank: int, world_size: int) -> Setup:
    """The (parallelized) loss module and this rank's inputs.

    Initialization and data depend only on ``cfg.seed`` (and the step), never on the rank:
    every rank builds the global model and batch, then keeps its own part.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if cfg.front not in FRONT_ENDS:
        raise ValueError(f"front must be one of {FRONT_ENDS}, got {cfg.front!r}")
    tp = world_size if cfg.front == "tp" else cfg.tp
    if world_size % tp:
        raise ValueError(f"tp={tp} does not divide the world size {world_size}")
    dp = world_size // tp
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg).to(cfg.device)
    tp_mesh = None
    if tp > 1:
        if dp > 1:
            mesh = init_device_mesh(cfg.device, (dp, tp), mesh_dim_names=("dp", "tp"))
            tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
        else:
            tp_mesh, dp_group = init_device_mesh(cfg.device, (tp,), mesh_dim_names=("tp",)), None
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, block_plan())
        head_plan = {
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        parallelize_module(model, tp_mesh, head_plan)
    else:
        dp_group = dist.group.WORLD if dp > 1 else None
    if cfg.front == "fsdp" and dp_group is not None:
        shard_parameters(model, dp_group)
    dp_rank, tp_rank = divmod(rank, tp)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
        x, target = torch.randn(2, cfg.batch, cfg.seq, cfg.dim, generator=gen).to(cfg.device)
        x, target = x.chunk(dp)[dp_rank], target.chunk(dp)[dp_rank]
        if tp_mesh is None:
            return x, target
        x_local = x.chunk(tp, dim=1)[tp_rank].contiguous()
        return DTensor.from_local(x_local, tp_mesh, [Shard(1)]), target

    return Setup(MSELoss(model), inputs, dp, dp_group)


def train(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    options: Mapping[str, Any] | None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> TrainResult:
    """``cfg.steps`` AdamW steps; ``options`` None: plain eager (no pass), else the
    ``torch.compile(backend="commfuse")`` options. ``on_step(step, loss, seconds)``."""
    report.reset()
    torch._dynamo.reset()  # a fresh compile per run: no cached graph, no recompile limit
    setup = build(cfg, rank, world_size)
    step_fn: Callable[..., torch.Tensor] = setup.loss_module
    if options is not None:
        step_fn = torch.compile(setup.loss_module, backend="commfuse", options=dict(options))
    opt = torch.optim.AdamW(setup.loss_module.parameters(), lr=cfg.lr)
    result = TrainResult(losses=[], step_s=[], sites=[])
    for step in range(cfg.steps):
        x, target = setup.inputs(step)
        start = time.perf_counter()
        loss = step_fn(x, target)
        (loss / setup.dp).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        value = loss.detach().clone()
        if setup.dp_group is not None:
            dist.all_reduce(value, group=setup.dp_group)
            value /= setup.dp
        result.losses.append(value.item())
        result.step_s.append(seconds)
        if on_step is not None:
            on_step(step, result.losses[-1], seconds)
    result.sites = [s.as_json() for s in report.REPORT.sites]
    return result

