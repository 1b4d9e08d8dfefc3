"""torchtitan 0.2's alignment padding around the ``moe`` kind (``kinds/moe/padding.py``):
a zero row appended to the dispatched tokens (``torch.vstack``), ``perm`` over each
expert's rows padded to a multiple of ``TOKEN_GROUP_ALIGN_SIZE_M`` (padding slots -1: the
zero row), the slots put back into the padded rows and the zero row dropped (``[:-1]``);
in the backward the gradient laid into zeros (``slice_backward`` or ``slice_scatter``)
and accumulated back. The front end's ``_permute``/``_unpermute`` and
``generate_permute_indices`` (``tools/training/moe_etp.py``) build it as torchtitan does.

Graph level, on torch's fake process group (rank 1 of 4, ``make_fx``): the padded layer
and both backward spellings are one rewritten ``moe`` site; appended rows that are not
dropped are declined ``moe.pad_kept``; rows appended from the tokens themselves are no
padding (the index then reads received values twice: ``site.permuted``).

On gloo ranks: the layer with torchtitan's padding compiled (``.tolist()`` splits) under
the routings of ``test_moe_kind`` (a peer sent nothing, an expert with no tokens: padded
to the alignment, a rank with no tokens), forward and backward, equal to the uncompiled
layer bit for bit (eager, 3 ranks; 2 and 4 ranks and Inductor under ``-m matrix``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from cases import records_of
from test_moe_kind import (
    OUT,
    D,
    E,
    H,
    N,
    a2a,
    bf16,
    check_routed,
    dispatched,
    experts,
    routings,
    run_routed,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile.tools.training import moe_etp

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RANK = 1
IN = [2, 2, 1, 3]
ROWS = sum(OUT)  # received: 10, padded to 11
# rank 1's received rows per (source rank, local expert): OUT's rows split over 2 experts
COUNTS = torch.tensor([2, 1, 0, 2, 4, 1, 0, 0])
SLOTS = (ROWS + E * moe_etp.TOKEN_GROUP_ALIGN_SIZE_M + 7) // 8 * 8


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def padded_layer(o, i, x, perm, w1, w2, offs, extra):
    """Dispatch, torchtitan's ``_permute`` (the zero row, the padded slots), experts,
    ``_unpermute`` (the zero row dropped), combine; the activation returned (saved)."""
    recv = a2a(x, o, i)
    out, h = experts(torch.vstack((recv, recv.new_zeros(D)))[perm], w1, w2, offs)
    back = out.new_empty((recv.shape[0] + 1, D)).index_put([perm], out)[:-1]
    return a2a(back, i, o), h


def inference(o, i, x, perm, w1, w2, offs, extra):
    return padded_layer(o, i, x, perm, w1, w2, offs, extra)[0]


def backward_shape(lay):
    """The padded layer's backward: the combine's gradient laid into the padded rows'
    zeros (``lay``), through the experts' transposed weights with a saved activation
    paired row by row, accumulated into zeros and sliced to the received rows."""

    def backward(o, i, dy, perm, w1, w2, offs, hs):
        g = lay(a2a(dy, o, i))[perm]
        dh = torch._grouped_mm(g, w2.transpose(-2, -1), offs=offs)
        dw2 = torch._grouped_mm(hs.t(), g, offs=offs)
        dh = (dh.float() * torch.sigmoid(hs.float())).bfloat16()
        dx = torch._grouped_mm(dh, w1.transpose(-2, -1), offs=offs)
        back = dx.new_zeros((ROWS + 1, D)).index_put([perm], dx, accumulate=True)[:ROWS]
        return a2a(back, i, o), dw2

    return backward


sliced_backward = backward_shape(lambda g: aten.slice_backward(g, [ROWS + 1, D], 0, 0, -1, 1))
scattered_backward = backward_shape(
    lambda g: g.new_zeros((ROWS + 1, D)).slice_scatter(g, 0, 0, ROWS)
)


def first_row_dropped(o, i, x, perm, w1, w2, offs, extra):
    """The zero row kept and a received row dropped instead (``[1:]``)."""
    recv = a2a(x, o, i)
    out, h = experts(torch.vstack((recv, recv.new_zeros(D)))[perm], w1, w2, offs)
    back = out.new_empty((recv.shape[0] + 1, D)).index_put([perm], out)[1:]
    return a2a(back, i, o), h


def token_appended(o, i, x, perm, w1, w2, offs, extra):
    """A received row appended (not padding: the index reads it twice)."""
    recv = a2a(x, o, i)
    out, h = experts(torch.vstack((recv, recv[:1]))[perm], w1, w2, offs)
    back = out.new_empty((recv.shape[0] + 1, D)).index_put([perm], out)[:-1]
    return a2a(back, i, o), h


def traced(fn):
    perm, m_sizes, offs = moe_etp.generate_permute_indices(COUNTS, E, N, SLOTS)
    assert int(m_sizes.sum()) < SLOTS and bool((perm == -1).any())  # padded, and a tail
    gen = torch.Generator().manual_seed(0)
    args = [
        bf16(sum(IN), D, gen=gen),
        perm.long(),
        bf16(E, D, H, gen=gen),
        bf16(E, H, D, gen=gen),
        offs,
        bf16(SLOTS, H, gen=gen),
    ]
    return make_fx(lambda *xs: fn(OUT, IN, *xs), tracing_mode="fake")(*args)


@pytest.mark.parametrize(
    ("fn", "saved", "summed"),
    [
        (padded_layer, 1, 0),
        (inference, 0, 0),
        (sliced_backward, 1, 1),
        (scattered_backward, 1, 1),
    ],
    ids=["forward", "inference", "backward-slice_backward", "backward-slice_scatter"],
)
def test_padded_dispatch_experts_combine_is_one_rewritten_site(fake_world, fn, saved, summed):
    gm = traced(fn)
    (record,) = records_of(gm)
    assert (record.kind, record.decision, record.decline_code) == ("moe", "rewritten", ""), (
        record.reason
    )
    match = record.match
    assert match["padded_rows"] == 1 and match["exchanged_shape"] == [ROWS, D]
    assert (len(match["saved"]), len(match["summed"])) == (saved, summed)
    kinds = [n.target for n in gm.graph.nodes]
    assert c10d.all_to_all_single.default not in kinds
    # each block's and this rank's halves' grouped matmuls; the padding slots' block where
    # a value is read whole, with only the ops it needs (the saved activation: the first
    # grouped matmul; the backward's saved gradient rows: none); the weight gradient once
    per_block = 2 * (N + 1)
    padding = 1 if fn is padded_layer else 0
    assert kinds.count(aten._grouped_mm.default) == per_block + padding + summed


@pytest.mark.parametrize(
    ("fn", "code", "reason"),
    [
        (first_row_dropped, "moe.pad_kept", "the rows appended to the dispatched tokens are not"),
        (token_appended, "site.permuted", "index (index.Tensor) reorders rows by an index"),
    ],
    ids=["first-row-dropped", "token-appended"],
)
def test_padding_not_proven_is_declined(fake_world, fn, code, reason):
    gm = traced(fn)
    before = str(gm.code)
    dispatch, *_ = records_of(gm)
    assert (dispatch.decision, dispatch.decline_code) == ("declined", code), dispatch.reason
    assert dispatch.reason.startswith(reason), dispatch.reason
    assert str(gm.code) == before


# ----------------------------------------------------------------------------------------
# on gloo ranks: torchtitan's padded dispatch, compiled


def padded_routed_layer(x, counts, w1, w2, local: int):
    """``test_moe_kind.routed_layer`` with torchtitan 0.2's ``_permute`` and
    ``_unpermute`` between the all-to-alls (the front end's, as ``ExpertParallel``
    calls them)."""
    recv, counts_recv, combine = dispatched(x, counts)
    shape, permuted, perm, padded = moe_etp._permute(
        recv, counts_recv, dist.get_world_size(), local
    )
    out, _ = experts(permuted, w1, w2, torch.cumsum(padded, 0, dtype=torch.int32))
    return combine(moe_etp._unpermute(out, shape, perm))


def padded_cells():
    for n, inner in itertools.product((2, 3, 4), ("eager", "inductor")):
        # by default 3 ranks eager, bit for bit (the front end's padded block runs with
        # Inductor in test_moe_etp)
        marks = () if (n, inner) == (3, "eager") else (pytest.mark.matrix,)
        yield pytest.param(n, inner, id=f"n{n}-{inner}", marks=marks)


@pytest.mark.parametrize(("n", "inner"), list(padded_cells()))
def test_padded_layer_equal_under_every_routing(ranks, n, inner):
    """One compile, five routings; an expert with no tokens gets the alignment's padding
    slots, a rank with none only padding: outputs and gradients equal (eager: bit for bit)."""
    results = ranks(n).run(run_routed, E, list(routings(n).values()), inner, 2, padded_routed_layer)
    check_routed(results, n, inner)
