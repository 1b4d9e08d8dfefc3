"""Plain tensor parallelism split on the joint graph (``passes/joint.py``), on torch's
fake process group (rank 1 of 3): a Llama-style decoder as Hugging Face writes it,
sharded with DTensor's default layouts (``tests/models.py``), compiled with
``backend="commfuse"`` and run forward and backward (the fake group's collectives give
no numbers, only shapes: the numbers are ``test_plain_tp.py``'s, on gloo ranks).

What the split gives the backward: the values it saves of the token-wise region (the
residual, the norms' statistics) are this rank's shards, the column-parallel inputs'
gradients of one input are summed into one reduce-scatter, and what stays whole says
why, with its decline code and bytes.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from models import HIDDEN, LAYERS, TOKENS, Decoder, rms_norm, tensor_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import report
from commfuse_compile.passes import joint

N = 3
SHARD = TOKENS[0] * TOKENS[1] // N  # this rank's tokens
EAGER_RING = {"schedule": "ring", "inner": "eager"}  # the split is made before the inner compile


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=1, world_size=N, store=FakeStore())
    torch._dynamo.reset()
    report.reset()
    yield
    dist.destroy_process_group()
    torch._dynamo.reset()


def run(model: torch.nn.Module, schedule: str = "ring") -> collections.Counter:
    """One forward and backward of ``model`` compiled with the pass (eager inner
    compiler); the shapes of the tensors saved for the backward, counted."""
    compiled = torch.compile(
        model, backend="commfuse", options={**EAGER_RING, "schedule": schedule}
    )
    saved: collections.Counter = collections.Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[tuple(t.shape)] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(torch.randn(*TOKENS, HIDDEN))
    out.pow(2).mean().backward()
    return saved


def sites(graph: str) -> list[tuple[str, str, str]]:
    return [(r.kind, r.decision, r.decline_code) for r in report.REPORT.sites if r.graph == graph]


def test_the_backward_reads_shards_of_the_region(fake_world):
    """Without the split the forward saves the residual stream and each norm's
    statistics on every token; split on the joint graph, on this rank's tokens."""
    whole = run(tensor_parallel(Decoder(), N), schedule="off")
    torch._dynamo.reset()
    split = run(tensor_parallel(Decoder(), N))
    statistics, residual = (*TOKENS, 1), (*TOKENS, HIDDEN)
    assert whole[statistics] >= 2 * LAYERS and whole[residual] >= 2 * LAYERS
    assert split[statistics] == 0
    assert split[(SHARD, 1)] == whole[statistics]
    # every residual on the shard, but the decoder's input (whole on every rank: the
    # first norm runs on every token)
    assert split[residual] == 1
    assert split[(SHARD, HIDDEN)] == whole[residual] - 1


def test_input_gradients_of_one_input_are_one_reduce_scatter(fake_world):
    run(tensor_parallel(Decoder(), N))
    backward = [r for r in report.REPORT.sites if r.graph == "backward" and r.kind == "mm_rs"]
    # q, k and v's input gradients; gate's and up's: each a sum of matmuls, one site
    assert sorted(len(r.match["matmuls"]) for r in backward) == [2, 2, 3, 3]
    assert all(r.decision == "rewritten" and r.match["from"] == "all_reduce" for r in backward)
    assert collections.Counter(sites("forward")) == {
        ("mm_rs", "rewritten", ""): 2 * LAYERS,
        ("ag_mm", "rewritten", ""): 2 * LAYERS - 1,
        ("ag_mm", "declined", "ag.no_matmul"): 1,  # the output, gathered whole
    }


def test_a_value_returned_whole_says_so_with_its_bytes(fake_world):
    run(tensor_parallel(Decoder(), N))
    (whole,) = [r for r in report.REPORT.sites if r.decline_code == "ag.no_matmul"]
    assert whole.match["kept_whole"] == ["split.output"]
    assert whole.match["kept_whole_bytes"] == TOKENS[0] * TOKENS[1] * HIDDEN * 4


class ResidualDropout(torch.nn.Module):
    """GPT-2's block: dropout on the attention projection's output, then the residual
    add (``h = x + dropout(o_proj(...))``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.nn.functional.dropout(self.o_proj(self.v_proj(x)), 0.1)
        return self.q_proj(rms_norm(h, self.weight))


def test_dropout_reads_the_all_reduce_whole_and_says_why(fake_world):
    """The mask is drawn over every token, as without the pass: the dropout reads the
    value gathered (``split.random``, its bytes in the record). The reduce-scatter half
    is still hidden behind o_proj's matmul, and the backward's all-reduce is split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = parallelize_module(
        ResidualDropout(),
        init_device_mesh("cpu", (N,)),
        {"v_proj": ColwiseParallel(), "o_proj": RowwiseParallel(), "q_proj": ColwiseParallel()},
    )
    run(model)
    assert sites("forward") == [("mm_rs", "rewritten", ""), ("ag_mm", "declined", "ag.no_matmul")]
    (whole,) = [r for r in report.REPORT.sites if r.decline_code == "ag.no_matmul"]
    assert whole.match["kept_whole"] == ["split.random"]
    assert "native_dropout.default is random" in whole.match["kept_whole_for"][0]
    assert whole.match["kept_whole_bytes"] == TOKENS[0] * TOKENS[1] * HIDDEN * 4


def test_a_token_count_the_group_does_not_divide_keeps_the_all_reduce(fake_world):
    model = tensor_parallel(Decoder(), N)
    compiled = torch.compile(model, backend="commfuse", options=EAGER_RING)
    compiled(torch.randn(1, 7, HIDDEN)).sum().backward()  # 7 tokens, 3 ranks
    codes = {r.match.get("not_split") for r in report.REPORT.sites if r.kind == "mm_ar"}
    assert "split.indivisible" in codes
    assert not [r for r in report.REPORT.sites if r.match.get("from") == "all_reduce"]


def test_the_split_runs_once_per_joint_graph_and_leaves_inference_alone(fake_world):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert not joint.is_joint(gm.graph)
    with torch.no_grad():
        run_no_grad = torch.compile(
            tensor_parallel(Decoder(), N), backend="commfuse", options=EAGER_RING
        )
        run_no_grad(torch.randn(*TOKENS, HIDDEN))
    assert {r.graph for r in report.REPORT.sites} == {"inference"}
    assert report.REPORT.graphs == 1  # no joint graph


def test_an_internal_error_in_the_joint_split_warns_and_keeps_the_graph(fake_world, monkeypatch):
    from commfuse_compile.passes.prepare import shard_tokens

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(shard_tokens, "split_planned", broken)
    monkeypatch.setenv("COMMFUSE_STRICT", "0")  # the fall-back, not the error
    with pytest.warns(UserWarning, match="the joint graph left as it was: .*boom"):
        run(tensor_parallel(Decoder(), N))
    assert not [r for r in report.REPORT.sites if r.match.get("from") == "all_reduce"]
