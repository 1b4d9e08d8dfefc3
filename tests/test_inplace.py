"""In-place c10d collectives, as Megatron-LM and DeepSpeed write them (the canonical form,
``passes/prepare/canonical.py``, and the one predicate of value readers, ``fx.graph.data_users``).

Graph level, on torch's fake process group through ``torch.compile`` (Dynamo traces the
in-place API into a functional collective and a copy into the preallocated buffer): each
spelling torch 2.13 produces is rewritten as its functional twin is (``async_op=True``:
``tests/test_async_collectives.py``); a graph whose sites are all declined is restored
byte-identical. Numbers on gloo ranks: the Megatron- and DeepSpeed-style front ends
(``tools/training/styles.py``), forward and backward, 2-4 ranks, eager and Inductor, every site
rewritten and the losses equal (2 and 4 ranks and the GQA / fused q/k/v variants:
``pytest -m matrix``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from trained import counts, loss_difference, small_config, train

from commfuse_compile import Options, report
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.tools.training import fronts

N, RANK = 4, 1
aten = torch.ops.aten


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def gather_into_tensor(x, w):
    out = torch.empty(N * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(out, x)
    return out @ w


def gather_base(x, w):
    out = torch.empty(N * x.shape[0], x.shape[1])
    dist._all_gather_base(out, x)
    return out @ w


def gather_single(x, w):
    """torch 2.13's name for all_gather_into_tensor."""
    out = torch.empty(N * x.shape[0], x.shape[1])
    dist.all_gather_single(out, x)
    return out @ w


def gather_into_list(x, w):
    parts = [torch.empty_like(x) for _ in range(N)]
    dist.all_gather(parts, x)
    return torch.cat(parts) @ w


def reduce_scatter_tensor(x, w):
    y = x @ w.t()
    out = torch.empty(y.shape[0] // N, y.shape[1])
    dist.reduce_scatter_tensor(out, y)
    return out


def reduce_scatter_base(x, w):
    y = x @ w.t()
    out = y.new_empty(y.shape[0] // N, y.shape[1])
    dist._reduce_scatter_base(out, y)
    return out


def reduce_scatter_single(x, w):
    """torch 2.13's name for reduce_scatter_tensor."""
    y = x @ w.t()
    out = torch.empty(y.shape[0] // N, y.shape[1])
    dist.reduce_scatter_single(out, y)
    return out


def all_to_all_after_matmul(x, w):
    """DeepSpeed's projection side: the blocks made contiguous, the output allocated like
    them (``empty_like`` reads only their sizes)."""
    sent = (x @ w.t()).view(N, -1, w.shape[0]).contiguous()
    out = torch.empty_like(sent)
    dist.all_to_all_single(out, sent)
    return out


def all_to_all_before_matmul(x, w):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out @ w


SPELLINGS = [
    (gather_into_tensor, "ag_mm"),
    (gather_base, "ag_mm"),
    (gather_single, "ag_mm"),
    (gather_into_list, "ag_mm"),
    (reduce_scatter_tensor, "mm_rs"),
    (reduce_scatter_base, "mm_rs"),
    (reduce_scatter_single, "mm_rs"),
    (all_to_all_after_matmul, "mm_a2a"),
    (all_to_all_before_matmul, "a2a_mm"),
]


def compiled_sites(fn, tmp_path, **options):
    """``fn`` compiled with the backend on the fake group: its sites, and the graph's code
    before the pass (from the debug dump)."""
    torch._dynamo.reset()
    report.reset()
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    options = {"schedule": "ring", "inner": "eager", "debug_dir": str(tmp_path), **options}
    torch.compile(fn, backend="commfuse", options=options, fullgraph=True)(x, w)
    before = (tmp_path / f"rank{RANK}" / "graph000_inference_before.py").read_text()
    return report.REPORT.sites, before


@pytest.mark.parametrize(("fn", "kind"), SPELLINGS, ids=[f.__name__ for f, _ in SPELLINGS])
def test_each_in_place_spelling_is_rewritten_as_its_functional_twin(fake_world, tmp_path, fn, kind):
    sites, before = compiled_sites(fn, tmp_path)
    assert "aten.copy.default" in before  # Dynamo's spelling: a copy into the buffer
    assert [(s.kind, s.decision) for s in sites] == [(kind, "rewritten")]
    assert sites[0].p2p_ops == N - 1


def aten_graph(fn):
    """The forward aten graph AOTAutograd gives the backend for ``fn`` (fake values)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(
        torch.randn(8, 16), torch.randn(16, 16)
    )
    return graphs[0]


@pytest.mark.parametrize("fn", [f for f, _ in SPELLINGS], ids=[f.__name__ for f, _ in SPELLINGS])
def test_a_graph_with_nothing_rewritten_is_restored_byte_identical(fake_world, fn):
    gm = aten_graph(fn)
    before = gm.code
    records = rewrite_graph(gm, "forward", Options(schedule="off", inner="eager"))
    assert [r.decision for r in records] == ["declined"]
    assert gm.code == before


def test_a_copy_that_converts_or_broadcasts_is_not_the_value(fake_world):
    """A copy into a buffer of another dtype converts: it stays, and so does the site's
    reader of the buffer (the matmul reads the converted copy)."""

    def gather_into_half(x, w):
        gathered = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_gather_into_tensor(x, N, dist.group.WORLD.group_name)
        )
        out = torch.empty(N * x.shape[0], x.shape[1], dtype=torch.float64)
        out.copy_(gathered)
        return out @ w.double()

    gm = aten_graph(gather_into_half)
    from commfuse_compile.passes.prepare.canonical import canonicalize

    assert not canonicalize(gm.graph, before_change=lambda: None)
    assert any(n.target is aten.copy.default for n in gm.graph.nodes)


# ----------------------------------------------------------------------------------------
# gloo ranks: the framework-style front ends


def style_config(front: str, n: int, variant: str) -> fronts.TrainConfig:
    extra = {"gqa_kv_heads": n, "fused_qkv": True} if variant == "gqa-fused" else {}
    return small_config(front, n, **extra)


# per block: (forward, backward) sites of each kind
EXPECTED = {
    "megatron": {"ag_mm": (2, 2), "mm_rs": (2, 2)},
    "deepspeed": {"mm_a2a": (3, 1), "a2a_mm": (1, 3)},
}


def style_cells():
    for front in ("megatron", "deepspeed"):
        for n in (2, 3, 4):
            for inner in ("eager", "inductor"):
                variants = ["plain"] + (["gqa-fused"] if front == "deepspeed" else [])
                for variant in variants:
                    # by default Inductor on 3 ranks (eager: the same sites, in the matrix)
                    default = (n, inner, variant) == (3, "inductor", "plain")
                    marks = () if default else (pytest.mark.matrix,)
                    name = f"{front}-{variant}-n{n}-{inner}"
                    yield pytest.param(front, n, inner, variant, id=name, marks=marks)


@pytest.mark.parametrize(("front", "n", "inner", "variant"), list(style_cells()))
def test_framework_style_models_rewrite_every_site_and_match(ranks, front, n, inner, variant):
    options = {"schedule": "ring", "inner": inner}
    results = ranks(n).run(train, style_config(front, n, variant), options)
    for result in results:
        assert loss_difference(result) < 1e-5, result["losses"]
        assert all(s[2] == "rewritten" for s in result["sites"]), result["sites"]
        for kind, expected in EXPECTED[front].items():
            assert counts(result, kind) == expected, (kind, result["sites"])


@pytest.mark.parametrize(
    ("front", "n"),
    [
        # the default options on 4 ranks: test_rank_order; each style's sites with the
        # ring and Inductor: by default above
        pytest.param("deepspeed", 3, id="deepspeed-n3", marks=pytest.mark.matrix),
        pytest.param("megatron", 3, id="megatron-n3", marks=pytest.mark.matrix),
        pytest.param("deepspeed", 4, id="deepspeed-n4", marks=pytest.mark.matrix),
        pytest.param("megatron", 4, id="megatron-n4", marks=pytest.mark.matrix),
    ],
)
def test_framework_style_models_with_default_options(ranks, front, n):
    """``backend="commfuse"`` and nothing else (Inductor, ``auto``): every site of the
    in-place spelling is found and decided, alike on every rank, and the losses match."""
    results = ranks(n).run(train, style_config(front, n, "plain"), {})
    for result in results:
        assert loss_difference(result) < 1e-5, result["losses"]
        assert result["sites"] == results[0]["sites"]
        for kind, expected in EXPECTED[front].items():
            assert counts(result, kind) == expected, (kind, result["sites"])
        declined = {s[4] for s in result["sites"] if s[2] == "declined"}
        assert declined <= {"plan.not_profitable"}, result["sites"]
