"""Mixture-of-Experts layers whose experts are tensor parallel too (expert tensor
parallelism, ETP), written the way torchtitan and Megatron-Core write them (our own code,
from their public source), so that the pass sees the graphs that code gives.

The ranks form a 2-D mesh ``[ep, tp]``: rank ``(i, t)`` holds experts ``i * E_local`` to
``(i + 1) * E_local - 1`` (the expert-parallel group: the ranks with one ``t``), and of
each of them the columns ``t`` of ``w1``/``w3`` and the rows ``t`` of ``w2`` (the
tensor-parallel group: the ranks with one ``i``). The tokens come sequence parallel: each
rank holds ``S`` of its tensor-parallel group's ``S * tp`` tokens. ``ep = 1`` is
tensor-parallel experts alone.

* :class:`TitanETPBlock` (torchtitan 0.2's ``models/moe`` with ``ExpertTensorParallel``,
  ``distributed/expert_parallel.py``; ``TensorParallel`` for ``GroupedExperts`` at
  ``ep = 1``): the MoE input is gathered over the tensor-parallel group at the module's
  boundary (``PrepareModuleInputOutput``: ``Shard -> Replicate``, a DTensor
  redistribution), so the router and the token order are the same on every rank of the
  group; the routed tokens go through ``DTensor.from_local(Replicate).to_local(
  grad_placements=Partial)`` (their gradient is all-reduced over the group); with
  ``ep > 1`` the token counts are exchanged over the expert-parallel group and the tokens
  dispatched by an uneven ``all_to_all_single_autograd``; ``_permute`` pads each local
  expert's tokens to a multiple of ``TOKEN_GROUP_ALIGN_SIZE_M`` (a zero row appended, the
  padding slots' index ``-1`` pointing at it: ``generate_permute_indices``); SwiGLU
  ``_grouped_mm`` experts in bfloat16 on this rank's shards; ``_unpermute`` (the zero row
  dropped); the combine; the scores' weighted sum back to the tokens (``scatter_add``);
  the output, partial over the group, reduce-scattered back to the sequence
  (``Partial -> Shard``).
* :class:`MegatronETPBlock` (Megatron-Core's ``MoELayer`` with the all-to-all token
  dispatcher, ``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity``,
  and ``expert_tensor_parallel_size = tp``): the router on this rank's own tokens, a
  capacity per expert (tokens over it dropped, the slots under it padded), the slots
  ``[E, C, D]`` dispatched over the expert-parallel group (equal splits, DeepSpeed's and
  Megatron's ``_AllToAll``), all-gathered over the tensor-parallel group
  (``gather_from_sequence_parallel_region``), sorted by local expert (``view``,
  ``transpose``, ``contiguous``: the drop-and-pad layout), the experts (``SequentialMLP``'s
  per-expert linears as one batched ``bmm``, or ``TEGroupedMLP``'s grouped GEMM as
  ``_grouped_mm`` with the experts' offsets), unsorted, reduce-scattered over the
  tensor-parallel group (``reduce_scatter_to_sequence_parallel_region``), sent back and
  weighted into the tokens (``scatter_add``).

Both are residual (``x + moe(norm(x))``); the norms and the router are replicated. Their
gradients are summed where their inputs differ: the norm's over every rank, torchtitan's
router's (which sees the group's tokens, the same on each of its ranks) over the
expert-parallel group (:meth:`sync`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .moe import (
    AllToAll,
    MoEModel,
    MoEShape,
    TokenChoiceTopKRouter,
    grouped_swiglu,
    sync_replicated,
    token_dispatch,
)
from .styles import GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion

# torchtitan's ``TOKEN_GROUP_ALIGN_SIZE_M`` (``models/moe/utils.py``): bfloat16's 16 bytes
TOKEN_GROUP_ALIGN_SIZE_M = 8


def expert_shards(
    experts: int, rows: int, cols: int, ep: tuple[int, int], tp: tuple[int, int], dim: int
) -> nn.Parameter:
    """This rank's shard of ``experts`` weights ``[rows, cols]``, drawn from one generator
    on every rank: its expert-parallel rank's experts (``ep`` = (rank, size)), of each
    the tensor-parallel rank's block along ``dim`` (1: rows, 2: columns)."""
    full = torch.randn(experts, rows, cols) / math.sqrt(rows if dim == 2 else cols)
    local = experts // ep[1]
    mine = full[ep[0] * local : (ep[0] + 1) * local]
    return nn.Parameter(mine.chunk(tp[1], dim=dim)[tp[0]].clone())


# ----------------------------------------------------------------------------------------
# torchtitan


def generate_permute_indices(
    tokens_per_expert_group: torch.Tensor, experts_per_rank: int, ranks: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's ``generate_permute_indices`` (``models/moe/kernels.py``), in torch ops:
    the rows received from each rank for each local expert (rank-major) reordered
    expert-major, each expert's rows padded to a multiple of ``TOKEN_GROUP_ALIGN_SIZE_M``
    (at least that many), ``max_len`` slots in all. Returns (the index of the row each slot
    takes, -1 for a padding slot; each expert's padded count; their cumulative sums)."""
    align = TOKEN_GROUP_ALIGN_SIZE_M
    counts = tokens_per_expert_group
    start_index = torch.cumsum(counts, 0) - counts
    per_expert = counts.view(ranks, experts_per_rank).sum(0)
    m_sizes = ((per_expert.clamp_min(align) + align - 1) // align * align).to(torch.int32)
    m_offsets = torch.cumsum(m_sizes, 0, dtype=torch.int32)
    write_offsets = m_offsets - m_sizes
    slot = torch.arange(max_len, device=counts.device)
    # each slot's expert, and its place among that expert's slots
    expert = torch.bucketize(slot, m_offsets, right=True).clamp(max=experts_per_rank - 1)
    place = slot - write_offsets[expert]
    # the (rank, expert) segments of that expert, in rank order: which one holds the place
    segments = counts.view(ranks, experts_per_rank).t()  # [expert, rank]
    ends = torch.cumsum(segments, 1)[expert]  # [slot, rank]
    source = (ends <= place.unsqueeze(1)).sum(1)  # the rank whose segment holds it
    first = (ends - segments[expert]).gather(1, source.clamp(max=ranks - 1).unsqueeze(1))
    index = start_index.view(ranks, experts_per_rank).t()[expert]  # [slot, rank]
    row = index.gather(1, source.clamp(max=ranks - 1).unsqueeze(1)).squeeze(1)
    row = row + place - first.squeeze(1)
    real = (source < ranks) & (slot < m_offsets[-1])
    return torch.where(real, row, -1).to(torch.int32), m_sizes, m_offsets


def _permute(
    x: torch.Tensor, counts: torch.Tensor, ranks: int, experts_per_rank: int
) -> tuple[torch.Size, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's ``_permute``: a zero row appended, the rows taken expert-major with
    each expert's padded to the alignment (padding slots take the zero row)."""
    align = TOKEN_GROUP_ALIGN_SIZE_M
    padded_max_len = (x.shape[0] + experts_per_rank * align + align - 1) // align * align
    with torch.no_grad():
        permuted_indices, m_sizes, _ = generate_permute_indices(
            counts, experts_per_rank, ranks, padded_max_len
        )
    x = torch.vstack((x, x.new_zeros(x.shape[-1])))
    input_shape = x.shape
    return input_shape, x[permuted_indices, :], permuted_indices, m_sizes


def _unpermute(out: torch.Tensor, input_shape: torch.Size, permuted: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``_unpermute``: the rows put back, the zero row dropped."""
    out_unpermuted = out.new_empty(input_shape)
    out_unpermuted[permuted, :] = out
    return out_unpermuted[:-1]


def redistributed(x: torch.Tensor, mesh: DeviceMesh, src: Any, dst: Any) -> torch.Tensor:
    """This rank's part of ``x`` as placement ``src`` redistributed to ``dst``."""
    return DTensor.from_local(x, mesh, (src,)).redistribute(mesh, (dst,)).to_local()


class TitanETPBlock(nn.Module):
    """``x + moe(norm(x))`` on this rank's tokens ``[S, D]``, torchtitan style."""

    def __init__(self, dim: int, hidden: int, experts_per_rank: int, mesh: DeviceMesh, k: int = 2):
        super().__init__()
        self.mesh, self.k, self.local = mesh, k, experts_per_rank
        ep, tp = ((mesh.get_local_rank(d), mesh.size(d)) for d in (0, 1))
        self.experts = ep[1] * experts_per_rank
        self.norm = nn.RMSNorm(dim)
        self.router = TokenChoiceTopKRouter(dim, self.experts, k, "softmax")
        # GroupedExperts: w1, w3 [E, hidden, dim] (column-wise: Shard(1)), w2 [E, dim,
        # hidden] (row-wise: Shard(2)), and Shard(0) over the expert-parallel group
        self.w1 = expert_shards(self.experts, hidden, dim, ep, tp, 1)
        self.w2 = expert_shards(self.experts, dim, hidden, ep, tp, 2)
        self.w3 = expert_shards(self.experts, hidden, dim, ep, tp, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tp_mesh = self.mesh["tp"]
        # PrepareModuleInputOutput: Shard -> Replicate (use_local_input)
        tokens = redistributed(self.norm(x), tp_mesh, Shard(0), Replicate())
        s, d = tokens.shape
        top_scores, selected, _ = self.router(tokens)
        # TokenReorderer
        counts = torch.histc(
            selected.view(-1).float(), bins=self.experts, min=0, max=self.experts
        ).to(torch.int64)
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        routed = tokens[order // self.k]
        routed = self._experts(routed, counts)
        routed = (routed.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        token_of = (order // self.k).reshape(-1, 1).expand(-1, d)
        out = torch.zeros_like(tokens).scatter_add(0, token_of, routed)
        # PrepareModuleInputOutput: Partial -> Shard
        return x + redistributed(out, tp_mesh, Partial(), Shard(0)), x.new_zeros(())

    def _experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``GroupedExperts`` as ``ExpertTensorParallel`` (``TensorParallel`` at ep = 1)
        runs it: dispatch, ``_permute``, the grouped experts on this rank's shards,
        ``_unpermute``, combine."""
        tp_mesh, ep = self.mesh["tp"], self.mesh.size(0)
        routed = DTensor.from_local(routed, tp_mesh, (Replicate(),))
        routed = routed.to_local(grad_placements=(Partial(),))
        if ep == 1:  # indices_padding_wrapper
            shape, routed, permuted, padded = _permute(routed, counts, 1, self.local)
            out = grouped_swiglu(routed, self.w1, self.w2, self.w3, padded)
            return _unpermute(out, shape, permuted)
        received, counts_group, combine = token_dispatch(
            routed, counts, self.mesh["ep"].get_group()
        )
        shape, received, permuted, padded = _permute(received, counts_group, ep, self.local)
        out = grouped_swiglu(received, self.w1, self.w2, self.w3, padded)
        return combine(_unpermute(out, shape, permuted))


# ----------------------------------------------------------------------------------------
# Megatron-Core


def capacity_routing(
    logits: torch.Tensor, k: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core's top-k router with ``moe_expert_capacity_factor``, drop policy
    ``probs``, padded to capacity: softmax scores, each token's top ``k``, of each
    expert's tokens the ``capacity`` with the highest scores kept. Returns (per expert
    the ``capacity`` tokens of its slots, kept ones first, ``[E, C]``; the weight of
    each slot, 0 on a padding slot, ``[E, C]``)."""
    scores = logits.float().softmax(dim=-1)
    top, chosen = torch.topk(scores, k=k, dim=1)
    probs = torch.zeros_like(scores).scatter(1, chosen, top)  # [S, E]
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)
    # apply_token_drop: per expert, the capacity highest-scoring of its tokens
    kept = torch.topk(probs, k=capacity, dim=0).indices  # [C, E]
    capacity_mask = torch.zeros_like(routing_map).scatter(0, kept, True)
    routing_map = routing_map & capacity_mask
    probs = probs * routing_map
    # permute(drop_and_pad=True): each expert's slots, its kept tokens first
    slots = routing_map.t().int().argsort(dim=-1, descending=True, stable=True)[:, :capacity]
    return slots, probs.t().gather(1, slots)


class MegatronETPBlock(nn.Module):
    """``x + moe(norm(x))`` on this rank's tokens ``[S, D]``, Megatron-Core style;
    ``grouped``: the experts as ``TEGroupedMLP`` (one ``_grouped_mm`` per linear over the
    slots of every local expert, bfloat16), else as ``SequentialMLP`` (each expert's
    linears; the experts hold equal slots, so one batched ``bmm`` for all)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts_per_rank: int,
        mesh: DeviceMesh,
        k: int = 2,
        capacity_factor: float = 1.0,
        grouped: bool = False,
    ):
        super().__init__()
        self.mesh, self.k, self.local, self.grouped = mesh, k, experts_per_rank, grouped
        self.capacity_factor = capacity_factor
        ep, tp = ((mesh.get_local_rank(d), mesh.size(d)) for d in (0, 1))
        self.experts = ep[1] * experts_per_rank
        self.norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, self.experts, bias=False)
        # linear_fc1 (column-parallel, gated: w1 and w3) and linear_fc2 (row-parallel)
        # of each local expert, as [E_local, in, out]
        self.w1 = expert_shards(self.experts, dim, hidden, ep, tp, 2)
        self.w3 = expert_shards(self.experts, dim, hidden, ep, tp, 2)
        self.w2 = expert_shards(self.experts, hidden, dim, ep, tp, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.norm(x)
        s, d = tokens.shape
        # get_capacity(num_tokens * topk, num_experts, capacity_factor)
        capacity = math.ceil(s * self.k / self.experts * self.capacity_factor)
        slots, weights = capacity_routing(self.gate(tokens), self.k, capacity)
        dispatched = tokens.index_select(0, slots.reshape(-1))  # [E * C, D]
        ep_group, tp_group = self.mesh["ep"].get_group(), self.mesh["tp"].get_group()
        ep, tp = self.mesh.size(0), self.mesh.size(1)
        if ep > 1:  # token_dispatch: [E, C, D], block j for rank j's experts
            dispatched = AllToAll.apply(ep_group, dispatched)
        # dispatch_postprocess: gather over the expert's tensor-parallel ranks, then sort
        # by local expert: [tp * ep, E_local, C, D] -> [E_local, tp * ep * C, D]
        gathered = GatherFromSequenceParallelRegion.apply(dispatched, tp_group)
        expert_in = gathered.view(tp * ep, self.local, capacity, d).transpose(0, 1).contiguous()
        expert_out = self._experts(expert_in.view(self.local, -1, d))
        # combine_preprocess: unsort, reduce-scatter over the tensor-parallel ranks
        expert_out = expert_out.view(self.local, tp * ep, capacity, d).transpose(0, 1)
        expert_out = expert_out.contiguous().view(-1, d)
        combined = ReduceScatterToSequenceParallelRegion.apply(expert_out, tp_group)
        if ep > 1:  # token_combine
            combined = AllToAll.apply(ep_group, combined)
        # unpermute: each slot's output, by its weight, added into its token
        weighted = combined * weights.reshape(-1, 1).to(combined.dtype)
        index = slots.reshape(-1, 1).expand(-1, d)
        out = torch.zeros_like(tokens).scatter_add(0, index, weighted)
        return x + out, x.new_zeros(())

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """``[E_local, M, D]`` slots through each local expert's gated MLP (this rank's
        shard of its hidden units: a partial sum of its output)."""
        if not self.grouped:
            h = F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3)
            return torch.bmm(h, self.w2)
        m = x.shape[1]
        # every expert's tokens_per_expert is m (drop-and-pad): its rows end at (e + 1) m
        # (a cumsum of the counts: Inductor 2.13 rewrites cumsum(full(...)) into an
        # int64 arange, which _grouped_mm refuses)
        offs = torch.arange(1, self.local + 1, dtype=torch.int32, device=x.device) * m
        flat = x.reshape(-1, x.shape[-1]).bfloat16()
        w1, w2, w3 = (w.bfloat16() for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch._grouped_mm(flat, w1, offs=offs)) * torch._grouped_mm(flat, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs).type_as(x).view(x.shape)


# ----------------------------------------------------------------------------------------
# the model and its training (``moe_loop``)

ETP_MOES = ("titan", "megatron", "megatron-grouped")


@functools.cache
def mesh_of(ep: int, tp: int) -> DeviceMesh:
    """The ``[ep, tp]`` mesh of every rank (made once per process: its groups stay)."""
    return init_device_mesh("cpu", (ep, tp), mesh_dim_names=("ep", "tp"))


@dataclasses.dataclass(frozen=True)
class ETPConfig(MoEShape):
    """Blocks of ``moe`` kind (``titan``, ``megatron``, ``megatron-grouped``: the experts
    as ``TEGroupedMLP``) whose experts are tensor parallel over ``tp`` ranks and expert
    parallel over ``ep``: each rank's ``tokens`` its share of its tensor-parallel group's
    sequence, each expert's ``hidden`` units over the ``tp`` ranks."""

    moe: str = "titan"
    ep: int = 2
    tp: int = 2

    def __post_init__(self) -> None:
        if self.moe not in ETP_MOES:
            raise ValueError(f"moe {self.moe!r}: one of {ETP_MOES}")
        if self.dim % 16 or self.hidden % (16 * self.tp):
            # _grouped_mm on CPU wants 16-byte-aligned strides (bf16: 8 elements)
            raise ValueError(f"dim={self.dim}, hidden/tp={self.hidden}/{self.tp}: multiples of 16")

    def build(self) -> MoEModel:
        """The model, from one seed on every rank, on the ``[ep, tp]`` mesh."""
        if dist.get_world_size() != self.ep * self.tp:
            raise ValueError(f"{dist.get_world_size()} ranks for ep={self.ep} x tp={self.tp}")
        torch.manual_seed(0)
        mesh = mesh_of(self.ep, self.tp)
        args = (self.dim, self.hidden, self.experts_per_rank, mesh)
        blocks: list[nn.Module] = [
            TitanETPBlock(*args)
            if self.moe == "titan"
            else MegatronETPBlock(*args, grouped=self.moe == "megatron-grouped")
            for _ in range(self.blocks)
        ]
        return MoEModel(self.dim, blocks, aux_weight=0.0)

    def sync(self, model: nn.Module) -> None:
        """Every rank's part of the replicated gradients summed; torchtitan's router sees
        its tensor-parallel group's tokens (the same on each of its ranks): over the
        expert-parallel group only."""
        over = {"router": mesh_of(self.ep, self.tp)["ep"].get_group()}
        sync_replicated(model, over if self.moe == "titan" else None)

    def router(self, model: nn.Module) -> nn.Module | None:
        return None
