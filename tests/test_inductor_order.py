"""The overlap order (start transfer -> partial matmul -> wait) survives Inductor, for
every matmul role and reduce-scatter form, and Inductor's code computes the same numbers.

Inductor's scheduler hoists a wait right after its collective unless told otherwise;
this checks the generated code itself: between every P2P start and the next wait
there must be a matmul to overlap with.
"""

from __future__ import annotations

import pytest
import torch
from cases import AgMm, MmRs


def compiled_code(rank, n, case, schedule="ring"):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(case.fn(n), backend="commfuse", options={"schedule": schedule})
    inputs = case.inputs(rank, 0, n) if isinstance(case, AgMm) else case.inputs(rank, 0)
    outputs, codes = run_and_get_code(fn, *inputs)
    expected = case.fn(n)(*inputs)  # eager: the real collectives
    error = max((a - e).abs().max().item() for a, e in zip(outputs, expected, strict=True))
    return codes, error


def overlap_violations(code: str) -> list[str]:
    """Steps whose transfer is waited on before any matmul ran while it was in flight."""
    body = code[code.index("def call(") :].splitlines()
    problems, open_since, matmuls = [], None, 0
    for number, line in enumerate(body):
        if "commfuse.p2p" in line:
            open_since, matmuls = number, 0
        elif "extern_kernels.mm(" in line or "extern_kernels.addmm(" in line:
            matmuls += 1
        elif "wait_tensor" in line and open_since is not None:
            if matmuls == 0:
                problems.append(
                    f"line {number}: wait right after the transfer of line {open_since}"
                )
            open_since = None
    return problems


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
@pytest.mark.parametrize("schedule", ["ring", "bidir"])
def test_waits_follow_the_overlapped_matmul(ranks, case, schedule):
    pool = ranks(3)
    for codes, error in pool.run(compiled_code, case, schedule):
        assert error < 1e-4  # and Inductor computes the same numbers
        assert any("commfuse.p2p" in c for c in codes)
        for code in codes:
            assert overlap_violations(code) == []


def test_checker_sees_a_hoisted_wait():
    """The checker itself: the order Inductor produces without the pass's dependencies."""
    code = """def call(args):
        buf0 = torch.ops.commfuse.p2p.default([arg0_1], [1], [arg0_1], [1], 1, '0')
        torch.ops._c10d_functional.wait_tensor.default(buf1)
        extern_kernels.addmm(arg1_1, arg0_1, arg2_1, out=buf7)
    """
    assert len(overlap_violations(code)) == 1
