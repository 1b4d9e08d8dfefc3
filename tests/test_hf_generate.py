"""Inference as users run it: greedy ``generate`` on a Hugging Face Llama loaded with
``tp_plan="auto"`` on gloo ranks (``test_hf_tp``'s tiny checkpoint, with one layer: the
split between layers, and a prefill's sites per graph, are ``test_hf_tp``'s), its forward
compiled with ``backend="commfuse"``, against the same model uncompiled (eager TP).

Per cell (ranks, inner compiler, cache, schedule): two prompt batches of different
lengths (Dynamo's automatic dynamic shapes make the second length a symbol), the second
left-padded; the tokens must equal eager TP's, the compile must make no more graphs
than the same compile with ``schedule="off"``, the first prefill's all-reduces must be
split into rewritten sites (``ring``), and every all-reduce left whole (a decode step's
few tokens, a symbolic count the group does not provably divide, or one ``auto``
finds slower split) must be declined by name. One cell goes through transformers' own
route, ``generate(compile_config=CompileConfig(backend="commfuse"))`` with its default
``mode="reduce-overhead"`` (a static cache; it compiles the decode steps only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from test_hf_tp import VOCAB, load, save_tiny_llama

from commfuse_compile import report

LAYERS = 1  # each graph is traced and compiled 8 times a cell: half the time of 2 layers
BATCH, NEW_TOKENS = 2, 2
LENGTHS = (6, 9)  # the first batch's tokens divide 2, 3 and 4 ranks' groups
# why an all-reduce is left whole, each by name: too few tokens (a decode step), a
# symbolic count not provably divisible, not a matmul's (the embedding), ``auto``'s plan
WHOLE = {
    "ar.indivisible",
    "ar.not_provably_divisible",
    "ar.not_matmul",
    "plan.not_profitable",
    "split.not_profitable",
    "plan.off",
}


def prompts() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches (ids, attention mask); the second's first row is left-padded."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for length in LENGTHS:
        ids = torch.randint(1, VOCAB, (BATCH, length), generator=gen)
        batches.append((ids, torch.ones_like(ids)))
    ids, mask = batches[-1]
    ids[0, :2], mask[0, :2] = 0, 0
    return batches


def generate_cell(rank: int, n: int, path: str, inner: str, cache: str, schedule: str) -> dict:
    """Eager TP's tokens, then per schedule (the cell's, ``off``) a fresh load compiled
    with it: whether its tokens equal eager TP's, the graphs Dynamo compiled, and every
    site record as (graph, kind, decision, code)."""
    import torch._dynamo
    import torch._inductor.config
    from transformers import CompileConfig

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    batches = prompts()

    def generated(model, config=None) -> list[torch.Tensor]:
        kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
        with torch.no_grad():
            return [
                model.generate(
                    ids,
                    attention_mask=mask,
                    cache_implementation=cache,
                    compile_config=config,
                    **kwargs,
                )
                for ids, mask in batches
            ]

    expected = generated(load(path, n).eval())
    result: dict = {}
    for sched in dict.fromkeys([schedule, "off"]):
        torch._dynamo.reset()
        report.reset()
        torch._dynamo.utils.counters.clear()
        model = load(path, n).eval()
        if cache == "static" and inner == "inductor":  # transformers' route, its defaults
            config = CompileConfig(backend="commfuse")
            config._compile_all_devices = True  # on CPU too
            with pytest.MonkeyPatch.context() as env:
                env.setenv("COMMFUSE_SCHEDULE", sched)
                got = generated(model, config)
        else:
            options = {"schedule": sched, "inner": inner}
            model.forward = torch.compile(model.forward, backend="commfuse", options=options)
            got = generated(model)
        result[sched] = {
            "equal": all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)),
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "sites": [
                (r.graph_index, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites
            ],
        }
    torch._dynamo.reset()
    return result


@pytest.fixture(scope="module")
def cell(ranks, tmp_path_factory) -> Callable[..., dict]:
    """``cell(n, inner, cache, schedule)``: rank 0's result, after every rank agreed."""
    checkpoint = str(tmp_path_factory.mktemp("tiny_llama"))
    save_tiny_llama(checkpoint, LAYERS)

    def get(n: int, inner: str, cache: str, schedule: str) -> dict:
        results = ranks(n).run(generate_cell, checkpoint, inner, cache, schedule)
        for sched, got in results[0].items():
            print(n, inner, cache, sched, "tokens equal", got["equal"], "graphs", got["graphs"])
        for graph in sorted({s[0] for s in results[0][schedule]["sites"]}):
            sites = Counter(s[1:] for s in results[0][schedule]["sites"] if s[0] == graph)
            print(n, inner, cache, schedule, "graph", graph, dict(sites))
        assert all(r == results[0] for r in results[1:])  # the ranks decided alike
        return results[0]

    return get


CELLS = [
    (3, "eager", "dynamic", "ring"),
    pytest.param(3, "inductor", "dynamic", "ring", marks=pytest.mark.matrix),
    pytest.param(2, "eager", "dynamic", "ring", marks=pytest.mark.matrix),
    pytest.param(4, "eager", "dynamic", "ring", marks=pytest.mark.matrix),
    pytest.param(2, "eager", "static", "ring", marks=pytest.mark.matrix),
    pytest.param(4, "eager", "static", "ring", marks=pytest.mark.matrix),
    pytest.param(3, "eager", "dynamic", "auto", marks=pytest.mark.matrix),
    pytest.param(2, "inductor", "static", "ring", marks=pytest.mark.matrix),  # CompileConfig
]


@pytest.mark.parametrize(("n", "inner", "cache", "schedule"), CELLS)
def test_generate_with_the_pass_gives_eager_tp_tokens(cell, n, inner, cache, schedule):
    result = cell(n, inner, cache, schedule)
    run, off = result[schedule], result["off"]
    assert run["equal"] and off["equal"]
    assert run["graphs"] <= off["graphs"]
    assert all(site[3] != "internal.error" for site in run["sites"])
    left_whole = [s for s in run["sites"] if s[1] == "mm_ar"]
    assert {s[3] for s in left_whole} <= WHOLE, left_whole
    first = Counter(s[1:] for s in run["sites"] if s[0] == 0)
    prefill_compiled = not (cache == "static" and inner == "inductor")
    if schedule == "ring" and prefill_compiled:  # each o_proj and down_proj all-reduce
        assert first[("mm_rs", "rewritten", "")] == 2 * LAYERS
        assert first[("ag_mm", "rewritten", "")] == 2 * LAYERS
    decode = [s for s in run["sites"] if s[0] != 0 and s[1] == "mm_ar"]
    if n > BATCH:  # a decode step's BATCH tokens: fewer than the ranks
        assert decode and {s[3] for s in decode} <= WHOLE
