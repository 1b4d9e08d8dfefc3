"""Schedules alone, before they touch a graph: checked against the unfused collective."""

from __future__ import annotations

import pytest
import torch

from commfuse_compile.schedules import GatherStep, ReduceStep, Transfer, bidir, ring, simulate

SCHEDULES = [pytest.param(ring, id="ring"), pytest.param(bidir, id="bidir")]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", range(1, 9))
def test_gather_matches_all_gather_then_matmul(schedule, n):
    gen = torch.Generator().manual_seed(n)
    blocks = [torch.randn(3, 5, generator=gen) for _ in range(n)]
    weight = torch.randn(5, 4, generator=gen)
    expected = torch.cat(blocks) @ weight
    for per_rank in simulate.gather(schedule, blocks, lambda b, x: x @ weight):
        assert sorted(per_rank) == list(range(n))
        got = torch.cat([per_rank[b] for b in range(n)])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", range(1, 9))
def test_reduce_matches_matmul_then_reduce_scatter(schedule, n):
    gen = torch.Generator().manual_seed(n)
    a = [torch.randn(2 * n, 5, generator=gen) for _ in range(n)]  # rank r's operand
    weight = torch.randn(5, 3, generator=gen)
    expected = sum(x @ weight for x in a).chunk(n)  # type: ignore[union-attr]
    got = simulate.reduce(schedule, n, lambda r, b: a[r].chunk(n)[b] @ weight, torch.add)
    for r in range(n):
        torch.testing.assert_close(got[r], expected[r])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", range(2, 9))
def test_no_head_and_no_tail(schedule, n):
    for r in range(n):
        gather, reduce = schedule.gather_steps(r, n), schedule.reduce_steps(r, n)
        assert gather[0].compute == (r,)  # local block first: nothing to wait for
        assert r in reduce[-1].blocks and not reduce[-1].sends  # own block last, no send after
        assert sum(len(s.sends) for s in gather) == n - 1  # every block leaves once...
        assert sum(len(s.sends) for s in reduce) == n - 1  # ...and every partial sum


@pytest.mark.parametrize("n", range(2, 9))
def test_bidir_needs_half_the_rounds(n):
    for r in range(n):
        rounds = sum(bool(s.sends) for s in bidir.gather_steps(r, n))
        assert rounds == n // 2 == -(-(n - 1) // 2)
        assert sum(bool(s.sends) for s in bidir.reduce_steps(r, n)) == n // 2
        assert all(len(s.compute) <= 2 for s in bidir.gather_steps(r, n))


def test_simulator_rejects_a_mismatched_exchange():
    class Broken:
        @staticmethod
        def gather_steps(rank, n):
            # everyone sends to the next rank but also expects from the next rank
            return [
                GatherStep(
                    compute=(rank,),
                    sends=(Transfer(rank, +1),),
                    recvs=(Transfer((rank + 1) % n, +1),),
                )
            ]

    with pytest.raises(simulate.ScheduleError):
        simulate.gather(Broken, [0, 1, 2], lambda b, x: x)


def test_simulator_rejects_a_wrong_final_block():
    class Broken:
        @staticmethod
        def reduce_steps(rank, n):
            return [ReduceStep(blocks=((rank + 1) % n,))]

    with pytest.raises(simulate.ScheduleError):
        simulate.reduce(Broken, 2, lambda r, b: 1, lambda x, y: x + y)


def test_simulator_rejects_an_add_before_its_receive():
    class Broken:
        @staticmethod
        def reduce_steps(rank, n):
            return [ReduceStep(blocks=(rank,), adds=(Transfer(rank, -1),))]

    with pytest.raises(simulate.ScheduleError, match="before receiving it"):
        simulate.reduce(Broken, 2, lambda r, b: 1, lambda x, y: x + y)
