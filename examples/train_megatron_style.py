"""Train a transformer written as Megatron-LM writes sequence parallelism, with
backend="commfuse".

    torchrun --nproc-per-node 2 examples/train_megatron_style.py --steps 3 --compare
    torchrun --nproc-per-node 4 examples/train_megatron_style.py --steps 3 --compare \
        --inner inductor
        [--schedule ring|auto|off] [--blocks N] [--float8 | --core [--rank0-warning]]

Activations are sequence-first ``[s, b, h]`` and sharded on the sequence. Each block's
column-parallel linears (fused q/k/v, fused gate/up) gather their input along the
sequence and its row-parallel linears (the attention's output projection, the MLP's
down projection) reduce-scatter their output, through ``autograd.Function``s that call
the in-place c10d API into preallocated buffers (``dist.all_gather_into_tensor(out, x)``,
``dist.reduce_scatter_tensor(out, y)``), as Megatron-LM's ``tensor_parallel/mappings.py``
does (``commfuse_compile/tools/training/styles.py``). Rank 0 prints each step's loss and time and
what the pass did with every site; ``--compare`` also trains without the pass (plain
eager, the same initialization and data) and prints the largest relative loss difference.
``--float8``: the linears compute in float8 (``commfuse_compile/tools/training/float8.py``: a
scaled matmul of inputs and weights cast with amax scaling; the column-parallel input
quantized before it is gathered, as its uint8 bytes). ``--core``: Megatron-Core's linears
(the column-parallel gather into the persistent global memory buffer inside the linear's
own function, whose backward overlaps its gather and reduce-scatter by hand with
``async_op=True``); ``--rank0-warning`` adds Megatron-Core's warning on rank 0 only on the
row-parallel path (a DeprecationWarning: run with ``-W default`` to see it; it runs after
the graph, so the ranks still compile the same graphs; ``COMMFUSE_DEFER_LOGGING=0``: they
differ and fall back together).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from commfuse_compile.tools.training import examples as training_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_examples.add_arguments(parser)
    parser.add_argument("--float8", action="store_true", help="the linears in float8")
    parser.add_argument("--core", action="store_true", help="Megatron-Core's linears")
    parser.add_argument(
        "--rank0-warning", action="store_true", help="--core: a warning on rank 0 only"
    )
    args = parser.parse_args()
    device = training_examples.init_torchrun()
    world_size = dist.get_world_size()
    # the whole batch on every rank; 32 tokens per rank (the sequence is sharded)
    front = "float8" if args.float8 else "megatron_core" if args.core else "megatron"
    extra = {"rank0_warning": True} if args.rank0_warning else {}
    cfg = training_examples.example_config(
        args, front, 1, 4, 32 * world_size, device, bias=True, **extra
    )
    training_examples.run_and_print(cfg, args)
    training_examples.leave_torchrun()


if __name__ == "__main__":
    main()
