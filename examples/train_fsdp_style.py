"""Train with FSDP-style sharding whose collectives are in the graph, with backend="commfuse".

    torchrun --nproc-per-node 2 examples/train_fsdp_style.py --steps 3 --compare
    torchrun --nproc-per-node 4 examples/train_fsdp_style.py --steps 3 --compare --tp 2
    torchrun --nproc-per-node 2 examples/train_fsdp_style.py --steps 3 --compare --simple-fsdp
        [--inner eager|inductor] [--schedule ring|auto|off] [--activation-checkpointing]

Every parameter of a small Llama-style transformer is sharded on dim 0 over the
data-parallel group: each rank keeps a plain ``nn.Parameter`` holding its shard, and
reading the parameter all-gathers it with a functional collective that has autograd
(``all_gather_single_autograd``), so the backward reduce-scatters the gradient: each
linear layer's weight gradient is a matmul feeding a reduce-scatter. Each rank trains on
its own micro-batch. ``--tp N`` makes a ``(dp, tp)`` mesh: TP+SP with
``parallelize_module`` over "tp", the gather over "dp". Rank 0 prints the loss and time
of each step and what the pass did with every site; ``--compare`` also trains the same
model without the pass (plain eager) and prints the largest relative loss difference.
``--simple-fsdp``: torchtitan's SimpleFSDP instead (DTensor parameters sharded on dim 0,
gathered in bfloat16 by a parametrization's ``redistribute``, gradients reduce-scattered
in float32; data parallel only).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from commfuse_compile.tools.training import examples as training_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_examples.add_arguments(parser)
    parser.add_argument("--tp", type=int, default=1, help="size of the tensor-parallel mesh dim")
    parser.add_argument("--simple-fsdp", action="store_true", help="torchtitan's SimpleFSDP")
    args = parser.parse_args()
    device = training_examples.init_torchrun()
    dp = dist.get_world_size() // args.tp
    # 2 sequences per data-parallel rank, 32 tokens per tensor-parallel rank
    front = "simple_fsdp" if args.simple_fsdp else "fsdp"
    cfg = training_examples.example_config(args, front, args.tp, 2 * dp, 32 * args.tp, device)
    training_examples.run_and_print(cfg, args)
    training_examples.leave_torchrun()


if __name__ == "__main__":
    main()
