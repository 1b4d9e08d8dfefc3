"""The collectives the sites leave in place, merged where it pays (``passes/bucket.py``):
which go into a bucket and which do not, and why (graph level, torch's fake process
group, rank 1 of 4); the numbers on 3 gloo ranks: a reduce-scatter bucket's per-rank
blocks, and plain TP's norm-gradient all-reduces giving the gradients of the unbucketed
compile.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph

c10d = torch.ops._c10d_functional
RING = Options(schedule="ring", inner="eager")


@pytest.fixture
def world():
    """The fake world of 4 ranks and a group of 2 in it: the group's name."""
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    pair = dist.new_group([0, 1])
    yield pair.group_name
    dist.destroy_process_group()


def summed(x: torch.Tensor, op: str = "sum", group: str | None = None) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x, op, group or dist.group.WORLD.group_name))


def scattered(x: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 4, dist.group.WORLD.group_name))


def fx(fn, *shapes) -> GraphModule:
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def calls(gm: GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def buckets_of(records) -> list[tuple[str, int, str]]:
    """Per site: its collective, its bucket, and the code of why it has none."""
    return [(r.match["collectives"][0], r.bucket, r.bucket_code) for r in records]


def norm_gradients(g, h, w, b):
    """Three norm-like gradient sums over the tokens, each all-reduced, read at the end."""
    return summed((g * h).sum(0)), summed(g.sum(0)), summed((g * w).sum(0)).view(2, 8) + b


SHAPES = [(6, 16), (6, 16), (16,), (2, 8)]


def test_all_reduces_read_at_the_end_go_as_one(world):
    report.reset()
    gm = fx(norm_gradients, *SHAPES)
    records = rewrite_graph(gm, "backward", RING)
    assert [r.decline_code for r in records] == ["ar.not_matmul"] * 3
    assert buckets_of(records) == [("all_reduce", 0, ""), ("all_reduce_1", 0, ""),
                                   ("all_reduce_2", 0, "")]  # fmt: skip
    (merged,) = calls(gm, c10d.all_reduce.default)
    assert list(merged.meta["val"].shape) == [48]
    (cat,) = calls(gm, torch.ops.aten.cat.default)
    assert merged.args[0] is cat
    gm.graph.lint()  # every value defined before it is read
    (bucket,) = report.REPORT.buckets
    assert (bucket.op, bucket.reduce_op, bucket.group, bucket.dtype) == (
        "all_reduce", "sum", dist.group.WORLD.group_name, "float32")  # fmt: skip
    assert bucket.collectives == ["all_reduce", "all_reduce_1", "all_reduce_2"]
    assert bucket.sites == [r.site for r in records]
    assert bucket.bytes == [64, 64, 64] and bucket.as_json()["total_bytes"] == 192
    # gloo's fixed cost per collective, twice saved: merged is predicted the faster
    assert bucket.predicted_us["bucketed"] < bucket.predicted_us["apart"] / 2
    assert bucket.saving_us == pytest.approx(
        bucket.predicted_us["apart"] - bucket.predicted_us["bucketed"], abs=0.02
    )
    assert "3 collectives in 1 bucket" in report.summary_line(records, "backward", [bucket])


def test_groups_and_ops_apart(world):
    """One bucket per group, op and reduce op: the collective alone with its own says so."""

    def mixed(g, h, w, b):
        first, other_group = summed(g.sum(0)), summed(h.sum(0), group=world)
        maximum, second = summed(w, op="max"), summed(b.sum(0))
        return first, other_group, maximum, second

    gm = fx(mixed, *SHAPES)
    records = rewrite_graph(gm, "backward", RING)
    assert buckets_of(records) == [
        ("all_reduce", 0, ""),
        ("all_reduce_1", -1, "bucket.alone"),
        ("all_reduce_2", -1, "bucket.alone"),
        ("all_reduce_3", 0, ""),
    ]
    assert records[1].bucket_reason == f"no other all_reduce on group {world} (sum, float32)"
    assert len(calls(gm, c10d.all_reduce.default)) == 3


def test_input_ready_after_another_collectives_reader_is_not_merged(world):
    """The second all-reduce reads the first one's value: merged, the first one's reader
    would wait for a collective that waits for it. Neither moves; the graph stays acyclic."""

    def chained(g, h, w, b):
        first = summed(g.sum(0))
        return summed(first * 2.0), summed(h.sum(0))

    gm = fx(chained, *SHAPES)
    records = rewrite_graph(gm, "backward", RING)
    assert buckets_of(records) == [
        ("all_reduce", -1, "bucket.read_early"),
        ("all_reduce_1", 0, ""),  # the third one, independent, joins the second
        ("all_reduce_2", 0, ""),
    ]
    assert records[0].bucket_reason.startswith("all_reduce's value is read by mul")
    assert "before all_reduce_1 starts" in records[0].bucket_reason
    gm.graph.lint()
    first, merged = calls(gm, c10d.all_reduce.default)
    assert first.name == "all_reduce" and list(merged.meta["val"].shape) == [32]


def test_collective_hidden_behind_matmuls_stays_apart(world):
    """An all-reduce whose wait comes after a large matmul is hidden behind it: merged with
    a later one it would start after the matmul and be exposed (cost model: not
    profitable)."""

    def hidden(g, h, a, b):
        started = c10d.all_reduce(g.sum(0), "sum", dist.group.WORLD.group_name)
        product = a @ b
        first = c10d.wait_tensor(started)
        return first, product, summed(h.sum(0))

    gm = fx(hidden, (6, 16), (6, 16), (512, 512), (512, 512))
    records = rewrite_graph(gm, "backward", RING)
    assert [r.bucket_code for r in records if r.kind == "mm_ar"] == ["bucket.not_profitable"] * 2
    assert "merged with all_reduce:" in records[-1].bucket_reason
    assert len(calls(gm, c10d.all_reduce.default)) == 2


def test_reduce_scatters_interleaved_by_rank(world):
    """Each input's rank-r rows land in the merged buffer's rank-r block: every input
    viewed as [n, -1], concatenated along dim 1."""

    def two_scatters(a, b):
        return scattered(a * 2.0), scattered(b * 3.0)

    gm = fx(two_scatters, (8, 3), (4, 5))
    records = rewrite_graph(gm, "backward", RING)
    assert [(r.decline_code, r.bucket) for r in records] == [("rs.no_matmul", 0)] * 2
    (merged,) = calls(gm, c10d.reduce_scatter_tensor.default)
    (cat,) = calls(gm, torch.ops.aten.cat.default)
    assert cat.args[1] == 1 and [list(x.meta["val"].shape) for x in cat.args[0]] == [
        [4, 6], [4, 5]]  # fmt: skip
    assert list(merged.meta["val"].shape) == [11]
    assert report.REPORT.buckets[-1].op == "reduce_scatter"


def test_sharded_data_parallel_norm_reduce_scatters_as_one(world):
    """Sharded data parallelism (``tools/training``'s "fsdp" front, 2 blocks): the 5
    reduce-scatters of the norms' weight gradients no matmul computes go as one."""
    from commfuse_compile.tools.training.fronts import TrainConfig, build

    torch._dynamo.reset()
    report.reset()
    setup = build(TrainConfig(front="fsdp", blocks=2, batch=4), 1, 4)
    options = {"schedule": "ring", "inner": "eager"}
    torch.compile(setup.loss_module, backend="commfuse", options=options)(
        *setup.inputs(0)
    ).backward()
    (bucket,) = report.REPORT.buckets
    assert (bucket.graph, bucket.op, len(bucket.collectives)) == ("backward", "reduce_scatter", 5)
    merged = [r for r in report.REPORT.sites if r.bucket == 0]
    assert {(r.kind, r.decline_code) for r in merged} == {("mm_rs", "rs.no_matmul")}
    assert bucket.predicted_us["bucketed"] < bucket.predicted_us["apart"]


def test_compiler_failure_undoes_the_bucket(world):
    """A bucket alone changes the graph: if the inner compiler rejects it, the graph as
    it came is compiled and the report says the collectives went into no bucket."""
    from commfuse_compile.passes import rewrite_and_compile

    report.reset()
    gm = fx(norm_gradients, *SHAPES)
    before, compiled = gm.code, []

    def compile_fn(g: GraphModule) -> str:
        if calls(g, torch.ops.aten.cat.default):
            raise RuntimeError("compiler says no")
        compiled.append(g.code)
        return "compiled"

    lenient = dataclasses.replace(RING, strict=False)  # the fall-back, not the error
    with pytest.warns(UserWarning, match="inner compiler failed on the rewritten graph"):
        assert rewrite_and_compile(gm, "backward", lenient, compile_fn) == "compiled"
    assert compiled == [before] and len(calls(gm, c10d.all_reduce.default)) == 3
    assert {(r.bucket, r.bucket_code) for r in report.REPORT.sites} == {(-1, "compiler.failed")}
    assert report.REPORT.buckets == []


def test_disabled_and_off(world):
    gm = fx(norm_gradients, *SHAPES)
    records = rewrite_graph(gm, "backward", Options(inner="eager", disable=frozenset({"bucket"})))
    assert {r.bucket_code for r in records} == {"bucket.disabled"}
    assert len(calls(gm, c10d.all_reduce.default)) == 3
    gm = fx(norm_gradients, *SHAPES)
    records = rewrite_graph(gm, "backward", Options(schedule="off", inner="eager"))
    assert {(r.bucket, r.bucket_code) for r in records} == {(-1, "")}
    assert len(calls(gm, c10d.all_reduce.default)) == 3


# ----------------------------------------------------------------------------------------
# numbers on gloo ranks


def scatters_and_sums(rank: int, n: int) -> dict:
    """Two reduce-scatters and two all-reduces of this rank's inputs, compiled (eager
    inner compiler) and not: per output, equal bit for bit and the largest difference;
    and the buckets."""
    torch._dynamo.reset()
    report.reset()
    name = dist.group.WORLD.group_name

    def collectives(a, b, c, d):
        return (
            c10d.wait_tensor(c10d.reduce_scatter_tensor(a * 2.0, "sum", n, name)),
            c10d.wait_tensor(c10d.reduce_scatter_tensor(b + 1.0, "sum", n, name)),
            c10d.wait_tensor(c10d.all_reduce(c.sum(0), "sum", name)),
            c10d.wait_tensor(c10d.all_reduce(d * d, "sum", name)),
        )

    torch.manual_seed(rank)
    inputs = (torch.randn(2 * n, 3), torch.randn(n, 2, 5), torch.randn(4, 7), torch.randn(3))
    options = {"schedule": "ring", "inner": "eager"}
    compiled = torch.compile(collectives, backend="commfuse", options=options, fullgraph=True)
    got, expected = compiled(*inputs), collectives(*inputs)
    return {
        "equal": [torch.equal(x, y) for x, y in zip(got, expected, strict=True)],
        "differences": [(x - y).abs().max().item() for x, y in zip(got, expected, strict=True)],
        "buckets": [(b.op, b.collectives) for b in report.REPORT.buckets],
    }


def test_buckets_give_every_rank_its_blocks(ranks):
    """Each rank gets its own rows of each reduce-scatter's sum (bit for bit: gloo sums
    them in the same order), and each all-reduce's sum (within rounding: gloo cuts a
    larger buffer into other pieces, whose elements it sums in another rank order)."""
    for r in ranks(3).run(scatters_and_sums):
        assert r["equal"][:2] == [True, True], r
        assert max(r["differences"][2:]) < 1e-5, r
        assert [(op, len(merged)) for op, merged in r["buckets"]] == [
            ("reduce_scatter", 2), ("all_reduce", 2)]  # fmt: skip


def plain_tp_gradients(rank: int, n: int, norm: str, inner: str) -> dict:
    """One forward and backward of the plain-TP transformer (one block: its norms and the
    final one give the backward several all-reduces to merge) with ``norm`` and the
    ``inner`` compiler, with the collectives merged and without: the gradients' largest
    difference, the backward's all-reduce sites and the buckets."""
    from commfuse_compile.tools.training.fronts import TrainConfig
    from commfuse_compile.tools.training.loop import gradients

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    cfg = TrainConfig(
        front="tp",
        sequence_parallel=False,
        norm=norm,
        tp=n,
        blocks=1,
        dim=24,
        heads=3,
        hidden=48,
        seq=12,
    )
    ring = {"schedule": "ring", "inner": inner}
    loss, merged, sites = gradients(rank, n, cfg, ring)
    buckets = [(b.graph, b.op, len(b.collectives)) for b in report.REPORT.buckets]
    loss_apart, apart, _ = gradients(rank, n, cfg, {**ring, "disable": ["bucket"]})
    return {
        "loss_equal": torch.equal(loss, loss_apart),
        "differences": {k: (merged[k] - apart[k]).abs().max().item() for k in apart},
        "scales": {k: apart[k].abs().max().item() for k in apart},
        "all_reduces": sum(s["kind"] == "mm_ar" and s["graph"] == "backward" for s in sites),
        "buckets": buckets,
    }


@pytest.mark.parametrize(
    "norm, inner, all_reduces",
    [
        # LayerNorm under Inductor's decompositions: weight and bias of the block's 2, the
        # final weight
        ("layer", "inductor", 5),
        # RMSNorm: each norm's weight gradient (the block's 2, the final norm's)
        pytest.param("rms", "eager", 3, marks=pytest.mark.matrix),
    ],
)
def test_plain_tp_norm_gradients_in_one_all_reduce(ranks, norm, inner, all_reduces):
    """The backward's norm-gradient all-reduces go as one; the gradients are those of the
    compile without buckets: the matmuls' bit for bit, the norms' within rounding (gloo
    sums the elements of a longer buffer in another order)."""
    for r in ranks(3).run(plain_tp_gradients, norm, inner):
        assert r["loss_equal"]
        assert r["all_reduces"] == all_reduces
        assert r["buckets"] == [("backward", "all_reduce", all_reduces)]
        for name, difference in r["differences"].items():
            bitwise = not name.endswith(("norm.weight", "norm.bias"))
            assert difference <= (0 if bitwise else 1e-6 * r["scales"][name]), (name, difference)
