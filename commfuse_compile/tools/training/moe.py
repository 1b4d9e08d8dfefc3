"""Mixture-of-Experts layers with expert parallelism, written the way the frameworks write
them (our own code, from their documented behaviour), so that the pass sees the graphs
MoE code gives: all-to-alls next to batched and grouped expert matmuls.

Expert parallelism over the whole group: rank ``r`` holds experts ``r * E_local`` to
``(r + 1) * E_local - 1`` (``E_local >= 2``); the router and the norms are replicated.
Each rank routes its own tokens (data parallel over the expert-parallel group). As a
trainer does (DeepSpeed's engine, torchtitan's FSDP over the replicated parameters): the
loss of each rank is its tokens' mean, the backward runs on ``loss / n`` (the global mean)
and the replicated parameters' gradients are summed over the group after it
(:func:`sync_replicated`, DDP's all-reduce); each expert's gradient already holds every
rank's tokens (the all-to-all's backward brings them), and its expert-data-parallel group
has one rank: nothing to reduce.

* :class:`CapacityMoEBlock` (GShard, DeepSpeed's ``MOELayer`` with ``top2gating``,
  Tutel): top-2 softmax router with a fixed capacity ``C`` per expert (a token's slot is
  the cumulative sum over the one-hot mask; tokens over capacity are dropped), dispatch
  by ``einsum("sec,sm->ecm")`` to ``[E, C, D]``, DeepSpeed's ``_AllToAll`` (equal splits
  of dim 0: ``dist.all_to_all_single(out, x)`` into ``torch.empty_like``; the backward is
  the same exchange of the gradient), ``[n, E_local, C, D]`` to ``[E_local, n * C, D]``,
  batched experts (``torch.bmm`` with ``w1 [E_local, D, F]``, GELU, ``w2 [E_local, F,
  D]``), back, the combine all-to-all and ``einsum("sec,ecm->sm")`` with the gate
  weights; pre-norm and residual around it. Returns the GShard load-balancing loss too.
* :class:`DroplessMoEBlock` (torchtitan's ``models/moe`` and
  ``distributed/expert_parallel.py``): top-k router (softmax or sigmoid scores,
  ``torch.topk``), ``num_tokens_per_expert`` by ``torch.histc``, tokens sorted by expert
  (stable ``argsort``), the token counts exchanged (``_functional_collectives.
  all_to_all_single``, waited), the splits by ``.view(n, -1).sum(1).tolist()``, the
  dispatch ``all_to_all_single_autograd`` with those uneven, data-dependent splits, the
  local permutation from (source rank, expert) order to expert order, grouped-GEMM
  SwiGLU experts (``torch._grouped_mm`` with ``offs`` the cumulative counts), the inverse
  permutation (``out.new_empty(...)[perm] = out``), the combine all-to-all (splits
  swapped) and the scores' weighted sum back to the tokens (``scatter_add``). Compile it
  as torchtitan does: ``torch._dynamo.config.capture_scalar_outputs = True`` and
  ``fullgraph=True`` per block (``moe_loop.compile_blocks``).

:class:`MoEModel` stacks blocks of one kind between a replicated input projection and
head; :class:`MoEConfig` is the front end ``moe_loop.train`` runs (SGD steps with or
without the pass, a ``RankPool`` job and the example's loop).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

MOES = ("capacity", "dropless")

# ----------------------------------------------------------------------------------------
# GShard / DeepSpeed MOELayer: capacity, einsum dispatch, equal all-to-all, batched experts


class AllToAll(torch.autograd.Function):
    """DeepSpeed's ``_AllToAll``: equal splits of dim 0 over the group, in place into
    ``torch.empty_like``; the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        output = torch.empty_like(x)
        dist.all_to_all_single(output, x, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, AllToAll.apply(ctx.group, grad)


def capacity_of(tokens: int, experts: int, k: int, factor: float, minimum: int) -> int:
    """GShard's capacity per expert: ``ceil(k * tokens / experts * factor)``, at least
    ``minimum`` (DeepSpeed's ``min_capacity``)."""
    return max(math.ceil(k * tokens / experts * factor), minimum)


def top2gating(
    logits: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard's top-2 gating (DeepSpeed's ``top2gating`` without noise): ``logits [S, E]``
    to (load-balancing loss, combine weights ``[S, E, C]``, dispatch mask ``[S, E, C]``).
    A token's slot in its expert is the cumulative sum of the one-hot mask over the tokens
    before it (the first choices of every token before any second choice); a slot at or
    past ``capacity`` drops the token from that expert."""
    gates = F.softmax(logits, dim=1)
    experts = gates.shape[1]
    indices1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2 = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2, num_classes=experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    # load balancing: the mean gate times the fraction of tokens routed first, per expert
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * experts * experts
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1_s, gates2_s = gates1_s / denom_s, gates2_s / denom_s
    gates1 = torch.einsum("s,se->se", gates1_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    locations2_sc = F.one_hot(locations2_s, num_classes=capacity).float()
    combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask


def _expert_weights(experts: int, rows: int, cols: int, rank: int, local: int) -> nn.Parameter:
    """This rank's ``local`` of ``experts`` weights ``[rows, cols]``, drawn from one
    generator on every rank (the whole set, then this rank's slice: the same model on any
    number of ranks)."""
    full = torch.randn(experts, rows, cols) / math.sqrt(rows)
    return nn.Parameter(full[rank * local : (rank + 1) * local].clone())


class CapacityMoEBlock(nn.Module):
    """``x + moe(norm(x))`` on this rank's tokens ``[S, D]``, GShard / DeepSpeed style;
    ``forward`` returns ``(output, load-balancing loss)``."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts_per_rank: int,
        group: Any,
        capacity_factor: float = 1.0,
        min_capacity: int = 4,
    ) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.n, self.local = group, n, experts_per_rank
        self.experts = n * experts_per_rank
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, self.experts, bias=False)  # replicated
        self.w1 = _expert_weights(self.experts, dim, hidden, rank, experts_per_rank)
        self.w2 = _expert_weights(self.experts, hidden, dim, rank, experts_per_rank)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.norm(x)
        s, d = tokens.shape
        capacity = capacity_of(s, self.experts, 2, self.capacity_factor, self.min_capacity)
        l_aux, combine_weights, dispatch_mask = top2gating(self.gate(tokens), capacity)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(tokens), tokens)
        dispatched = AllToAll.apply(self.group, dispatched)  # [E, C, D]: block j from rank j
        # [n, E_local, C, D] -> [E_local, n * C, D]: each local expert's tokens from every rank
        expert_in = dispatched.reshape(self.n, self.local, capacity, d).transpose(0, 1)
        expert_in = expert_in.reshape(self.local, self.n * capacity, d)
        expert_out = torch.bmm(F.gelu(torch.bmm(expert_in, self.w1)), self.w2)
        expert_out = expert_out.reshape(self.local, self.n, capacity, d).transpose(0, 1)
        expert_out = expert_out.reshape(self.experts, capacity, d)
        expert_out = AllToAll.apply(self.group, expert_out)  # back to the tokens' ranks
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(tokens), expert_out)
        return x + combined, l_aux


# ----------------------------------------------------------------------------------------
# torchtitan: dropless, uneven all-to-all, grouped GEMM


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan's router: scores of every expert (softmax or sigmoid, in float32), the
    top ``k``; with softmax the chosen scores renormalized. Returns (top scores ``[S,
    k]``, chosen experts ``[S, k]``, tokens per expert ``[E]`` int64)."""

    def __init__(self, dim: int, experts: int, k: int, score_func: str) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts, self.k, self.score_func = experts, k, score_func

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.gate(x).float()
        scores = torch.sigmoid(scores) if self.score_func == "sigmoid" else scores.softmax(1)
        top_scores, selected = torch.topk(scores, k=self.k, dim=1)
        if self.score_func == "softmax":
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        # torchtitan's histc of the indices; on CPU histc takes floating point only
        counts = torch.histc(
            selected.view(-1).float(), bins=self.experts, min=0, max=self.experts
        ).to(torch.int64)
        return top_scores, selected, counts


class DroplessMoEBlock(nn.Module):
    """``x + moe(norm(x))`` on this rank's tokens ``[S, D]``, torchtitan style (every
    token reaches its ``k`` experts: no capacity); ``forward`` returns ``(output, 0)``
    (no auxiliary loss: torchtitan balances by a bias instead)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts_per_rank: int,
        group: Any,
        k: int = 2,
        score_func: str = "softmax",
    ) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        if dim % 16 or hidden % 16:
            # _grouped_mm on CPU wants 16-byte-aligned strides
            raise ValueError(f"dim={dim} and hidden={hidden} must be multiples of 16")
        self.group, self.n, self.local, self.k = group, n, experts_per_rank, k
        self.experts = n * experts_per_rank
        self.norm = nn.RMSNorm(dim)
        self.router = TokenChoiceTopKRouter(dim, self.experts, k, score_func)
        # torchtitan's GroupedExperts: w1, w3 [E, hidden, dim], w2 [E, dim, hidden]
        self.w1 = _expert_weights(self.experts, hidden, dim, rank, experts_per_rank)
        self.w2 = _expert_weights(self.experts, dim, hidden, rank, experts_per_rank)
        self.w3 = _expert_weights(self.experts, hidden, dim, rank, experts_per_rank)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.norm(x)
        s, d = tokens.shape
        top_scores, selected, counts = self.router(tokens)
        # TokenReorderer: the (token, choice) pairs sorted by expert
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        token_of = order // self.k
        routed = tokens[token_of]
        routed = self._experts_parallel(routed, counts)
        routed = (routed.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = torch.zeros_like(tokens)
        out = out.scatter_add(0, token_of.reshape(-1, 1).expand(-1, d), routed)
        return x + out, x.new_zeros(())

    def _experts_parallel(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """torchtitan's ``ExpertParallel``: dispatch (counts, then tokens), the local
        permutation, the grouped experts, back."""
        n = self.n
        received, counts_group, combine = token_dispatch(routed, counts, self.group)
        # rows come in (source rank, local expert) order; the experts want expert order
        with torch.no_grad():
            expert_of_row = torch.arange(self.local, device=routed.device).repeat(n)
            expert_of_row = expert_of_row.repeat_interleave(
                counts_group, output_size=received.shape[0]
            )
            perm = torch.argsort(expert_of_row, stable=True)
            per_expert = counts_group.view(n, self.local).sum(dim=0)
        out = grouped_swiglu(received[perm], self.w1, self.w2, self.w3, per_expert)
        unpermuted = out.new_empty(out.shape)
        unpermuted[perm] = out
        return combine(unpermuted)


def token_dispatch(
    routed: torch.Tensor, counts: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """torchtitan's ``ExpertParallel._token_dispatch``: the tokens per (rank, expert)
    exchanged (waited), the splits from ``.tolist()``, ``routed`` dispatched. Returns
    (the rows received, the counts received per (source rank, local expert), the
    ``_token_combine`` that sends a result's rows back)."""
    n = dist.get_world_size(group)
    with torch.no_grad():
        counts_group = funcol.all_to_all_single(counts, None, None, group=group)
        counts_group = torch.ops._c10d_functional.wait_tensor(counts_group)
        input_splits = counts.view(n, -1).sum(dim=1).tolist()
        output_splits = counts_group.view(n, -1).sum(dim=1).tolist()
    received = funcol.all_to_all_single_autograd(routed, output_splits, input_splits, group)

    def combine(out: torch.Tensor) -> torch.Tensor:
        return funcol.all_to_all_single_autograd(out, input_splits, output_splits, group)

    return received, counts_group, combine


def grouped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """torchtitan's ``_run_experts_grouped_mm``: SwiGLU with one grouped matmul per weight
    (``[E, out, in]``, transposed), rows of expert ``e`` ending at ``offs[e]``, in
    bfloat16 as torchtitan casts them (``_grouped_mm``'s shape function takes bfloat16
    only, on any device)."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = x.bfloat16()
    w1, w2, w3 = (w.bfloat16().transpose(-2, -1) for w in (w1, w2, w3))
    h = F.silu(torch._grouped_mm(h, w1, offs=offs)) * torch._grouped_mm(h, w3, offs=offs)
    return torch._grouped_mm(h, w2, offs=offs).type_as(x)


# ----------------------------------------------------------------------------------------
# the model and its training


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A small MoE model's size and run: ``blocks`` blocks on ``tokens`` tokens per rank,
    ``experts_per_rank`` experts of ``hidden`` units on each, ``steps`` SGD steps."""

    blocks: int = 1
    dim: int = 32
    hidden: int = 32
    experts_per_rank: int = 2
    tokens: int = 24
    steps: int = 2
    lr: float = 0.1

    def inputs(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens and targets at ``step`` (each rank its own)."""
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(self.tokens, self.dim, generator=gen)
        return x, torch.randn(self.tokens, self.dim, generator=gen)


@dataclasses.dataclass(frozen=True)
class MoEConfig(MoEShape):
    """Blocks of ``moe`` kind (expert parallel over every rank)."""

    moe: str = "capacity"
    aux_weight: float = 0.01
    capacity_factor: float = 1.0
    score_func: str = "softmax"

    def __post_init__(self) -> None:
        if self.moe not in MOES:
            raise ValueError(f"moe {self.moe!r}: one of {MOES}")

    def build(self) -> MoEModel:
        return build(self)

    def sync(self, model: nn.Module) -> None:
        """DDP's gradient all-reduce of the replicated parameters (the backward ran on
        the loss over ``n``: the sum is the global mean's gradient)."""
        sync_replicated(model)

    def router(self, model: nn.Module) -> nn.Module | None:
        """The dropless first block's router (its tokens per expert are recorded)."""
        blocks = model.blocks
        assert isinstance(blocks, nn.ModuleList)
        router = blocks[0].router if self.moe == "dropless" else None
        assert router is None or isinstance(router, nn.Module)
        return router


class MoEModel(nn.Module):
    """Input projection, MoE blocks, final norm and head (all but the experts replicated);
    ``forward(x, target)`` is this rank's loss: mean squared error plus the blocks'
    load-balancing losses times ``aux_weight``."""

    def __init__(self, dim: int, blocks: list[nn.Module], aux_weight: float) -> None:
        super().__init__()
        self.aux_weight = aux_weight
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        aux = x.new_zeros(())
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        return F.mse_loss(self.head(self.norm(h)), target) + self.aux_weight * aux


def rank_inputs(tokens: int, dim: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and targets at ``step`` (each rank its own)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(tokens, dim, generator=gen)
    return x, torch.randn(tokens, dim, generator=gen)


def is_expert(name: str) -> bool:
    """A parameter sharded by expert."""
    return name.rsplit(".", 1)[-1] in ("w1", "w2", "w3")


def build(cfg: MoEConfig, group: Any = None) -> MoEModel:
    """The model, from one seed on every rank (replicated weights equal everywhere)."""
    torch.manual_seed(0)
    group = group if group is not None else dist.group.WORLD
    block: Callable[[], nn.Module]
    if cfg.moe == "capacity":
        block = lambda: CapacityMoEBlock(  # noqa: E731
            cfg.dim, cfg.hidden, cfg.experts_per_rank, group, cfg.capacity_factor
        )
    else:
        block = lambda: DroplessMoEBlock(  # noqa: E731
            cfg.dim, cfg.hidden, cfg.experts_per_rank, group, score_func=cfg.score_func
        )
    return MoEModel(cfg.dim, [block() for _ in range(cfg.blocks)], cfg.aux_weight)


def sync_replicated(model: nn.Module, over: Mapping[str, Any] | None = None) -> None:
    """DDP's gradient all-reduce of the parameters that are not experts' (the backward
    ran on the loss over ``n``: the sum is the global mean's gradient): over the group
    ``over`` names for a module on the parameter's path, else over every rank."""
    over = over or {}
    for name, param in model.named_parameters():
        if is_expert(name) or param.grad is None:
            continue
        group = next((over[part] for part in name.split(".") if part in over), None)
        dist.all_reduce(param.grad, group=group)
