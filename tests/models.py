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
from commfuse_compile.tools.models import MLP, mlp_plan


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the expected tensor's largest magnitude."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def mlp_train_step(
    rank: int, n: int, options: dict, debug_dir: str, seq: int = 6, residual: bool = False
) -> dict:
    """Compiled (commfuse) vs eager TP+SP MLP: outputs, the input's and every parameter's
    gradient (relative errors), plus the report. ``residual``: the SwiGLU block of a real
    model (gate and up with bias, a residual add, LayerNorm with random affine
    parameters, loss sum(y^2))."""
    commfuse_compile.report.reset()
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = MLP(up_bias=residual, residual=residual)
    if residual:
        with torch.no_grad():
            model.norm.weight.uniform_(0.5, 1.5)
            model.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, seq * n, 16)
    ref = copy.deepcopy(model)
    plan = mlp_plan(local_output=not residual)
    parallelize_module(model, mesh, plan)
    parallelize_module(ref, mesh, plan)
    compiled = torch.compile(
        model, backend="commfuse", options={**options, "debug_dir": debug_dir}, fullgraph=True
    )
    x_local = x.chunk(n, dim=1)[rank].contiguous()
    registered = _get_work_registry_size()
    outs = []
    for module in (compiled, ref):
        leaf = x_local.clone().requires_grad_()
        out = module(DTensor.from_local(leaf, mesh, [Shard(1)]))
        (out * out if residual else out).sum().backward()
        grads = {
            k: p.grad.full_tensor()
            for k, p in (module._orig_mod if module is compiled else module).named_parameters()
        }
        grads["input"] = leaf.grad
        if isinstance(out, DTensor):
            out = out.to_local()
        outs.append((out.detach(), grads))
    (out_c, grads_c), (out_r, grads_r) = outs
    report = json.loads((Path(debug_dir) / f"rank{rank}" / "report.json").read_text())
    return {
        "leaked_works": _get_work_registry_size() - registered,
        "out_diff": relative_error(out_c, out_r),
        "grad_diff": {k: relative_error(grads_c[k], grads_r[k]) for k in grads_r},
        "report": report,
        "files": sorted(os.listdir(Path(debug_dir) / f"rank{rank}")),
    }
