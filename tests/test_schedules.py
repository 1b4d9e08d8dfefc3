"""Schedules alone, before they touch a graph: checked against the unfused collective."""

from __future__ import annotations

import pytest
import torch

from commfuse_compile.schedules import (
    GatherStep,
    ReduceStep,
    Transfer,
    bidir,
    exchange,
    push,
    ring,
    slicing,
)

SCHEDULES = [pytest.param(ring, id="ring"), pytest.param(bidir, id="bidir")]
P2P_SCHEDULES = [*SCHEDULES, pytest.param(push, id="push")]


@pytest.mark.parametrize("schedule", P2P_SCHEDULES)
@pytest.mark.parametrize("n", range(1, 9))
def test_gather_matches_all_gather_then_matmul(schedule, n):
    gen = torch.Generator().manual_seed(n)
    blocks = [torch.randn(3, 5, generator=gen) for _ in range(n)]
    weight = torch.randn(5, 4, generator=gen)
    expected = torch.cat(blocks) @ weight
    for per_rank in exchange.gather(schedule, blocks, lambda b, x: x @ weight):
        assert sorted(per_rank) == list(range(n))
        got = torch.cat([per_rank[b] for b in range(n)])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", P2P_SCHEDULES)
@pytest.mark.parametrize("n", range(1, 9))
def test_reduce_matches_matmul_then_reduce_scatter(schedule, n):
    gen = torch.Generator().manual_seed(n)
    a = [torch.randn(2 * n, 5, generator=gen) for _ in range(n)]  # rank r's operand
    weight = torch.randn(5, 3, generator=gen)
    expected = sum(x @ weight for x in a).chunk(n)  # type: ignore[union-attr]
    got = exchange.reduce(schedule, n, lambda r, b: a[r].chunk(n)[b] @ weight, torch.add)
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

    with pytest.raises(exchange.ScheduleError):
        exchange.gather(Broken, [0, 1, 2], lambda b, x: x)


def test_simulator_rejects_a_wrong_final_block():
    class Broken:
        @staticmethod
        def reduce_steps(rank, n):
            return [ReduceStep(blocks=((rank + 1) % n,))]

    with pytest.raises(exchange.ScheduleError):
        exchange.reduce(Broken, 2, lambda r, b: 1, lambda x, y: x + y)


def test_simulator_rejects_an_add_before_its_receive():
    class Broken:
        @staticmethod
        def reduce_steps(rank, n):
            return [ReduceStep(blocks=(rank,), adds=(Transfer(rank, -1),))]

    with pytest.raises(exchange.ScheduleError, match="before receiving it"):
        exchange.reduce(Broken, 2, lambda r, b: 1, lambda x, y: x + y)


@pytest.mark.parametrize("n", range(2, 9))
def test_push_sends_straight_to_the_owner_and_reduces_at_the_end(n):
    """Push moves only a rank's own shard (gather) or the partial for the destination's
    own block (reduce), never a relayed one; the n-1 partials are all added in the last
    step, after the last matmul: the tail that the ring spreads over its steps."""
    for r in range(n):
        gather, reduce = push.gather_steps(r, n), push.reduce_steps(r, n)
        assert all(t.block == r for step in gather for t in step.sends)
        assert all(t.block == (r + t.peer) % n for step in reduce for t in step.sends)
        *early, last = reduce
        assert not any(step.adds for step in early)
        assert last.blocks == (r,) and not last.sends
        assert sorted(t.peer for t in last.adds) == list(range(-(n - 1), 0))
        assert {t.block for t in last.adds} == {r}
        assert [len(step.adds) for step in ring.reduce_steps(r, n)] == [0] + [1] * (n - 1)


@pytest.mark.parametrize("k", range(1, 9))
def test_slicing_orders_are_valid(k):
    slicing.check(slicing.gather_steps(k), k, gather=True)
    slicing.check(slicing.reduce_steps(k), k, gather=False)


@pytest.mark.parametrize("k", range(1, 9))
def test_slicing_exposes_a_head_for_gather_and_a_tail_for_reduce(k):
    """The first chunk's all-gather runs with no matmul beside it, and the last chunk's
    reduce-scatter starts after the last matmul: the latency that CommFuse removes."""
    gather, reduce = slicing.gather_steps(k), slicing.reduce_steps(k)
    assert len(gather) == len(reduce) == k + 1
    assert gather[0].compute is None and gather[0].wait == 0
    assert reduce[-1].compute is None and reduce[-1].issue == k - 1
    assert all(step.compute is not None for step in gather[1:] + reduce[:-1])


def _steps(*triples):
    return [slicing.SliceStep(issue, compute, wait) for issue, compute, wait in triples]


@pytest.mark.parametrize(
    ("steps", "gather", "error"),
    [
        pytest.param(
            _steps((0, 0, 0), (1, 1, 1)), True, "chunk 0 used before gathered", id="gather-early"
        ),
        pytest.param(
            _steps((0, None, 0), (1, 0, 1), (None, None, None)),
            True,
            r"computed \[0\], expected each of 0..1",
            id="gather-leaves-a-chunk-out",
        ),
        pytest.param(_steps((None, None, 0)), True, "waited before started", id="wait-first"),
        pytest.param(
            _steps((0, 0, None), (None, 1, 0), (1, None, 1)),
            False,
            "chunk 0 reduced before computed",
            id="reduce-early",
        ),
        pytest.param(
            _steps((None, 0, None), (0, 0, 0), (None, 1, None), (1, None, 1)),
            False,
            r"computed \[0, 0, 1\]",
            id="reduce-computes-twice",
        ),
        pytest.param(slicing.gather_steps(2), False, "reduced before computed", id="swapped"),
    ],
)
def test_slicing_check_rejects_a_broken_order(steps, gather, error):
    with pytest.raises(exchange.ScheduleError, match=error):
        slicing.check(steps, 2, gather=gather)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("direction", ["exchange_in", "exchange_out"])
def test_pairwise_all_to_all_meets_every_send_and_ends_with_every_block(n, direction):
    exchange.all_to_all(ring, n, direction)
    # the ring's pairwise order is the one all-to-all schedule
    assert not any(hasattr(s, f"{direction}_steps") for s in (bidir, push, slicing))


def test_all_to_all_check_catches_a_block_sent_to_the_wrong_rank():
    class Wrong:
        @staticmethod
        def exchange_out_steps(rank, n):  # the block meant for rank+1 goes to rank-1
            steps = ring.exchange_out_steps(rank, n)
            first = steps[0]
            flipped = tuple(Transfer(t.block, -t.peer) for t in first.sends)
            back = tuple(Transfer(t.block, -t.peer) for t in first.recvs)
            return [ReduceStep(first.blocks, (), flipped, back), *steps[1:]]

    with pytest.raises(exchange.ScheduleError):
        exchange.all_to_all(Wrong, 3, "exchange_out")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_round_trip_computes_every_block_once_after_it_arrives_and_returns_it(n):
    """The MoE site's schedule (``schedules/round_trip``): n + 1 steps, this rank's own
    block first with nothing to wait for, every other block computed the step after it
    arrived and sent back the step after that; only the last step waits bare."""
    from commfuse_compile.schedules import round_trip

    round_trip.check(n)
    steps = round_trip.steps(n)
    assert len(steps) == n + 1 and steps[0].compute == 0 and steps[-1].compute is None
    assert [s.dispatch for s in steps if s.dispatch] == list(range(1, n))
    assert [s.combine for s in steps if s.combine] == list(range(1, n))
