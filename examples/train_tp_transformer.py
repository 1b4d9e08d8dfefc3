"""Train a small TP+SP Llama-style transformer with backend="commfuse", under torchrun.

    torchrun --nproc-per-node 2 examples/train_tp_transformer.py --steps 3 --compare
        [--inner eager|inductor] [--schedule ring|auto|off] [--activation-checkpointing [block|op]]
        [--vocab N] [--compile-per-block] [--loss-parallel] [--plain-tp]

Each block (RMSNorm, attention, SwiGLU) is sharded with
``commfuse_compile.tools.training.models.block_plan`` over all ranks; the final norm and
the linear head are sequence / column parallel; the loss is the MSE to a fixed random
target; AdamW. Rank 0 prints the loss and time of each step, then, per graph and kind, how
many all-gather/reduce-scatter sites the pass found, rewrote and declined (and why).
``--compare`` also trains an identical copy without the pass (plain eager DTensor, same
initialization and data) and prints the largest relative loss difference. ``--vocab N``
puts a token embedding first (row-parallel, as torchtitan shards it; the blocks then take
and return local tensors), ``--compile-per-block`` compiles each block by itself
(``fullgraph=True``) as torchtitan does, the rest eager; ``--loss-parallel`` keeps the
head's output sharded on its last dim (the MSE on the shards, averaged over the ranks; no
all-gather of the output); ``--plain-tp`` shards the blocks with DTensor's default
layouts (plain tensor parallelism, an all-reduce after each row-parallel linear, as
Hugging Face's ``tp_plan``), which the pass turns into sequence parallelism. The model
lives in ``commfuse_compile.tools.training.fronts``, the step and the summary in
``commfuse_compile.tools.training.loop``, the options and the run in
``commfuse_compile.tools.training.examples``.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from commfuse_compile.tools.training import examples as training_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_examples.add_arguments(parser)
    parser.add_argument(
        "--vocab", type=int, default=0, help="token embedding of N rows first (default: none)"
    )
    parser.add_argument(
        "--compile-per-block",
        action="store_true",
        help="compile each block by itself (fullgraph=True), the rest eager, like torchtitan",
    )
    parser.add_argument(
        "--loss-parallel",
        action="store_true",
        help="keep the head's output sharded; the loss on the shards (no output all-gather)",
    )
    parser.add_argument(
        "--plain-tp",
        action="store_true",
        help="no sequence parallelism (default layouts, all-reduces): the pass splits them",
    )
    args = parser.parse_args()
    device = training_examples.init_torchrun()
    world_size = dist.get_world_size()
    # TP over every rank; 32 tokens per rank (sequence parallel)
    cfg = training_examples.example_config(
        args,
        "tp",
        world_size,
        4,
        32 * world_size,
        device,
        vocab=args.vocab,
        compile_per_block=args.compile_per_block,
        loss_parallel=args.loss_parallel,
        sequence_parallel=not args.plain_tp,
    )
    training_examples.run_and_print(cfg, args)
    training_examples.leave_torchrun()


if __name__ == "__main__":
    main()
