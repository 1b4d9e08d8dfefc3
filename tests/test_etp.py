"""``bmm`` and ``_grouped_mm`` as matmul forms of the tensor-parallel kinds (``ag_mm``,
``mm_rs``, ``mm_ar``): experts that are tensor parallel too (``passes/kit/paths.py``), as
Megatron-Core's drop-and-pad dispatcher lays the experts' slots out (all-gathered over
the tensor-parallel group, ``view``, ``transpose``, ``contiguous`` into each local
expert's rows) and as grouped GEMMs over each expert's rows read them.

Graph level, on torch's fake process group (rank 1 of 4, ``make_fx``): the gathered
blocks followed through the layout ops to the rows of every batch entry (``bmm``) or of
a grouped matmul (its offsets a block's own: ``clamp(offs - start, 0, width)``), its
contraction (a weight gradient's, the offsets cut too, or K: untouched) and its columns;
a product's blocks followed back to the reduce-scatter and the all-reduce. Declined with
the reason: blocks along the batch or the groups (``rs.batch_blocks``,
``ar.batch_blocks``, a gathered weight's experts), blocks that are rows of several groups
(``site.blocks_lost``, an all-gather's note).

On gloo ranks (3 by default, 2 and 4 under ``-m matrix``): the programs through
``apply``, uneven groups that cross the blocks' bounds and an empty group among them:
rows equal bit for bit; columns (a narrower block may take another kernel) and partial
sums (the reduce-scatter's, the contraction's float32 sum of bfloat16 partials) within
their rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import records_of
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile

N, RANK = 4, 1
c10d = torch.ops._c10d_functional
aten = torch.ops.aten
GROUPED = aten._grouped_mm.default
P2P = torch.ops.commfuse.p2p.default
E, C, D, F_ = 2, 4, 16, 32  # local experts, slots per expert and rank, width, hidden


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def group() -> str:
    return dist.group.WORLD.group_name


def ag(x, n, dim=0):
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group()))
    return out if dim == 0 else torch.cat(torch.split(out, x.shape[0]), dim=dim)


def rs(z, n, dim=0):
    if dim != 0:
        z = torch.cat(torch.split(z, z.shape[dim] // n, dim=dim), dim=0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", n, group()))


def ar(z):
    return c10d.wait_tensor(c10d.all_reduce(z, "sum", group()))


def sorted_by_expert(x, n):
    """Megatron-Core's drop-and-pad ``dispatch_postprocess``: [n, E, C, D] -> [E, n*C, D]."""
    return x.view(n, E, C, D).transpose(0, 1).contiguous().view(E, n * C, D)


def unsorted(y, n):
    """``combine_preprocess``: back to [n * E * C, D]."""
    return y.view(E, n, C, D).transpose(0, 1).contiguous().view(-1, D)


# ----------------------------------------------------------------------------------------
# the programs: (n, *tensors)


def bmm_experts(n, x, w1, w2):
    """Megatron-Core's ETP expert forward as one batched matmul per linear: the slots
    gathered, sorted by expert, column-parallel w1, GELU, row-parallel w2, unsorted,
    reduce-scattered; the gathered rows returned too (saved for the backward)."""
    g = sorted_by_expert(ag(x, n), n)
    return rs(unsorted(torch.bmm(F.gelu(torch.bmm(g, w1)), w2), n), n), g


def bmm_backward(n, dy, h, w1, w2):
    """Its backward's shape: the output's gradient gathered into dH (rows) and dW2 (its
    blocks along the contraction), dX reduce-scattered."""
    g = sorted_by_expert(ag(dy, n), n)
    dh = torch.bmm(g, w2.transpose(1, 2))
    dw2 = torch.bmm(h.transpose(1, 2), g)
    dx = torch.bmm(dh * h, w1.transpose(1, 2))
    return rs(unsorted(dx, n), n), dw2


def bmm_weight_columns(n, x, w1, w2):
    """Each expert's weight gathered along its columns (``[E, K, N/n]`` on each rank) into
    the batched matmul."""
    return torch.bmm(x.view(E, C, D), ag(w1, n, dim=2))


def bmm_columns_scattered(n, x, w1, w2):
    """A batched product reduce-scattered along its columns."""
    return rs(torch.bmm(x.view(E, C, D), w1), n, dim=2)


def bmm_weight_gradient(n, dy, h, w1, w2):
    """A weight's gradient from gathered rows: ``G^T @ X`` per expert (the blocks along
    the contraction, through the transpose)."""
    g = sorted_by_expert(ag(dy, n), n)
    return torch.bmm(g.transpose(1, 2), h)


def grouped_experts(n, x, w1, w2, offs):
    """TEGroupedMLP's grouped GEMMs over every rank's tokens of each expert (offs over
    the gathered rows): A's rows by their group's weight, their block's offsets."""
    h = F.silu(torch._grouped_mm(ag(x, n), w1, offs=offs))
    return rs(torch._grouped_mm(h, w2, offs=offs), n), h


def grouped_backward(n, dy, h, w2, offs):
    """dH (rows) and dW2 (the contraction in groups: 2-D x 2-D, its blocks' offsets)."""
    g = ag(dy, n)
    return torch._grouped_mm(g, w2.transpose(-2, -1), offs=offs), torch._grouped_mm(
        h.t(), g, offs=offs
    )


def grouped_contract_k(n, x, w1, w2, offs):
    """An activation gathered on its last dim (the contraction: the groups untouched)."""
    return torch._grouped_mm(ag(x, n, dim=1), w1, offs=offs)


def grouped_columns(n, x, w1, w2, offs):
    """A product reduce-scattered on its columns (the groups untouched)."""
    return rs(torch._grouped_mm(x, w1, offs=offs), n, dim=1)


def grouped_all_reduce(n, x, w1, w2, offs):
    """Plain TP's row-parallel grouped output, all-reduced (rows: their blocks' offsets)."""
    return ar(torch._grouped_mm(x, w1, offs=offs))


def bmm_all_reduce(n, x, w1, w2):
    """The experts' batched output all-reduced as it is: its rows are the experts."""
    return ar(torch.bmm(x.view(E, -1, D), w1))


def bmm_scatter_experts(n, x, w1, w2):
    """Reduce-scattered along the experts (the batch)."""
    return rs(torch.bmm(x, w1), n)


def grouped_interleaved(n, x, w1, w2, offs):
    """TEGroupedMLP on the drop-and-pad layout of 2 local experts flattened: a block of
    each rank's slots holds rows of both groups."""
    g = sorted_by_expert(ag(x, n), n).reshape(-1, D)
    h = torch._grouped_mm(g, w1, offs=offs)
    return rs(unsorted(torch._grouped_mm(h, w2, offs=offs).view(E, -1, D), n), n)


def gathered_experts(n, x, w1, w2, offs):
    """Expert weights gathered along the experts (the groups) into a grouped matmul."""
    return torch._grouped_mm(x, ag(w1, n), offs=offs)


def bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16()


def offsets(rows: int, groups: int, gen) -> torch.Tensor:
    """Uneven group ends over ``rows``: the first group empty, the others across the
    blocks' bounds."""
    cuts = torch.randint(1, rows, (groups - 2,), generator=gen).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])]).to(torch.int32)


def inputs(fn, n: int, seed: int) -> list[torch.Tensor]:
    """One rank's inputs of ``fn`` on ``n`` ranks (its own shard, weights and offsets)."""
    gen = torch.Generator().manual_seed(seed)
    m, g = 6 * n, 4  # the grouped programs' rows (gathered) and groups

    def weights(*shape):
        return torch.randn(*shape, generator=gen) / shape[-2] ** 0.5

    if fn in (bmm_experts, bmm_all_reduce):
        return [torch.randn(E * C, D, generator=gen), weights(E, D, D), weights(E, D, D)]
    if fn is bmm_weight_columns:  # 8 of each expert's 8 n columns per rank
        return [torch.randn(E * C, D, generator=gen), weights(E, D, 8), weights(1, D, D)]
    if fn is bmm_columns_scattered:  # 8 n columns, 8 per rank's block
        return [torch.randn(E * C, D, generator=gen), weights(E, D, 8 * n), weights(1, D, D)]
    if fn is bmm_scatter_experts:
        return [torch.randn(E * n, C, D, generator=gen), weights(E * n, D, D), weights(1, D, D)]
    if fn in (bmm_backward, bmm_weight_gradient):
        dy, h = torch.randn(E * C, D, generator=gen), torch.randn(E, n * C, D, generator=gen)
        return [dy, h, weights(E, D, D), weights(E, D, D)]
    if fn is grouped_backward:
        return [bf16(m // n, D, gen=gen), bf16(m, F_, gen=gen), bf16(g, F_, D, gen=gen)] + [
            offsets(m, g, gen)
        ]
    if fn is grouped_interleaved:
        rows = E * n * C
        x, w1, w2 = bf16(E * C, D, gen=gen), bf16(E, D, F_, gen=gen), bf16(E, F_, D, gen=gen)
        return [x, w1, w2, torch.tensor([rows // 2, rows], dtype=torch.int32)]
    if fn is gathered_experts:  # one expert per rank, gathered
        return [bf16(m, D, gen=gen), bf16(1, D, F_, gen=gen), bf16(1, gen=gen), offsets(m, n, gen)]
    if fn is grouped_contract_k:  # 8 of the contraction's 8 n per rank
        return [
            bf16(m, 8, gen=gen),
            bf16(g, 8 * n, F_, gen=gen),
            bf16(1, gen=gen),
            offsets(m, g, gen),
        ]
    if fn is grouped_columns:  # 16 of the product's 16 n columns per rank's block
        return [
            bf16(m, D, gen=gen),
            bf16(g, D, 16 * n, gen=gen),
            bf16(1, gen=gen),
            offsets(m, g, gen),
        ]
    rows = m // n if fn is grouped_experts else m
    return [bf16(rows, D, gen=gen), bf16(g, D, F_, gen=gen), bf16(g, F_, D, gen=gen)] + [
        offsets(m, g, gen)
    ]


def traced(fn, n: int = N, seed: int = 0):
    args = inputs(fn, n, seed)
    return make_fx(lambda *xs: fn(n, *xs), tracing_mode="fake")(*args), args


# ----------------------------------------------------------------------------------------
# graph level

REWRITTEN = {
    # program: [(kind, roles of its matmuls or the product's blocks)] in graph order
    bmm_experts: [("ag_mm", ["rows"]), ("mm_rs", "rows")],
    bmm_backward: [("ag_mm", ["contract_left", "rows"]), ("mm_rs", "rows")],
    bmm_weight_columns: [("ag_mm", ["columns"])],
    bmm_columns_scattered: [("mm_rs", "columns")],
    bmm_weight_gradient: [("ag_mm", ["contract"])],
    grouped_experts: [("ag_mm", ["rows"]), ("mm_rs", "rows")],
    grouped_backward: [("ag_mm", ["rows", "contract_left"])],
    grouped_contract_k: [("ag_mm", ["contract_k"])],
    grouped_columns: [("mm_rs", "columns")],
    grouped_all_reduce: [("mm_ar", "rows")],
}


def _roles(record) -> object:
    if record.kind == "ag_mm":
        return sorted(record.match["roles"].values())
    return record.match["blocks"]


@pytest.mark.parametrize("fn", list(REWRITTEN), ids=lambda fn: fn.__name__)
def test_batched_and_grouped_sites_are_rewritten(fake_world, fn):
    gm, _ = traced(fn)
    records = records_of(gm)
    table = [(r.kind, r.decision, r.decline_code) for r in records]
    assert table == [(kind, "rewritten", "") for kind, _ in REWRITTEN[fn]], [
        r.reason for r in records
    ]
    assert [(r.kind, _roles(r)) for r in records] == [
        (kind, sorted(roles) if isinstance(roles, list) else roles) for kind, roles in REWRITTEN[fn]
    ]
    kinds = [node.target for node in gm.graph.nodes]
    assert (
        not {c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default} & set(kinds)
        or fn is grouped_all_reduce
    )  # (its second half: one all-gather)
    assert kinds.count(P2P) == sum(r.p2p_ops for r in records) > 0


DECLINED = [
    # (program, collective's kind, code, reason starts with)
    (bmm_all_reduce, "mm_ar", "ar.batch_blocks", "the all-reduce's rows (dim 0) are along"),
    (bmm_scatter_experts, "mm_rs", "rs.batch_blocks", "the reduce-scatter's n blocks are"),
    (grouped_interleaved, "ag_mm", "ag.matmuls_left_out", "_grouped_mm (no role): the gathered"),
    (grouped_interleaved, "mm_rs", "site.blocks_lost", "the collective's n blocks do not"),
    (gathered_experts, "ag_mm", "ag.matmuls_left_out", "_grouped_mm (no role): the gathered"),
]


@pytest.mark.parametrize(
    ("fn", "kind", "code", "reason"), DECLINED, ids=[f"{d[0].__name__}-{d[1]}" for d in DECLINED]
)
def test_blocks_that_are_not_rows_columns_or_contraction_decline(
    fake_world, fn, kind, code, reason
):
    gm, _ = traced(fn)
    before = str(gm.code)
    (record,) = [r for r in records_of(gm) if r.kind == kind]
    assert (record.decision, record.decline_code) == ("declined", code), record.reason
    assert record.reason.startswith(reason), record.reason
    assert str(gm.code) == before


def test_a_block_of_a_grouped_matmul_has_its_own_offsets(fake_world):
    """Each piece's grouped matmul reads ``clamp(offs - start, 0, width)``."""
    gm, _ = traced(grouped_experts)
    records_of(gm)
    clamps = [n for n in gm.graph.nodes if n.target is aten.clamp_max.default]
    assert len(clamps) == 2 * N  # a block's offsets per piece, for the gather and the scatter
    grouped = [n for n in gm.graph.nodes if n.target is GROUPED]
    assert {n.args[2].args[0] for n in grouped} == set(clamps)  # (cast back to int32)
    assert {n.args[2].meta["val"].dtype for n in grouped} == {torch.int32}


# ----------------------------------------------------------------------------------------
# on gloo ranks

NUMERIC = [*REWRITTEN]


def run_programs(rank: int, n: int, names: list[str], seed: int) -> dict:
    """Each program traced for this rank (its own inputs), its outputs with and without
    the rewrite (``apply``, ring), and how many collectives the rewrite left."""
    torch.set_num_threads(1)
    results = {}
    for name in names:
        fn = globals()[name]
        args = inputs(fn, n, seed * 100 + rank)
        gm = make_fx(lambda *xs, fn=fn: fn(n, *xs), tracing_mode="fake")(*args)
        expected = _outputs(gm(*[a.clone() for a in args]))
        rewritten = commfuse_compile.apply(copy.deepcopy(gm), schedule="ring")
        actual = _outputs(rewritten(*[a.clone() for a in args]))
        results[name] = {
            "pairs": list(zip(actual, expected, strict=True)),
            "p2p": [node.target for node in rewritten.graph.nodes].count(P2P),
        }
    return results


def _outputs(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple | list) else [value]


# outputs equal bit for bit: blocks of rows of one product (a sum over the ranks, or over
# blocks of the contraction, rounds in another order)
EXACT = {
    "bmm_experts": [False, True],
    "bmm_backward": [False, False],
    "bmm_weight_columns": [False],  # (a narrower float32 block may take another kernel)
    "bmm_columns_scattered": [False],
    "bmm_weight_gradient": [False],
    "grouped_experts": [False, True],
    "grouped_backward": [True, False],
    "grouped_contract_k": [False],
    "grouped_columns": [False],
    "grouped_all_reduce": [False],
}


def numeric_cells():
    for n in (2, 3, 4):
        yield pytest.param(n, id=f"n{n}", marks=() if n == 3 else (pytest.mark.matrix,))


@pytest.mark.parametrize("n", list(numeric_cells()))
def test_programs_equal_with_the_rewrite(ranks, n):
    names = [fn.__name__ for fn in NUMERIC]
    for rank, results in enumerate(ranks(n).run(run_programs, names, 1)):
        for name, out in results.items():
            assert out["p2p"] > 0, (rank, name)
            for exact, (a, b) in zip(EXACT[name], out["pairs"], strict=True):
                if exact:
                    assert torch.equal(a, b), (rank, name, (a.float() - b.float()).abs().max())
                else:  # a sum in another order; a bfloat16 product's partials rounded
                    scale = b.float().abs().max().item()
                    tol = 2e-2 if b.dtype == torch.bfloat16 else 1e-5
                    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)
