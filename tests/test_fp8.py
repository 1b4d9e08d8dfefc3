"""Float8 matmuls (``torch._scaled_mm``) next to all-gathers and reduce-scatters.

PyTorch's async-TP fp8 cases (``test_micro_pipeline_tp``: all-gather -> scaled matmul and
scaled matmul -> reduce-scatter, A 2-D and 3-D, gather/scatter dim 0 and 1, tensor-wise
and row-wise scales), ported as ``cases.Scaled``: on torch's fake process group (rank 1
of 4: what the rewrite emits, what it declines and why) and on 2, 3 and 4 gloo ranks,
eager and Inductor (the rewritten program against the original one, collectives and
fused scaled matmuls, run the same way).

A block of the product is one ``_scaled_mm`` of the operand's block and its scales' block
(a row-wise ``scale_a`` sliced with A's rows, ``scale_b`` with B's columns, a tensor-wise
scale shared); bias, ``out_dtype`` and ``use_fast_accum`` are kept. The float8 shard is
gathered as its uint8 bytes (gloo refuses float8 collectives); the ring moves the float8
data itself. Rows and columns blocks compute every output element as the whole op does;
a block of the contracting dim is a float32 partial, summed in float32 and rounded once;
the reduce-scatter's partial sums are added in the output dtype, as the collective adds
them (ring order instead of gloo's).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.distributed as dist
from cases import FP8, Scaled, float8_gathered, gathered, run_case, scaled_mm, scattered, trace
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options
from commfuse_compile.passes import rewrite_graph

N, RANK = 4, 1
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
SCALED = aten._scaled_mm.default
COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
RING = Options(schedule="ring", inner="eager")


def _ports() -> list:
    """PyTorch's fp8 async-TP cases, with the role (gather) or block kind (scatter) each
    becomes. A 2-D shard gathered on dim 1 is gathered on the contracting dim (PyTorch
    declines it; here ``contract_k``). Row-wise scales of a gathered A come replicated
    (the gathered rows' scales, sliced per block) or sharded with A ("row_gathered":
    their own all-gather, whose shards then travel in A's messages)."""
    ports = []
    for scaling in ("tensor", "row", "row_gathered"):
        for a, dim, role in (
            ((8, 32), 0, "rows"),
            ((8, 16), 1, "contract_k"),
            ((2, 4, 32), 0, "rows"),
            ((2, 4, 32), 1, "rows"),
        ):
            if role == "rows" or scaling != "row_gathered":
                case = Scaled(side="gather", a=a, dim=dim, scaling=scaling)
                ports.append(pytest.param(case, role, id=f"ag-{len(a)}d-dim{dim}-{scaling}"))
        if scaling == "row_gathered":
            continue
        for a, dim, blocks in (  # the scattered dim divides by 2, 3 and 4
            ((24, 32), 0, "rows"),
            ((24, 32), 1, "columns"),
            ((12, 4, 32), 0, "rows"),
            ((2, 12, 32), 1, "rows"),
            ((2, 4, 32), 2, "columns"),
        ):
            case = Scaled(side="scatter", a=a, dim=dim, n_out=48, scaling=scaling)
            ports.append(pytest.param(case, blocks, id=f"rs-{len(a)}d-dim{dim}-{scaling}"))
    return ports


PORTS = _ports()


@pytest.fixture
def fake_world():
    """Torch's fake process group, rank ``RANK`` of ``N`` (graph tests only; the gloo
    tests run in the rank pools' own processes)."""
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def build(case) -> GraphModule:
    return trace(case, N, case.inputs(RANK, seed=0, n=N))


def rewrite(gm: GraphModule, options: Options = RING):
    records = rewrite_graph(gm, "forward", options)
    assert len(records) == 1, [(r.kind, r.reason) for r in records]
    return records[0]


def calls(gm: GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def placeholder_of(node: torch.fx.Node) -> str:
    """The graph input a value is cut from (through views, slices and copies)."""
    while node.op != "placeholder":
        node = node.args[0]
    return node.name


# ----------------------------------------------------------------------------------------
# graph level


@pytest.mark.parametrize(("case", "role"), PORTS)
def test_scaled_site_becomes_one_scaled_matmul_per_block(fake_world, case, role):
    """n - 1 P2P steps, no collective left, one ``_scaled_mm`` per step (``contract_k``:
    float32 partials, rounded once), the scales' blocks as the operands': a row-wise
    scale_a sliced with A's rows (or, gathered beside A, come with them), scale_b with B's
    columns, tensor-wise ones shared."""
    gm = build(case)
    (original,) = calls(gm, SCALED)
    scale_a, scale_b = original.args[2:4]  # as the fused op reads them
    gathers = [n.name for n in calls(gm, c10d.all_gather_into_tensor.default)]
    record = rewrite(gm)
    assert record.match.get("collectives") == gathers or case.side == "scatter"
    assert (record.decision, record.schedule, record.p2p_ops) == ("rewritten", "ring", N - 1)
    assert not any(calls(gm, c) for c in COLLECTIVES)
    if case.side == "gather":
        assert list(record.match["roles"].values()) == [role]
    else:
        assert record.match["blocks"] == role
    blocks = calls(gm, SCALED)
    steps = collections.Counter(n.meta["commfuse"]["step"] for n in blocks)
    assert steps == {s: 1 for s in range(N)}
    sliced = case.scaling != "tensor" and role in ("rows", "columns")
    for node in blocks:
        out = node.meta["val"]
        assert out.dtype == (torch.float32 if role == "contract_k" else torch.bfloat16)
        a_scale, b_scale = node.args[2], node.args[3]
        if not sliced:  # tensor-wise, or a block of the contracting dim: the whole scales
            assert (a_scale, b_scale) == (scale_a, scale_b)
        elif role == "rows":  # A's per-row scale: this block's rows, strides (1, 1)
            assert a_scale.target is aten.as_strided.default and b_scale is scale_b
            if case.scaling == "row":
                assert placeholder_of(a_scale) == placeholder_of(scale_a)
            assert list(a_scale.meta["val"].shape) == [out.shape[0], 1]
            assert a_scale.meta["val"].stride() == (1, 1)
        else:  # B's per-column scale: this block's columns
            assert a_scale is scale_a and b_scale.target is aten.slice.Tensor
            assert b_scale.args[0] is scale_b
            assert list(b_scale.meta["val"].shape) == [1, out.shape[1]]
    gm.graph.lint()
    placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    FakeTensorProp(gm, detect_fake_mode(placeholders)).propagate_dont_convert_inputs(*placeholders)


def test_row_scales_gathered_beside_a_travel_in_its_messages(fake_world):
    """A's shard's rows' scales, gathered on their own on the same dim (PyTorch's
    row-wise sharded mode): one site for both collectives; each message is A's block's
    bytes then its scales' (uint8); this rank's block reads its own shards, each received
    block its unpacked scales. Nothing gathers the scales any more."""
    case = Scaled(a=(2, 4, 32), dim=1, scaling="row_gathered")
    gm = build(case)
    a, _, scale_shard = list(gm.graph.find_nodes(op="placeholder"))[:3]
    record = rewrite(gm)
    assert record.match["scale_beside"] == "all_gather_into_tensor_1"
    assert len(record.match["collectives"]) == 2 and not calls(
        gm, c10d.all_gather_into_tensor.default
    )
    for node in calls(gm, P2P):
        (sent,), _, (like,), *_ = node.args
        assert sent.meta["val"].dtype == torch.uint8
        assert list(like.meta["val"].shape) == [2 * 4 * 32 + 2 * 4 * 4]  # A's bytes, scales'
    blocks = sorted(calls(gm, SCALED), key=lambda node: node.meta["commfuse"]["step"])
    assert placeholder_of(blocks[0].args[0]) == a.name  # this rank's block: its own shards
    assert placeholder_of(blocks[0].args[2]) == scale_shard.name
    for node in blocks[1:]:  # received blocks: the scales unpacked from the message
        assert node.args[2].args[0].args[0].target is aten.clone.default


@pytest.mark.parametrize(
    ("fn", "shapes", "why"),
    [
        (lambda a, s: (a, s * 2), ((2, 4, 32), (2, 4, 1)), "its gathered value is read too"),
        (lambda a, s: (a,), ((3, 5), (3, 1)), "A's shard is 15 bytes"),
    ],
    ids=["scale-read-elsewhere", "unaligned"],
)
def test_row_scales_gathered_beside_a_stay_a_collective_where_they_cannot_travel(
    fake_world, fn, shapes, why
):
    """Where the scales' gathered value has another reader, or A's bytes would leave them
    unaligned in a message, their all-gather stays (declined: the matmul reads it as its
    scale), and A's ring reads slices of its result."""

    def program(a, b, scale_a, scale_b):
        a, scale_a = float8_gathered(a, N, 0), gathered(scale_a, N, 0)
        c = scaled_mm(a.reshape(-1, a.shape[-1]), b, scale_a, scale_b)
        return (c, *fn(a, scale_a)[1:])

    (a_shape, s_shape) = shapes
    inputs = _inputs(a_shape, (16, a_shape[-1]), s_shape, (1, 16))
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    records = rewrite_graph(gm, "forward", RING)
    decided = sorted((r.decision, r.reason.split(": ", 1)[-1]) for r in records)
    assert decided == [
        ("declined", "the gathered tensor is its scale_a"),
        ("rewritten", "schedule 'ring' requested"),
    ], why
    assert len(calls(gm, c10d.all_gather_into_tensor.default)) == 1


def test_slicing_chunks_that_would_misalign_the_scales_beside_them_are_declined(fake_world):
    case = Scaled(a=(2, 2, 4), dim=1, n_out=16, scaling="row_gathered")
    gm = build(case)
    record = rewrite(gm, Options(schedule="slicing", slices=2, inner="eager"))
    assert (record.decision, record.decline_code) == ("declined", "lower.scale_beside")
    assert "is 8 bytes, not a multiple of 16" in record.reason


@pytest.mark.parametrize("as_bytes", [True, False], ids=["uint8-view", "float8"])
def test_gathered_float8_travels_as_itself_and_the_gathered_tensor_is_rebuilt(fake_world, as_bytes):
    """Gathered as uint8 bytes (view -> gather -> view back, gloo's and NCCL's way) or as
    float8 (torchao's): either way the ring sends the float8 shard (P2P moves any dtype;
    a dtype view is no buffer of its own), and the gathered tensor, which the program
    returns, is rebuilt from the blocks in the collective's dtype."""
    case = Scaled(a=(2, 4, 32), dim=1, scaling="row", as_bytes=as_bytes)
    gm = build(case)
    gathered_dtype = calls(gm, c10d.all_gather_into_tensor.default)[0].meta["val"].dtype
    assert gathered_dtype == (torch.uint8 if as_bytes else FP8)
    record = rewrite(gm)
    assert record.decision == "rewritten"
    for node in calls(gm, P2P):
        sends, _, recv_like, *_ = node.args
        assert [t.meta["val"].dtype for t in (*sends, *recv_like)] == [FP8, FP8]
    returned_a = gm.graph.output_node().args[0][0]
    assert returned_a.meta["val"].dtype == FP8 and list(returned_a.meta["val"].shape) == [2, 16, 32]


def test_bias_out_dtype_and_fast_accumulation_are_kept_in_every_block(fake_world):
    case = Scaled(
        side="scatter", a=(2, 8, 32), dim=2, n_out=64, scaling="row", bias=True,
        out_dtype=torch.float16, fast_accum=True,
    )  # fmt: skip
    gm = build(case)
    bias = list(gm.graph.find_nodes(op="placeholder"))[4]
    record = rewrite(gm)
    assert record.decision == "rewritten" and record.match["blocks"] == "columns"
    for node in calls(gm, SCALED):
        _, _, _, _, block_bias, scale_result, out_dtype, fast = node.args
        assert placeholder_of(block_bias) == bias.name
        assert list(block_bias.meta["val"].shape) == [64 // N]  # the block's columns
        assert (scale_result, out_dtype, fast) == (None, torch.float16, True)


def _blockwise(a, b, scale_a, scale_b):
    """1x128 block-wise scales (DeepSeek-style): scale_a [M, K/128], scale_b [K/128, N/128]."""
    g = float8_gathered(a, N, 0)
    return (scaled_mm(g, b, scale_a, scale_b),)


def _blockwise_rs(a, b, scale_a, scale_b):
    return (scattered(scaled_mm(a, b, scale_a, scale_b), N, 0),)


def _float8_out_rs(a, b, scale_a, scale_b):
    return (scattered(scaled_mm(a, b, scale_a, scale_b, out_dtype=FP8), N, 0),)


def _float8_out_contract_k(a, b, scale_a, scale_b):
    return (scaled_mm(float8_gathered(a, N, 1), b, scale_a, scale_b, out_dtype=FP8),)


def _cast_after_the_gather(x, b, scale_a, scale_b):
    """Gathered in bfloat16, cast to float8 after (a static scale): the cast sits between
    the collective and the matmul. (Scales computed from the gathered rows, amax ->
    divide -> cast, are element-wise work in between: no site, as for any matmul.)"""
    return (scaled_mm(gathered(x, N, 0).to(FP8), b, scale_a, scale_b),)


def _inputs(a, b, scale_a=(), scale_b=(), dtype=FP8) -> list[torch.Tensor]:
    """A (``dtype``), B ([N, K] transposed: column-major), the two scales (float32)."""
    ones = torch.ones
    return [ones(a).to(dtype), ones(b).to(FP8).t(), ones(scale_a), ones(scale_b)]


BLOCKWISE = "scales [16, 2] and [2, 1] are neither per tensor nor per row and column"
DECLINES = [  # (program, inputs, code, reason, id)
    (_blockwise, _inputs((4, 256), (16, 256), (16, 2), (2, 1)), "ag.matmuls_left_out", BLOCKWISE,
     "ag-blockwise-scales"),
    (_blockwise_rs, _inputs((16, 256), (16, 256), (16, 2), (2, 1)), "site.scales", BLOCKWISE,
     "rs-blockwise-scales"),
    (_float8_out_rs, _inputs((16, 32), (16, 32)), "rs.scaled_sum",
     "computes torch.float8_e4m3fn: float8 partial sums cannot be added", "rs-float8-output"),
    (_float8_out_contract_k, _inputs((8, 8), (16, 32)), "ag.matmuls_left_out",
     "(contract_k): a torch.float8_e4m3fn product (or result scale) summed over blocks",
     "ag-contract-k-float8-output"),
    (_cast_after_the_gather, _inputs((4, 32), (16, 32), dtype=torch.bfloat16),
     "ag.matmuls_left_out",
     "_to_copy (_to_copy.default) sits between the gathered tensor and a matmul",
     "ag-cast-after-the-gather"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fn", "inputs", "code", "reason"), [d[:4] for d in DECLINES], ids=[d[4] for d in DECLINES]
)
def test_what_cannot_be_decomposed_exactly_is_declined_with_a_code(
    fake_world, fn, inputs, code, reason
):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    before = gm.code
    record = rewrite(gm)
    assert (record.decision, record.decline_code) == ("declined", code), record.reason
    assert reason in record.reason
    assert gm.code == before


def test_a_block_the_cuda_kernel_refuses_is_declined(fake_world):
    """CUDA's kernel takes only dims divisible by 16: a reduce-scatter of N = 32 columns
    over 4 ranks would multiply blocks of 8 (the meta function says so on fake CUDA
    tensors); the site is declined, the graph left as it was."""
    case = Scaled(side="scatter", a=(2, 8, 32), dim=2, n_out=32)
    mode = FakeTensorMode()

    def on_cuda(t):
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(mode, meta, torch.device("cuda", 0))

    gm = make_fx(case.fn(N), tracing_mode="fake")(*map(on_cuda, case.inputs(RANK, 0, N)))
    before = gm.code
    record = rewrite(gm)
    assert (record.decision, record.decline_code) == ("declined", "lower.scaled_block")
    assert "divisible by 16" in record.reason and gm.code == before


# ----------------------------------------------------------------------------------------
# numbers on gloo ranks

# bfloat16: one unit in the last place of the result (Inductor fuses the partial sums'
# additions and the "avg" division without rounding between them; eager rounds each)
BF16_ULP = 2**-7


def _check(pool, case, inner, schedule="ring"):
    """Every rank: the rewritten program's outputs against the original's (collectives
    and fused scaled matmuls), run the same way; returns the largest difference per
    output, relative to the output's largest value."""
    results = pool.run(run_case, case, 11, {"schedule": schedule}, "fake", inner)
    worst = []
    for out in results:
        assert out["collectives_left"] == 0 and out["p2p"] == pool.world_size - 1
        pairs = list(zip(out["actual"], out["expected"], strict=True))
        if case.side == "gather":  # the rebuilt gathered tensor: the same bytes
            actual, expected = pairs.pop(0)
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        for actual, expected in pairs:
            scale = expected.abs().max().item()
            torch.testing.assert_close(actual, expected, rtol=BF16_ULP, atol=BF16_ULP * scale)
            worst.append((actual - expected).abs().max().item() / scale)
    return max(worst)


def _cells():
    """Every port on 2, 3 and 4 ranks, eager and Inductor: by default each port once,
    eager (the rank count turning), and four Inductor cells; the rest under -m matrix."""
    inductor = {"ag-3d-dim1-row": 3, "ag-2d-dim1-tensor": 2, "rs-3d-dim2-row": 4}
    inductor |= {"rs-3d-dim1-tensor": 3}
    cells = []
    for i, port in enumerate(PORTS):
        (case, _), name = port.values, port.id
        for n in (2, 3, 4):
            for inner in ("eager", "inductor"):
                default = n == (inductor.get(name) if inner == "inductor" else 2 + i % 3)
                marks = () if default else (pytest.mark.matrix,)
                cells.append(pytest.param(case, n, inner, marks=marks, id=f"{name}-n{n}-{inner}"))
    return cells


@pytest.mark.parametrize(("case", "n", "inner"), _cells())
def test_scaled_sites_compute_what_the_fused_ops_do_on_gloo(ranks, case, n, inner):
    _check(ranks(n), case, inner)


@pytest.mark.parametrize(
    ("case", "n", "schedule"),
    [
        (Scaled(a=(2, 6, 32), dim=1, scaling="row", bias=True, fast_accum=True), 3, "bidir"),
        (Scaled(side="scatter", a=(4, 6, 32), dim=1, n_out=64, op="avg"), 3, "push"),
        (Scaled(a=(2, 4, 32), dim=1, scaling="row"), 4, "slicing"),
    ],
    ids=["ag-bidir-bias-fast-accum", "rs-push-avg", "ag-slicing"],
)
def test_every_schedule_decomposes_scaled_sites(ranks, case, n, schedule):
    """bidir, push and slicing (whose chunk all-gathers move the shard's bytes, as the
    original collective did) with bias, fast accumulation and "avg"."""
    results = ranks(n).run(run_case, case, 5, {"schedule": schedule}, "fake", "eager")
    for out in results:
        for actual, expected in zip(out["actual"], out["expected"], strict=True):
            scale = expected.abs().max().item()
            torch.testing.assert_close(actual, expected, rtol=BF16_ULP, atol=BF16_ULP * scale)


def test_a_port_with_bias_and_avg_is_exact_for_two_ranks(ranks):
    """n = 2: each block adds the same two bfloat16 partials as gloo does: bit for bit."""
    case = Scaled(side="scatter", a=(2, 6, 32), dim=2, n_out=64, scaling="row", bias=True)
    case = dataclasses.replace(case, op="avg")
    for out in ranks(2).run(run_case, case, 3, {"schedule": "ring"}, "fake", "eager"):
        torch.testing.assert_close(out["actual"][0], out["expected"][0], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# a training front end: Megatron-style TP+SP with float8 linears (tools/training/float8.py)


@pytest.mark.parametrize(
    ("n", "inner"),
    [
        pytest.param(2, "eager", id="n2-eager"),
        pytest.param(2, "inductor", id="n2-inductor", marks=pytest.mark.matrix),
        pytest.param(4, "inductor", id="n4-inductor", marks=pytest.mark.matrix),
    ],
)
def test_float8_megatron_front_end_trains_with_every_site_rewritten(ranks, n, inner):
    """Every site of a 2-block step, forward and backward, is rewritten, and the losses
    follow the uncompiled model's. Float8 quantizes each linear's input anew: a value a
    float32 summation order moves by one unit can round to another float8 value, so the
    losses agree to ~1e-5, not bit for bit, as soon as the order differs (n > 2)."""
    from commfuse_compile.tools.training import fronts, loop

    cfg = fronts.TrainConfig(front="float8", blocks=2, steps=3, seq=8 * n, bias=True)
    fused, eager = ranks(n).run(loop.compare, cfg, {"schedule": "ring", "inner": inner})[0]
    rows = loop.summarize(fused.sites)
    table = {(r.graph, r.kind): (r.found, r.rewritten) for r in rows if r.kind != "mm_ar"}
    assert table == {
        (graph, kind): (4, 4) for graph in ("forward", "backward") for kind in ("ag_mm", "mm_rs")
    }
    # the amax all-reduces (max of |x|) are recorded, declined: no matmul behind them
    assert all(set(r.reasons) == {"ar.not_matmul"} for r in rows if r.kind == "mm_ar")
    assert loop.max_relative_diff(fused.losses, eager.losses) < 1e-4
