"""Every collective of a graph has exactly one record: one that no site kind claims (it
touches no matmul, or only past an index or as a grouped matmul's operand) is declined
with its own code, never skipped in silence (``passes/kinds/unclaimed.py``).

Graph level, on torch's fake process group (rank 1 of 4).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from cases import (
    AgMm,
    FusedQkv,
    MmRs,
    Ulysses,
    collective_names,
    exchanged,
    gathered,
    records_of,
    scattered,
    trace,
)
from torch.fx import Graph, GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import Options, report
from commfuse_compile.passes import kinds, match, rewrite_graph
from commfuse_compile.passes.fx.declines import Decline, decline
from commfuse_compile.passes.kinds import KINDS
from commfuse_compile.passes.kinds.ag_mm import AgMm as AgMmKind
from commfuse_compile.passes.kinds.ag_mm.site import AgMmSite
from commfuse_compile.passes.kit.rewrite import Taken

N, RANK = 4, 1
RING = Options(schedule="ring", inner="eager")
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def fx(fn, *inputs: torch.Tensor) -> GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def only(gm: GraphModule) -> report.SiteRecord:
    (record,) = records_of(gm)
    assert record.decision == "declined"
    return record


# ----------------------------------------------------------------------------------------
# the programs


def gathered_not_multiplied(x):
    return gathered(x, N, 0).relu()


def gathered_into_buffer(x, buffer):
    """The gathered rows written into a buffer that only an element-wise op reads."""
    g = gathered(x, N, 0)
    return buffer.slice_scatter(g, 0, 0, g.shape[0]) * 2


def token_counts(counts):
    """An MoE's exchange of per-expert token counts: integers, read by no matmul."""
    group = dist.group.WORLD.group_name
    out = c10d.wait_tensor(c10d.all_to_all_single(counts, [1] * N, [1] * N, group))
    return out.sum()


def scattered_not_a_product(x):
    return scattered(x * 2 + 1, N, 0)


def dispatched(x, perm, w):
    """An MoE's dispatch: tokens exchanged, then reordered by expert before the matmul."""
    return exchanged(x, N)[perm] @ w


def dispatched_grouped(x, perm, w, offs):
    """torchtitan's: the reordered tokens into a grouped matmul."""
    return torch._grouped_mm(exchanged(x, N)[perm], w, offs=offs)


def grouped_gradient(x, w, offs):
    """A reduce-scatter of a grouped matmul's product (experts tensor parallel too)."""
    return scattered(torch._grouped_mm(x, w, offs=offs), N, 0)


def exchanged_grouped(x, w, offs):
    """Exchanged tokens straight into a grouped matmul (no permutation, no combine)."""
    return torch._grouped_mm(exchanged(x, N), w, offs=offs)


def broadcast(x):
    group = dist.group.WORLD.group_name
    return c10d.wait_tensor(c10d.broadcast(x, 0, group)) * 2


def gathered_coalesced(x, y):
    group = dist.group.WORLD.group_name
    a, b = c10d.all_gather_into_tensor_coalesced([x, y], N, group)
    return c10d.wait_tensor(a) + 1, c10d.wait_tensor(b) * 2


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


OFFS = torch.tensor([4, 8], dtype=torch.int32)


# ----------------------------------------------------------------------------------------
# the codes


def test_an_all_gather_no_matmul_reads_is_declined():
    gm = fx(gathered_not_multiplied, torch.randn(2, 3))
    (name,) = collective_names(gm)
    record = only(gm)
    assert (record.kind, record.decline_code) == ("ag_mm", "ag.no_matmul")
    assert record.match["collectives"] == [name] and record.match["group_size"] == N
    assert record.reason == "no matmul consumes the gathered rows"


def test_an_all_gather_into_a_buffer_no_matmul_reads_is_declined():
    record = only(fx(gathered_into_buffer, torch.randn(2, 3), torch.randn(10, 3)))
    assert (record.kind, record.decline_code) == ("ag_mm", "ag.no_matmul")


def test_an_all_to_all_of_token_counts_is_declined_for_its_dtype():
    record = only(fx(token_counts, torch.arange(N)))
    assert (record.kind, record.decline_code) == ("a2a_mm", "site.dtype")
    assert "torch.int64" in record.reason and "all_to_all_single" in record.reason


def test_a_reduce_scatter_of_no_product_is_declined():
    record = only(fx(scattered_not_a_product, torch.randn(8, 3)))
    assert (record.kind, record.decline_code) == ("mm_rs", "rs.no_matmul")
    assert record.reason == "reduce-scatter input is add (add.Tensor): no matmul computes it"


def test_an_all_to_all_read_through_an_index_before_a_matmul_is_declined():
    gm = fx(dispatched, torch.randn(8, 3), torch.randperm(8), torch.randn(3, 5))
    record = only(gm)
    assert (record.kind, record.decline_code) == ("a2a_mm", "site.permuted")
    assert record.reason.startswith("index (index.Tensor) reorders rows by an index")
    assert "matmul mm" in record.reason


def test_an_moe_dispatch_into_grouped_matmuls_never_combined_is_declined():
    """The dispatched tokens, reordered, into a grouped matmul whose rows are never put
    back and combined: the MoE kind's (``kinds/moe``) record says so."""
    gm = fx(dispatched_grouped, bf16(8, 16), torch.randperm(8), bf16(2, 16, 16), OFFS)
    record = only(gm)
    assert (record.kind, record.decline_code) == ("moe", "moe.no_put_back")


def test_a_reduce_scatter_of_a_grouped_matmul_is_the_reduce_scatter_kinds():
    """``_grouped_mm`` is a matmul form of the tensor-parallel kinds (``test_etp``)."""
    (record,) = records_of(fx(grouped_gradient, bf16(8, 16), bf16(2, 16, 16), OFFS))
    assert (record.kind, record.decision) == ("mm_rs", "rewritten"), record.reason


def test_an_all_to_all_into_a_grouped_matmul_is_declined():
    record = only(fx(exchanged_grouped, bf16(8, 16), bf16(2, 16, 16), OFFS))
    assert (record.kind, record.decline_code) == ("a2a_mm", "site.grouped_mm")
    assert record.reason.startswith("_grouped_mm (_grouped_mm.default) is a grouped matmul")


@pytest.mark.parametrize(
    ("fn", "inputs", "op"),
    [
        (broadcast, (torch.randn(3),), "broadcast.default"),
        (
            gathered_coalesced,
            (torch.randn(3), torch.randn(2)),
            "all_gather_into_tensor_coalesced.default",
        ),
    ],
)
def test_a_collective_no_kind_rewrites_is_declined(fn, inputs, op):
    record = only(fx(fn, *inputs))
    assert (record.kind, record.decline_code) == ("collective", "site.no_kind")
    assert record.reason == f"no site kind rewrites {op}" and record.match["op"] == op


def test_the_debug_log_names_the_collective(caplog):
    gm = fx(gathered_not_multiplied, torch.randn(2, 3))
    (name,) = collective_names(gm)
    with caplog.at_level("DEBUG", logger="commfuse"):
        (record,) = rewrite_graph(gm, "forward", RING)
    assert f"ag_mm site {record.site} ({name}) in forward graph declined" in caplog.text


# ----------------------------------------------------------------------------------------
# every collective, one record


CASES = [
    AgMm(),
    AgMm(consumers=2, contract=1),
    MmRs(),
    Ulysses(side="in"),
    Ulysses(side="out"),
    Ulysses(side="grad"),
    FusedQkv(side="in"),
    FusedQkv(side="grad"),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_collective_of_a_traced_case_has_one_record(case):
    sized = {"n": N} if "n" in inspect.signature(case.inputs).parameters else {}
    records = records_of(trace(case, N, case.inputs(RANK, seed=0, **sized)))
    assert all(r.decision == "rewritten" for r in records)  # the kinds claim them all


def mixed(x, w, counts, y):
    """Sites the kinds claim beside collectives they do not, in one graph."""
    a = gathered(x, N, 0) @ w  # ag_mm
    b = scattered(a, N, 0)  # mm_rs, of the same product
    return b, token_counts(counts), gathered(y, N, 0) * 2


def test_every_collective_of_a_mixed_graph_has_one_record_in_graph_order():
    gm = fx(mixed, torch.randn(2, 3), torch.randn(3, 4), torch.arange(N), torch.randn(2, 3))
    sites = match.find_sites(gm.graph)
    assert [s.anchor.name for s in sites] == collective_names(gm)
    records = records_of(gm)
    assert [(r.kind, r.decision, r.decline_code) for r in records] == [
        ("ag_mm", "rewritten", ""),
        ("mm_rs", "declined", "rs.taken"),
        ("a2a_mm", "declined", "site.dtype"),
        ("ag_mm", "declined", "ag.no_matmul"),
    ]


def gathered_product(x, w):
    """A matmul -> all-gather (the head's output gathered for the loss)."""
    return gathered(x @ w, N, 0).relu()


def scattered_then_multiplied(x, w):
    return scattered(x * 2, N, 0) @ w


@pytest.mark.parametrize(
    ("fn", "shapes", "kind", "pattern"),
    [
        (gathered_product, ((2, 3), (3, 4)), "ag_mm", "mm (mm.default) -> all_gather_into_tensor"),
        (
            scattered_then_multiplied,
            ((8, 3), (3, 4)),
            "mm_rs",
            "reduce_scatter_tensor.default -> mm (mm.default)",
        ),
    ],
)
def test_a_matmul_on_the_side_no_kind_rewrites_is_declined(fn, shapes, kind, pattern):
    record = only(fx(fn, *(torch.randn(s) for s in shapes)))
    assert (record.kind, record.decline_code) == (kind, "site.no_kind")
    assert record.reason.startswith(f"no site kind rewrites {pattern}")


# ----------------------------------------------------------------------------------------
# one collective, two kinds: the claim is settled in the registry's order


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RivalSite(AgMmSite):
    kind: ClassVar[str] = "rival"


class _Rival(AgMmKind):
    """A kind that claims every all-gather ``ag_mm`` claims, and lowers it as ``ag_mm``
    does; ``declined``: each site declined as found."""

    name = "rival"

    def __init__(self, declined: bool) -> None:
        self.declined = declined

    def find(self, graph: Graph) -> list[AgMmSite]:
        why = decline("site.no_kind", pattern="a rival's").kept() if self.declined else None
        return [_rival(site, declined=why) for site in super().find(graph)]

    def rematch(self, site: AgMmSite, taken: Taken) -> AgMmSite | None:
        again = super().rematch(site, taken)
        return None if again is None else _rival(again, declined=again.declined)


def _rival(site: AgMmSite, declined: Decline | None) -> _RivalSite:
    fields = {f.name: getattr(site, f.name) for f in dataclasses.fields(site)}
    return _RivalSite(**{**fields, "declined": declined})


@pytest.mark.parametrize(
    ("first", "declined", "winner", "loser"),
    [
        pytest.param(False, False, "ag_mm", "rival", id="registered-last"),
        pytest.param(True, False, "rival", "ag_mm", id="registered-first"),
        pytest.param(True, True, "ag_mm", "rival", id="first-but-declined-as-found"),
    ],
)
def test_a_collective_two_kinds_claim_goes_to_the_first_that_matched_it(
    monkeypatch, first, declined, winner, loser
):
    """The loser keeps a record, declined ``site.claimed``, naming the winner."""
    rival = [("rival", _Rival(declined))]
    registry = dict(rival + list(KINDS.items()) if first else list(KINDS.items()) + rival)
    monkeypatch.setattr(kinds, "KINDS", registry)
    monkeypatch.setattr(match, "KINDS", registry)
    gm = trace(AgMm(), N, AgMm().inputs(RANK, seed=0))
    (gather,) = collective_names(gm)
    records = {r.kind: r for r in rewrite_graph(gm, "forward", RING)}
    assert sorted(records) == ["ag_mm", "rival"]
    assert records[winner].decision == "rewritten"
    assert records[loser].decline_code == "site.claimed"
    assert records[loser].reason == (
        f"{gather} is claimed by a {winner} site (a collective two kinds match goes to the "
        "first in kinds.KINDS that matched it)"
    )
