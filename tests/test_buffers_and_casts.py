"""A gathered value also written to a buffer, and dtype casts between a matmul and its
collective.

A column-parallel linear as Megatron-LM writes it all-gathers its input into a
persistent buffer (a graph input): the graph copies the gathered value into that buffer
(``copy_(buffer, gathered)`` under Inductor, ``copy(buffer, gathered)`` read by the
matmul under the eager inner compiler). That copy only reads the gathered tensor: the
site is rewritten and the buffer receives the tensor rebuilt from the ring's blocks. A
write into the gathered tensor (``copy_`` into it, ``add_``) still declines.

Graph level on torch's fake process group (rank 1 of 4); numbers on 3 gloo ranks,
forward and backward, eager and Inductor, against the uncompiled program.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.passes.graph import writes_into

N, RANK = 4, 1
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
RING = Options(schedule="ring", inner="eager")


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def gathered(x: torch.Tensor) -> torch.Tensor:
    group = dist.group.WORLD.group_name
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, N, group))


def fx(fn, *shapes) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


# ----------------------------------------------------------------------------------------
# a gathered value also written to a buffer: graph level


def copy_in_place_then_mm(x, w, buffer):
    """Inductor's form: the matmul reads the gathered value, the buffer is written at
    the end (AOTAutograd keeps the input's mutation in the graph)."""
    g = gathered(x)
    out = g @ w
    buffer.copy_(g)
    return out


def copy_then_mm(x, w, buffer):
    """The eager inner compiler's form: the copy's value is the buffer's new value (the
    graph returns it for the runtime to write back), and the matmul reads it."""
    copied = aten.copy.default(buffer, gathered(x))
    return copied, copied @ w


@pytest.mark.parametrize("program", [copy_in_place_then_mm, copy_then_mm])
def test_a_gathered_value_copied_into_a_buffer_is_rewritten(fake_world, program):
    gm = fx(program, (2, 8), (8, 6), (8, 8))
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [
        ("ag_mm", "rewritten", "")
    ], [r.reason for r in records]
    assert not calls(gm, c10d.all_gather_into_tensor.default)
    assert len(calls(gm, P2P)) == N - 1
    (copy,) = calls(gm, aten.copy_.default) + calls(gm, aten.copy.default)
    assert copy.args[0].op == "placeholder"  # still the buffer
    rebuilt = copy.args[1]  # the gathered tensor, from this rank's shard and the received
    assert rebuilt.target is aten.cat.default and len(rebuilt.args[0]) == N
    assert rebuilt.args[0][RANK].op == "placeholder"  # this rank's own shard, not gathered
    (matmul_out,) = (u for u in calls(gm, aten.cat.default) if u is not rebuilt)
    assert all(p.target is aten.mm.default for p in matmul_out.args[0])


@pytest.mark.parametrize(
    "program",
    [
        pytest.param(lambda x, w, y: (gathered(x) @ w, gathered(x).copy_(y)), id="copy_-into"),
        pytest.param(lambda x, w, y: (gathered(x) @ w, gathered(x).add_(y)), id="add_"),
        pytest.param(
            lambda x, w, y: (gathered(x) @ w, gathered(x).view(4, 16).mul_(2)), id="view-mul_"
        ),
    ],
)
def test_a_write_into_the_gathered_tensor_still_declines(fake_world, program):
    gm = fx(program, (2, 8), (8, 6), (8, 8))
    before = gm.code
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.decision, r.decline_code) for r in records] == [("declined", "site.mutated")]
    assert gm.code == before


def test_writes_into_tells_a_copys_source_from_its_destination(fake_world):
    gm = fx(lambda x, y, z: (x.copy_(y), torch.mm(y, y, out=z)), (4, 4), (4, 4), (4, 4))
    x, y, z = (n for n in gm.graph.nodes if n.op == "placeholder")
    (copy,) = calls(gm, aten.copy_.default)
    (mm,) = calls(gm, aten.mm.out)
    assert writes_into(copy, x) and not writes_into(copy, y)
    assert writes_into(mm, z) and not writes_into(mm, y)


# ----------------------------------------------------------------------------------------
# gloo ranks


class GatherIntoBufferLinear(torch.autograd.Function):
    """Megatron-LM's column-parallel linear with sequence parallelism: the input gathered
    into a persistent buffer, which the matmul reads; the backward gathers it again for
    the weight's gradient and reduce-scatters the input's."""

    @staticmethod
    def forward(ctx, x, weight, buffer):
        dist.all_gather_into_tensor(buffer, x)
        ctx.save_for_backward(x, weight)
        return buffer @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = torch.empty(dist.get_world_size() * x.shape[0], x.shape[1], dtype=x.dtype)
        dist.all_gather_into_tensor(total, x)
        grad_x = torch.empty_like(x)
        dist.reduce_scatter_tensor(grad_x, grad @ weight)
        return grad_x, grad.t() @ total, None


def megatron_linear(x, w, buffer):
    return GatherIntoBufferLinear.apply(x, w, buffer)


def functional_linear(x, w, buffer):
    """The same with autograd's functional all-gather, its value also copied out."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    g = all_gather_single_autograd(x, 0, dist.group.WORLD)
    buffer.copy_(g.detach())
    return g @ w.t()


PROGRAMS = {"megatron": megatron_linear, "functional": functional_linear}


def buffer_step(rank: int, n: int, program: str, inner: str) -> dict:
    """One forward and backward of ``program``, uncompiled and compiled (ring): the
    largest differences of the output, the buffer and the gradients, and the sites."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    report.reset()
    fn = PROGRAMS[program]
    torch.manual_seed(0)
    w = torch.randn(6, 8)
    torch.manual_seed(1 + rank)
    x = torch.randn(4, 8)
    compiled = torch.compile(
        fn, backend="commfuse", options={"schedule": "ring", "inner": inner}, fullgraph=True
    )
    results = []
    for run in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        buffer = torch.full((n * 4, 8), float("nan"))
        out = run(*leaves, buffer)
        (out * out).sum().backward()
        results.append([out.detach(), buffer, *(t.grad for t in leaves)])
    return {
        "diffs": [(c - e).abs().max().item() for c, e in zip(*reversed(results), strict=True)],
        "sites": [(r.graph, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites],
    }


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_gathered_into_a_buffer_matches_on_gloo_ranks(ranks, program, inner):
    for r in ranks(3).run(buffer_step, program, inner):
        print(program, inner, "max abs diff (out, buffer, dx, dw):", r["diffs"])
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        forward = [s for s in r["sites"] if s[0] == "forward"]
        assert forward == [("forward", "ag_mm", "rewritten", "")], r["sites"]
        assert all(s[2] == "rewritten" for s in r["sites"]), r["sites"]
