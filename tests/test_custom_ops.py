"""Collectives that frameworks wrap in custom ops (``passes/fx/custom_ops.py``): a known op
(DeepSpeed's ``deepspeed::dim_zero_all_to_all``, defined here as DeepSpeed defines it by
``tools/training/deepspeed_hf.py``) or one a user registers is rewritten as the
functional collective it computes; any other op that takes a process group gets a
record; a bad registration raises.

Graph level, on torch's fake process group (rank 1 of 4). Numbers on gloo ranks:
tests/test_deepspeed_hf.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import records_of
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import CommfuseOptionError
from commfuse_compile.passes.fx import custom_ops
from commfuse_compile.tools.training import deepspeed_hf  # noqa: F401 (defines deepspeed::dim_zero_all_to_all)

N, RANK = 4, 1
c10d = torch.ops._c10d_functional
P2P = torch.ops.commfuse.p2p.default
DEEPSPEED = torch.ops.deepspeed.dim_zero_all_to_all.default


@torch.library.custom_op("mylib::exchange", mutates_args=())
def exchange(input: torch.Tensor, group_name: str) -> torch.Tensor:
    """A framework's all-to-all the pass does not know (DeepSpeed's schema)."""
    raise NotImplementedError  # traced only


exchange.register_fake(lambda input, group_name: torch.empty_like(input))


@torch.library.custom_op("mylib::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group: str) -> torch.Tensor:
    raise NotImplementedError


reduce_scatter.register_fake(lambda x, group: x.new_empty(x.shape[0] // N, *x.shape[1:]))


@torch.library.custom_op("mylib::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    raise NotImplementedError


all_gather.register_fake(lambda x, group_name: x.new_empty(x.shape[0] * N, *x.shape[1:]))


@torch.library.custom_op("mylib::scaled", mutates_args=())
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    raise NotImplementedError  # takes no group: not a collective


scaled.register_fake(lambda x, factor: torch.empty_like(x))


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


@pytest.fixture
def registered():
    """Ops registered by a test are forgotten after it."""
    ops: list[str] = []
    yield (
        lambda op, *args, **kw: (
            ops.append(op) or commfuse_compile.register_collective_op(op, *args, **kw)
        )
    )
    for op in ops:
        commfuse_compile.unregister_collective_op(op)


def group() -> str:
    return dist.group.WORLD.group_name


def heads_exchanged(op, b=2, s=3, hl=2, d=2):
    """UlyssesSPAttentionHF's q: x @ Wq as [s, b, n, h/n, d], block j to rank j, by ``op``."""

    def program(x, w):
        q = (x @ w).view(b, s, N, hl, d).permute(2, 1, 0, 3, 4).contiguous()
        return (op(q, group()).reshape(N * s, b, hl, d) * 2,)

    return make_fx(program, tracing_mode="fake")(torch.randn(b * s, 5), torch.randn(5, N * hl * d))


def sequence_exchanged(op, b=2, s=3, hl=2, d=2):
    """UlyssesSPAttentionHF's output: [sl, bs, em_l] as [n, sl_l, bs, em_l] by ``op``, then
    o_proj (the heads contracted)."""

    def program(o, w):
        out = op(o.reshape(N, s, b, hl * d).contiguous(), group())
        return (out.permute(1, 2, 0, 3).reshape(s * b, N * hl * d) @ w,)

    return make_fx(program, tracing_mode="fake")(
        torch.randn(N * s, b, hl * d), torch.randn(N * hl * d, 5)
    )


def targets(gm: GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ----------------------------------------------------------------------------------------
# DeepSpeed's op, known


@pytest.mark.parametrize(
    ("program", "kind", "layout"),
    [
        (heads_exchanged, "mm_a2a", {"blocks": "columns"}),
        (sequence_exchanged, "a2a_mm", {"roles": {"mm": "contract"}}),
    ],
)
def test_deepspeeds_all_to_all_op_is_rewritten_as_the_functional_one(program, kind, layout):
    gm = program(torch.ops.deepspeed.dim_zero_all_to_all)
    assert DEEPSPEED in targets(gm)
    (record,) = records_of(gm)
    assert (record.kind, record.decision) == (kind, "rewritten"), record.reason
    assert {k: record.match[k] for k in layout} == layout
    assert record.match["group"] == group() and record.match["group_size"] == N
    assert DEEPSPEED not in targets(gm) and c10d.all_to_all_single.default not in targets(gm)
    assert targets(gm).count(P2P) == N - 1
    gm.graph.lint()


def test_a_known_op_whose_call_does_not_fit_is_recorded_and_kept():
    """Dim 0 of 6 cannot be 4 equal blocks: the op stays, with the reason."""
    gm = make_fx(
        lambda x: torch.ops.deepspeed.dim_zero_all_to_all(x, group()) @ x.t(), tracing_mode="fake"
    )(torch.randn(6, 3))
    before = gm.code
    (record,) = records_of(gm)
    assert (record.kind, record.decline_code) == ("collective", "site.custom_op_unfit")
    assert "dim 0 of its input [6, 3] is not divisible by 4" in record.reason
    assert gm.code == before


# ----------------------------------------------------------------------------------------
# ops the pass does not know; registered ones


def test_an_unknown_op_that_takes_a_group_gets_a_record_and_nothing_changes():
    """Before the op is registered: 0 sites rewritten, the graph as it came."""
    gm = heads_exchanged(exchange)
    before = gm.code
    (record,) = records_of(gm)
    assert (record.kind, record.decision, record.decline_code) == (
        "collective",
        "declined",
        "site.custom_op",
    )
    assert record.reason.startswith("exchange calls mylib::exchange, which takes a process group")
    assert record.match["group"] == group() and record.match["group_size"] == N
    assert gm.code == before


def test_an_op_without_a_group_is_no_collective():
    gm = make_fx(lambda x: scaled(x, 2.0) @ x.t(), tracing_mode="fake")(torch.randn(4, 3))
    assert records_of(gm) == []


def test_a_registered_all_to_all_is_rewritten_until_it_is_unregistered(registered):
    entry = registered("mylib::exchange", "all_to_all_single")
    assert entry == custom_ops.CollectiveOp("mylib::exchange", "all_to_all_single")
    (record,) = records_of(heads_exchanged(exchange))
    assert (record.kind, record.decision) == ("mm_a2a", "rewritten")
    commfuse_compile.unregister_collective_op("mylib::exchange")
    (record,) = records_of(heads_exchanged(exchange))
    assert record.decline_code == "site.custom_op"


def test_a_registered_reduce_scatter_and_all_gather_are_rewritten_as_theirs(registered):
    """MM -> RS and AG -> MM sites through a framework's ops, arguments named as theirs."""
    registered(
        "mylib::reduce_scatter", "reduce_scatter_tensor", tensor="x", group="group", reduce_op="sum"
    )
    registered("mylib::all_gather", "all_gather_into_tensor", tensor="x")

    def program(x, w1, w2):
        y = reduce_scatter(x @ w1, group())
        return (all_gather(y, group()) @ w2,)

    gm = make_fx(program, tracing_mode="fake")(
        torch.randn(8, 3), torch.randn(3, 5), torch.randn(5, 2)
    )
    records = records_of(gm)
    assert sorted((r.kind, r.decision) for r in records) == [
        ("ag_mm", "rewritten"),
        ("mm_rs", "rewritten"),
    ]
    assert targets(gm).count(P2P) == 2 * (N - 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        (
            ("mylib::nothing", "all_reduce"),
            {"reduce_op": "sum"},
            "torch.ops has no op 'mylib::nothing'",
        ),
        (("nonsense", "all_reduce"), {"reduce_op": "sum"}, "is not a 'namespace::name' of an op"),
        (("mylib::exchange", "all_to_all"), {}, "collective must be one of all_to_all_single"),
        (("mylib::exchange", "all_reduce"), {}, "all_reduce needs reduce_op, one of avg"),
        (("mylib::exchange", "all_to_all_single"), {"reduce_op": "sum"}, "takes no reduce_op"),
        (("mylib::exchange", "all_to_all_single"), {"tensor": "x"}, "has no tensor argument 'x'"),
        (
            ("mylib::scaled", "all_reduce"),
            {"tensor": "x", "reduce_op": "sum"},
            "no string argument 'group_name'",
        ),
    ],
)
def test_a_bad_registration_raises_and_says_why(args, kwargs, error):
    with pytest.raises(CommfuseOptionError, match="register_collective_op") as raised:
        commfuse_compile.register_collective_op(*args, **kwargs)
    assert error in str(raised.value)
    assert custom_ops.collective_of(torch.ops.mylib.exchange.default) is None


def test_a_process_group_argument_is_a_group_too():
    """An op declared with a ProcessGroup (torch.library.define) takes a group."""
    torch.library.define(
        "mylib::with_group", "(Tensor x, __torch__.torch.classes.c10d.ProcessGroup pg) -> Tensor"
    )
    assert custom_ops.group_argument(torch.ops.mylib.with_group.default) == "pg"
    assert custom_ops.group_argument(torch.ops.mylib.scaled.default) is None
    assert custom_ops.group_argument(c10d.all_reduce.default) is None  # torch's own
