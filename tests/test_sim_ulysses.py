"""`commfuse sim --parallelism up`: the Ulysses layer's all-to-all sites.

The sites' Work is what the site kinds' own ``work`` gives for the same shapes, a rank
sends (n-1)/n of each exchanged tensor (the all-to-all's bytes), and the rows follow n.
No timing is asserted beyond the simulator's own consistency.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from cases import Ulysses, trace
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile.cost.profiles import BUILTIN
from commfuse_compile.passes.kinds import KINDS
from commfuse_compile.tools.cli import main
from commfuse_compile.tools.sim.layer import (
    PRESETS,
    UP_GROUP_SIZES,
    UP_SEQUENCES,
    ModelShape,
    simulate_ulysses,
    ulysses_sites,
)

N, RANK = 4, 1
PROFILE = BUILTIN["h100-nvlink4"]


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def _site_work(case: Ulysses, kind: str):
    (site,) = [s for s in KINDS[kind].find(trace(case, N, case.inputs(RANK, 0, N)).graph)]
    assert site.declined is None
    # the sim's sites run at the profile's own matmul rate (its models' bfloat16), whatever
    # the traced graph's dtype
    return dataclasses.replace(KINDS[kind].work(site, N), matmul_class=None)


def test_ulysses_sites_count_as_the_kinds_do(fake_world):
    """The sim's q projection, attention output and dq sites against ``mm_a2a.work`` and
    ``a2a_mm.work`` on traced Ulysses graphs of the same shapes (fp32)."""
    case = Ulysses(batch=2, seq_per_rank=4, heads_per_rank=2, head_dim=3, dim=8)
    heads = case.heads_per_rank * N
    tokens = N * case.batch * case.seq_per_rank
    model = ModelShape("tiny", "test", case.dim, heads, heads, case.head_dim, 1, False, tokens, 4)
    sites = dict(ulysses_sites(model, N))
    assert sites["forward q projection"] == _site_work(case, "mm_a2a")
    out = _site_work(dataclasses.replace(case, side="out"), "a2a_mm")
    assert sites["forward attention output"] == out
    # the traced dW alone (columns); the sim's dq site also has dX (contract): twice it
    grad = _site_work(dataclasses.replace(case, side="grad"), "a2a_mm")
    dq = sites["backward q grads (dX, dW)"]
    assert (dq.block_flops, dq.block_bytes, dq.matmuls_per_block) == (
        2 * grad.block_flops,
        grad.block_bytes,
        2,
    )


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("n", UP_GROUP_SIZES)
def test_ulysses_bytes_are_the_all_to_alls(name, n):
    """A rank sends n-1 messages of 1/n of the exchanged tensor: (n-1)/n of its bytes;
    GQA: k and v exchange kv_heads x head_dim columns, q heads x head_dim."""
    model = dataclasses.replace(PRESETS[name], tokens=32768)
    local = model.tokens // n  # this rank's tokens
    q = model.heads * model.head_dim * local * model.dtype_bytes
    kv = model.kv_heads * model.head_dim * local * model.dtype_bytes
    out, into = "exchange_out", "exchange_in"  # matmul -> all-to-all, all-to-all -> matmul
    expected = {
        "forward q projection": (out, q),
        "forward k projection": (out, kv),
        "forward v projection": (out, kv),
        "forward attention output": (into, q),
        "backward attention output grads": (out, q),
        "backward q grads (dX, dW)": (into, q),
        "backward k grads (dX, dW)": (into, kv),
        "backward v grads (dX, dW)": (into, kv),
    }
    sites = ulysses_sites(model, n)
    assert [s for s, _ in sites] == list(expected)
    for site, work in sites:
        direction, exchanged = expected[site]
        assert (work.direction, work.n) == (direction, n)
        assert (n - 1) * work.block_bytes == pytest.approx((n - 1) / n * exchanged)
    simulated = simulate_ulysses(model, n, PROFILE).sites
    assert all(set(timelines) == {"collective", "ring"} for _, timelines in simulated)


def test_ulysses_rows_respond_to_n_and_the_sequence():
    """More ranks: fewer FLOPs and bytes per rank, a faster layer; twice the sequence:
    twice each rank's FLOPs and bytes."""
    model = dataclasses.replace(PRESETS["llama3-70b"], tokens=65536)
    by_n = {n: dict(ulysses_sites(model, n)) for n in UP_GROUP_SIZES}
    for small, large in zip(UP_GROUP_SIZES, UP_GROUP_SIZES[1:], strict=False):
        for site, work in by_n[small].items():
            bigger = by_n[large][site]
            assert bigger.n == large
            assert bigger.block_flops * bigger.n < work.block_flops * work.n
            assert bigger.block_bytes * bigger.n < work.block_bytes * work.n
        slow = simulate_ulysses(model, small, PROFILE).total_s("collective")
        assert simulate_ulysses(model, large, PROFILE).total_s("collective") < slow
    longer = dict(ulysses_sites(dataclasses.replace(model, tokens=2 * model.tokens), 4))
    for site, work in by_n[4].items():
        assert longer[site].block_flops == pytest.approx(2 * work.block_flops)
        assert longer[site].block_bytes == pytest.approx(2 * work.block_bytes)


def test_sim_up_prints_the_presets_rows(capsys, tmp_path):
    for name in ("llama3-8b", "llama3-70b"):
        assert main(["sim", "--parallelism", "up", "--model", name]) == 0
        out = capsys.readouterr().out
        for seq in UP_SEQUENCES:
            assert f"{name} layer under Ulysses (UP), tokens {seq}," in out
        for n in UP_GROUP_SIZES:
            assert f"n = {n}:" in out
        assert "forward k projection" in out and "backward v grads (dX, dW)" in out
        summary = out[out.index(f"{name} under Ulysses (UP)") :].splitlines()
        assert summary[1].split() == ["sequence", "n", "collective", "ring", "auto"]
        assert len(summary) == 2 + len(UP_SEQUENCES) * len(UP_GROUP_SIZES)
    args = ["sim", "--parallelism", "up", "--tokens", "4096", "--group-size", "2"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "trace_up_s4096_n2.json").is_file()
    with pytest.raises(SystemExit):
        main(["sim", "--parallelism", "up", "--group-size", "16"])  # 8 k/v heads
    assert "needs 16 to divide llama3-8b's 32 heads and 8 k/v heads" in capsys.readouterr().err
