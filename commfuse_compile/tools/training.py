"""Small training runs that feed the pass real forward and backward graphs.

Shared by the training examples (``examples/train_*.py``) and the tests. Three front ends
put collectives next to matmuls, and two more write two of them as Megatron-LM and
DeepSpeed do (``"megatron"``, ``"deepspeed"``: :mod:`.styles`):

* ``"tp"``: a stack of :class:`~commfuse_compile.tools.models.Block` sharded with DTensor's
  ``parallelize_module`` (tensor + sequence parallel over the whole world): activations
  are all-gathered into the column-parallel projections and reduce-scattered out of the
  row-parallel ones. ``vocab`` adds a token embedding as torchtitan shards it, and
  ``compile_per_block`` compiles each block by itself as torchtitan does.
* ``"fsdp"``: every parameter is sharded on dim 0 over a data-parallel group and
  all-gathered in forward by a functional collective with autograd, so the backward
  reduce-scatters its gradient; ``tp > 1`` adds TP+SP on the second dim of a
  ``(dp, tp)`` mesh, with the gather over the ``"dp"`` group.
* ``"ulysses"``: DeepSpeed-Ulysses sequence parallelism over the whole world
  (:class:`~commfuse_compile.tools.models.UlyssesBlock`): activations sharded on the
  sequence, weights whole on every rank; q, k and v are all-to-all'd from sequence shards
  to head shards before attention and the attention output back before ``wo``
  (``all_to_all_single_autograd``). The gradients of the replicated weights are summed
  over the ranks after the backward, outside the compiled region (like DDP).

:func:`train` runs the same steps with the pass (``torch.compile(backend="commfuse")``)
or without it (plain eager), from the same initialization and data.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import report
from ..passes.declines import REASONS
from .float8 import Float8MegatronBlock
from .models import Block, UlyssesBlock, block_plan
from .styles import DeepSpeedUlyssesBlock, MegatronBlock

FRONT_ENDS = ("tp", "fsdp", "ulysses", "megatron", "deepspeed", "float8")
# fronts whose activations are sharded on the sequence over the whole world, and whose
# replicated parameters' gradients are summed over it after the backward
SEQUENCE_SHARDED = ("ulysses", "megatron", "deepspeed", "float8")


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
    # "tp": compile each block by itself (fullgraph=True), the rest eager, as torchtitan
    # does; with ``vocab``, a forward hook clones the embedding's output (a torch 2.13
    # fault, see clone_output) unless ``clone_embedding`` is False
    compile_per_block: bool = False
    clone_embedding: bool = True
    # "tp": the head's output stays sharded on its last dim (no all-gather of the
    # "logits"); the MSE is computed on the shards and averaged over the ranks (one scalar
    # all-reduce), as torchtitan's loss_parallel does for the cross-entropy
    loss_parallel: bool = False


@dataclasses.dataclass
class TrainResult:
    """Per step: the loss (averaged over data-parallel ranks) and the wall time."""

    losses: list[float]
    step_s: list[float]
    sites: list[dict[str, Any]]  # the report's sites recorded during this run (as JSON)


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


class Checkpointed(nn.Module):
    """A block under ``torch.utils.checkpoint`` (non-reentrant, with ``context_fn``): what
    :func:`compile_blocks` compiles when the run checkpoints (torchtitan, too, wraps each
    block for activation checkpointing first and compiles the wrapper)."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], tuple[Any, Any]]) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(
            self.block, x, use_reentrant=False, context_fn=self.context_fn
        )
        return out


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


CHECKPOINT_MODES = ("block", "op")  # the values of --activation-checkpointing

_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def checkpoint_context(mode: bool | str) -> Callable[[], tuple[Any, Any]] | None:
    """The ``context_fn`` of ``torch.utils.checkpoint`` for ``TrainConfig.activation_
    checkpointing`` (None: no checkpointing). True is "block"."""
    if mode is False or mode == "":
        return None
    if mode is True or mode == "block":
        return _save_attention
    if mode == "op":
        return save_matmuls_and_reduce_scatters
    raise ValueError(f"activation_checkpointing must be one of {CHECKPOINT_MODES}, got {mode!r}")


def _selective(saved: set[Any]) -> tuple[Any, Any]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _attention_ops() -> set[Any]:
    return {getattr(torch.ops.aten, name).default for name in _ATTENTION_OPS}


def save_matmuls_and_reduce_scatters() -> tuple[Any, Any]:
    """Selective activation checkpointing as torchtitan's op-level policy does it: save
    the outputs of ``aten.mm`` and of ``reduce_scatter_tensor`` (the row-parallel
    projections' results), and of attention; recompute the rest (norms, activations, and
    the all-gathers into the column-parallel projections).

    Attention must be saved on CPU too (``_scaled_dot_product_flash_attention_for_cpu``,
    which torchtitan's GPU list lacks): recomputing it fails in AOTAutograd with DTensor
    in torch 2.13 whatever the backend (see :func:`_save_attention`). torchtitan also
    saves ``aten.max`` (no op of these blocks) and, to halve the memory, only every second
    mm; this policy saves every mm.
    """
    ops = torch.ops
    return _selective(
        {ops.aten.mm.default, ops._c10d_functional.reduce_scatter_tensor.default} | _attention_ops()
    )


def _save_attention() -> tuple[Any, Any]:
    """Activation checkpointing that keeps the attention output and recomputes the rest.

    Recomputing attention does not compile with DTensor in torch 2.13: SDPA is tagged
    ``nondeterministic_seeded`` (dropout), so the partitioner functionalizes its RNG
    (``functionalize_rng_ops``) and inserts the RNG state among the forward's outputs
    before the saved DeviceMesh, which then lands in the saved-tensor slice
    ("expected all tensors_saved_with_vc_check to be Tensors").
    """
    return _selective(_attention_ops())


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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if cfg.front not in FRONT_ENDS:
        raise ValueError(f"front must be one of {FRONT_ENDS}, got {cfg.front!r}")
    if cfg.front in SEQUENCE_SHARDED:
        return build_sequence_sharded(cfg, rank, world_size)
    tp = world_size if cfg.front == "tp" else cfg.tp
    if world_size % tp:
        raise ValueError(f"tp={tp} does not divide the world size {world_size}")
    dp = world_size // tp
    if (cfg.vocab or cfg.compile_per_block or cfg.loss_parallel) and (cfg.front != "tp" or tp == 1):
        raise ValueError(
            "vocab, compile_per_block and loss_parallel are options of front 'tp' on 2+ ranks"
        )
    if cfg.batch % dp or cfg.seq % tp:
        raise ValueError(f"batch {cfg.batch} / seq {cfg.seq} not divisible by dp={dp} / tp={tp}")
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    model = Transformer(cfg).to(cfg.device, dtype)
    tp_mesh = None
    if tp > 1:
        if dp > 1:
            mesh = init_device_mesh(cfg.device, (dp, tp), mesh_dim_names=("dp", "tp"))
            tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
        else:
            tp_mesh, dp_group = init_device_mesh(cfg.device, (tp,), mesh_dim_names=("tp",)), None
        plan = block_plan()
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
        if cfg.loss_parallel:
            head_plan["head"] = ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            )
        parallelize_module(model, tp_mesh, head_plan)
    else:
        dp_group = dist.group.WORLD if dp > 1 else None
    if cfg.front == "fsdp" and dp_group is not None:
        shard_parameters(model, dp_group)
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
        if tp_mesh is None:
            return x, target
        x_local = x.chunk(tp, dim=1)[tp_rank].contiguous()
        return DTensor.from_local(x_local, tp_mesh, [Shard(1)]), target

    return Setup(MSELoss(model), inputs, dp, dp_group)


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
    if options is not None and cfg.compile_per_block:
        compile_blocks(setup.loss_module.model, options, cfg.clone_embedding)
    elif options is not None:
        step_fn = torch.compile(setup.loss_module, backend="commfuse", options=dict(options))
    opt = torch.optim.AdamW(setup.loss_module.parameters(), lr=cfg.lr)
    result = TrainResult(losses=[], step_s=[], sites=[])
    for step in range(cfg.steps):
        x, target = setup.inputs(step)
        start = time.perf_counter()
        loss = step_fn(x, target)
        (loss / setup.dp).backward()
        setup.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
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


def compare(
    rank: int, world_size: int, cfg: TrainConfig, options: Mapping[str, Any]
) -> tuple[TrainResult, TrainResult]:
    """(with the pass, without it): the same run twice; a ``RankPool`` job."""
    return train(cfg, rank, world_size, options), train(cfg, rank, world_size, None)


def gradients(
    rank: int, world_size: int, cfg: TrainConfig, options: Mapping[str, Any] | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict[str, Any]]]:
    """One forward and backward (``options`` None: plain eager, else compiled with
    ``backend="commfuse"``): the loss, this rank's shard of every parameter's gradient
    (float32), and the sites the pass recorded (a ``RankPool`` job)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None, "a parameter got no gradient"
        return (t.to_local() if isinstance(t, DTensor) else t).detach().float()

    report.reset()
    torch._dynamo.reset()
    setup = build(cfg, rank, world_size)
    step_fn: Callable[..., torch.Tensor] = setup.loss_module
    if options is not None:
        step_fn = torch.compile(setup.loss_module, backend="commfuse", options=dict(options))
    loss = step_fn(*setup.inputs(0))
    loss.backward()
    setup.sync_gradients()
    grads = {k: local(p.grad) for k, p in setup.loss_module.named_parameters()}
    return local(loss), grads, [s.as_json() for s in report.REPORT.sites]


def per_block_backward(
    rank: int, world_size: int, cfg: TrainConfig, backend: str, clone_embedding: bool
) -> str | None:
    """One forward and backward of ``cfg`` (front "tp" with ``vocab``) compiled per block
    with ``backend`` (no options: "aot_eager", "eager", ...): None if it ran, else the
    error as ``Type: message`` (a ``RankPool`` job; shows the torch fault of
    :func:`clone_output`)."""
    torch._dynamo.reset()
    setup = build(cfg, rank, world_size)
    compile_blocks(setup.loss_module.model, None, clone_embedding, backend=backend)
    try:
        setup.loss_module(*setup.inputs(0)).backward()
    except Exception as error:  # noqa: BLE001 - the fault is the result
        return f"{type(error).__name__}: {error}"
    return None


def max_relative_diff(a: Iterable[float], b: Iterable[float]) -> float:
    """Largest ``|a - b| / |b|`` over steps (``b`` the reference)."""
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True)), default=0.0)


@dataclasses.dataclass
class SiteSummary:
    """The sites of one (graph, kind): how many, and why the declined ones were."""

    graph: str
    kind: str
    found: int = 0
    rewritten: int = 0
    declined: int = 0
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # decline code -> n


def summarize(sites: Iterable[Mapping[str, Any]]) -> list[SiteSummary]:
    """Group report sites (``SiteRecord.as_json()``) by graph and kind, in that order."""
    rows: dict[tuple[str, str], SiteSummary] = {}
    for site in sites:
        key = (site["graph"], site["kind"])
        row = rows.setdefault(key, SiteSummary(*key))
        row.found += 1
        if site["decision"] == "rewritten":
            row.rewritten += 1
        else:
            row.declined += 1
            code = site["decline_code"]
            row.reasons[code] = row.reasons.get(code, 0) + 1
    return sorted(rows.values(), key=lambda r: (r.graph != "forward", r.graph, r.kind))


def format_summary(rows: Iterable[SiteSummary]) -> str:
    """The summary as a text table, one line per (graph, kind), reasons indented below."""
    lines = [f"{'graph':<9} {'site':<6} {'found':>5} {'rewritten':>9} {'declined':>8}"]
    for row in rows:
        lines.append(
            f"{row.graph:<9} {row.kind:<6} {row.found:>5} {row.rewritten:>9} {row.declined:>8}"
        )
        lines += [
            f"    {n} x declined {code}: {REASONS[code].template}"
            for code, n in sorted(row.reasons.items())
        ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# torchrun scripts (examples/)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every training example takes."""
    from ..options import SCHEDULES

    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (default 5)")
    parser.add_argument(
        "--compare", action="store_true", help="also train uncompiled; print the loss difference"
    )
    parser.add_argument(
        "--inner",
        default="eager",
        choices=["eager", "inductor"],
        help="compiler after the pass (default eager)",
    )
    parser.add_argument(
        "--schedule", default="ring", choices=SCHEDULES, help="the pass's schedule (default ring)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="block",
        default=None,
        choices=CHECKPOINT_MODES,
        help="checkpoint every block: 'block' (the default when given without a value) "
        "saves only the attention output; 'op' is torchtitan's op-level policy (saves "
        "every mm, reduce-scatter and attention output)",
    )
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--debug-dir", default=None, help="write commfuse's debug dump here")


def ulysses_example(front: str, description: str) -> None:
    """The Ulysses examples' ``main`` (``front`` "ulysses" or "deepspeed"): the common
    options and ``--gqa``/``--fused-qkv``; the whole batch on every rank, 32 tokens per
    rank (the sequence is sharded)."""
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    parser.add_argument("--gqa", type=int, default=0, help="k/v heads (default: all 8 heads)")
    parser.add_argument("--fused-qkv", action="store_true", help="q, k and v as one linear")
    args = parser.parse_args()
    device = init_torchrun()
    seq = 32 * dist.get_world_size()
    extra = {"gqa_kv_heads": args.gqa, "fused_qkv": args.fused_qkv}
    run_and_print(example_config(args, front, 1, 4, seq, device, **extra), args)
    leave_torchrun()


def example_config(
    args: argparse.Namespace,
    front: str,
    tp: int,
    batch: int,
    seq: int,
    device: str,
    **extra: Any,
) -> TrainConfig:
    """The examples' model (128 wide, 8 heads, SwiGLU 384) with the command line's options
    (``extra``: more ``TrainConfig`` fields)."""
    return TrainConfig(
        front=front,
        tp=tp,
        blocks=args.blocks,
        dim=128,
        heads=8,
        hidden=384,
        batch=batch,
        seq=seq,
        steps=args.steps,
        activation_checkpointing=args.activation_checkpointing or False,
        device=device,
        **extra,
    )


def init_torchrun() -> str:
    """Initialize the default group from torchrun's environment: NCCL on CUDA if there is
    one, else gloo on CPU. Returns the device type."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return device


def leave_torchrun() -> None:
    """Leave the group together: a rank that tears its connections down while a peer
    still closes its own can abort that peer at exit (seen once in 7 two-rank runs)."""
    dist.barrier()
    dist.destroy_process_group()


def run_and_print(cfg: TrainConfig, args: argparse.Namespace) -> None:
    """Train with the pass, then the same compile with ``schedule="off"`` (what the pass
    buys: the speed line compares the two), and with ``--compare`` plain eager too (the
    losses must agree); rank 0 prints each step, the sites and the comparisons."""
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def show(step: int, loss: float, seconds: float) -> None:
        if rank == 0:
            print(f"step {step:>3}  loss {loss:.6f}  {seconds * 1e3:8.1f} ms", flush=True)

    options = {"schedule": args.schedule, "inner": args.inner, "debug_dir": args.debug_dir}
    if rank == 0:
        print(f"with commfuse ({options}), {world_size} ranks:\n{cfg}", flush=True)
    fused = train(cfg, rank, world_size, options, on_step=show)
    if rank == 0:
        print("\nsites (rank 0):\n" + format_summary(summarize(fused.sites)), flush=True)
        print("\nthe same compile with schedule='off' (every collective kept):", flush=True)
    off = train(cfg, rank, world_size, {**options, "schedule": "off", "debug_dir": None}, show)
    if rank == 0:
        print("\n" + speed_line(fused, off), flush=True)
    if args.compare:
        if rank == 0:
            print("\nwithout the pass (plain eager):", flush=True)
        eager = train(cfg, rank, world_size, None, on_step=show)
        if rank == 0:
            diff = max_relative_diff(fused.losses, eager.losses)
            print(f"\nlargest relative loss difference over {cfg.steps} steps: {diff:.3e}")


def speed_line(fused: TrainResult, off: TrainResult) -> str:
    """The median step after the first (which compiles), with the pass and without, and
    the schedules the rewritten sites ran. With one step there is no step after the
    first: the line says so and gives that step's time, compile included."""
    ran = sorted({s["schedule"] for s in fused.sites if s["decision"] == "rewritten"})
    sites = f"sites ran: {', '.join(ran) or 'none rewritten'}"
    if min(len(fused.step_s), len(off.step_s)) < 2:
        with_pass, without = (sum(r.step_s) for r in (fused, off))
        return (
            f"no step after the first (which compiles), so no speed comparison: "
            f"{with_pass * 1e3:.1f} ms with the pass ({sites}), {without * 1e3:.1f} ms with "
            "schedule='off', compile included (run 2 or more --steps to compare)"
        )
    with_pass, without = (statistics.median(r.step_s[1:]) for r in (fused, off))
    return (
        f"median step after the first: {with_pass * 1e3:.1f} ms with the pass "
        f"({sites}), {without * 1e3:.1f} ms with "
        f"schedule='off': {without / with_pass:.2f}x"
    )
