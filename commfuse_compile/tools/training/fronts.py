"""The training front ends: one rank's model, loss and inputs per front end (:func:`build`).

Three front ends put collectives next to matmuls, and more write them as Megatron-LM,
DeepSpeed and torchtitan do (``"megatron"``, ``"deepspeed"``, ``"megatron_core"``: the
block with Megatron-Core's linears and their hand-overlapped backward, ``"simple_fsdp"``:
torchtitan's SimpleFSDP with bfloat16 parameters and float32 gradient reduction;
:mod:`.styles`; with ``"float8"``, Megatron's block with float8 linears: :mod:`.float8`):

* ``"tp"``: a stack of :class:`~commfuse_compile.tools.training.models.Block` sharded with DTensor's
  ``parallelize_module`` (tensor + sequence parallel over the whole world): activations
  are all-gathered into the column-parallel projections and reduce-scattered out of the
  row-parallel ones. ``vocab`` adds a token embedding as torchtitan shards it, and
  ``compile_per_block`` compiles each block by itself as torchtitan does.
* ``"fsdp"``: every parameter is sharded on dim 0 over a data-parallel group and
  all-gathered in forward by a functional collective with autograd, so the backward
  reduce-scatters its gradient; ``tp > 1`` adds TP+SP on the second dim of a
  ``(dp, tp)`` mesh, with the gather over the ``"dp"`` group.
* ``"ulysses"``: DeepSpeed-Ulysses sequence parallelism over the whole world
  (:class:`~commfuse_compile.tools.training.models.UlyssesBlock`): activations sharded on the
  sequence, weights whole on every rank; q, k and v are all-to-all'd from sequence shards
  to head shards before attention and the attention output back before ``wo``
  (``all_to_all_single_autograd``). The gradients of the replicated weights are summed
  over the ranks after the backward, outside the compiled region (like DDP).

Initialization and data depend only on the seed (and the step), never on the rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .checkpointing import Checkpointed, checkpoint_context
from .float8 import Float8MegatronBlock
from .models import Block, UlyssesBlock, block_plan
from .styles import DeepSpeedUlyssesBlock, MegatronBlock, MegatronCoreBlock, simple_fsdp

FRONT_ENDS = (
    "tp",
    "fsdp",
    "ulysses",
    "megatron",
    "deepspeed",
    "float8",
    "megatron_core",
    "simple_fsdp",
)
# fronts whose activations are sharded on the sequence over the whole world, and whose
# replicated parameters' gradients are summed over it after the backward
SEQUENCE_SHARDED = ("ulysses", "megatron", "deepspeed", "float8", "megatron_core")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run; sizes are global (batch over dp ranks, sequence over tp ranks,
    or over every rank with "ulysses")."""

    # "tp", "fsdp", "ulysses"; "megatron" and "deepspeed": the same parallelisms written
    # as those frameworks write them (in-place collectives, sequence-first; tools/styles)
    front: str = "tp"
    blocks: int = 2
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    batch: int = 2
    seq: int = 16
    steps: int = 3
    lr: float = 1e-2
    seed: int = 0
    tp: int = 1  # fsdp: size of the "tp" mesh dim (1: none); front "tp": the whole world
    # False: none; True or "block": each block checkpointed, saving only the attention
    # output; "op": torchtitan's op-level policy (saves every mm, reduce-scatter and the
    # attention op, recomputes the rest); see CHECKPOINT_MODES
    activation_checkpointing: bool | str = False
    device: str = "cpu"
    norm: str = "rms"  # "rms" or "layer" (LayerNorm: weight and bias)
    bias: bool = False  # biases on q/k/v, w1, w3
    dtype: str = "float32"  # of parameters and activations ("bfloat16": half precision)
    gqa_kv_heads: int = 0  # "ulysses", "deepspeed": k/v heads (0: ``heads``; fewer: GQA)
    fused_qkv: bool = False  # "ulysses", "deepspeed": q, k, v as one linear, split after
    # "tp": token ids in, an nn.Embedding(vocab, dim) first (0: none, the input is the
    # activations), sharded as torchtitan does (row-parallel, its output the local
    # sequence shard); the blocks then take and return local tensors (torchtitan's plan)
    vocab: int = 0
    # "tp": False gives plain tensor parallelism (DTensor's default Colwise/Rowwise
    # layouts, the input whole on every rank, an all-reduce after each row-parallel
    # linear: Hugging Face's tp_plan); the pass then does the sequence parallelism
    sequence_parallel: bool = True
    # "tp": compile each block by itself (fullgraph=True), the rest eager, as torchtitan
    # does; with ``vocab``, a forward hook clones the embedding's output (a torch 2.13
    # fault, see clone_output) unless ``clone_embedding`` is False
    compile_per_block: bool = False
    clone_embedding: bool = True
    # "tp": the head's output stays sharded on its last dim (no all-gather of the
    # "logits"); the MSE is computed on the shards and averaged over the ranks (one scalar
    # all-reduce), as torchtitan's loss_parallel does for the cross-entropy
    loss_parallel: bool = False
    # "megatron_core": Megatron-Core's DeprecationWarning on rank 0 only in every
    # row-parallel linear's forward (styles.group_if_none)
    rank0_warning: bool = False


class Transformer(nn.Module):
    """``blocks`` transformer blocks, a final RMSNorm and a linear head (no embedding).

    Fronts "ulysses", "megatron", "deepspeed": blocks that communicate over ``group``
    themselves (:class:`UlyssesBlock`, ``styles``' blocks; "ulysses" with None: one rank,
    no communication); the final norm and the head are local. Other fronts:
    :class:`Block` (parallelized afterwards by :func:`build`)."""

    def __init__(self, cfg: TrainConfig, group: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim) if cfg.vocab else None
        self.layers = nn.ModuleList(_block(cfg, group) for _ in range(cfg.blocks))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.context_fn = checkpoint_context(cfg.activation_checkpointing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if self.context_fn is not None and not isinstance(layer, Checkpointed):
                x = checkpoint(layer, x, use_reentrant=False, context_fn=self.context_fn)
            else:
                x = layer(x)
        return self.head(self.norm(x))


def _block(cfg: TrainConfig, group: Any) -> nn.Module:
    if cfg.front == "float8":  # "megatron" with float8 linears (tools/float8)
        return Float8MegatronBlock(cfg.dim, cfg.heads, cfg.hidden, group, cfg.bias)
    if cfg.front == "megatron":
        return MegatronBlock(cfg.dim, cfg.heads, cfg.hidden, group, cfg.bias)
    if cfg.front == "megatron_core":
        return MegatronCoreBlock(cfg.dim, cfg.heads, cfg.hidden, group, cfg.bias, cfg.rank0_warning)
    if cfg.front == "deepspeed":
        return DeepSpeedUlyssesBlock(
            cfg.dim, cfg.heads, cfg.hidden, group, cfg.gqa_kv_heads, cfg.fused_qkv
        )
    if cfg.front == "ulysses":
        return UlyssesBlock(
            cfg.dim,
            cfg.heads,
            cfg.hidden,
            cfg.gqa_kv_heads,
            cfg.fused_qkv,
            cfg.norm,
            cfg.bias,
            group,
        )
    return Block(cfg.dim, cfg.heads, cfg.hidden, cfg.norm, cfg.bias)


def clone_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the module's output, cloned.

    On the embedding of a per-block compile (torch 2.13): the embedding's row-parallel
    output is ``to_local()`` of a DTensor, a view; when that view is the input of a block
    compiled by itself, the block's backward fails in DTensor's redistribute
    (``AttributeError: 'Tensor' object has no attribute '_local_tensor'``) with any AOT
    backend, ``aot_eager`` included. The clone is no view, and the backward runs.
    """
    return output.clone()


def compile_blocks(
    model: nn.Module,
    options: Mapping[str, Any] | None,
    clone_embedding: bool = True,
    backend: str = "commfuse",
) -> None:
    """torchtitan's compile: each block of a :class:`Transformer` by itself
    (``fullgraph=True``), with ``backend`` (and its ``options``); the embedding, final
    norm, head and loss stay eager. With an embedding and ``clone_embedding``, its output
    is cloned (:func:`clone_output`)."""
    assert isinstance(model, Transformer), type(model)
    opts = None if options is None else dict(options)
    for i, layer in enumerate(model.layers):
        block = layer if model.context_fn is None else Checkpointed(layer, model.context_fn)
        compiled = torch.compile(block, backend=backend, options=opts, fullgraph=True)
        model.layers[i] = cast(nn.Module, compiled)
    if model.embed is not None and clone_embedding:
        model.embed.register_forward_hook(clone_output)


class MSELoss(nn.Module):
    """The compiled unit: model forward and the MSE to a target, in one graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        loss = F.mse_loss(self.model(x), target)
        if isinstance(loss, DTensor):  # loss_parallel: Partial(avg), all-reduced here
            loss = loss.full_tensor()
        return loss


class GatherShard(nn.Module):
    """Parametrization: the module stores this rank's dim-0 shard of a parameter; reading
    the parameter all-gathers it (so the backward reduce-scatters the gradient).

    With ``tp`` (mesh, placements), the gathered tensor is this rank's local part of a
    TP-sharded DTensor parameter and is wrapped back into that DTensor.
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


def shard_parameters(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Shard every parameter of ``model`` on dim 0 over ``group`` (FSDP-style, in graph).

    A DTensor parameter (TP) is sharded through its local tensor: the module keeps a plain
    ``nn.Parameter`` with this rank's dim-0 block of it.
    """
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import parametrize

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            tp = None
            local = param.detach()
            if isinstance(param, DTensor):
                tp = (param.device_mesh, tuple(param.placements))
                local = param.to_local().detach()
            if local.shape[0] % size:
                raise ValueError(
                    f"{name}: dim 0 of {tuple(local.shape)} is not divisible by {size}"
                )
            module._parameters[name] = nn.Parameter(local.chunk(size, dim=0)[rank].clone())
            parametrize.register_parametrization(module, name, GatherShard(group, tp), unsafe=True)


@dataclasses.dataclass
class Setup:
    """What :func:`build` makes for one rank."""

    loss_module: MSELoss
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> (x, target)
    dp: int  # ranks whose losses are averaged (1 for "tp"; every rank for "ulysses")
    dp_group: dist.ProcessGroup | None  # None when dp == 1
    # fronts sharded on the sequence: the replicated parameters' gradients are summed over
    # this group after the backward (outside the compiled region, like DDP)
    grad_group: dist.ProcessGroup | None = None

    def sync_gradients(self) -> None:
        """Sum the replicated parameters' gradients over ``grad_group`` (if any); a
        parameter marked ``tensor_model_parallel`` (Megatron's mark) is a shard: kept."""
        if self.grad_group is None:
            return
        grads = [
            p.grad
            for p in self.loss_module.parameters()
            if p.grad is not None and not getattr(p, "tensor_model_parallel", False)
        ]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.grad_group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))


def build(cfg: TrainConfig, rank: int, world_size: int) -> Setup:
    """The (parallelized) loss module and this rank's inputs.

    Initialization and data depend only on ``cfg.seed`` (and the step), never on the rank:
    every rank builds the global model and batch, then keeps its own part.
    """
    if cfg.front not in FRONT_ENDS:
        raise ValueError(f"front must be one of {FRONT_ENDS}, got {cfg.front!r}")
    if cfg.front in SEQUENCE_SHARDED:
        return build_sequence_sharded(cfg, rank, world_size)
    tp, dp = _mesh_sizes(cfg, world_size)
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    model = Transformer(cfg).to(cfg.device, dtype)
    if tp > 1:
        tp_mesh, dp_group = _tensor_parallel(model, cfg, tp, dp)
    else:
        tp_mesh, dp_group = None, dist.group.WORLD if dp > 1 else None
    if cfg.front == "fsdp" and dp_group is not None:
        shard_parameters(model, dp_group)
    inputs = _mesh_inputs(cfg, rank, tp, dp, tp_mesh)
    if cfg.front == "simple_fsdp":
        if tp > 1:
            raise ValueError("front 'simple_fsdp' is data parallel only (tp=1)")
        from torch.distributed.device_mesh import init_device_mesh

        simple_fsdp(model, init_device_mesh(cfg.device, (dp,), mesh_dim_names=("dp",)))
        inputs = _in_param_dtype(inputs)
    return Setup(MSELoss(model), inputs, dp, dp_group)


def _in_param_dtype(
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """SimpleFSDP's inputs: activations in bfloat16 (as a bfloat16 embedding gives them),
    the target as it is (the MSE promotes to float32)."""

    def cast(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = inputs(step)
        return x.to(torch.bfloat16), target

    return cast


def _mesh_sizes(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(tp, dp) of fronts "tp" (tp: the whole world) and "fsdp" (``cfg.tp``), checked
    against the world, the sizes and the options that need front "tp"."""
    tp = world_size if cfg.front == "tp" else cfg.tp
    if world_size % tp:
        raise ValueError(f"tp={tp} does not divide the world size {world_size}")
    dp = world_size // tp
    if (cfg.vocab or cfg.compile_per_block or cfg.loss_parallel) and (cfg.front != "tp" or tp == 1):
        raise ValueError(
            "vocab, compile_per_block and loss_parallel are options of front 'tp' on 2+ ranks"
        )
    if not cfg.sequence_parallel and (cfg.front != "tp" or cfg.vocab or cfg.loss_parallel):
        # (loss_parallel neither: the head's output is whole)
        raise ValueError("sequence_parallel=False (plain TP) is front 'tp', without vocab")
    if cfg.batch % dp or cfg.seq % tp:
        raise ValueError(f"batch {cfg.batch} / seq {cfg.seq} not divisible by dp={dp} / tp={tp}")
    return tp, dp


def _tensor_parallel(
    model: Transformer, cfg: TrainConfig, tp: int, dp: int
) -> tuple[Any, dist.ProcessGroup | None]:
    """TP+SP of ``model`` over the "tp" dim of a ``(dp, tp)`` mesh (a ``(tp,)`` mesh when
    dp is 1): every block by ``block_plan``, the embedding and the head as torchtitan
    shards them. Returns the tp mesh and the data-parallel group (None when dp is 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if dp > 1:
        mesh = init_device_mesh(cfg.device, (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
    else:
        tp_mesh, dp_group = init_device_mesh(cfg.device, (tp,), mesh_dim_names=("tp",)), None
    plan = block_plan(cfg.sequence_parallel)
    if cfg.vocab:  # torchtitan's: the row-parallel outputs local tensors
        for name in ("wo", "w2"):
            plan[name] = RowwiseParallel(output_layouts=Shard(1))
        assert model.embed is not None
        parallelize_module(
            model.embed,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        )
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
    head_plan = {
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if not cfg.sequence_parallel:
        head_plan = {"head": ColwiseParallel(output_layouts=Replicate())}
    if cfg.loss_parallel:
        head_plan["head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    parallelize_module(model, tp_mesh, head_plan)
    return tp_mesh, dp_group


def _mesh_inputs(
    cfg: TrainConfig, rank: int, tp: int, dp: int, tp_mesh: Any
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """step -> (x, target) of this rank: its data-parallel part of the global batch; with
    a tp mesh, x as a DTensor sharded on the sequence (or the whole batch of token ids
    with ``vocab``) and, with ``loss_parallel``, the target's block of the last dim."""
    from torch.distributed.tensor import DTensor, Shard

    dtype = getattr(torch, cfg.dtype)
    dp_rank, tp_rank = divmod(rank, tp)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
        x, target = torch.randn(2, cfg.batch, cfg.seq, cfg.dim, generator=gen).to(cfg.device, dtype)
        x, target = x.chunk(dp)[dp_rank], target.chunk(dp)[dp_rank]
        if cfg.loss_parallel:  # this rank's block of the target's last dim
            assert tp_mesh is not None
            target_local = target.chunk(tp, dim=-1)[tp_rank].contiguous()
            target = DTensor.from_local(target_local, tp_mesh, [Shard(-1)], run_check=False)
        if cfg.vocab:  # every rank the whole batch of token ids (the embedding's input)
            tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
            return tokens.to(cfg.device), target
        if tp_mesh is None or not cfg.sequence_parallel:  # plain TP: x whole on every rank
            return x, target
        x_local = x.chunk(tp, dim=1)[tp_rank].contiguous()
        return DTensor.from_local(x_local, tp_mesh, [Shard(1)]), target

    return inputs


def build_sequence_sharded(cfg: TrainConfig, rank: int, world_size: int) -> Setup:
    """Fronts whose blocks communicate themselves over the whole world: every rank builds
    the global model and batch and keeps its ``seq / n`` tokens (rank r: the r-th block of
    the sequence; ``[b, s/n, d]``, or ``[s/n, b, d]`` for the sequence-first "megatron"
    and "deepspeed"). ``world_size == 1`` ("ulysses" only): no communication (the
    single-process reference)."""
    n = world_size
    kv_heads = cfg.gqa_kv_heads or cfg.heads
    if cfg.seq % n or cfg.heads % n or kv_heads % n:
        raise ValueError(
            f"{n} ranks must divide seq {cfg.seq}, heads {cfg.heads} and k/v heads {kv_heads}"
        )
    group = dist.group.WORLD if n > 1 else None
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    model = Transformer(cfg, group=group).to(cfg.device, dtype)
    sequence_first = cfg.front != "ulysses"

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
        both = torch.randn(2, cfg.batch, cfg.seq, cfg.dim, generator=gen).to(cfg.device, dtype)
        if sequence_first:
            both = both.transpose(1, 2)
        x, target = (t.chunk(n, dim=0 if sequence_first else 1)[rank] for t in both)
        return x.contiguous(), target.contiguous()

    # the mean over this rank's tokens; the global loss is the average over the ranks
    return Setup(MSELoss(model), inputs, n, group, grad_group=group)
