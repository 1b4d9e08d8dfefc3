"""The program Inductor generates from a rewritten graph, read back (``passes/ranks/program.py``).

On real gloo ranks, for every matmul role and reduce-scatter form and every schedule:
no transfer's buffer is reused, freed, written (or, received, read) before its wait;
the overlap order (start transfer -> partial matmul -> wait) survives Inductor's
scheduler, which would otherwise hoist a wait right after its transfer; and Inductor's
code computes the same numbers. Then the checker itself, on small programs written the
way Inductor writes them, each breaking one rule.
"""

from __future__ import annotations

import pytest
import torch
from cases import AgMm, MmRs

from commfuse_compile.passes.ranks import program


def compiled_code(rank, n, case, schedule="ring"):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(case.fn(n), backend="commfuse", options={"schedule": schedule})
    inputs = case.inputs(rank, 0, n) if isinstance(case, AgMm) else case.inputs(rank, 0)
    outputs, codes = run_and_get_code(fn, *inputs)
    expected = case.fn(n)(*inputs)  # eager: the real collectives
    error = max((a - e).abs().max().item() for a, e in zip(outputs, expected, strict=True))
    return codes, error


@pytest.mark.parametrize(
    "case",
    [
        AgMm(consumers=2),
        AgMm(shard=(4, 8), dim=0, consumers=1, contract=1, columns=1, left=1, bias=False),
        MmRs(lead=(2, 6), dim=1),
        MmRs(lead=(6, 2), dim=0, terms=2, transposed=True),
    ],
    ids=["ag_mm_rows", "ag_mm_all_roles", "mm_rs", "mm_rs_sum_transposed"],
)
@pytest.mark.parametrize("schedule", ["ring", "bidir", "push"])
def test_waits_follow_the_overlapped_matmul(ranks, case, schedule):
    pool = ranks(3)
    for codes, error in pool.run(compiled_code, case, schedule):
        assert error < 1e-4  # and Inductor computes the same numbers
        assert any("commfuse.p2p" in c for c in codes)
        for code in codes:
            result = program.check(code)
            assert result.violations == [] and result.exposed == []


@pytest.mark.parametrize(
    "case",
    [AgMm(shard=(2, 4, 8), dim=1, consumers=2), MmRs(lead=(2, 12), dim=1)],
    ids=["ag_mm", "mm_rs"],
)
def test_slicing_overlaps_all_but_its_head_or_tail(ranks, case):
    """Two chunks: the first all-gather (head) or the last reduce-scatter (tail) has no
    matmul to hide behind; the other chunk's collective must keep its matmuls, and the
    chunks' inputs stay untouched until their collective is waited."""
    for codes, error in ranks(3).run(compiled_code, case, "slicing"):
        assert error < 1e-4
        code = next(c for c in codes if "_c10d_functional" in c)
        result = program.check(code)
        assert result.transfers == 2 and result.violations == []
        assert len(result.exposed) == 1  # the head or the tail


# ----------------------------------------------------------------------------------------
# the checker, on programs written the way Inductor writes them

HEADER = """
cpp_fused_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''...''')
cpp_fused_1 = async_compile.cpp_pybinding(['float*', 'const float*'], r'''...''')
def call(args):
    arg0_1, arg1_1 = args
    args.clear()
"""
LABEL = "'site 3 step 0 (mm_rs)'"
P2P_STEP = f"""
    buf0 = torch.ops.commfuse.p2p.default([arg0_1], [1], [arg0_1], [2], 7, '0', {LABEL})
    buf1 = buf0[0]
    del buf0
    buf2 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    extern_kernels.mm(arg0_1, arg1_1, out=buf2)
"""
WAITS = """
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    torch.ops._c10d_functional.wait_tensor.default(arg0_1)
"""


def checked(body: str):
    return program.check(HEADER + body)


def test_checker_passes_a_step_that_waits_before_touching_its_buffers():
    result = checked(P2P_STEP + WAITS + "    cpp_fused_0(buf1, arg0_1)\n    return (buf2, )\n")
    assert (result.violations, result.exposed, result.transfers) == ([], [], 1)


@pytest.mark.parametrize(
    ("between", "problem"),
    [
        # the bug Inductor's memory planning produced: the sent buffer reused for a new value
        ("    buf3 = arg0_1; del arg0_1  # reuse\n", "arg0_1 is reused for buf3 while send 0"),
        ("    cpp_fused_0(buf2, arg0_1)\n", "cpp_fused_0 writes arg0_1 while send 0"),
        ("    cpp_fused_1(arg0_1, buf2)\n", "cpp_fused_1 writes arg0_1 while send 0"),
        ("    cpp_fused_0(buf1, buf2)\n", "cpp_fused_0 reads buf1 before receive 0"),
        ("    extern_kernels.mm(arg1_1, arg1_1, out=buf1)\n", "writes buf1 while receive 0"),
        ("    del buf1\n", "buf1 is freed while receive 0"),
        (
            "    buf4 = reinterpret_tensor(arg0_1, (2, 8), (8, 1), 8)  # alias\n"
            "    cpp_fused_0(buf2, buf4)\n",
            "cpp_fused_0 writes buf4 while send 0",
        ),
    ],
    ids=["reused", "written", "in_out", "read_early", "out_written", "freed", "alias"],
)
def test_checker_finds_a_transfer_buffer_touched_before_its_wait(between, problem):
    result = checked(P2P_STEP + between + WAITS)
    assert any(problem in v for v in result.violations), result.violations


def test_checker_allows_a_disjoint_part_of_a_sent_storage_to_be_written():
    body = """
    buf9 = empty_strided_cpu((8, 8), (8, 1), torch.float32)
    buf3 = reinterpret_tensor(buf9, (4, 8), (8, 1), 0)  # alias
    buf4 = reinterpret_tensor(buf9, (4, 8), (8, 1), 32)  # alias
    buf0 = torch.ops.commfuse.p2p.default([buf3], [1], [buf3], [2], 7, '0', 'site 1 step 0 (ag_mm)')
    buf1 = buf0[0]
    cpp_fused_0(arg0_1, buf4)
    extern_kernels.mm(buf3, arg1_1, out=arg0_1)
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    torch.ops._c10d_functional.wait_tensor.default(buf3)
"""
    assert checked(body).violations == []


def test_checker_finds_transfers_never_waited_and_waits_without_overlap():
    never = checked(P2P_STEP + "    torch.ops._c10d_functional.wait_tensor.default(buf1)\n")
    (violation,) = never.violations
    assert "send 0 of site 3 step 0 (mm_rs)" in violation and "never waited" in violation
    no_matmul = P2P_STEP.replace("extern_kernels.mm(arg0_1, arg1_1, out=buf2)", "pass")
    assert checked(no_matmul + WAITS).exposed == [
        "site 3 step 0 (mm_rs): waited with no matmul in flight"
    ]


def test_checker_keeps_a_collectives_input_until_its_output_is_waited():
    body = """
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 3, '0')
    cpp_fused_0(arg1_1, arg0_1)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
"""
    (violation,) = checked(body).violations
    assert "writes arg0_1 while all_gather_into_tensor's input" in violation
