"""`commfuse sim`'s plain-TP section: the layer as written (four all-reduces, the
residual add and RMSNorm on every token) against the pass's split (the TP+SP section's
eight sites, the token-wise work on 1/n of the tokens). The sim is a model: its own
outputs are asserted, nothing measured."""

from __future__ import annotations

import math

import pytest

from commfuse_compile.cost.profiles import BUILTIN
from commfuse_compile.tools.cli import main
from commfuse_compile.tools.sim.layer import (
    PRESETS,
    simulate_layer,
    simulate_plain_tp,
    token_wise_s,
)

PROFILE = BUILTIN["h100-nvlink4"]
SIZES = (2, 4, 8, 16, 32, 64)  # the CLI's default group sizes


# 32 and 64 ranks (12 s of simulation at 64) in the matrix
@pytest.mark.parametrize(
    "n", [n if n <= 16 else pytest.param(n, marks=pytest.mark.matrix) for n in SIZES]
)
def test_split_is_never_slower_than_the_all_reduce_llama3_8b(n):
    model = PRESETS["llama3-8b"]
    layer = simulate_layer(model, n, PROFILE, 2)
    plain = simulate_plain_tp(model, n, PROFILE, 2, layer)
    assert plain.split is layer
    # an all-reduce is a reduce-scatter then an all-gather of the same blocks: with no
    # overlap the split differs from the layer as written by the token-wise work alone
    saved = plain.token_wise_whole_s - plain.token_wise_shard_s
    assert math.isclose(plain.split_s("collective"), plain.all_reduce_s - saved)
    assert math.isclose(plain.token_wise_whole_s, 4 * token_wise_s(model, model.tokens, PROFILE))
    assert math.isclose(plain.token_wise_shard_s * n, plain.token_wise_whole_s)
    assert plain.split_auto_s() <= plain.all_reduce_s
    assert plain.whole_auto_s <= plain.all_reduce_s
    if n <= 8:  # the ring pays on a few ranks of NVLink (not on 16+: too many small steps)
        assert plain.split_s("ring") < plain.all_reduce_s


def test_sim_prints_the_plain_tp_rows(capsys):
    assert main(["sim", "--group-size", "2,8"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b layer, tokens 8192" in out  # the TP+SP section, as before
    section = out[out.index("llama3-8b under PLAIN TP") :]
    assert "PROJECTIONS of the cost model" in section.splitlines()[0]
    header = section.splitlines()[4]
    for column in ("all-reduce", "whole, auto", "split collective", "split ring", "split auto"):
        assert column in header
    rows = {line.split()[0]: line for line in section.splitlines()[5:] if line.strip()}
    saved = rows.pop("saved")  # the region's saved activations: half and an eighth
    assert "134.2 MB as written, split n=2 67.1, n=8 16.8 MB" in saved
    assert set(rows) == {"2", "8"}
    assert "(1.00x)" in rows["2"]  # the all-reduce column: its own baseline
