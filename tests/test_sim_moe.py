"""`commfuse sim --parallelism moe`: an MoE layer's expert-parallel dispatch and combine
around its experts. Every row is a projection of the cost model (the two sites are what
the pass does for a capacity layer, the fused row its ``moe`` site for a dropless one):
its own outputs are asserted, nothing measured."""

from __future__ import annotations

import dataclasses

import pytest

from commfuse_compile.cost.profiles import BUILTIN
from commfuse_compile.cost.simulator import simulate
from commfuse_compile.schedules import Direction
from commfuse_compile.tools.cli import main
from commfuse_compile.tools.sim.moe import (
    MOE_PRESETS,
    MOE_SKEW,
    MOE_TOKENS,
    moe_activation_s,
    moe_routing,
    moe_sites,
    moe_sites_ring_s,
    simulate_moe,
)

PROFILE = BUILTIN["h100-nvlink4"]
CASES = [(m, t, n) for m in MOE_PRESETS for t in MOE_TOKENS for n in (4, 8)]


def test_sites_count_the_all_to_alls_bytes_and_the_expert_flops():
    model = MOE_PRESETS["deepseek-v3-moe"]
    dispatch, combine = moe_sites(model, 8)
    rows = 4096 * 8  # tokens x top_k, [rows, 7168] bf16 each way
    assert (dispatch.direction, combine.direction) == (
        Direction.EXCHANGE_IN,
        Direction.EXCHANGE_OUT,
    )
    assert dispatch.block_bytes * 8 == combine.block_bytes * 8 == rows * 7168 * 2
    assert dispatch.block_flops * 8 == 2 * rows * 7168 * 2 * 2048  # gate + up
    assert combine.block_flops * 8 == 2 * rows * 2048 * 7168  # down


@pytest.mark.parametrize("n", (4, 8))
@pytest.mark.parametrize("skew", (1.0, MOE_SKEW))
def test_routing_keeps_every_ranks_rows_and_bytes(n, skew):
    rows = 1000.0
    routing = moe_routing(n, rows, skew)
    for r in range(n):
        assert sum(routing[r]) == pytest.approx(rows)  # sent, itself included
        assert sum(routing[s][r] for s in range(n)) == pytest.approx(rows)  # received
        assert routing[r][r] == pytest.approx(rows / n)
    assert max(max(row) for row in routing) == pytest.approx(skew * rows / n)


@pytest.mark.parametrize("profile", ("h100-nvlink4", "pcie-8x-l40s", "gloo-loopback"))
def test_uneven_steps_reproduce_the_simulators_ring_when_balanced(profile):
    p = BUILTIN[profile]
    model = MOE_PRESETS["mixtral-8x7b-moe"]
    for n in (4, 8):
        dispatch, combine = moe_sites(model, n)
        ring = simulate(dispatch, "ring", p).end_s + simulate(combine, "ring", p).end_s
        ring += moe_activation_s(model, model.rows, p)
        assert moe_sites_ring_s(model, moe_routing(n, model.rows), p) == pytest.approx(ring)


@pytest.mark.parametrize(("name", "tokens", "n"), CASES)
def test_rows_are_consistent(name, tokens, n):
    r = simulate_moe(dataclasses.replace(MOE_PRESETS[name], tokens=tokens), n, PROFILE)
    assert r.limit_s <= r.sites_ring_s <= r.baseline_s
    assert r.limit_s <= r.fused_s <= r.baseline_s
    # skewed routing moves and runs the same rows per rank: same limit, no faster rows
    assert r.skew_limit_s == pytest.approx(r.limit_s)
    for skewed in (r.skew_ring_s, r.skew_fused_s, r.skew_padded_s):
        assert skewed >= r.skew_limit_s
    assert r.skew_ring_s >= r.sites_ring_s * (1 - 1e-9)  # on h100: the gain shrinks
    assert r.skew_fused_s >= r.fused_s * (1 - 1e-9)
    # equal splits (a capacity layer's) pad every block to the largest: the gain is gone
    assert r.skew_padded_s > r.baseline_s


def test_skew_takes_part_of_deepseeks_gain():
    model = dataclasses.replace(MOE_PRESETS["deepseek-v3-moe"], tokens=4096)
    r = simulate_moe(model, 4, PROFILE)
    saved, skew_saved = r.baseline_s - r.sites_ring_s, r.baseline_s - r.skew_ring_s
    assert 0 < skew_saved < saved


def test_sim_prints_the_moe_section(capsys):
    assert main(["sim", "--parallelism", "moe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("deepseek-v3-moe under EXPERT PARALLELISM (MOE)")
    assert "PROJECTIONS of the cost model, not measurements" in out
    blocks = [b for b in out.split("\n\n")[1:] if b.strip()]
    assert [b.splitlines()[0].split(" (")[0] for b in blocks] == [
        f"tokens {t} per rank, n = {n}" for t in MOE_TOKENS for n in (4, 8)
    ]
    for block in blocks:
        rows = block.splitlines()[1:]
        assert len(rows) == 8 and all(row.endswith("projection") for row in rows)
        assert "(1.00x)" in rows[0] and "baseline" in rows[0]


def test_sim_moe_rejects_what_it_cannot_split(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "--parallelism", "moe", "--model", "mixtral-8x7b-moe", "--group-size", "3"])
    assert "divide mixtral-8x7b-moe's 8 routed experts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--model", "deepseek-v3-moe"])
    assert "--parallelism moe" in capsys.readouterr().err
