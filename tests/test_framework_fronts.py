"""Megatron-Core's linears and torchtitan's SimpleFSDP, written as those frameworks write
them (``tools/training/styles.py``), trained on gloo ranks with and without the pass.

Megatron-Core (``"megatron_core"``): the column-parallel linear gathers into the
persistent global memory buffer and its backward overlaps by hand (``async_op=True``
gather and reduce-scatter, waited after the next matmul), which Dynamo traces into the
graph through ``commfuse_compile.async_collectives``. SimpleFSDP (``"simple_fsdp"``):
DTensor parameters gathered in bfloat16 by a parametrization, gradients reduce-scattered
in float32. 3 ranks, eager and Inductor; 2 and 4 ranks in ``-m matrix``.
"""

from __future__ import annotations

import collections

import pytest
from trained import counts, loss_difference, small_config, train

# (forward, backward) sites of each kind rewritten under "ring" in a 2-step run of one
# block: every site next to a matmul. Megatron-Core compiles twice, under either inner
# compiler (the global buffer made at step 1 is a new input at step 2: each job starts
# without it, trained.train); its column-parallel matmuls read the gathered input back
# from the global buffer (``slice(slice_scatter(buffer, gathered))``, which
# ``canonical.py`` reads as the gathered value), in the forward and in the backward's
# hand-overlapped gather of the weight gradient's input. Under Inductor the backward
# reuses the forward's gather (Inductor's clean-up merges the two), so its backward has
# only the row-parallel gradients' gathers. SimpleFSDP: the 8 weights' gathers and
# gradients' reduce-scatters.
EXPECTED = {
    ("megatron_core", "eager"): {"ag_mm": (4, 8), "mm_rs": (4, 4)},
    ("megatron_core", "inductor"): {"ag_mm": (4, 4), "mm_rs": (4, 4)},
    ("simple_fsdp", "eager"): {"ag_mm": (8, 0), "mm_rs": (0, 8)},
    ("simple_fsdp", "inductor"): {"ag_mm": (8, 0), "mm_rs": (0, 8)},
}
# the collectives no kind claims, declined with their codes ((graph, code) -> count):
# SimpleFSDP's 3 norm weights, gathered for an element-wise product and their gradients
# reduce-scattered, no matmul on either
UNCLAIMED = {
    "megatron_core": {},
    "simple_fsdp": {("forward", "ag.no_matmul"): 3, ("backward", "rs.no_matmul"): 3},
}


def cells():
    for front in ("megatron_core", "simple_fsdp"):
        for n in (2, 3, 4):
            for inner in ("eager", "inductor"):
                # by default Inductor on 3 ranks; eager (the same sites) in the matrix
                marks = () if (n, inner) == (3, "inductor") else (pytest.mark.matrix,)
                yield pytest.param(front, n, inner, False, id=f"{front}-n{n}-{inner}", marks=marks)
    # Megatron-Core's rank-0-only DeprecationWarning in every row-parallel linear: the same
    # sites, as it runs after the graph (deferred_logging; real Megatron-Core's default
    # cell in test_megatron_core.py covers it)
    for inner in ("eager", "inductor"):
        yield pytest.param(
            "megatron_core",
            3,
            inner,
            True,
            id=f"rank0_warning-n3-{inner}",
            marks=pytest.mark.matrix,
        )


@pytest.mark.parametrize(("front", "n", "inner", "rank0_warning"), list(cells()))
def test_framework_fronts_rewrite_every_site_and_match(ranks, front, n, inner, rank0_warning):
    extra = {"batch": n} if front == "simple_fsdp" else {"rank0_warning": rank0_warning}
    cfg = small_config(front, n, **extra)
    results = ranks(n).run(train, cfg, {"schedule": "ring", "inner": inner})
    for result in results:
        print(front, n, inner, "loss difference", loss_difference(result), result["sites"])
        # float32 (Megatron-Core); SimpleFSDP computes in bfloat16
        assert loss_difference(result) < (1e-5 if front == "megatron_core" else 2e-2)
        assert result["sites"], "no site found"
        declined = collections.Counter((s[0], s[4]) for s in result["sites"] if s[2] != "rewritten")
        assert declined == UNCLAIMED[front], result["sites"]
        rewritten = {"sites": [s for s in result["sites"] if s[2] == "rewritten"]}
        for kind, expected in EXPECTED[front, inner].items():
            assert counts(rewritten, kind) == expected, (kind, result["sites"])
