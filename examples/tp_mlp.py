"""A tensor+sequence-parallel MLP compiled with backend="commfuse", under torchrun.

    torchrun --nproc-per-node 2 examples/tp_mlp.py [--inner eager|inductor]

Prints, on rank 0, every all-gather / reduce-scatter site next to a matmul in the
forward and backward graphs and what the pass did with it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import commfuse_compile
from commfuse_compile.tools.training.examples import leave_torchrun
from commfuse_compile.tools.training.models import MLP, mlp_plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--schedule", default="ring", choices=["auto", "ring", "off"])
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    mesh = init_device_mesh(device, (int(os.environ["WORLD_SIZE"]),))
    torch.manual_seed(0)
    model = MLP(dim=256, hidden=1024).to(device)
    parallelize_module(model, mesh, mlp_plan())
    compiled = torch.compile(
        model, backend="commfuse", options={"schedule": args.schedule, "inner": args.inner}
    )
    x = torch.randn(4, 128, 256, device=device)
    out = compiled(DTensor.from_local(x, mesh, [Shard(1)]))
    out.sum().backward()
    if dist.get_rank() == 0:
        for site in commfuse_compile.REPORT.sites:
            print(
                f"{site.graph:<9} {site.kind:<6} {site.decision:<10} {site.schedule:<5} "
                f"{site.reason}"
            )
    leave_torchrun()  # barrier, destroy_process_group, then exit without finalizing


if __name__ == "__main__":
    main()
