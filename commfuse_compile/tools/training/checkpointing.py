"""Activation checkpointing of the training front ends' blocks: the ``context_fn``
policies of ``torch.utils.checkpoint`` for ``TrainConfig.activation_checkpointing``, and
the wrapper that checkpoints one block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

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


class Checkpointed(nn.Module):
    """A block under ``torch.utils.checkpoint`` (non-reentrant, with ``context_fn``): what
    :func:`.fronts.compile_blocks` compiles when the run checkpoints (torchtitan, too, wraps each
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
