"""The data-slicing baseline (Megatron-LM / MindSpeed style): k chunks, k collectives.

Each rank's shard is cut into k chunks along the collective's dim; chunk i's collective
overlaps chunk i-1's matmul. The first all-gather (head) and the last reduce-scatter
(tail) stay exposed, which is what the ring removes. Steps follow the lowering's order:
start ``issue``'s collective, run ``compute``'s matmuls, then wait for ``wait``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SliceStep:
    issue: int | None  # chunk whose collective starts
    compute: int | None  # chunk whose matmuls run
    wait: int | None  # chunk whose collective completes


def gather_steps(k: int) -> list[SliceStep]:
    """Gather chunk 0 (exposed), then gather chunk i while multiplying chunk i-1."""
    return [
        SliceStep(
            issue=i if i < k else None,
            compute=i - 1 if i >= 1 else None,
            wait=i if i < k else None,
        )
        for i in range(k + 1)
    ]


def reduce_steps(k: int) -> list[SliceStep]:
    """Multiply chunk i while chunk i-1 is reduce-scattered; chunk k-1's is exposed."""
    return [
        SliceStep(
            issue=i - 1 if i >= 1 else None,
            compute=i if i < k else None,
            wait=i - 1 if i >= 1 else None,
        )
        for i in range(k + 1)
    ]


def check(steps: list[SliceStep], k: int, gather: bool) -> None:
    """Every chunk is collected once and computed once, in an order that can run:
    a gathered chunk is waited before its matmul, a reduced chunk computed before its
    collective starts."""
    from .exchange import ScheduleError

    done: set[int] = set()  # gathered (waited) or computed chunks
    issued, waited, computed = [], [], []
    for s, step in enumerate(steps):
        if step.issue is not None:
            if not gather and step.issue not in done:
                raise ScheduleError(f"step {s}: chunk {step.issue} reduced before computed")
            issued.append(step.issue)
        if step.compute is not None:
            if gather and step.compute not in done:
                raise ScheduleError(f"step {s}: chunk {step.compute} used before gathered")
            computed.append(step.compute)
            if not gather:
                done.add(step.compute)
        if step.wait is not None:
            if step.wait not in issued:
                raise ScheduleError(f"step {s}: chunk {step.wait} waited before started")
            waited.append(step.wait)
            if gather:
                done.add(step.wait)
    for name, chunks in (("issued", issued), ("waited", waited), ("computed", computed)):
        if sorted(chunks) != list(range(k)):
            raise ScheduleError(f"chunks {name} {sorted(chunks)}, expected each of 0..{k - 1}")
