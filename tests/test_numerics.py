"""The rewritten graph computes the numbers of the original, on real gloo ranks.

Property tests: hypothesis draws shapes, dtypes, collective dims, bias, consumers, world
sizes, the schedule (ring, bidirectional ring, push, or slicing into 2 or 3 chunks), the
inner compiler (eager: the rewritten aten graph as it is; Inductor: the program compiled
by ``backend="commfuse"``, the default) and, for all-gathers, static or symbolic sizes
(dynamic shapes); every rank runs the original program (real collectives) and the
rewritten one (P2P steps) on the same inputs, and compares.
Splitting a matmul into row or column blocks keeps each output element's dot product,
but BLAS may pick another kernel for a smaller block (a matrix-vector product for one
row) and sum K in another order; contracting the gathered dim sums blocks in ring order;
a reduce-scatter's partials are summed in ring order instead of gloo's. So outputs are
equal up to summation order, and the rebuilt gathered tensor is equal bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from cases import AgMm, Experts, FusedQkv, MmRs, Ulysses, examples, run_case
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

PROPERTY = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
STEPS_WITH_P2P = {"ring": lambda n: n - 1, "bidir": lambda n: n // 2, "push": lambda n: n - 1}
SCHEDULES = [*STEPS_WITH_P2P, "slicing"]
INNER = st.sampled_from(["eager", "inductor"])
SUM_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _run(pool, case, seed, schedule="ring", slices=2, tracing_mode="fake", inner="eager"):
    options = {"schedule": schedule} | ({"slices": slices} if schedule == "slicing" else {})
    results = pool.run(run_case, case, seed, options, tracing_mode, inner)
    for out in results:
        if schedule == "slicing":  # one collective per chunk, no P2P
            assert (out["collectives_left"], out["p2p"]) == (slices, 0)
        else:
            assert out["collectives_left"] == 0
            assert out["p2p"] == STEPS_WITH_P2P[schedule](pool.world_size)
    return results


def _schedule(draw):
    """A schedule, and the chunk count its sizes are drawn divisible by (1: no slicing)."""
    schedule = draw(st.sampled_from(SCHEDULES))
    return schedule, draw(st.sampled_from([2, 3])) if schedule == "slicing" else 1


@st.composite
def gather_cases(draw):
    n = draw(st.sampled_from([2, 3, 4]))
    schedule, k = _schedule(draw)
    rank3 = draw(st.booleans())
    dim = draw(st.integers(0, 1)) if rank3 else 0
    shard = [draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))]
    shard[dim] *= k
    case = AgMm(
        shard=tuple(shard) if rank3 else (shard[0] * shard[1], shard[2]),
        dim=dim,
        n_out=draw(st.integers(1, 7)),
        consumers=draw(st.integers(0, 2)),
        contract=draw(st.integers(0, 2)),
        columns=draw(st.integers(0, 1)) if dim == 0 else 0,
        left=draw(st.integers(0, 1)),
        bias=draw(st.booleans()),
        extra_user=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
    )
    # symbolic: every size a symbol (dynamic shapes); slicing's chunks of a symbolic shard
    # are not provably equal, so it declines there (tests/test_dynamic.py)
    symbolic = draw(st.booleans()) and schedule != "slicing"
    return n, case, draw(st.integers(0, 10_000)), schedule, k, symbolic, draw(INNER)


@st.composite
def scatter_cases(draw):
    n = draw(st.sampled_from([2, 3, 4]))
    schedule, k = _schedule(draw)
    dim = draw(st.integers(0, 2))
    lead = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    n_out = draw(st.integers(1, 4))
    if dim < 2:
        lead[dim] *= n * k
    else:
        n_out *= n * k
    case = MmRs(
        lead=tuple(lead),
        k=draw(st.integers(1, 9)),
        n_out=n_out,
        dim=dim,
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        terms=draw(st.integers(1, 3)),
        transposed=draw(st.booleans()),
        op=draw(st.sampled_from(["sum", "avg"])),
    )
    return n, case, draw(st.integers(0, 10_000)), schedule, k, draw(INNER)


@pytest.mark.parametrize("examples", examples(8, 40))
def test_all_gather_matmul_matches(ranks, examples):
    """Every matmul output matches up to summation order; the rebuilt gathered tensor
    (the extra user) is bit-exact: it is the same bytes, moved by P2P instead."""

    @settings(PROPERTY, max_examples=examples)
    @given(gather_cases())
    def check(example):
        n, case, seed, schedule, k, symbolic, inner = example
        if case.consumers + case.contract + case.columns + case.left == 0:
            case = dataclasses.replace(case, consumers=1)
        # Inductor turns a matmul with a dim of 1 (of M, K, N) into element-wise ops before the
        # pass sees it
        assume(inner == "eager" or min(case.shard[-1], case.n_out) > 1)
        rtol, atol = SUM_TOLERANCE[case.dtype]
        mode = "symbolic" if symbolic else "fake"
        for out in _run(ranks(n), case, seed, schedule, k, mode, inner):
            assert len(out["actual"]) == len(out["expected"])
            pairs = list(zip(out["actual"], out["expected"], strict=True))
            if case.extra_user:
                actual, expected = pairs.pop()
                torch.testing.assert_close(actual, expected, rtol=0, atol=0)
            for actual, expected in pairs:
                torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * 4)

    check()


@pytest.mark.parametrize("examples", examples(8, 40))
def test_matmul_reduce_scatter_matches(ranks, examples):
    """Partials are rounded to the dtype before they are summed (by gloo or by the ring), so
    in bfloat16 two summation orders differ by a few units in the last place of the
    largest values, whatever a cancelling result's own magnitude."""

    @settings(PROPERTY, max_examples=examples)
    @given(scatter_cases())
    def check(example):
        n, case, seed, schedule, k, inner = example
        assume(inner == "eager" or min(math.prod(case.lead), case.k, case.n_out) > 1)  # (as above)
        rtol, atol = SUM_TOLERANCE[case.dtype]
        for out in _run(ranks(n), case, seed, schedule, k, inner=inner):
            (actual,), (expected,) = out["actual"], out["expected"]
            scale = expected.abs().max().item() if case.dtype == torch.bfloat16 else 0.0
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol + scale * 2**-5)

    check()


def test_exact_for_two_ranks_reduce_scatter(ranks):
    """With n=2 each block is one addition of the same two partials: equal bit for bit."""
    for out in _run(ranks(2), MmRs(lead=(2, 4), dim=1), seed=3):
        torch.testing.assert_close(out["actual"][0], out["expected"][0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("schedule", "inner"), [("ring", "inductor"), ("push", "eager"), ("slicing", "eager")]
)
def test_averaging_reduce_scatter_on_three_ranks(ranks, schedule, inner):
    """reduce op "avg", which gloo itself cannot run: the rewrite sums over P2P (or chunk
    collectives with "sum") and divides once; the reference is the sum divided by n."""
    case = MmRs(lead=(2, 12), k=5, n_out=4, dim=1, op="avg", terms=2)
    for out in _run(ranks(3), case, seed=5, schedule=schedule, inner=inner):
        (actual,), (expected,) = out["actual"], out["expected"]
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@st.composite
def exchange_cases(draw):
    side = draw(st.sampled_from(["in", "out", "grad"]))
    case = Ulysses(
        side=side,
        batch=draw(st.integers(1, 2)),
        seq_per_rank=draw(st.integers(1, 3)),
        heads_per_rank=draw(st.integers(1, 2)),
        head_dim=draw(st.integers(2, 4)),
        dim=draw(st.integers(2, 6)),
        bias=side == "in" and draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
    )
    return draw(st.sampled_from([2, 3, 4])), case, draw(st.integers(0, 10_000)), draw(INNER)


@pytest.mark.parametrize("examples", examples(6, 16))
def test_all_to_all_matmul_matches(ranks, examples):
    """Ulysses' all-to-alls next to a projection, both directions, in the pairwise order:
    blocks of the product are sent (never partial sums), so only the contracting side
    ("out") changes the summation order."""

    @settings(PROPERTY, max_examples=examples)
    @given(exchange_cases())
    def check(example):
        n, case, seed, inner = example
        assume(inner == "eager" or min(case.dim, case.head_dim, case.batch * case.seq_per_rank) > 1)
        rtol, atol = SUM_TOLERANCE[case.dtype]
        for out in _run(ranks(n), case, seed, "ring", inner=inner):
            (actual,), (expected,) = out["actual"], out["expected"]
            scale = expected.abs().max().item() if case.dtype == torch.bfloat16 else 0.0
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol + scale * 2**-5)

    check()


def test_all_to_all_of_blocks_copied_before_they_are_sent_under_inductor(ranks):
    """q laid out [s, b, h/n, d] from a batch-first model's rows (DeepSpeed's Hugging
    Face layout): each block is copied, once, into the buffer its transfer sends."""
    case = Ulysses(side="in", batch=2, seq_per_rank=3, sequence_first=True, bias=True)
    for out in _run(ranks(3), case, seed=2, inner="inductor"):
        (actual,), (expected,) = out["actual"], out["expected"]
        # Inductor's addmm against eager's: within float32 rounding
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "schedule", "inner"),
    [(3, "ring", "inductor"), (4, "bidir", "eager"), (2, "push", "eager"), (3, "slicing", "eager")],
)
def test_gather_on_the_contracting_dim_sums_a_product_per_block(ranks, n, schedule, inner):
    """An activation gathered on its last dim, then @ W: the product is the sum over blocks
    of X_b @ W[rows of b] (role ``contract_k``), each added as its block arrives."""
    case = AgMm(shard=(2, 3, 4), dim=2, n_out=5, consumers=2, bias=False)
    for out in _run(ranks(n), case, seed=7, schedule=schedule, inner=inner):
        for actual, expected in zip(out["actual"], out["expected"], strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "schedule", "inner"),
    [(3, "ring", "inductor"), (4, "bidir", "eager"), (2, "slicing", "eager")],
)
def test_weight_gradient_of_a_sequence_gathered_input_contracts_each_block(
    ranks, n, schedule, inner
):
    """Y @ G2d with G gathered on the sequence of [batch, seq, dim] (a weight gradient
    t(dY) @ X under checkpointing): a block's rows are strided in G2d, so the columns of
    Y that meet them are sliced out of Y viewed [M, batch, seq] (role contract_left)."""
    case = AgMm(shard=(2, 2, 4), dim=1, consumers=0, left=2, bias=False)
    for out in _run(ranks(n), case, seed=3, schedule=schedule, inner=inner):
        for actual, expected in zip(out["actual"], out["expected"], strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("side", "n", "inner", "bias"),
    [
        ("in", 3, "inductor", True),
        ("in", 4, "eager", False),
        ("grad", 3, "inductor", False),
        ("grad", 2, "eager", False),
    ],
)
def test_fused_qkv_projection_matches(ranks, side, n, inner, bias):
    """One projection for q, k and v (GQA: 2 q heads, 1 k/v head per rank), split into
    one matmul per all-to-all: forward (each part's heads sent) and backward (each part's
    gradient contracted with its rows of W, its weight-gradient rows filled)."""
    case = FusedQkv(side=side, bias=bias)
    results = ranks(n).run(run_case, case, 5, {"schedule": "ring"}, "fake", inner)
    for out in results:
        assert out["collectives_left"] == 0 and out["p2p"] == 3 * (n - 1)
        for actual, expected in zip(out["actual"], out["expected"], strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("side", "n", "inner", "dtype"),
    [
        ("backward", 3, "inductor", torch.float32),
        pytest.param("forward", 4, "eager", torch.bfloat16, marks=pytest.mark.matrix),
        pytest.param("forward", 3, "inductor", torch.float32, marks=pytest.mark.matrix),
        pytest.param("backward", 4, "eager", torch.float32, marks=pytest.mark.matrix),
        pytest.param("forward", 2, "eager", torch.float32, marks=pytest.mark.matrix),
        pytest.param("backward", 4, "inductor", torch.bfloat16, marks=pytest.mark.matrix),
    ],
)
def test_batched_experts_between_dispatch_and_combine_match(ranks, side, n, inner, dtype):
    """A capacity-style MoE's batched experts (``bmm``, 2 per rank): the dispatched slots
    multiplied block by block as they arrive, the combined ones computed block by block
    and sent; in the backward the combine's gradient also feeds dW2, a sum over its
    blocks (along K). Two sites, n - 1 steps with transfers each."""
    case = Experts(side=side, dtype=dtype)
    rtol, atol = SUM_TOLERANCE[dtype]
    results = ranks(n).run(run_case, case, 11, {"schedule": "ring"}, "fake", inner)
    for out in results:
        assert out["collectives_left"] == 0 and out["p2p"] == 2 * (n - 1)
        for actual, expected in zip(out["actual"], out["expected"], strict=True):
            scale = expected.abs().max().item() if dtype == torch.bfloat16 else 0.0
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol + scale * 2**-6)
