"""Dynamic shapes: sites whose token (row) dims are symbolic, as torch.compile(dynamic=True)
traces them, are rewritten; divisibility the ShapeEnv cannot prove is declined.

Graph tests trace with ``make_fx(tracing_mode="symbolic")`` on torch's fake process group
(rank 1 of 4) and re-run the rewritten graph on fake inputs of other sizes: the sizes it
computes (slice bounds, views) follow the symbols, not the trace's example sizes. The
last test compiles with ``dynamic=True`` on real gloo ranks and calls with a sequence
length that changes between calls.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from cases import AgMm, gathered, scattered
from models import rms_norm
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph

N, RANK = 4, 1
K, H = 8, 6  # feature dims: static, like parameter shapes under torch.compile

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
P2P = torch.ops.commfuse.p2p.default
COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def symbolic(fn, *inputs: torch.Tensor) -> GraphModule:
    return make_fx(fn, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*inputs)


def rewrite(gm: GraphModule, schedule: str = "ring") -> list[report.SiteRecord]:
    return rewrite_graph(gm, "forward", Options(schedule=schedule, inner="eager"))


def output_shapes(gm: GraphModule, *inputs: torch.Tensor) -> list[torch.Size]:
    """The graph run on fake copies of ``inputs`` (concrete sizes: no symbols left)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) for x in inputs]
    with mode:
        outs = FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return [out.shape for out in (outs if isinstance(outs, tuple | list) else [outs])]


def assert_rewritten(gm: GraphModule, records, traced, *other_sizes) -> None:
    """Every site rewritten into P2P steps, no collective left, the graph well formed, and
    (for inputs of other sizes) the same output shapes as the original graph."""
    assert [r.decision for r in records] == ["rewritten"] * len(records), [
        r.reason for r in records
    ]
    targets = [n.target for n in gm.graph.nodes]
    assert P2P in targets
    assert not any(t in COLLECTIVES for t in targets)
    gm.graph.lint()
    for inputs in other_sizes:
        assert output_shapes(gm, *inputs) == output_shapes(traced, *inputs)


def guards(gm: GraphModule) -> int:
    """How many guards the graph's ShapeEnv holds."""
    value = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"]
    return len(value.fake_mode.shape_env.guards)


def traced_and_rewritten(fn, schedule: str, *inputs):
    """The traced graph, and a second trace rewritten (which must add no guard)."""
    traced = symbolic(fn, *inputs)
    gm = symbolic(fn, *inputs)
    before = guards(gm)
    records = rewrite(gm, schedule)
    assert guards(gm) == before
    return traced, gm, records


# ----------------------------------------------------------------------------------------
# all-gather -> matmul: rows and contract roles, gathered on dim 0 or (split + cat) dim 1


@pytest.mark.parametrize("schedule", ["ring", "bidir", "push"])
@pytest.mark.parametrize(
    "case",
    [
        AgMm(shard=(7, K), dim=0, consumers=2, bias=True),
        AgMm(shard=(2, 5, K), dim=1, consumers=1, contract=1),
        AgMm(shard=(5, K), dim=0, consumers=0, contract=2, extra_user=True),
    ],
    ids=["rows-dim0", "rows-contract-dim1", "contract-extra-user"],
)
def test_all_gather_matmul_with_symbolic_rows(case, schedule):
    """Example sizes are distinct: equal ones would be one symbol (duck sizing), which
    other sizes must then keep equal."""
    fn = case.fn(N)
    traced, gm, records = traced_and_rewritten(fn, schedule, *case.inputs(RANK, 0, N))
    assert any(dims_are_symbolic(r.match["gathered_shape"]) for r in records)
    bigger = type(case)(**{**case.__dict__, "shard": (*[s + 3 for s in case.shard[:-1]], K)})
    assert_rewritten(gm, records, traced, bigger.inputs(RANK, 1, N))


def dims_are_symbolic(shape) -> bool:
    return any(isinstance(size, str) for size in shape)


# ----------------------------------------------------------------------------------------
# matmul -> reduce-scatter: the product's rows are n times a symbol


def tokens_times_n(x: torch.Tensor) -> torch.Tensor:
    """[s, ...] -> [N*s, ...]: a row count the ShapeEnv knows is divisible by N."""
    return torch.cat([x] * N)


def scatter_rows(x, w):
    return scattered(torch.mm(tokens_times_n(x), w), N, 0)


def scatter_dim1(x, w, b):
    """x: [2, s, K] -> [2, N*s, K] -> addmm -> [2, N*s, H], scattered on dim 1."""
    a = torch.cat([x] * N, dim=1)
    z = torch.addmm(b, a.reshape(-1, K), w)
    return scattered(z.view(x.shape[0], -1, H), N, 1)


def scatter_sum_of_matmuls(x, w1, w2):
    a = tokens_times_n(x)
    return scattered(torch.mm(a, w1) + torch.mm(a, w2), N, 0)


W_COLUMNS = torch.randn(K, H * N)


def scatter_columns(x):
    """The (static) columns of a constant weight are scattered; the rows are symbolic."""
    return scattered(torch.mm(x, W_COLUMNS), N, 1)


def gather_mm_scatter(x, w1, w2):
    """The tensor-parallel MLP: the RS input is the AG's N*s rows."""
    h = torch.mm(gathered(x, N, 0), w1)
    return scattered(torch.mm(h, w2), N, 0)


@pytest.mark.parametrize("schedule", ["ring", "bidir", "push"])
@pytest.mark.parametrize(
    ("fn", "shapes", "other"),
    [
        (scatter_rows, [(3, K), (K, H)], [(7, K), (K, H)]),
        (scatter_dim1, [(2, 3, K), (K, H), (H,)], [(2, 5, K), (K, H), (H,)]),
        (scatter_sum_of_matmuls, [(3, K), (K, H), (K, H)], [(9, K), (K, H), (K, H)]),
        (scatter_columns, [(3, K)], [(5, K)]),
        (gather_mm_scatter, [(3, K), (K, H), (H, K)], [(5, K), (K, H), (H, K)]),
    ],
    ids=["rows", "dim1-bias", "sum-of-matmuls", "columns", "ag-mm-mm-rs"],
)
def test_matmul_reduce_scatter_with_symbolic_rows(fn, shapes, other, schedule):
    traced, gm, records = traced_and_rewritten(fn, schedule, *(torch.randn(s) for s in shapes))
    assert any(dims_are_symbolic(r.match.get("product_shape", [])) for r in records)
    assert_rewritten(gm, records, traced, [torch.randn(s) for s in other])


def test_reduce_scatter_not_provably_divisible_is_declined():
    """[s, H] scattered on the s rows: s % 4 == 0 is not known, and no guard is added."""

    def scatter_any_rows(x, w):
        return scattered(torch.mm(x, w), N, 0)

    traced, gm, (record,) = traced_and_rewritten(
        scatter_any_rows, "ring", torch.randn(8, K), torch.randn(K, H)
    )
    assert record.decision == "declined"
    assert record.reason.startswith("scattered dim 0 of symbolic size s")
    assert record.reason.endswith("is not provably divisible by 4 (no guard is added)")
    assert gm.code == traced.code


def gather_two_chunks(x, w):
    """The shard's rows are 2*s: two slicing chunks divide them, provably."""
    return torch.mm(gathered(torch.cat([x, x]), N, 0), w)


def scatter_two_chunks_per_block(x, w):
    return scattered(torch.mm(torch.cat([x] * 2 * N), w), N, 0)


@pytest.mark.parametrize("fn", [gather_two_chunks, scatter_two_chunks_per_block])
def test_slicing_with_provable_chunks(fn):
    shapes, other = [(3, K), (K, H)], [(5, K), (K, H)]
    traced, gm, records = traced_and_rewritten(fn, "slicing", *(torch.randn(s) for s in shapes))
    assert [r.decision for r in records] == ["rewritten"]
    assert output_shapes(gm, *(torch.randn(s) for s in other)) == output_shapes(
        traced, *(torch.randn(s) for s in other)
    )


def test_slicing_declines_chunks_not_provably_dividing():
    case = AgMm(shard=(7, K), dim=0, consumers=1)
    (record,) = rewrite(symbolic(case.fn(N), *case.inputs(RANK, 0, N)), "slicing")
    assert record.decision == "declined"
    assert record.reason.startswith("slicing: 2 chunks do not provably divide the shard's dim 0")


def test_cost_model_uses_hints():
    """``auto`` predicts on the traced sizes; every schedule gets a finite prediction."""
    case = AgMm(shard=(6, K), dim=0, consumers=1)
    gm = symbolic(case.fn(N), *case.inputs(RANK, 0, N))
    (record,) = rewrite(gm, "auto")
    predicted = record.predicted_us
    assert {"collective", "ring"} <= set(predicted)
    assert all(0 < t < float("inf") for t in predicted.values())


# ----------------------------------------------------------------------------------------
# torch.compile(dynamic=True) on gloo ranks, with a sequence length that changes


class SequenceParallelMlp(torch.nn.Module):
    """all-gather the tokens (on ``dim``), two linears, reduce-scatter back (on ``dim``).
    Parameter shapes are static under torch.compile; the token dims are not."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.n, self.dim = n, dim
        self.up = torch.nn.Parameter(torch.randn(K, H, generator=gen), requires_grad=False)
        self.down = torch.nn.Parameter(torch.randn(H, K, generator=gen), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = gathered(x, self.n, self.dim)
        h = torch.relu(g.reshape(-1, K) @ self.up)
        return scattered((h @ self.down).view(*g.shape[:-1], K), self.n, self.dim)


def compile_with_changing_lengths(rank: int, n: int, dim: int, lengths: list[int]) -> dict:
    import torch._dynamo

    torch.set_num_threads(1)
    torch._dynamo.reset()
    report.reset()
    torch._dynamo.utils.counters.clear()
    model = SequenceParallelMlp(n, dim)
    options = {"schedule": "ring", "inner": "eager"}
    compiled = torch.compile(model, backend="commfuse", dynamic=True, options=options)
    diffs = []
    for length in lengths:
        gen = torch.Generator().manual_seed(rank * 100 + length)
        x = torch.randn((length, K) if dim == 0 else (2, length, K), generator=gen)
        expected, actual = model(x), compiled(x)
        assert actual.shape == expected.shape
        diffs.append((actual - expected).abs().max().item())
    return {
        "diffs": diffs,
        "sites": [(s.graph, s.kind, s.decision, s.reason) for s in report.REPORT.sites],
        "graphs": report.REPORT.graphs,
        "frames_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "recompiles": sum(torch._dynamo.utils.counters["recompiles"].values()),
    }


@pytest.mark.parametrize("dim", [0, 1])
def test_compile_dynamic_sequence_length(ranks, dim):
    """One compiled graph serves 4, 6 and 10 tokens per rank: both sites rewritten once,
    no recompile, every output equal to the uncompiled module's."""
    for res in ranks(2).run(compile_with_changing_lengths, dim, [4, 6, 10]):
        assert max(res["diffs"]) <= 1e-5, res["diffs"]
        assert res["sites"] == [
            ("inference", "ag_mm", "rewritten", "schedule 'ring' requested"),
            ("inference", "mm_rs", "rewritten", "schedule 'ring' requested"),
        ]
        assert (res["graphs"], res["frames_compiled"], res["recompiles"]) == (1, 1, 0)


def test_full_slice_after_the_gather_is_seen_through():
    """DTensor unpads a gather it cannot prove even with ``slice(x, 1, 0, size)``; when
    that is the whole dim (Dynamo's automatic dynamic shapes on a TP block) it is a view.
    make_fx drops such a slice, so it is put back into the traced graph by hand."""

    def gather_view_mm(x, w):
        g = gathered(x, N, 0)
        return g.view(1, g.shape[0], K).reshape(-1, K) @ w

    def with_full_slice() -> GraphModule:
        gm = symbolic(gather_view_mm, *inputs)
        view = next(n for n in gm.graph.nodes if n.target is aten.view.default)
        with gm.graph.inserting_after(view):
            size = gm.graph.call_function(aten.sym_size.int, (view, 1))
        with gm.graph.inserting_after(size):
            whole = gm.graph.call_function(aten.slice.Tensor, (view, 1, 0, size))
        view.replace_all_uses_with(whole, delete_user_cb=lambda user: user not in (size, whole))
        size.meta["val"] = view.meta["val"].shape[1]
        whole.meta["val"] = view.meta["val"]
        gm.recompile()
        return gm

    inputs = (torch.randn(3, K), torch.randn(K, 6))
    traced, gm = with_full_slice(), with_full_slice()
    records = rewrite(gm)
    assert_rewritten(gm, records, traced, (torch.randn(5, K), torch.randn(K, 6)))


def test_partial_slice_after_the_gather_is_declined():
    def sliced(x, w):
        g = gathered(x, N, 0)
        return g[1:] @ w

    _, _, (record,) = traced_and_rewritten(sliced, "ring", torch.randn(3, K), torch.randn(K, 6))
    assert record.decision == "declined"
    assert "(slice.Tensor) sits between the gathered tensor and a matmul" in record.reason


# ----------------------------------------------------------------------------------------
# plain TP's all-reduces with a token count Dynamo made symbolic (a second prompt length)


def reduced(y: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(y, "sum", dist.group.WORLD.group_name))


W_O, W_Q, NORM_W = torch.randn(K, H), torch.randn(H, H), torch.randn(H)


def two_prompts(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor):
    """A block's row-parallel output for a batch of 4 prompts (4*s tokens: 4 ranks
    divide them, provably), residual add, norm and the next matmul; and one for a batch
    of 2 (2*s tokens: not provably divisible by 4)."""
    h2 = h + reduced(x.view(-1, K) @ W_O).view(h.shape)
    normed = rms_norm(h2, NORM_W).view(-1, H)
    return h2, normed @ W_Q, reduced(y.view(-1, K) @ W_O)


@pytest.mark.parametrize("schedule", ["ring", "auto"])
def test_all_reduces_of_a_second_prompt_length_split_where_provable(schedule):
    """Dynamo's automatic dynamic shapes: the second call's prompt length is a symbol s.
    The all-reduce of 4*s tokens is split (its reduce-scatter and gather rewritten under
    ``ring``; under ``auto`` on loopback kept whole, as at the first length); the one of
    2*s tokens is declined by name; no internal error leaves the graph whole."""
    torch._dynamo.reset()
    report.reset()
    options = {"schedule": schedule, "inner": "eager"}
    compiled = torch.compile(two_prompts, backend="commfuse", options=options)
    for length in (4, 6):
        x, y = torch.randn(4, length, K), torch.randn(2, length, K)
        compiled(x, y, torch.randn(4, length, H))
    torch._dynamo.reset()
    dynamic = [r for r in report.REPORT.sites if r.graph_index == 1]
    assert all(r.decline_code != "internal.error" for r in report.REPORT.sites)
    symbolic_shapes = [r.match["product_shape"] for r in dynamic if "product_shape" in r.match]
    assert any(dims_are_symbolic(shape) for shape in symbolic_shapes)
    (not_provable,) = [r for r in dynamic if r.decline_code == "ar.not_provably_divisible"]
    assert re.fullmatch(
        r"the product's 2\*s\d+ rows \(tokens\) are not provably divisible by the group size 4",
        not_provable.reason,
    )
    if schedule == "ring":
        assert [(r.kind, r.decision) for r in dynamic if r is not not_provable] == [
            ("mm_rs", "rewritten"),
            ("ag_mm", "declined"),  # the residual returned: gathered whole
            ("ag_mm", "rewritten"),
        ]
    else:
        assert [(r.kind, r.decline_code) for r in dynamic if r is not not_provable] == [
            ("mm_ar", "plan.not_profitable")
        ]
