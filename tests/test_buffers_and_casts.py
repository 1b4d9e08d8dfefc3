"""A gathered value also written to a buffer, and dtype casts between a matmul and its
collective.

A column-parallel linear as Megatron-LM writes it all-gathers its input into a
persistent buffer (a graph input): the graph copies the gathered value into that buffer
(``copy_(buffer, gathered)`` under Inductor, ``copy(buffer, gathered)`` read by the
matmul under the eager inner compiler). That copy only reads the gathered tensor: the
site is rewritten and the buffer receives the tensor rebuilt from the ring's blocks. A
write into the gathered tensor (``copy_`` into it, ``add_``) still declines.
Megatron-Core gathers into a view of its flat global memory buffer: the eager inner
compiler's graph writes the value into a region of the buffer and the matmul reads the
region back (``slice(slice_scatter(buffer, gathered, R), R)``): rewritten the same way.
A read of a part of R is that part of the gathered tensor; a read reaching past R (old
bytes of the buffer with gathered ones) declines (``ag.buffer_region``); a region that a
``beta=0`` matmul ignores (Megatron-Core's attention ``baddbmm``) is not read at all.

A dtype cast between the matmul and its collective joins the site (SimpleFSDP's mixed
precision: bfloat16 parameters gathered, the bfloat16 weight gradient cast to float32 and
reduce-scattered): each block is cast as the collective's operand was, and the partial
sums are added in the collective's dtype.

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
from commfuse_compile.passes.fx.graph import writes_into

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


def functional_fx(fn, *shapes) -> torch.fx.GraphModule:
    """``fn``'s writes into views functionalized as AOTAutograd does (a write through a
    view: a ``slice_scatter`` into the base; reads of the view: slices of its result)."""
    return fx(torch.func.functionalize(fn, remove="mutations"), *shapes)


def into_global_buffer(x, w, buffer):
    """Megatron-Core's column-parallel linear: the gathered input copied into a view of
    the global memory buffer (``buffer[0:numel].view(shape)``), the matmul reading the
    view: ``slice(slice_scatter(buffer, gathered, 0, 0, 64), 0, 0, 64)``."""
    total = buffer[0:64].view(8, 8)
    total.copy_(gathered(x))
    return total @ w


def into_two_regions(x, w, buffer):
    """Two gathers into disjoint regions of one buffer, the first read back after the
    second's write (which a read of the first region reads past)."""
    first, second = buffer[0:64].view(8, 8), buffer[64:128].view(8, 8)
    first.copy_(gathered(x))
    second.copy_(gathered(x + 1))
    return first @ w, second @ w


def test_a_gathered_value_written_into_a_view_of_a_buffer_is_read_back_and_rewritten(
    fake_world,
):
    gm = functional_fx(into_global_buffer, (2, 8), (8, 6), (80,))
    (scatter,) = calls(gm, aten.slice_scatter.default)
    assert any(u.target is aten.slice.Tensor for u in scatter.users)  # the read-back
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [
        ("ag_mm", "rewritten", "")
    ], [r.reason for r in records]
    assert not calls(gm, c10d.all_gather_into_tensor.default)
    assert len(calls(gm, P2P)) == N - 1
    (scatter,) = calls(gm, aten.slice_scatter.default)  # the buffer still written ...
    assert scatter.args[0].op == "placeholder" and scatter.args[2:] == (0, 0, 64)
    rebuilt = scatter.args[1].args[0]  # ... with the gathered tensor rebuilt, flat
    assert rebuilt.target is aten.cat.default and len(rebuilt.args[0]) == N
    assert rebuilt.args[0][RANK].op == "placeholder"  # this rank's own shard
    assert not any(u.target is aten.slice.Tensor for u in scatter.users)  # nothing reads back
    (copy,) = calls(gm, aten.copy_.default)
    assert copy.args == (scatter.args[0], scatter)
    (out,) = (u for u in calls(gm, aten.cat.default) if u is not rebuilt)
    assert all(p.target is aten.mm.default for p in out.args[0])


def test_reads_back_past_a_write_into_another_region_of_the_buffer(fake_world):
    gm = functional_fx(into_two_regions, (2, 8), (8, 6), (128,))
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision) for r in records] == [("ag_mm", "rewritten")] * 2, [
        r.reason for r in records
    ]
    assert not calls(gm, c10d.all_gather_into_tensor.default)
    assert len(calls(gm, aten.slice_scatter.default)) == 2


@pytest.mark.parametrize(
    ("read", "code", "message"),
    [
        pytest.param(
            lambda buffer: buffer[8:72].view(8, 8),
            "ag.buffer_region",
            "reads [8:72] of dim 0 of the buffer the gathered tensor is written into at [0:64]",
            id="reaching-past-the-region",
        ),
        pytest.param(
            lambda buffer: buffer[0:32].view(4, 8),
            "ag.matmuls_left_out",
            "sits between the gathered tensor and a matmul",
            id="a-part-of-the-region",
        ),
    ],
)
def test_a_read_of_another_region_of_the_buffer_declines(fake_world, read, code, message):
    """A region reaching past the one written reads the buffer's old bytes with gathered
    ones: ``ag.buffer_region``. A part of the region written holds gathered bytes only:
    read as that slice of the gathered tensor, the decline is the site kind's (a matmul
    of a part of the gathered rows). Declined with its code, never skipped in silence."""

    def program(x, w, buffer):
        buffer[0:64].view(8, 8).copy_(gathered(x))
        return read(buffer) @ w

    gm = functional_fx(program, (2, 8), (8, 6), (80,))
    before = gm.code
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [("ag_mm", "declined", code)]
    assert message in records[0].reason
    assert gm.code == before


def megatron_core_attention(x, w, q, k, buffer, scores):
    """Megatron-Core's column-parallel linear gathers into the global buffer, and its
    ``DotProductAttention`` hands ``baddbmm`` ``scores`` elements of the same buffer as
    the input that ``beta=0.0`` ignores (its preallocated output)."""
    buffer[0:64].view(8, 8).copy_(gathered(x))
    product = buffer[0:64].view(8, 8) @ w
    # all of it: as Inductor's clean-up leaves it (a view, the no-op slice dropped)
    region = (buffer if scores == buffer.numel() else buffer[0:scores]).view(2, 4, scores // 8)
    return product, torch.baddbmm(region, q, k, beta=0.0, alpha=0.5)


@pytest.mark.parametrize("scores", [32, 80], ids=["a-region", "the-whole-buffer"])
def test_a_buffer_region_that_beta_0_ignores_is_not_a_read_of_the_buffer(fake_world, scores):
    """A region of the buffer, or all of it (the scores outgrow the gathered input, as at
    real sequence lengths; Inductor's clean-up then leaves a view of the whole buffer)."""

    def program(x, w, q, k, buffer):
        return megatron_core_attention(x, w, q, k, buffer, scores)

    shape = (2, 4, scores // 8)
    gm = functional_fx(program, (2, 8), (8, 6), (2, 4, 3), (2, 3, scores // 8), (80,))
    (baddbmm,) = calls(gm, aten.baddbmm.default)
    assert baddbmm.meta["val"].shape == shape
    assert (baddbmm.args[0].args[0].target is aten.slice_scatter.default) == (scores == 80)
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision) for r in records] == [("ag_mm", "rewritten")], [
        r.reason for r in records
    ]
    (baddbmm,) = calls(gm, aten.baddbmm.default)
    assert baddbmm.args[0].target is aten.empty_strided.default  # its layout, not its values
    assert len(calls(gm, P2P)) == N - 1


def test_writes_into_tells_a_copys_source_from_its_destination(fake_world):
    gm = fx(lambda x, y, z: (x.copy_(y), torch.mm(y, y, out=z)), (4, 4), (4, 4), (4, 4))
    x, y, z = (n for n in gm.graph.nodes if n.op == "placeholder")
    (copy,) = calls(gm, aten.copy_.default)
    (mm,) = calls(gm, aten.mm.out)
    assert writes_into(copy, x) and not writes_into(copy, y)
    assert writes_into(mm, z) and not writes_into(mm, y)


# ----------------------------------------------------------------------------------------
# casts between the matmul and the collective: graph level


def scattered(z: torch.Tensor) -> torch.Tensor:
    group = dist.group.WORLD.group_name
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", N, group))


CONVERT = torch.ops.prims.convert_element_type.default
BF16 = torch.bfloat16


def bf16_fx(fn, *shapes) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s, dtype=BF16) for s in shapes))


@pytest.mark.parametrize(
    "program",
    [
        pytest.param(lambda a, w: scattered((a @ w).float()), id="to_copy"),
        pytest.param(lambda a, w: scattered(CONVERT(a @ w, torch.float32)), id="convert"),
        pytest.param(  # a weight gradient: t(t(...)) around the cast, then a view
            lambda a, w: scattered((a.t() @ w).t().float().t().reshape(8, 6)), id="t-cast-t"
        ),
    ],
)
def test_a_cast_before_the_reduce_scatter_joins_the_site(fake_world, program):
    """Each step's partial product block (bfloat16) is cast to float32 before it is added
    to the partial sum received and sent on: every message is float32."""
    gm = bf16_fx(program, (8, 8), (8, 6))
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [("mm_rs", "rewritten", "")]
    assert not calls(gm, c10d.reduce_scatter_tensor.default)
    blocks = calls(gm, aten.mm.default)
    assert len(blocks) == N and all(b.meta["val"].dtype == BF16 for b in blocks)
    for block in blocks:
        (cast,) = block.users
        assert cast.target is CONVERT and cast.args[1] == torch.float32
    p2p = calls(gm, P2P)
    assert len(p2p) == N - 1
    assert all(sent.meta["val"].dtype == torch.float32 for op in p2p for sent in op.args[0])
    (out,) = gm.graph.find_nodes(op="output")
    assert out.args[0].meta["val"].dtype == torch.float32


@pytest.mark.parametrize(
    "program",
    [
        pytest.param(lambda x, w: gathered(x).float() @ w.float(), id="to_copy"),
        pytest.param(
            lambda x, w: CONVERT(gathered(x).view(8, 8), torch.float32) @ w.float(), id="view"
        ),
        pytest.param(lambda x, w: w.float().t() @ gathered(x).float(), id="contract_left"),
    ],
)
def test_a_cast_after_the_all_gather_joins_the_site(fake_world, program):
    """The ring moves the bfloat16 shards; each block is cast before its matmul."""
    gm = bf16_fx(program, (2, 8), (8, 6))
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [("ag_mm", "rewritten", "")]
    p2p = calls(gm, P2P)
    assert len(p2p) == N - 1
    assert all(sent.meta["val"].dtype == BF16 for op in p2p for sent in op.args[0])
    blocks = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert len(blocks) == N
    for block in blocks:
        assert all(op.meta["val"].dtype == torch.float32 for op in block.args[-2:])
    assert len(calls(gm, CONVERT)) >= N


@pytest.mark.parametrize(
    ("program", "code"),
    [
        pytest.param(
            lambda a, w, r: scattered((a @ w).float() + r[:, :6].float()),
            "rs.not_matmul",
            id="plus-r",
        ),
        pytest.param(  # one term of a sum cast: the sum is not the matmuls' sum
            lambda a, w, r: scattered((a @ w).float() + r.float() @ w.float()),
            "rs.not_matmul",
            id="one-term-cast",
        ),
    ],
)
def test_what_a_cast_does_not_make_a_matmul_still_declines(fake_world, program, code):
    gm = bf16_fx(program, (8, 8), (8, 6), (8, 8))
    before = gm.code
    records = rewrite_graph(gm, "forward", RING)
    assert [(r.decision, r.decline_code) for r in records] == [("declined", code)]
    assert gm.code == before


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


def megatron_core_linear(x, w, buffer):
    """Megatron-Core's: the input gathered into a view of the global memory buffer
    (``buffer[0:numel].view(shape)`` of the flat buffer), which the matmul reads."""
    rows = dist.get_world_size() * x.shape[0]
    total = buffer.view(-1)[0 : rows * x.shape[1]].view(rows, x.shape[1])
    return GatherIntoBufferLinear.apply(x, w, total)


PROGRAMS = {
    "megatron": megatron_linear,
    "megatron_core": megatron_core_linear,
    "functional": functional_linear,
}


def buffer_step(rank: int, n: int, program: str, inner: str) -> dict:
    """One forward and backward of ``program``, uncompiled and compiled (ring): the
    relative errors of the output, the buffer and the gradients (the weight gradient's
    rows summed in the ring's order), and the sites."""
    import torch._inductor.config
    from models import relative_error

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
        "diffs": [relative_error(c, e) for c, e in zip(*reversed(results), strict=True)],
        "sites": [(r.graph, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites],
    }


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_gathered_into_a_buffer_matches_on_gloo_ranks(ranks, program, inner):
    for r in ranks(3).run(buffer_step, program, inner):
        print(program, inner, "relative errors (out, buffer, dx, dw):", r["diffs"])
        assert max(r["diffs"]) < 1e-6, r["diffs"]
        forward = [s for s in r["sites"] if s[0] == "forward"]
        assert forward == [("forward", "ag_mm", "rewritten", "")], r["sites"]
        assert all(s[2] == "rewritten" for s in r["sites"]), r["sites"]


class GatherMixedPrecision(torch.autograd.Function):
    """SimpleFSDP's default mixed precision: the float32 shard gathered in bfloat16, the
    bfloat16 gradient cast to float32 and reduce-scattered (the weight-gradient matmul,
    a cast, the reduce-scatter)."""

    @staticmethod
    def forward(ctx, shard):
        from torch.distributed._functional_collectives import all_gather_tensor

        return all_gather_tensor(shard.to(torch.bfloat16), 0, dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed._functional_collectives import reduce_scatter_tensor

        return reduce_scatter_tensor(grad.to(torch.float32), "sum", 0, dist.group.WORLD)


def fsdp_mixed_precision(x, w_shard):
    """x: bfloat16 activations, w_shard: this rank's float32 rows of the weight."""
    return (x @ GatherMixedPrecision.apply(w_shard).t()).float().pow(2).sum()


def gather_then_cast(x_shard, w):
    """A bfloat16 activation gathered, cast to float32 for the matmul; the backward casts
    the float32 input gradient to bfloat16 before its reduce-scatter."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    g = all_gather_single_autograd(x_shard, 0, dist.group.WORLD)
    return (g.float() @ w.t()).pow(2).sum()


CAST_PROGRAMS = {
    # (program, x's shape (rows per rank for the gather), x's dtype, w's shape per rank)
    "fsdp_mixed_precision": (fsdp_mixed_precision, (8, 8), torch.bfloat16, (2, 8)),
    "gather_then_cast": (gather_then_cast, (2, 8), torch.bfloat16, (6, 8)),
}


def cast_step(rank: int, n: int, program: str, inner: str) -> dict:
    """One forward and backward of ``program``, uncompiled and compiled (ring): relative
    errors of the loss and the gradients, their dtypes, and the sites."""
    import torch._inductor.config
    from models import relative_error

    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    report.reset()
    fn, x_shape, x_dtype, w_shape = CAST_PROGRAMS[program]
    torch.manual_seed(0)
    w = torch.randn(w_shape)
    torch.manual_seed(1 + rank)
    x = torch.randn(x_shape).to(x_dtype)
    compiled = torch.compile(
        fn, backend="commfuse", options={"schedule": "ring", "inner": inner}, fullgraph=True
    )
    results = []
    for run in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        loss = run(*leaves)
        loss.backward()
        results.append([loss.detach(), *(t.grad for t in leaves)])
    expected, actual = results
    return {
        "errors": [
            relative_error(a.float(), e.float()) for a, e in zip(actual, expected, strict=True)
        ],
        "dtypes": [str(a.dtype) for a in actual],
        "sites": [(r.graph, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites],
    }


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("program", list(CAST_PROGRAMS))
def test_casts_between_matmul_and_collective_match_on_gloo_ranks(ranks, program, inner):
    """Every site rewritten, the cast ones included: the backward's reduce-scatter of the
    cast weight gradient (float32) or input gradient (bfloat16), the forward's gather
    read through a cast. Loss and gradients against the uncompiled program."""
    for r in ranks(3).run(cast_step, program, inner):
        print(program, inner, "relative errors (loss, dx, dw):", r["errors"], r["dtypes"])
        assert r["sites"] and all(s[2] == "rewritten" for s in r["sites"]), r["sites"]
        assert ("backward", "mm_rs", "rewritten", "") in r["sites"], r["sites"]
        assert ("forward", "ag_mm", "rewritten", "") in r["sites"], r["sites"]
        loss, dx, dw = r["errors"]
        assert loss < 1e-2 and dx < 2e-2, r["errors"]  # bfloat16 products
        assert dw < (1e-5 if program == "fsdp_mixed_precision" else 2e-2), r["errors"]
