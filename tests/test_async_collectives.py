"""Hand-overlapped collectives (``async_op=True``, ``.wait()`` later) traced into the graph
(``commfuse_compile.async_collectives``): torch 2.13's Dynamo alone breaks the graph at
each such call.

On torch's fake process group: each of ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``all_to_all_single`` compiles in one graph
(``fullgraph=True``) with the collective issued before the matmul written between call
and wait and waited after it, and the gather and reduce-scatter sites are rewritten. On 3
gloo ranks: a Megatron-Core-shaped linear equal to eager, and a handle that leaves the
graph (a graph break between call and wait) waits in eager code.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import report

N, RANK = 4, 1
RING = {"schedule": "ring", "inner": "eager"}


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def gather_overlapped(x, w, other):
    gathered = torch.empty(N * x.shape[0], x.shape[1])
    handle = dist.all_gather_into_tensor(gathered, x, async_op=True)
    overlapped = other @ w
    handle.wait()
    return gathered @ w, overlapped


def reduce_scatter_overlapped(x, w, other):
    scattered = torch.empty(x.shape[0] // N, w.shape[1])
    handle = dist.reduce_scatter_tensor(scattered, x @ w, async_op=True)
    overlapped = other @ w
    handle.wait()
    return scattered, overlapped


def all_to_all_overlapped(x, w, other):
    exchanged = torch.empty_like(x)
    handle = dist.all_to_all_single(exchanged, x, async_op=True)
    overlapped = other @ w
    handle.wait()
    return exchanged @ w, overlapped


def traced(fn):
    """The pass's sites and the aten graph it was given (``fullgraph=True``: no break)."""
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        from commfuse_compile.backend import commfuse_backend

        return commfuse_backend(gm, inputs, RING)

    torch._dynamo.reset()
    report.reset()
    x, w, other = torch.randn(8, 16), torch.randn(16, 16), torch.randn(8, 16)
    torch.compile(fn, backend=keep, fullgraph=True)(x, w, other)
    return [(s.kind, s.decision) for s in report.REPORT.sites], graphs[0]


@pytest.mark.parametrize(
    ("fn", "collective", "kind"),
    [
        (gather_overlapped, "all_gather_into_tensor", "ag_mm"),
        (reduce_scatter_overlapped, "reduce_scatter_tensor", "mm_rs"),
        (all_to_all_overlapped, "all_to_all_single", None),
    ],
    ids=["all_gather", "reduce_scatter", "all_to_all"],
)
def test_an_async_collective_and_its_wait_are_one_graph(fake_world, fn, collective, kind):
    sites, gm = traced(fn)
    code = gm.code
    issued = code.index(f"_c10d_functional.{collective}")
    assert issued < code.index("overlapped = ") < code.index("wait_tensor")  # as overlapped
    if kind is not None:
        assert (kind, "rewritten") in sites, sites


def test_synchronous_calls_trace_as_torchs_remap(fake_world):
    def gather(x, w, other):
        gathered = torch.empty(N * x.shape[0], x.shape[1])
        assert dist.all_gather_into_tensor(gathered, x) is None
        return gathered @ w

    sites, gm = traced(gather)
    assert sites == [("ag_mm", "rewritten")]
    assert "copy" in gm.code


class OverlappedLinear(torch.autograd.Function):
    """Megatron-Core's backward in miniature: gather the input (async), input gradient,
    wait, reduce-scatter it (async), weight gradient, wait."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        gathered = torch.empty(dist.get_world_size() * x.shape[0], x.shape[1])
        dist.all_gather_into_tensor(gathered, x)
        return gathered @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gathered = torch.empty(dist.get_world_size() * x.shape[0], x.shape[1])
        handle = dist.all_gather_into_tensor(gathered, x, async_op=True)
        grad_input = grad @ w
        handle.wait()
        scattered = torch.empty_like(x)
        handle = dist.reduce_scatter_tensor(scattered, grad_input, async_op=True)
        grad_weight = grad.t() @ gathered
        handle.wait()
        return scattered, grad_weight


def overlapped_step(rank: int, n: int) -> dict:
    from models import relative_error

    torch.manual_seed(0)
    x0, w0 = torch.randn(4 * n, 8)[4 * rank : 4 * rank + 4], torch.randn(6, 8)

    def loss(x, w):
        return (OverlappedLinear.apply(x, w) ** 2).sum()

    results = []
    for compiled in (True, False):
        torch._dynamo.reset()
        report.reset()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn = torch.compile(loss, backend="commfuse", options=RING) if compiled else loss
        value = fn(x, w)
        value.backward()
        results.append([value.detach(), x.grad, w.grad])
        if compiled:
            sites = [(s.graph, s.kind, s.decision) for s in report.REPORT.sites]

    def escaping(x, w):
        gathered = torch.empty(n * x.shape[0], x.shape[1])
        handle = dist.all_gather_into_tensor(gathered, x, async_op=True)
        scaled = w.t() * 2
        torch._dynamo.graph_break()
        waited = handle.wait()
        return gathered @ scaled, waited

    torch._dynamo.reset()
    escaped = torch.compile(escaping, backend="commfuse", options=RING)(x0, w0)
    return {
        # relative: the weight gradient's 12 rows are summed in the ring's order
        "diffs": [relative_error(a, b) for a, b in zip(*results, strict=True)],
        "sites": sites,
        "escaped": (float((escaped[0] - escaping(x0, w0)[0]).abs().max()), escaped[1]),
    }


def test_hand_overlapped_linear_matches_on_gloo_ranks(ranks):
    for result in ranks(3).run(overlapped_step):
        assert max(result["diffs"]) < 1e-6, result
        assert ("backward", "mm_rs", "rewritten") in result["sites"], result["sites"]
        assert ("backward", "ag_mm", "rewritten") in result["sites"], result["sites"]
        assert result["escaped"] == (0.0, True)
