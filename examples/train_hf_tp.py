"""Train a Hugging Face transformers model loaded with ``tp_plan="auto"``, compiled with
backend="commfuse", under torchrun.

    torchrun --nproc-per-node 2 examples/train_hf_tp.py --steps 3 --compare
        [--inner eager|inductor] [--schedule ring|auto|off] [--model PATH] [--layers N]

transformers shards the model with its own plan (Llama's ``base_model_tp_plan``: q/k/v
and gate/up column-parallel, o and down row-parallel, the embedding vocab-parallel, the
head column-parallel with its output gathered); each row-parallel output is all-reduced.
The pass splits those all-reduces into a reduce-scatter, the residual add and the norm on
this rank's tokens, and all-gathers that the next matmuls read (sequence parallelism done
in the graph), then hides them behind the matmuls as ``mm_rs`` and ``ag_mm`` sites.

Without ``--model`` rank 0 writes a tiny random Llama (``save_pretrained``, 12 heads:
2, 3, 4 or 6 ranks) and every rank loads it as a user loads a checkpoint,
``from_pretrained(path, tp_plan="auto")``; ``--model`` loads a checkpoint of yours (a
directory or a Hub name: it must be there already, or downloadable). Next-token loss on
random tokens, SGD. Rank 0 prints each step's loss, per graph and kind how many sites the
pass found, rewrote and declined (and why), then a prefill under ``torch.no_grad()``;
``--compare`` loads the model again, trains it uncompiled on the same tokens, and prints
the largest relative loss difference and the prefill logits' largest difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections import Counter

import torch
import torch.distributed as dist

from commfuse_compile import report
from commfuse_compile.options import SCHEDULES
from commfuse_compile.tools.training import examples as training_examples
from commfuse_compile.tools.training.hf_llama import checkpoint, load, load_vocab
from commfuse_compile.tools.training.loop import format_summary, max_relative_diff, summarize

BATCH, SEQ = 2, 24  # 48 tokens: 2, 3, 4 or 6 ranks


def run(path: str, batches: list[torch.Tensor], options: dict | None) -> tuple[list, torch.Tensor]:
    """Train on ``batches[:-1]`` (compiled with ``options``, or uncompiled for None), then
    prefill ``batches[-1]``: the losses and the prefill's logits."""
    rank = dist.get_rank()
    model = load(path)
    model.train()
    step = torch.compile(model, backend="commfuse", options=options) if options else model
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, ids in enumerate(batches[:-1]):
        start = time.perf_counter()
        loss = step(input_ids=ids, labels=ids).loss
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            ms = (time.perf_counter() - start) * 1e3
            print(f"step {i:>3}  loss {losses[-1]:.6f}  {ms:8.1f} ms", flush=True)
    model.eval()
    with torch.no_grad():
        logits = step(input_ids=batches[-1]).logits
    return losses, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    parser.add_argument(
        "--compare", action="store_true", help="also train uncompiled; print the differences"
    )
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--schedule", default="ring", choices=SCHEDULES)
    parser.add_argument("--model", default="", help="a checkpoint (default: a tiny Llama)")
    parser.add_argument("--layers", type=int, default=2, help="the tiny Llama's layers")
    parser.add_argument("--debug-dir", default=None, help="write commfuse's debug dump here")
    args = parser.parse_args()
    device = training_examples.init_torchrun()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = checkpoint(args)
    vocab = load_vocab(path)
    gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
    batches = [
        torch.randint(0, vocab, (BATCH, SEQ), generator=gen).to(device)
        for _ in range(args.steps + 1)
    ]
    options = {"schedule": args.schedule, "inner": args.inner, "debug_dir": args.debug_dir}
    if rank == 0:
        print(f"{path} with tp_plan='auto' on {world_size} ranks, commfuse {options}:")
    losses, logits = run(path, batches, options)
    if rank == 0:
        records = report.REPORT.sites
        print("\nsites (rank 0):\n" + format_summary(summarize(r.as_json() for r in records)))
        split = Counter(r.graph for r in records if r.match.get("from") == "all_reduce")
        print(f"all-reduces split into reduce-scatter + all-gathers: {dict(split)}", flush=True)
    if args.compare:
        if rank == 0:
            print("\nwithout the pass (uncompiled):", flush=True)
        plain_losses, plain_logits = run(path, batches, None)
        if rank == 0:
            diff = max_relative_diff(losses, plain_losses)
            print(f"\nlargest relative loss difference over {args.steps} steps: {diff:.3e}")
            logits_diff = (logits - plain_logits).abs().max().item()
            print(f"prefill logits, largest difference: {logits_diff:.3e}", flush=True)
    if not args.model and rank == 0:  # every rank has loaded it: the runs' steps met
        shutil.rmtree(path, ignore_errors=True)
    training_examples.leave_torchrun()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
