"""Hugging Face transformers' own tensor parallelism: a tiny random Llama saved with
``save_pretrained`` and loaded with ``from_pretrained(path, tp_plan="auto")`` on gloo CPU
ranks, as a user loads a checkpoint, then compiled with ``backend="commfuse"``.

transformers' plan (``LlamaConfig.base_model_tp_plan``, with the ``embed_tokens`` and
``lm_head`` rules it adds) shards the embedding by vocabulary rows (a masked lookup, then
an all-reduce), q/k/v and gate/up column-wise, o/down row-wise (each output all-reduced:
DTensor's ``Partial`` to ``Replicate`` when training, an in-place ``dist.all_reduce``
under ``no_grad``) and the head column-wise with its logits all-gathered. The pass splits
the row-parallel all-reduces into a reduce-scatter, the residual add and the norm on
this rank's tokens and an all-gather that the next matmuls read
(``passes/shard_tokens``, on the joint graph when training: ``passes/joint.py``): ``mm_rs``
sites whose match says ``from: all_reduce``, and ``ag_mm`` sites. Per cell (ranks,
compiler after the pass), one job on the ranks: two SGD steps with the loss transformers
computes from ``labels``, compiled and uncompiled (each a fresh load), and a prefill
under ``no_grad``; one test compares the numbers, the other the sites per graph.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

import accelerate  # noqa: F401  # from_pretrained with a tp_plan needs it
import pytest
import torch
import transformers  # noqa: F401  # the test extra installs both: missing, this fails

from commfuse_compile import report

HIDDEN, HEADS, FFN, LAYERS, VOCAB = 24, 12, 48, 2, 96  # 12 heads, 48 and 96: 2, 3 and 4
BATCH, SEQ = 2, 6  # 12 tokens: 2, 3 and 4 ranks


def save_tiny_llama(path: str, layers: int = LAYERS) -> None:
    """A random Llama of ``layers`` layers, written as a checkpoint the ranks load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=64,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def load(path: str, n: int):
    """The checkpoint as a user loads it for tensor parallelism on ``n`` CPU ranks."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():  # 5.x: "pass it in DistributedConfig(tp_plan=...)"
        warnings.filterwarnings("ignore", "Passing `tp_plan`", FutureWarning)
        return AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", tp_size=n, dtype=torch.float32
        )


def run_hf(rank: int, n: int, path: str, inner: str, steps: int = 2) -> dict:
    """``steps`` SGD steps uncompiled, then compiled (``ring``), each followed by a prefill:
    the losses, the prefills' largest logit difference and the compiled run's sites."""
    import torch._inductor.config

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    report.reset()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(steps + 1)]
    losses, logits = [], []
    for compiled in (False, True):
        model = load(path, n)
        model.train()
        options = {"schedule": "ring", "inner": inner}
        run = torch.compile(model, backend="commfuse", options=options) if compiled else model
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        runs = []
        for ids in batches[:steps]:
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            sgd.step()
            sgd.zero_grad()
            runs.append(loss.item())
        losses.append(runs)
        model.eval()
        with torch.no_grad():
            logits.append(run(input_ids=batches[steps]).logits)
    return {
        "losses": losses,
        "logits": (logits[1] - logits[0]).abs().max().item(),
        "sites": [
            (r.graph, r.kind, r.decision, r.decline_code, r.match.get("from", ""))
            for r in report.REPORT.sites
        ],
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def cell(ranks, checkpoint) -> Callable[[int, str], list[dict]]:
    """``cell(n, inner)``: every rank's result of ``run_hf``, run once per module."""
    done: dict[tuple[int, str], list[dict]] = {}

    def get(n: int, inner: str) -> list[dict]:
        if (n, inner) not in done:
            done[n, inner] = ranks(n).run(run_hf, checkpoint, inner)
            for site in done[n, inner][0]["sites"]:
                print(n, inner, site)
        return done[n, inner]

    return get


CELLS = [  # Inductor on plain TP by default: tests/test_plain_tp.py (3 ranks)
    (4, "eager"),
    pytest.param(3, "inductor", marks=pytest.mark.matrix),
    pytest.param(2, "eager", marks=pytest.mark.matrix),
    pytest.param(3, "eager", marks=pytest.mark.matrix),
    pytest.param(4, "inductor", marks=pytest.mark.matrix),
]


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_trains_and_prefills_as_uncompiled(cell, n, inner):
    for rank, r in enumerate(cell(n, inner)):
        plain, compiled = r["losses"]
        print(n, inner, rank, "losses", plain, compiled, "prefill logits |diff|", r["logits"])
        assert compiled == pytest.approx(plain, rel=1e-5)
        assert r["logits"] < 1e-5


# Per graph, what the pass does with each collective of the tiny Llama (LAYERS layers).
# Forward and prefill: the vocabulary-parallel embedding's all-reduce (a masked lookup,
# no matmul) and each o_proj/down_proj all-reduce are split; the embedding's
# reduce-scatter has no matmul to hide behind (rs.no_matmul), the others are rings;
# the gathers before q/k/v, gate/up and lm_head are hidden behind them; the logits'
# all-gather after lm_head (a matmul then a gather: no kind) is kept. Training, the split
# is made on the joint graph: what the backward reads of the region is saved as shards,
# and nothing is gathered whole for it. Backward: lm_head's input gradient's all-reduce
# and per layer q/k/v's and gate/up's (each summed into one) split, the gathers before
# down_proj's and o_proj's gradients hidden, the embedding's gradient (the graph's output)
# gathered whole, and each norm weight's gradient summed over this rank's tokens and
# all-reduced as it is.
SPLIT = ("mm_rs", "rewritten", "", "all_reduce")
HIDDEN_GATHER = ("ag_mm", "rewritten", "", "all_reduce")
WHOLE_GATHER = ("ag_mm", "declined", "ag.no_matmul", "all_reduce")
INFERENCE = {
    SPLIT: 2 * LAYERS,
    ("mm_rs", "declined", "rs.no_matmul", "all_reduce"): 1,
    HIDDEN_GATHER: 2 * LAYERS + 1,
    ("ag_mm", "declined", "site.no_kind", ""): 1,
}
EXPECTED = {
    "forward": INFERENCE,
    "inference": INFERENCE,
    "backward": {
        SPLIT: 1 + 2 * LAYERS,
        HIDDEN_GATHER: 2 * LAYERS,
        WHOLE_GATHER: 1,
        ("mm_ar", "declined", "ar.not_matmul", ""): 2 * LAYERS + 1,
    },
}


@pytest.mark.parametrize(("n", "inner"), CELLS)
def test_all_reduces_split_into_sequence_parallel_sites(cell, n, inner):
    for r in cell(n, inner):
        table = {graph: Counter(s[1:] for s in r["sites"] if s[0] == graph) for graph in EXPECTED}
        assert table == {graph: Counter(counts) for graph, counts in EXPECTED.items()}
