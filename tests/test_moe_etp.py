"""MoE layers whose experts are tensor parallel too, as torchtitan and Megatron-Core write
them (``tools/training/moe_etp.py``), on a 2-D mesh ``[ep, tp]`` and with the experts
tensor parallel alone (``ep = 1``).

Graph level, on torch's fake process group (rank 1 of 4): a block compiled as the backend
compiles it, per graph every collective's record from ``rewrite_graph`` (ring, eager):

* torchtitan 0.2 (``ExpertTensorParallel``): the boundary's gather into the router
  (``ag_mm``), the dispatch and combine with the alignment padding one ``moe`` site,
  forward and backward; the output's reduce-scatter, the routed tokens' gradient
  all-reduce and the boundary's gradient gather touch no matmul (a ``scatter_add``, an
  all-to-all, an index between).
* Megatron-Core (drop-and-pad dispatcher, ``expert_tensor_parallel_size``): the slots'
  gather into the experts' batched matmuls and the reduce-scatter of their output, both
  ways; the expert-parallel all-to-alls touch no matmul (the gather and reduce-scatter
  stand between). As ``TEGroupedMLP``: with one local expert the grouped GEMMs are
  rewritten the same way; with two, each rank's slots are rows of both groups: declined.

On gloo ranks: forward, backward and 2 SGD steps with the pass (ring) and without, from
one initialization: losses equal (float32 experts: to 1e-5; bfloat16 ones within their
rounding), one compile, the sites as the graph level finds them. By default Megatron-Core
on 2 x 2 ranks with Inductor; both front ends on 2 x 2 and on 3 ranks of tensor-parallel
experts, eager and Inductor, under ``-m matrix``.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx import GraphModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.passes.kinds.unclaimed import COLLECTIVES
from commfuse_compile.tools.training import moe_etp, moe_loop

N, RANK = 4, 1
RING = Options(schedule="ring", inner="eager")


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def captured(cfg: moe_etp.ETPConfig) -> dict[str, list[tuple[str, str, str]]]:
    """One block of ``cfg`` compiled (fullgraph, scalars captured) with a backend that
    records per graph every collective's (kind, decision, decline code), and checks each
    collective has one record; it runs the graph unchanged."""
    tables: dict[str, list[tuple[str, str, str]]] = {}

    def compiler(gm: GraphModule, example_inputs, role: str):
        copied = GraphModule(gm, copy.deepcopy(gm.graph))
        names = [n.name for n in copied.graph.nodes if n.target in COLLECTIVES]
        records = rewrite_graph(copied, role, RING)
        named = collections.Counter(c for r in records for c in r.match["collectives"])
        assert named == collections.Counter(names), [r.reason for r in records]
        tables[role] = [(r.kind, r.decision, r.decline_code) for r in records]
        for r in records:
            print(role, r.kind, r.decision, r.decline_code, r.reason)
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=lambda gm, inputs: compiler(gm, inputs, "forward"),
        bw_compiler=lambda gm, inputs: compiler(gm, inputs, "backward"),
    )
    torch._dynamo.reset()
    block = cfg.build().blocks[0]
    x = torch.randn(cfg.tokens, cfg.dim, requires_grad=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out, aux = torch.compile(block, backend=backend, fullgraph=True)(x)
        (out.pow(2).mean() + aux).backward()
    torch._dynamo.reset()
    return tables


R, D_ = "rewritten", "declined"
TITAN = {
    # the boundary's gather into the router's gate; the counts; the padded dispatch and
    # combine; the partial output's reduce-scatter (a scatter_add computes it)
    "forward": [
        ("ag_mm", R, ""),
        ("a2a_mm", D_, "site.dtype"),
        ("moe", R, ""),
        ("mm_rs", D_, "rs.no_matmul"),
    ],
    # the output gradient's gather (into the scatter_add's gather); the experts'; the
    # routed tokens' gradient summed over the group (torchtitan's Partial placement)
    "backward": [("ag_mm", D_, "ag.no_matmul"), ("moe", R, ""), ("mm_ar", D_, "ar.not_matmul")],
}
MEGATRON = {
    # the dispatch; the slots' gather into the experts; their output's reduce-scatter; the
    # combine
    "forward": [
        ("a2a_mm", D_, "a2a.no_matmul"),
        ("ag_mm", R, ""),
        ("mm_rs", R, ""),
        ("a2a_mm", D_, "a2a.no_matmul"),
    ],
    # AOTAutograd recomputes the forward's dispatch and reduce-scatter, never read (the
    # same without the pass; Inductor's graphs drop them: ``RECOMPUTED``); the combine's
    # gradient, gathered into dH and dW2; dX reduce-scattered; the dispatch's gradient
    "backward": [
        ("a2a_mm", D_, "a2a.no_matmul"),
        ("mm_rs", D_, "site.unread"),
        ("a2a_mm", D_, "a2a.no_matmul"),
        ("ag_mm", R, ""),
        ("mm_rs", R, ""),
        ("a2a_mm", D_, "a2a.no_matmul"),
    ],
}


RECOMPUTED = collections.Counter(
    [("backward", "a2a_mm", D_, "a2a.no_matmul"), ("backward", "mm_rs", D_, "site.unread")]
)


def tp_only(table: dict[str, list[tuple[str, str, str]]]) -> dict[str, list]:
    """The same layer with the experts tensor parallel alone: no all-to-all."""
    return {
        role: [row for row in rows if row[0] not in ("a2a_mm", "moe") and row[2] != "site.unread"]
        for role, rows in table.items()
    }


EXPECTED = {
    ("titan", 2, 2, 2): TITAN,
    ("titan", 1, 4, 2): {
        "forward": [("ag_mm", R, ""), ("mm_rs", D_, "rs.no_matmul")],
        "backward": [("ag_mm", D_, "ag.no_matmul"), ("mm_ar", D_, "ar.not_matmul")],
    },
    ("megatron", 2, 2, 2): MEGATRON,
    ("megatron", 1, 4, 2): tp_only(MEGATRON),
    ("megatron-grouped", 2, 2, 1): MEGATRON,
    # two local experts flattened: each rank's slots are rows of both groups
    ("megatron-grouped", 1, 4, 2): {
        "forward": [("ag_mm", D_, "ag.matmuls_left_out"), ("mm_rs", D_, "site.blocks_lost")],
        "backward": [("ag_mm", D_, "ag.matmuls_left_out"), ("mm_rs", D_, "site.blocks_lost")],
    },
}


@pytest.mark.parametrize(
    ("moe", "ep", "tp", "local"),
    list(EXPECTED),
    ids=[f"{m}-{e}x{t}-local{k}" for m, e, t, k in EXPECTED],
)
def test_sites_of_each_graph(fake_world, moe, ep, tp, local):
    cfg = moe_etp.ETPConfig(moe=moe, ep=ep, tp=tp, experts_per_rank=local, hidden=16 * tp)
    assert captured(cfg) == EXPECTED[moe, ep, tp, local]


# ----------------------------------------------------------------------------------------
# on gloo ranks


def cells():
    for moe in ("titan", "megatron"):
        for ep, tp in ((2, 2), (1, 3)):
            for inner in ("eager", "inductor"):
                default = (moe, ep, tp, inner) == ("megatron", 2, 2, "inductor")
                marks = () if default else (pytest.mark.matrix,)
                yield pytest.param(moe, ep, tp, inner, id=f"{moe}-{ep}x{tp}-{inner}", marks=marks)
    for inner in ("eager", "inductor"):  # TEGroupedMLP, one local expert
        yield pytest.param(
            "megatron-grouped", 2, 2, inner, id=f"megatron-grouped-2x2-{inner}",
            marks=(pytest.mark.matrix,),
        )  # fmt: skip


def expected_sites(moe: str, ep: int, local: int, inner: str) -> collections.Counter:
    """The graph level's table (the tensor-parallel experts' at any group size; under
    Inductor without the never-read recomputed collectives)."""
    table = EXPECTED[moe, ep, 4 if ep == 1 else 2, local]
    sites = collections.Counter((role, *row) for role, rows in table.items() for row in rows)
    return sites - RECOMPUTED if inner == "inductor" and moe != "titan" and ep > 1 else sites


@pytest.mark.parametrize(("moe", "ep", "tp", "inner"), list(cells()))
def test_etp_trains_equal_with_the_pass(ranks, moe, ep, tp, inner):
    local = 1 if moe == "megatron-grouped" else 2
    cfg = moe_etp.ETPConfig(moe=moe, ep=ep, tp=tp, experts_per_rank=local, hidden=16 * tp)
    for r in ranks(ep * tp).run(moe_loop.compare, cfg, {"schedule": "ring", "inner": inner}):
        fused, plain = r["losses"]
        print(moe, ep, tp, inner, "losses", fused, plain, "grad", r["grad_diff"])
        # float32 experts (Megatron's bmm): the sums' order; bfloat16 ones: their rounding
        bf16 = moe != "megatron"
        assert fused == pytest.approx(plain, rel=2e-3 if bf16 else 1e-5), (fused, plain)
        assert r["grad_names"] and r["grad_diff"] < (3e-2 if bf16 else 1e-4)
        assert r["compiles"] == 1
        assert collections.Counter(r["sites"]) == expected_sites(moe, ep, local, inner), r["sites"]
