"""Plain tensor parallelism, sequence parallelism done by the pass: the all-reduce after
a row-parallel matmul is split into a reduce-scatter, the residual add and the norm on
this rank's tokens, and an all-gather that the next column-parallel matmuls read
(``passes/shard_tokens.py``); those become ``mm_rs`` and ``ag_mm`` sites.

Graph level on torch's fake process group (rank 1 of 4) for what moves and what is
gathered; numbers on 3 and 4 gloo ranks, forward, backward and optimizer steps, eager and
Inductor, against the uncompiled model: a Llama-style decoder written as Hugging Face
writes it (RMSNorm in float32, q/k/v and gate/up column-parallel, o and down
row-parallel), sharded with DTensor's ``ColwiseParallel``/``RowwiseParallel`` and their
default layouts, as transformers' ``tp_plan`` does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models import in_place_sum, tensor_parallel_regions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RING = Options(schedule="ring", inner="eager")


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


def reduced(y: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(y, "sum", dist.group.WORLD.group_name))


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: statistics in float32, the weight applied last."""
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def residual_norm_qk(x, h, w_o, norm_w, w_q, w_k):
    out = reduced(x @ w_o)
    h2 = h + out.view(h.shape)
    normed = rms_norm(h2, norm_w).view(-1, h.shape[-1])
    return h2, normed @ w_q, normed @ w_k


SHAPES = [(16, 8), (2, 8, 16), (8, 16), (16,), (16, 4), (16, 4)]


def traced(fn, shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def decisions(records) -> list[tuple[str, str, str]]:
    return [(r.kind, r.decision, r.decline_code) for r in records]


def calls(gm, target):
    return list(gm.graph.find_nodes(op="call_function", target=target))


def test_all_reduce_split_into_reduce_scatter_norm_on_shard_and_gather(fake_world):
    gm = traced(residual_norm_qk, SHAPES)
    records = rewrite_graph(gm, "forward", RING)
    assert decisions(records) == [
        ("mm_rs", "rewritten", ""),
        ("ag_mm", "rewritten", ""),
        ("ag_mm", "declined", "ag.no_matmul"),  # the residual returned: gathered whole
    ]
    split = records[0].match
    assert split["from"] == "all_reduce"
    assert split["gathered_for"] == {"mm_1": "matmul", "mm_2": "matmul", "output": "split.output"}
    assert split["token_sums"] == 0
    # moved: the all-reduce's 16x16 floats; gathered: the residual (output) and the
    # normed input of q and k, each 16x16 (a value returned keeps its full value)
    assert (split["all_reduce_bytes"], split["gathered_bytes"]) == (1024, 2048)
    assert records[1].match["matmuls"] == ["mm_1", "mm_2"]  # q and k share one gather
    assert not calls(gm, c10d.all_reduce.default)
    # the norm runs on this rank's 4 of 16 tokens
    (mean,) = calls(gm, aten.mean.dim)
    assert list(mean.meta["val"].shape) == [4, 1]
    # the residual returned keeps its full value: one plain all-gather of it
    (gather,) = calls(gm, c10d.all_gather_into_tensor.default)
    assert list(gather.meta["val"].shape) == [16, 16]


def test_values_saved_whole_recomputed_from_the_gathered_all_reduce(fake_world):
    """A forward graph returns several values of the chain for the backward: rather
    than one all-gather each, the all-reduce's value is gathered once (its own second
    half) and the values are recomputed from it on every token."""

    def saves_for_backward(x, h, w_o, norm_w, w_q, w_k):
        h2, q, k = residual_norm_qk(x, h, w_o, norm_w, w_q, w_k)
        return h2, h2.pow(2), h2.sigmoid(), q, k

    gm = traced(saves_for_backward, SHAPES)
    records = rewrite_graph(gm, "forward", RING)
    assert decisions(records) == [
        ("mm_rs", "rewritten", ""),
        ("ag_mm", "declined", "ag.no_matmul"),  # the all-reduce's value, gathered once
        ("ag_mm", "rewritten", ""),
    ]
    split = records[0].match
    assert (split["all_reduce_bytes"], split["gathered_bytes"]) == (1024, 2048)
    assert split["recomputed"] == 4  # view, add, pow, sigmoid on every token
    (sigmoid,) = calls(gm, aten.sigmoid.default)
    assert list(sigmoid.meta["val"].shape) == [2, 8, 16]


def test_all_reduce_value_returned_whole_is_gathered_once(fake_world):
    """Inductor's forward returns the all-reduce's own value (saved for the backward) with
    other values recomputed from it: one gather serves both."""

    def one_all_reduce(x, h, w_o, norm_w, w_q, w_k):
        out = reduced(x @ w_o)
        h2 = h + out.view(h.shape)
        normed = rms_norm(h2, norm_w).view(-1, 16)
        return out, h2, h2.sigmoid(), normed @ w_q, normed @ w_k

    gm = traced(one_all_reduce, SHAPES)
    records = rewrite_graph(gm, "forward", RING)
    assert decisions(records) == [
        ("mm_rs", "rewritten", ""),
        ("ag_mm", "declined", "ag.no_matmul"),  # the all-reduce's value, gathered once
        ("ag_mm", "rewritten", ""),
    ]
    assert len(calls(gm, c10d.all_gather_into_tensor.default)) == 1  # and the ring's p2p


def test_split_that_fails_leaves_the_all_reduce_to_its_site(fake_world, monkeypatch):
    from commfuse_compile.passes.shard_tokens import build

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(build, "_moved", broken)
    gm = traced(residual_norm_qk, SHAPES)
    with pytest.warns(UserWarning, match="all-reduces left whole .*RuntimeError: boom"):
        records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision) for r in records] == [("mm_ar", "rewritten")]


def test_vocabulary_parallel_embedding_all_reduce_split_too(fake_world):
    """transformers' ``embedding_rowwise``: each rank looks up its rows of the vocabulary
    and the lookups are all-reduced. No matmul to hide the reduce-scatter behind, but the
    norm runs on the shard and the gather is hidden behind q's matmul."""

    def embedding_then_q(ids, table, norm_w, w_q):
        h = reduced(torch.nn.functional.embedding(ids, table))
        return rms_norm(h, norm_w).view(-1, 16) @ w_q

    args = (torch.randint(0, 32, (2, 8)), torch.randn(32, 16), torch.randn(16), torch.randn(16, 4))
    gm = make_fx(embedding_then_q, tracing_mode="fake")(*args)
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision, r.decline_code, r.match.get("from")) for r in records] == [
        ("mm_rs", "declined", "rs.no_matmul", "all_reduce"),
        ("ag_mm", "rewritten", "", "all_reduce"),
    ]
    (mean,) = calls(gm, aten.mean.dim)
    assert list(mean.meta["val"].shape) == [4, 1]


def test_max_all_reduce_of_no_matmul_is_not_split(fake_world):
    def maximum_then_q(h, norm_w, w_q):
        top = c10d.wait_tensor(c10d.all_reduce(h * 2.0, "max", dist.group.WORLD.group_name))
        return rms_norm(top, norm_w).view(-1, 16) @ w_q

    gm = traced(maximum_then_q, [(2, 8, 16), (16,), (16, 4)])
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decline_code) for r in records] == [("mm_ar", "ar.not_matmul")]
    assert calls(gm, c10d.all_reduce.default)


def test_graph_output_alone_is_left_to_the_all_reduce_site(fake_world):
    def no_matmul_after(x, h, w_o, norm_w):
        return rms_norm(h + reduced(x @ w_o).view(h.shape), norm_w)

    gm = traced(no_matmul_after, SHAPES[:4])
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision) for r in records] == [("mm_ar", "rewritten")]
    assert records[0].match["not_split"] == "split.no_matmul_after"


def test_dropout_mask_is_drawn_whole_and_the_shard_takes_its_rows(fake_world):
    """The mask is drawn over every token, as without the pass (the same draw on every
    rank where the model's RNG makes it so); the shard multiplies its rows of it. Its
    ``empty_like`` reads only the value's shape: allocated from the shard, no gather."""

    def dropout_then_matmul(x, h, w_o, norm_w, w_q):
        h2 = h + reduced(x @ w_o).view(h.shape)
        return torch.nn.functional.dropout(h2, 0.1).view(-1, 16) @ w_q

    gm = traced(dropout_then_matmul, SHAPES[:5])
    records = rewrite_graph(gm, "forward", RING)
    assert [r.kind for r in records] == ["mm_rs", "ag_mm"]
    assert records[0].match["gathered_for"] == {"mm_1": "matmul"}
    (draw,) = calls(gm, aten.bernoulli_.float)
    assert list(draw.meta["val"].shape) == [2, 8, 16]
    (allocation,) = calls(gm, aten.new_empty.default)  # the shard's dtype, the full shape
    assert list(allocation.args[0].meta["val"].shape) == [4, 16]


def test_random_op_reading_a_shard_keeps_the_all_reduce_whole(fake_world):
    """A shard's draw would not be the rows of the whole draw: the random op reads the
    value whole, so no matmul reads a gather and the all-reduce stays one site."""

    def random_then_matmul(x, h, w_o, norm_w, w_q):
        h2 = h + reduced(x @ w_o).view(h.shape)
        return aten.native_dropout(h2, 0.1, True)[0].view(-1, 16) @ w_q

    gm = traced(random_then_matmul, SHAPES[:5])
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision) for r in records] == [("mm_ar", "rewritten")]


def test_norm_weight_gradient_is_summed_on_the_shard_then_all_reduced(fake_world):
    def norm_backward_like(x, g, w_o, w_next):
        grad = reduced(x @ w_o).view(2, 8, 16)
        weight_grad = (grad * g).sum([0, 1])  # a norm weight's gradient: over the tokens
        return weight_grad, (grad * 2.0).view(-1, 16) @ w_next

    gm = traced(norm_backward_like, [(16, 8), (2, 8, 16), (8, 16), (16, 4)])
    records = rewrite_graph(gm, "backward", RING)
    assert records[0].match["token_sums"] == 1
    (small,) = calls(gm, c10d.all_reduce.default)  # the width, not the tokens
    assert list(small.meta["val"].shape) == [16]
    assert [r.kind for r in records] == ["mm_rs", "mm_ar", "ag_mm"]
    assert records[1].decline_code == "ar.not_matmul"  # recorded, kept


def prefill_sized(tokens: int) -> list[tuple[int, ...]]:
    return [(tokens, 1024), (4, tokens // 4, 4096), (1024, 4096), (4096,), (4096, 1024)] + [
        (4096, 1024)
    ]


def norm_qk(x, h, w_o, norm_w, w_q, w_k):
    """The residual stays inside the graph (the next layer reads it)."""
    return residual_norm_qk(x, h, w_o, norm_w, w_q, w_k)[1:]


H100 = Options(schedule="auto", inner="eager", profile="h100-nvlink4")


def test_auto_splits_a_prefill_sized_all_reduce(fake_world):
    records = rewrite_graph(traced(norm_qk, prefill_sized(8192)), "forward", H100)
    assert [(r.kind, r.decision, r.match.get("from")) for r in records] == [
        ("mm_rs", "rewritten", "all_reduce"),
        ("ag_mm", "rewritten", "all_reduce"),
    ]


def test_auto_counts_the_gather_of_a_returned_residual(fake_world):
    """Returning the residual whole costs one more all-gather of every token, which the
    all-reduce did not move: predicted to cost more than the split saves, the all-reduce
    stays one site (its own reduce-scatter ring and all-gather)."""
    records = rewrite_graph(traced(residual_norm_qk, prefill_sized(8192)), "forward", H100)
    assert [(r.kind, r.decision) for r in records] == [("mm_ar", "rewritten")]
    assert records[0].match["not_split"] == "split.not_profitable"
    assert records[0].match["not_split_reason"].startswith("auto: the split predicted to save")


def test_auto_keeps_a_few_tokens_all_reduce(fake_world):
    gm = traced(residual_norm_qk, SHAPES)
    records = rewrite_graph(gm, "forward", Options(schedule="auto", inner="eager"))
    assert [(r.kind, r.decision) for r in records] == [("mm_ar", "declined")]
    assert calls(gm, c10d.all_reduce.default)


# ----------------------------------------------------------------------------------------
# numbers on gloo ranks

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


def compiled_with(model: torch.nn.Module, route: str, schedule: str, inner: str):
    """``model`` compiled the way ``route`` names: ``backend="commfuse"`` with ``inner``,
    or ``backend="inductor"`` with the pass installed in Inductor (``schedule`` "off":
    Inductor alone)."""
    from commfuse_compile import install_inductor_pass, uninstall_inductor_pass

    if route == "backend":
        options = {"schedule": schedule, "inner": inner}
        return torch.compile(model, backend="commfuse", options=options)
    uninstall_inductor_pass()
    if schedule != "off":
        install_inductor_pass(schedule=schedule)
    return torch.compile(model, backend="inductor")


def train_steps(
    rank: int,
    n: int,
    program: str,
    inner: str,
    route: str = "backend",
    checkpointing: bool = False,
    steps: int = 2,
) -> dict:
    """``steps`` SGD steps of the decoder sharded by ``program`` (its layers under
    selective activation checkpointing with ``checkpointing``), uncompiled, compiled with
    the pass (``ring``) and compiled without it (``schedule="off"``, or Inductor alone):
    the losses, the sites of the run with the pass, and per compiled run the bytes the
    first step saves for the backward (``saved_tensors_hooks``)."""
    import torch._inductor.config

    from commfuse_compile import uninstall_inductor_pass

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    losses, saved, sites = {}, {}, []
    for run_as in ("uncompiled", "ring", "off"):
        torch._dynamo.reset()
        report.reset()
        model = PROGRAMS[program](Decoder(checkpointing), n)
        run = model if run_as == "uncompiled" else compiled_with(model, route, run_as, inner)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        losses[run_as], saved[run_as] = [], 0
        for step in range(steps):
            x = torch.randn(*TOKENS, HIDDEN)
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t, first=step == 0: _counted(saved, run_as, t, first), lambda t: t
            ):
                loss = run(x).pow(2).mean()
            loss.backward()
            sgd.step()
            sgd.zero_grad()
            losses[run_as].append(loss.item())
        if run_as == "ring":
            sites = [
                (r.graph, r.kind, r.decision, r.decline_code, r.match.get("from", ""))
                for r in report.REPORT.sites
            ]
    uninstall_inductor_pass()
    return {"losses": losses, "sites": sites, "saved": saved}


def _counted(saved: dict, run_as: str, t: torch.Tensor, first: bool) -> torch.Tensor:
    if first:
        saved[run_as] += t.numel() * t.element_size()
    return t


def split_sites(sites: list[tuple]) -> dict[str, dict[str, int]]:
    """Per graph: the split all-reduces, the gathers a matmul ring took, the gathers of
    values read whole (the graph's outputs) and the norm weights' gradient sums (small
    all-reduces no matmul produces, recorded and kept)."""
    table: dict[str, dict[str, int]] = {}
    for graph, kind, decision, code, origin in sites:
        row = table.setdefault(graph, {"split": 0, "ag_mm": 0, "whole": 0, "token_sums": 0})
        if kind == "mm_rs" and decision == "rewritten" and origin == "all_reduce":
            row["split"] += 1
        elif kind == "ag_mm" and decision == "rewritten":
            row["ag_mm"] += 1
        elif (kind, decision, code, origin) == ("ag_mm", "declined", "ag.no_matmul", "all_reduce"):
            row["whole"] += 1
        elif (kind, decision, code) == ("mm_ar", "declined", "ar.not_matmul"):
            row["token_sums"] += 1
        else:
            raise AssertionError(f"unexpected site {(graph, kind, decision, code, origin)}")
    return table


# Per layer, forward: o_proj's and down_proj's all-reduces split, the gathers before
# gate/up and the next layer's q/k/v taken by rings (after the last down_proj the final
# norm, then the output, reads the value whole). Backward, the mirror image: q/k/v's and
# gate/up's input gradients (one all-reduce each) split, the gathers before down_proj's
# and o_proj's input and weight gradients taken (the first layer's input gradient is the
# graph's output), and the two norms' weight gradients summed over the shard's tokens.
# The values the forward saves for the backward (residuals, norm statistics) are
# recomputed on every token from each all-reduce's value, gathered once ("whole").
EXPECTED = {
    "forward": {"split": 2 * LAYERS, "ag_mm": 2 * LAYERS - 1, "whole": 2 * LAYERS, "token_sums": 0},
    "backward": {
        "split": 5 * LAYERS,
        "ag_mm": 2 * LAYERS - 1,
        "whole": 0,
        "token_sums": 2 * LAYERS,
    },
}


@pytest.mark.parametrize(
    "program, n, inner",
    [
        ("dtensor", 3, "inductor"),
        ("dtensor", 4, "eager"),
        ("megatron", 3, "eager"),
        pytest.param("dtensor", 3, "eager", marks=pytest.mark.matrix),
        pytest.param("dtensor", 4, "inductor", marks=pytest.mark.matrix),
        pytest.param("megatron", 4, "inductor", marks=pytest.mark.matrix),
        pytest.param("dtensor", 2, "inductor", marks=pytest.mark.matrix),
        pytest.param("megatron", 2, "eager", marks=pytest.mark.matrix),
    ],
)
def test_decoder_trains_equal_with_sequence_parallel_split(ranks, program, n, inner):
    for r in ranks(n).run(train_steps, program, inner):
        losses = r["losses"]
        print(program, n, inner, losses, r["saved"], split_sites(r["sites"]))
        assert losses["ring"] == pytest.approx(losses["uncompiled"], rel=1e-5, abs=1e-6)
        assert split_sites(r["sites"]) == EXPECTED


def prefill(rank: int, n: int, inner: str) -> dict:
    """An inference prefill under ``torch.no_grad``, uncompiled and compiled."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    report.reset()
    model = tensor_parallel(Decoder(), n)
    compiled = torch.compile(
        model, backend="commfuse", options={"schedule": "ring", "inner": inner}
    )
    torch.manual_seed(1)
    x = torch.randn(*TOKENS, HIDDEN)
    with torch.no_grad():
        expected, actual = model(x), compiled(x)
    return {
        "difference": (actual - expected).abs().max().item(),
        "sites": [
            (r.graph, r.kind, r.decision, r.decline_code, r.match.get("from", ""))
            for r in report.REPORT.sites
        ],
    }


def test_prefill_under_no_grad_splits_every_all_reduce(ranks):
    for r in ranks(3).run(prefill, "eager"):
        assert r["difference"] < 1e-5, r["difference"]
        table = split_sites(r["sites"])
        assert list(table) == ["inference"], table
        # the forward's sites; the one value returned (the final norm's) gathered whole
        assert table["inference"] == {**EXPECTED["forward"], "whole": 1}, table
