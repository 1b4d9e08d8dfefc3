"""Train a Mixture-of-Experts model with expert parallelism over every rank, compiled with
backend="commfuse" per block, under torchrun.

    torchrun --nproc-per-node 2 examples/train_moe.py --steps 3 --compare
        [--moe capacity|dropless|titan|megatron|megatron-grouped] [--tp N]
        [--inner eager|inductor] [--schedule ring|auto|off]

``--moe capacity`` (default): GShard / DeepSpeed's ``MOELayer``: top-2 gating with a
capacity per expert, einsum dispatch, one all-to-all with equal splits, batched experts
(``bmm``), the combine all-to-all. ``--moe dropless``: torchtitan's: top-k router, token
counts exchanged, an all-to-all with uneven splits from them, grouped-GEMM experts
(``torch._grouped_mm``), back (compiled with ``fullgraph=True`` and scalars captured, as
torchtitan compiles it). Each rank holds ``--experts-per-rank`` experts and routes its own
tokens; the router, norms and projections are replicated (gradients all-reduced after the
backward). ``--moe titan`` / ``megatron`` / ``megatron-grouped``: experts tensor parallel
too over ``--tp`` ranks (the rest expert parallel, a 2-D mesh), as torchtitan 0.2's
``ExpertTensorParallel`` (its padded permutation) and Megatron-Core's drop-and-pad
dispatcher with ``expert_tensor_parallel_size`` (``SequentialMLP`` as one ``bmm``, or
``TEGroupedMLP``'s grouped GEMM) write them (``tools/training/moe_etp.py``). Rank 0
prints each step's loss, every collective's site (kind, decision, decline code) per
graph, and the compiles; ``--compare`` trains the same model uncompiled and prints the
largest relative loss difference.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from commfuse_compile.options import SCHEDULES
from commfuse_compile.tools.training import examples as training_examples
from commfuse_compile.tools.training import moe, moe_etp, moe_loop
from commfuse_compile.tools.training.loop import format_summary, max_relative_diff, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    parser.add_argument(
        "--compare", action="store_true", help="also train uncompiled; print the difference"
    )
    parser.add_argument("--moe", default="capacity", choices=(*moe.MOES, *moe_etp.ETP_MOES))
    parser.add_argument("--tp", type=int, default=2, help="ETP: tensor-parallel ranks")
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--schedule", default="ring", choices=SCHEDULES)
    parser.add_argument("--blocks", type=int, default=2, help="MoE blocks (default 2)")
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank (default 64)")
    parser.add_argument("--debug-dir", default=None, help="write commfuse's debug dump here")
    args = parser.parse_args()
    training_examples.init_torchrun()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shape = dict(
        moe=args.moe,
        blocks=args.blocks,
        dim=64,
        hidden=128,
        experts_per_rank=args.experts_per_rank,
        tokens=args.tokens,
        steps=args.steps,
    )
    cfg: moe_loop.Setup
    if args.moe in moe.MOES:
        cfg = moe.MoEConfig(**shape)  # type: ignore[arg-type]
    else:
        cfg = moe_etp.ETPConfig(ep=world_size // args.tp, tp=args.tp, **shape)  # type: ignore[arg-type]
    options = {"schedule": args.schedule, "inner": args.inner, "debug_dir": args.debug_dir}

    def show(step: int, loss: float, seconds: float) -> None:
        if rank == 0:
            print(f"step {step:>3}  loss {loss:.6f}  {seconds * 1e3:8.1f} ms", flush=True)

    if rank == 0:
        print(f"with commfuse ({options}), {world_size} ranks:\n{cfg}", flush=True)
    fused = moe_loop.train(cfg, options, on_step=show)
    if rank == 0:
        print("\nsites (rank 0):\n" + format_summary(summarize(fused.sites)))
        print("\nevery collective (rank 0): graph, kind, decision, decline code")
        for site in fused.sites:
            row = (site["graph"], site["kind"], site["decision"], site["decline_code"] or "-")
            print("  " + "  ".join(row))
        print(f"compiles: {fused.compiles} ({args.blocks} blocks)", flush=True)
    if args.compare:
        if rank == 0:
            print("\nwithout the pass (uncompiled):", flush=True)
        plain = moe_loop.train(cfg, None, on_step=show)
        # every rank's largest difference; rank 0 prints the largest of them
        diff = [max_relative_diff(fused.losses, plain.losses)]
        every: list[list[float] | None] = [None] * world_size
        dist.all_gather_object(every, diff)
        if rank == 0:
            worst = max(d[0] for d in every if d is not None)
            print(f"\nlargest relative loss difference over {cfg.steps} steps: {worst:.3e}")
    training_examples.leave_torchrun()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
