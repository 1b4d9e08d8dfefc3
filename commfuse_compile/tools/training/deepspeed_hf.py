"""DeepSpeed's Ulysses sequence parallelism for Hugging Face models (ALST), as DeepSpeed
0.19.8 writes it, on a transformers Llama, trained on gloo ranks.

DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` puts its attention in
place of the model's own (``ALL_ATTENTION_FUNCTIONS["sdpa"]``): q, k, v arrive as
``[bs, hc, sl_l, hs]`` (this rank's tokens, every head), are laid out
``[ws, sl_l, bs, hc_l, hs]`` and exchanged so each rank holds every token of its heads;
the attention output goes back the same way, before ``o_proj``. Both exchanges are
DeepSpeed's custom op ``deepspeed::dim_zero_all_to_all(Tensor input, str group_name) ->
Tensor`` (``deepspeed/sequence/layer.py``): ``all_to_all_single`` of the ws blocks of dim
0 into ``torch.empty_like`` over the group registered under that name, a fake
implementation ``empty_like(input)``, and as backward the same op on the gradient made
contiguous. Defined here as DeepSpeed defines it, so a process must not import
DeepSpeed's too. The position ids are gathered from every rank (``dist.all_gather`` into
a list) so the causal mask sees the whole sequence. DeepSpeed's ``einops.rearrange``
calls are written as the permutes they are.

The data: each rank takes its slice of the sequence of ``input_ids``, ``position_ids``
and the pre-shifted labels (``UlyssesSPDataLoaderAdapter``); the loss is the
tutorial's: each rank's shard loss, gathered differentiably and weighted by its tokens.
Gradients are averaged over the ranks (DeepSpeed's engine), then AdamW steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from ... import report

# DeepSpeed resolves the op's group by name: a process group cannot be an op's argument
_all_to_all_groups: dict[str, dist.ProcessGroup] = {}


def register_all_to_all_group(group: dist.ProcessGroup) -> str:
    name = group.group_name
    _all_to_all_groups[name] = group
    return name


@torch.library.custom_op("deepspeed::dim_zero_all_to_all", mutates_args=())
def _dim_zero_all_to_all_op(input: torch.Tensor, group_name: str) -> torch.Tensor:
    output = torch.empty_like(input)
    dist.all_to_all_single(output, input, group=_all_to_all_groups[group_name])
    return output


@_dim_zero_all_to_all_op.register_fake
def _(input: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(input)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return _dim_zero_all_to_all_op(grad.contiguous(), ctx.group_name), None


_dim_zero_all_to_all_op.register_autograd(_backward, setup_context=_setup_context)


def dim_zero_all_to_all(group: dist.ProcessGroup, input: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ``_dim_zero_all_to_all``: block j of dim 0 (of ws) to rank j."""
    assert input.shape[0] == dist.get_world_size(group), "dim 0 is not the world size"
    return _dim_zero_all_to_all_op(input.contiguous(), group.group_name)


class UlyssesSPAttentionHF(nn.Module):
    """DeepSpeed's ``UlyssesSPAttentionHF`` (``seq_length_is_variable=True``): the
    attention ``attn`` of transformers over every token of this rank's heads."""

    def __init__(
        self,
        attn: Callable[..., Any],
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        process_group: dist.ProcessGroup,
    ) -> None:
        super().__init__()
        self.attn, self.process_group = attn, process_group
        register_all_to_all_group(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.batch_size, self.attn_head_size = batch_size, attn_head_size
        self.attn_head_count = attn_head_count
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication_factor = self.world_size // kv_head_count
        self.local_kv_head_count = (
            1 if self.kv_replication_factor > 1 else kv_head_count // self.world_size
        )
        if attn_head_count % self.world_size or not (
            kv_head_count % self.world_size == 0 or self.world_size % kv_head_count == 0
        ):
            raise ValueError(f"{attn_head_count}/{kv_head_count} heads on {self.world_size}")
        self.local_seq_length = self.global_seq_length = 1

    def _combine_sequence(self, input: torch.Tensor, local_heads: int, kv: bool) -> torch.Tensor:
        """[sl_l, bs, hc, hs] -> [sl, bs, hc_l, hs]."""
        if kv and self.kv_replication_factor > 1:
            input = input.repeat_interleave(self.kv_replication_factor, dim=2)
        shape = [self.local_seq_length, self.batch_size, self.world_size, local_heads]
        input = input.reshape([*shape, self.attn_head_size])
        input = input.permute(2, 0, 1, 3, 4).contiguous()  # -> ws sl_l bs hc_l hs
        output = dim_zero_all_to_all(self.process_group, input)
        return output.reshape([self.global_seq_length, *output.shape[2:]]).contiguous()

    def _partition_global_sequence(self, input: torch.Tensor) -> torch.Tensor:
        """[sl, bs, em_l] -> [sl_l, bs, em]."""
        local = self.attn_head_size * self.attn_head_count // self.world_size
        shape = [self.world_size, self.local_seq_length, self.batch_size, local]
        output = dim_zero_all_to_all(self.process_group, input.reshape(shape).contiguous())
        output = output.permute(1, 2, 0, 3)  # -> sl_l bs ws em_l
        return output.reshape([*output.shape[:2], -1]).contiguous()

    def forward(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        self.local_seq_length = query.shape[2]
        self.global_seq_length = self.local_seq_length * self.world_size
        query, key, value = (t.permute(2, 0, 1, 3) for t in (query, key, value))  # sl bs hc hs
        assert "position_ids" in kwargs, "Ulysses SP needs position_ids"
        position_ids = [torch.empty_like(kwargs["position_ids"]) for _ in range(self.world_size)]
        dist.all_gather(position_ids, kwargs["position_ids"], group=self.process_group)
        kwargs["position_ids"] = torch.cat(position_ids, dim=1)
        query = self._combine_sequence(query, self.local_q_head_count, kv=False)
        key = self._combine_sequence(key, self.local_kv_head_count, kv=True)
        value = self._combine_sequence(value, self.local_kv_head_count, kv=True)
        query, key, value = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
        if self.kv_replication_factor > 1:
            module.num_key_value_groups = query.size(-3) // key.size(-3)  # type: ignore[assignment]
        context, weights = self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        context = context.permute(1, 0, 2, 3)  # bs sl hc_l hs -> sl bs hc_l hs
        output = self._partition_global_sequence(context.reshape([*context.shape[:2], -1]))
        output = output.permute(1, 0, 2)  # sl_l bs em -> bs sl_l em
        return output.reshape([*output.shape[:2], -1]), weights


@contextmanager
def ulysses_attention(model: Any, batch_size: int, group: dist.ProcessGroup) -> Iterator[None]:
    """``register_with_transformers(core_attn_implementation="sdpa")``: DeepSpeed's
    attention in place of ``sdpa`` (the attention mask dropped), undone on exit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config.get_text_config()
    uattn = UlyssesSPAttentionHF(
        ALL_ATTENTION_FUNCTIONS["sdpa"],
        batch_size,
        config.num_attention_heads,
        getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
        config.num_key_value_heads,
        group,
    )

    def wrapper(module: nn.Module, q: Any, k: Any, v: Any, mask: Any, *args: Any, **kw: Any) -> Any:
        return uattn(module, q, k, v, None, *args, **kw)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


@dataclasses.dataclass(frozen=True)
class Config:
    """A tiny random Llama and its data: every sharded count divides by 2, 3 and 4."""

    hidden: int = 24
    heads: int = 12
    kv_heads: int = 12
    ffn: int = 48
    layers: int = 1
    vocab: int = 96
    batch: int = 2
    seq: int = 24
    steps: int = 2
    lr: float = 1e-2


def llama(cfg: Config) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=2 * cfg.seq,
        initializer_range=0.1,
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batches(cfg: Config, rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    """Each step's batch, this rank's slice of the sequence (``UlyssesSPDataLoaderAdapter``:
    the labels shifted before the batch is cut)."""
    gen = torch.Generator().manual_seed(1)
    local = slice(rank * cfg.seq // n, (rank + 1) * cfg.seq // n)
    out = []
    for _ in range(cfg.steps):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        positions = torch.arange(cfg.seq).expand(cfg.batch, -1)
        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:]
        out.append({"input_ids": ids, "position_ids": positions, "shift_labels": shift})
        out[-1] = {k: v[:, local].contiguous() for k, v in out[-1].items()}
    return out


def _loss(model: Any, run: Callable[..., Any], batch: dict[str, torch.Tensor], n: int) -> Any:
    """The ALST tutorial's loss: each rank's shard loss, weighted by its tokens."""
    ids, positions = batch["input_ids"], batch["position_ids"]
    logits = run(input_ids=ids, position_ids=positions, use_cache=False).logits
    shift = batch["shift_labels"]
    loss = model.loss_function(
        logits=logits, labels=None, shift_labels=shift, vocab_size=model.config.vocab_size
    )
    losses = dist_nn.all_gather(loss)
    good = (shift != -100).view(-1).sum()
    counts = dist_nn.all_gather(good)
    return sum(losses[r] * counts[r] for r in range(n)) / max(sum(counts), 1)


def train(rank: int, n: int, cfg: Config, options: dict[str, Any] | None) -> dict[str, Any]:
    """``cfg.steps`` AdamW steps of the Llama with DeepSpeed's Ulysses attention, compiled
    with ``backend="commfuse"`` and ``options`` (None: uncompiled): the losses and the
    sites recorded (a ``RankPool`` job)."""
    report.reset()
    torch._dynamo.reset()
    model = llama(cfg)
    model.train()
    run = model if options is None else torch.compile(model, backend="commfuse", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = []
    with ulysses_attention(model, cfg.batch, dist.group.WORLD):  # type: ignore[arg-type]
        for batch in _batches(cfg, rank, n):
            loss = _loss(model, run, batch, n)
            loss.backward()
            for p in model.parameters():  # DeepSpeed's engine: the ranks' mean
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= n
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return {"losses": losses, "sites": [s.as_json() for s in report.REPORT.sites]}


def whole_loss(cfg: Config) -> float:
    """The first step's loss of the same model on every token in one process (plain
    ``sdpa``): what the sequence-parallel ranks compute together."""
    model = llama(cfg)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    return model(input_ids=ids, labels=ids).loss.item()
