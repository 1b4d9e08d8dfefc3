"""The overlap order (start transfer -> partial matmul -> wait) survives Inductor, for
every matmul role and reduce-scatter form, and Inductor's code computes the same numbers.

Inductor's scheduler hoists a wait right after its collective unless told otherwise;
this checks the generated code itself: between every P2P start (or, under slicing, every
chunk collective after the first) and the next wait there must be a matmul to overlap with.
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


TRANSFER_STARTS = (
    "torch.ops.commfuse.p2p.default(",
    "torch.ops._c10d_functional.all_gather_into_tensor.default(",
    "torch.ops._c10d_functional.reduce_scatter_tensor.default(",
)


def overlap_violations(code: str, exposed: int = 0) -> list[str]:
    """Transfers waited on before any matmul ran while they were in flight; ``exposed``
    first ones are allowed. A wait counts for the transfer whose output it waits on
    (Inductor may start a later, independent transfer before an earlier one's wait)."""
    body = code[code.index("def call(") :].splitlines()
    problems = []
    open_transfers: dict[str, tuple[int, int]] = {}  # output buffer -> (line, matmuls seen)
    for number, line in enumerate(body):
        text = line.strip()
        name = text.split(" = ")[0] if " = " in text else None
        if name and any(start in text for start in TRANSFER_STARTS):
            open_transfers[name] = (number, 0)
        elif name and text.endswith("]") and text.split(" = ")[1].split("[")[0] in open_transfers:
            open_transfers[name] = open_transfers[text.split(" = ")[1].split("[")[0]]
        elif "extern_kernels.mm(" in text or "extern_kernels.addmm(" in text:
            open_transfers = {k: (start, seen + 1) for k, (start, seen) in open_transfers.items()}
        elif "wait_tensor" in text:
            waited = text[text.index("(") + 1 : text.rindex(")")]
            if waited in open_transfers:
                start, seen = open_transfers.pop(waited)
                if seen == 0:
                    problems.append(f"line {number}: wait right after the transfer of line {start}")
    return problems[exposed:]


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
            assert overlap_violations(code) == []


@pytest.mark.parametrize(
    "case",
    [AgMm(shard=(2, 4, 8), dim=1, consumers=2), MmRs(lead=(2, 12), dim=1)],
    ids=["ag_mm", "mm_rs"],
)
def test_slicing_overlaps_all_but_its_head_or_tail(ranks, case):
    """Two chunks: the first all-gather (head) or the last reduce-scatter (tail) has no
    matmul to hide behind; the other chunk's collective must keep its matmuls."""
    for codes, error in ranks(3).run(compiled_code, case, "slicing"):
        assert error < 1e-4
        code = next(c for c in codes if "_c10d_functional" in c)
        assert sum(code.count(f"= {start}") for start in TRANSFER_STARTS[1:]) == 2
        assert len(overlap_violations(code)) == 1  # the head or the tail
        assert overlap_violations(code, exposed=1) == []


def test_checker_sees_a_hoisted_wait():
    """The checker itself: the order Inductor produces without the pass's dependencies."""
    code = """def call(args):
        buf0 = torch.ops.commfuse.p2p.default([arg0_1], [1], [arg0_1], [1], 1, '0')
        buf1 = buf0[1]
        torch.ops._c10d_functional.wait_tensor.default(buf1)
        extern_kernels.addmm(arg1_1, arg0_1, arg2_1, out=buf7)
    """
    assert len(overlap_violations(code)) == 1
