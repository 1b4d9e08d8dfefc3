"""Train a Hugging Face Llama with DeepSpeed's Ulysses attention (its custom-op
all-to-all), compiled with backend="commfuse", under torchrun.

    torchrun --nproc-per-node 3 examples/train_deepspeed_hf.py --steps 3 --compare
        [--inner eager|inductor] [--schedule ring|auto|off]

DeepSpeed's Hugging Face path (``UlyssesSPAttentionHF.register_with_transformers``) as
DeepSpeed 0.19.8 writes it (``commfuse_compile/tools/training/deepspeed_hf.py``): its
attention replaces the model's ``sdpa``, q, k, v and the attention output are exchanged
by the custom op ``deepspeed::dim_zero_all_to_all``, which the pass reads as the
functional all-to-all. A tiny random transformers Llama (12 heads, 24 tokens: 2, 3 or 4
ranks), each rank its slice of the sequence, the ALST tutorial's loss, AdamW. Rank 0
prints each step's loss and, per graph and kind, the sites found, rewritten and
declined; ``--compare`` also trains it uncompiled and prints the largest relative loss
difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch.distributed as dist

from commfuse_compile.options import SCHEDULES
from commfuse_compile.tools.training import deepspeed_hf
from commfuse_compile.tools.training import examples as training_examples
from commfuse_compile.tools.training.loop import format_summary, max_relative_diff, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    parser.add_argument("--compare", action="store_true", help="also train uncompiled")
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--schedule", default="ring", choices=SCHEDULES)
    args = parser.parse_args()
    training_examples.init_torchrun()
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(deepspeed_hf.Config(), steps=args.steps)
    options = {"schedule": args.schedule, "inner": args.inner}
    fused = deepspeed_hf.train(rank, n, cfg, options)
    if rank == 0:
        print(f"DeepSpeed HF Ulysses on {n} ranks, commfuse {options}: losses {fused['losses']}")
        print("\nsites (rank 0):\n" + format_summary(summarize(fused["sites"])), flush=True)
    if args.compare:
        plain = deepspeed_hf.train(rank, n, cfg, None)
        if rank == 0:
            diff = max_relative_diff(fused["losses"], plain["losses"])
            print(f"\nuncompiled: {plain['losses']}")
            print(f"largest relative loss difference over {args.steps} steps: {diff:.3e}")
    training_examples.leave_torchrun()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
