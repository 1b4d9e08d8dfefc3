"""DTensor tensor+sequence-parallel models for end-to-end tests (and the demo's shapes)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch._C._distributed_c10d import _get_work_registry_size
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    parallelize_module,
)

import commfuse_compile
from commfuse_compile.models import MLP, mlp_plan

MLP_PLAN = mlp_plan()


def mlp_train_step(rank: int, n: int, options: dict, debug_dir: str, seq: int = 6) -> dict:
    """Compiled (commfuse) vs eager TP+SP MLP: outputs and every gradient, plus the report."""
    commfuse_compile.report.reset()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, seq * n, 16)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, MLP_PLAN)
    parallelize_module(ref, mesh, MLP_PLAN)
    compiled = torch.compile(
        model, backend="commfuse", options={**options, "debug_dir": debug_dir}, fullgraph=True
    )
    x_local = x.chunk(n, dim=1)[rank].contiguous()
    registered = _get_work_registry_size()
    outs = []
    for module in (compiled, ref):
        inp = DTensor.from_local(x_local.clone().requires_grad_(), mesh, [Shard(1)])
        out = module(inp)
        out.sum().backward()
        grads = {
            k: p.grad.full_tensor()
            for k, p in (module._orig_mod if module is compiled else module).named_parameters()
        }
        outs.append((out.detach(), grads))
    (out_c, grads_c), (out_r, grads_r) = outs
    report = json.loads((Path(debug_dir) / f"rank{rank}" / "report.json").read_text())
    return {
        "leaked_works": _get_work_registry_size() - registered,
        "out_diff": (out_c - out_r).abs().max().item(),
        "grad_diff": {k: (grads_c[k] - grads_r[k]).abs().max().item() for k in grads_r},
        "report": report,
        "files": sorted(os.listdir(Path(debug_dir) / f"rank{rank}")),
    }
