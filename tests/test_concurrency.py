"""Several compiled models, forward and backward interleaved, in one process per rank.

Every rewritten site has its own P2P tag and runs its steps in program order, so two
compiled models (different shapes: a message delivered to the wrong site would fail
or change numbers) and the two directions of training must not mix their messages:
each rank runs the same interleaving of forwards and backwards of both models, and
outputs and gradients equal those of the uncompiled models.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch._C._distributed_c10d import _get_work_registry_size
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import commfuse_compile
from commfuse_compile.tools.training.models import MLP, mlp_plan

OPTIONS = {"schedule": "ring", "inner": "eager"}
SHAPES = {"a": (16, 24), "b": (12, 18)}  # (dim, hidden) of the two models
SEQ = 2  # sequence positions per rank
# commfuse.p2p(sends, send_peers, recv_like, recv_peers, tag, ...) in the dumped code
P2P_TAG = re.compile(r"commfuse\.p2p\.default\((?:\[[^]]*\], ){4}(\d+), ")


def interleaved_training(rank: int, n: int, debug_dir: str) -> dict:
    """Both models, compiled and not, through one interleaving of forwards and backwards
    (a second forward of ``a`` while its first backward is pending, ``b`` in between)."""
    torch._dynamo.reset()
    commfuse_compile.report.reset()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    plain = {name: MLP(dim, hidden) for name, (dim, hidden) in SHAPES.items()}
    compiled = {}
    for name, model in plain.items():
        twin = copy.deepcopy(model)
        parallelize_module(model, mesh, mlp_plan())
        parallelize_module(twin, mesh, mlp_plan())
        options = {**OPTIONS, "debug_dir": debug_dir}
        compiled[name] = torch.compile(twin, backend="commfuse", options=options, fullgraph=True)
    inputs = {
        name: [torch.randn(2, SEQ * n, dim).chunk(n, dim=1)[rank] for _ in range(3)]
        for name, (dim, _) in SHAPES.items()
    }
    registered = _get_work_registry_size()

    def run(models: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        def forward(name: str, i: int) -> torch.Tensor:
            x = DTensor.from_local(inputs[name][i].clone().requires_grad_(), mesh, [Shard(1)])
            return models[name](x)

        outs = []
        a0 = forward("a", 0)
        b0 = forward("b", 0)
        a1 = forward("a", 1)  # a's first backward still pending
        b0.sum().backward()
        a0.sum().backward()
        b1 = forward("b", 1)
        a1.sum().backward()
        a2 = forward("a", 2)
        b1.sum().backward()
        a2.sum().backward()
        outs += [t.detach() for t in (a0, b0, a1, b1, a2)]  # local: sequence shards
        grads = {
            f"{name}.{key}": p.grad.full_tensor()
            for name, model in models.items()
            for key, p in getattr(model, "_orig_mod", model).named_parameters()
        }
        return outs, grads

    expected_outs, expected_grads = run(plain)
    actual_outs, actual_grads = run(compiled)
    sites = commfuse_compile.report.REPORT.sites
    return {
        "out_diff": max(
            (a - e).abs().max().item() for a, e in zip(actual_outs, expected_outs, strict=True)
        ),
        "grad_diff": {
            key: (actual_grads[key] - grad).abs().max().item()
            for key, grad in expected_grads.items()
        },
        "rewritten": sorted((s.graph, s.kind) for s in sites if s.decision == "rewritten"),
        "declined": [s.reason for s in sites if s.decision != "rewritten"],
        "leaked_works": _get_work_registry_size() - registered,
        "tags": [
            (path.name, int(tag))
            for path in sorted((Path(debug_dir) / f"rank{rank}").glob("*_after.py"))
            for tag in P2P_TAG.findall(path.read_text())
        ],
    }


@pytest.mark.parametrize("n", [2, 3])
def test_two_models_interleaved_forward_backward_match_uncompiled(ranks, tmp_path, n):
    """Also: every rank gives each rewritten site the same tag, and no two sites one."""
    # forward: gate + up (one ring), down; backward: down's gathered dY (dX and dW in one
    # ring), the input gradients through up and through gate (one reduce-scatter each)
    per_model = [("forward", "ag_mm"), ("forward", "mm_rs"), ("backward", "ag_mm")]
    per_model += [("backward", "mm_rs")] * 2
    results = ranks(n).run(interleaved_training, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["declined"] == [], rank
        assert result["rewritten"] == sorted(per_model * len(SHAPES)), rank
        assert result["tags"] == results[0]["tags"], rank
        tags_per_graph = {graph: set() for graph, _ in result["tags"]}
        for graph, tag in result["tags"]:
            tags_per_graph[graph].add(tag)
        tags = [tag for graph_tags in tags_per_graph.values() for tag in graph_tags]
        assert len(tags) == len(set(tags)) == len(result["rewritten"]), result["tags"]
        assert result["out_diff"] <= 1e-5, rank
        assert max(result["grad_diff"].values()) <= 1e-5, result["grad_diff"]
        assert result["leaked_works"] == 0
