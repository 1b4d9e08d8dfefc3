"""DeepSpeed's Ulysses sequence parallelism for Hugging Face models, as DeepSpeed 0.19.8
writes it (``tools/training/deepspeed_hf.py``): a transformers Llama whose ``sdpa``
attention is DeepSpeed's ``UlyssesSPAttentionHF``, its all-to-alls DeepSpeed's custom op
``deepspeed::dim_zero_all_to_all``; the whole model compiled with ``backend="commfuse"``
(``schedule="ring"``) and trained (AdamW, the ALST tutorial's loss) on gloo ranks, and
the same uncompiled.

Before the pass read that op as the functional all-to-all, these graphs had no site.
Now (per graph, rank 0): v's projection -> all-to-all and the attention output ->
o_proj are rewritten, and in the backward the gradient through o_proj -> all-to-all and
the all-to-all of dv -> v's weight and input gradients. q's and k's all-to-alls stay
(``a2a.no_matmul``): the rotary embedding stands between their projection and the
all-to-all, and between the all-to-all of their gradients and the projections'. Under
Inductor the position ids' all-gather is in the forward graph too (integers:
``site.dtype``; the eager inner compiler's graph drops it, as its value is unused).

3 ranks under Inductor by default; 2 and 4 ranks, eager and Inductor, under -m matrix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import transformers  # noqa: F401  # the test extra installs it: missing, this fails

from commfuse_compile.tools.training import deepspeed_hf

CONFIG = deepspeed_hf.Config()  # 12 heads, 24 tokens: 2, 3 and 4 ranks


def run(rank: int, n: int, inner: str) -> dict:
    """The same steps uncompiled and compiled; the first step's loss in one process."""
    import torch
    import torch._inductor.config

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    plain = deepspeed_hf.train(rank, n, CONFIG, None)
    fused = deepspeed_hf.train(rank, n, CONFIG, {"schedule": "ring", "inner": inner})
    return {
        "losses": (plain["losses"], fused["losses"]),
        "whole": deepspeed_hf.whole_loss(CONFIG),
        "sites": [
            (s["graph"], s["kind"], s["decision"], s["decline_code"]) for s in fused["sites"]
        ],
    }


@pytest.fixture(scope="module")
def cell(ranks) -> Callable[[int, str], list[dict]]:
    done: dict[tuple[int, str], list[dict]] = {}

    def get(n: int, inner: str) -> list[dict]:
        if (n, inner) not in done:
            done[n, inner] = ranks(n).run(run, inner)
            for site in done[n, inner][0]["sites"]:
                print(n, inner, site)
        return done[n, inner]

    return get


CELLS = [
    (3, "inductor"),
    pytest.param(2, "eager", marks=pytest.mark.matrix),
    pytest.param(2, "inductor", marks=pytest.mark.matrix),
    pytest.param(3, "eager", marks=pytest.mark.matrix),
    pytest.param(4, "eager", marks=pytest.mark.matrix),
    pytest.param(4, "inductor", marks=pytest.mark.matrix),
]


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_trains_as_uncompiled_and_as_one_process(cell, n, inner):
    for rank, r in enumerate(cell(n, inner)):
        plain, fused = r["losses"]
        print(n, inner, rank, "losses", plain, fused, "one process", r["whole"])
        assert fused == pytest.approx(plain, rel=1e-6)
        assert plain[0] == pytest.approx(r["whole"], rel=1e-6)  # the front end is the model


REWRITTEN = {
    ("forward", "mm_a2a", "rewritten", ""): 1,  # v_proj -> all-to-all
    ("forward", "a2a_mm", "rewritten", ""): 1,  # all-to-all -> o_proj
    ("forward", "a2a_mm", "declined", "a2a.no_matmul"): 2,  # q, k: the rotary between
    ("backward", "mm_a2a", "rewritten", ""): 1,  # d(o_proj input) -> all-to-all
    ("backward", "a2a_mm", "rewritten", ""): 1,  # all-to-all -> dv's matmuls
    ("backward", "a2a_mm", "declined", "a2a.no_matmul"): 2,  # dq, dk: the rotary between
}
POSITIONS = {("forward", "ag_mm", "declined", "site.dtype"): 1}


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_deepspeeds_exchanges_next_to_a_matmul_are_rewritten(cell, n, inner):
    expected = REWRITTEN | (POSITIONS if inner == "inductor" else {})
    for r in cell(n, inner):
        assert Counter(r["sites"]) == expected
