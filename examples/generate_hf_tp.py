"""Greedy ``generate`` on a Hugging Face transformers model loaded with ``tp_plan="auto"``,
its forward compiled with backend="commfuse", under torchrun.

    torchrun --nproc-per-node 2 examples/generate_hf_tp.py --compare
        [--inner eager|inductor] [--schedule ring|auto|off] [--cache dynamic|static]
        [--prompts 24,40] [--new-tokens 8] [--rounds 3] [--model PATH] [--layers N]

transformers shards the model with its own plan (row-parallel o and down projections,
each output all-reduced); the pass splits a prefill's all-reduces into a reduce-scatter,
the residual add and the norm on this rank's tokens and all-gathers that the next
matmuls read, and hides them behind the matmuls. A decode step (one token per sequence)
has too few tokens to split over the ranks, or too few to pay: its all-reduces are kept
and the report says why. Prompt lengths change between calls (the first batch's length,
then a longer one, left-padded: Dynamo makes the length a symbol), as a server's do.

Without ``--model`` rank 0 writes a tiny random Llama (12 heads: 2, 3, 4 or 6 ranks;
``tools/training/hf_llama.py``). Rank 0 prints the generated tokens, how many graphs the
pass saw, and per graph and kind how many sites it found, rewrote and declined (and
why). ``--compare`` also generates with the same compile with ``schedule="off"`` and
uncompiled (eager TP): whether every token equals eager TP's, and each compiled model's
median time per ``generate`` call after the first round (which compiles), the two models
called in turn, which goes first alternating, so that the ratio compares them under the
same load. The two compiles share Dynamo's shape state (one process, one model code):
the one that meets a prompt length first may compile it static, so their graph counts
can differ by one or two; ``tests/test_hf_generate.py`` compares them on fresh state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from commfuse_compile import report
from commfuse_compile.options import MODES, SCHEDULES
from commfuse_compile.tools.training import examples as training_examples
from commfuse_compile.tools.training.hf_llama import checkpoint, load, load_vocab
from commfuse_compile.tools.training.loop import format_summary, summarize

BATCH = 2


def prompts(args: argparse.Namespace, vocab: int, device: str) -> list[tuple[torch.Tensor, ...]]:
    """One batch (ids, attention mask) per prompt length, the same on every rank; from
    the second on, the first sequence is left-padded (2 pad tokens, id 0)."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for i, length in enumerate(args.prompts):
        ids = torch.randint(1, vocab, (BATCH, length), generator=gen)
        mask = torch.ones_like(ids)
        if i > 0:
            ids[0, :2], mask[0, :2] = 0, 0
        batches.append((ids.to(device), mask.to(device)))
    return batches


class Generator:
    """A model as generate runs it: compiled with ``options`` (None: uncompiled), its
    outputs, each call's seconds and the site records of its compiles."""

    def __init__(self, path: str, args: argparse.Namespace, options: dict | None) -> None:
        self.model = load(path).eval()
        if options is not None:  # its own recompiles: two models' forwards share one code
            self.model.forward = torch.compile(
                self.model.forward, backend="commfuse", options=options, isolate_recompiles=True
            )
        self.args, self.seconds = args, []
        self.outputs: list[torch.Tensor] = []
        self.sites: list[dict] = []

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        before = len(report.REPORT.sites)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=self.args.new_tokens,
                do_sample=False,
                pad_token_id=0,
                cache_implementation=self.args.cache,
            )
        self.seconds.append(time.perf_counter() - start)
        self.outputs.append(out)
        self.sites += [s.as_json() for s in report.REPORT.sites[before:]]

    def graphs(self) -> int:
        """Graphs compiled for this model: one per graph index its sites name."""
        return len({s["graph_index"] for s in self.sites})


def in_turn(models: list[Generator], batches: list[tuple[torch.Tensor, ...]], rounds: int) -> None:
    """Every batch through every model, ``rounds`` times; which model goes first
    alternates call by call."""
    calls = 0
    for _ in range(rounds):
        for ids, mask in batches:
            for model in models[:: 1 if calls % 2 == 0 else -1]:
                model(ids, mask)
            calls += 1


def after_first_round(model: Generator, per_round: int) -> float:
    """The median seconds per generate call after the first round (which compiles)."""
    later = model.seconds[per_round:]
    return statistics.median(later) if later else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="also schedule='off' and eager")
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--schedule", default="ring", choices=SCHEDULES)
    parser.add_argument("--mode", default="default", choices=MODES, help="torch.compile's mode")
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    parser.add_argument("--prompts", type=_lengths, default=[24, 40], help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument("--rounds", type=int, default=3, help="times every batch is generated")
    parser.add_argument("--model", default="", help="a checkpoint (default: a tiny Llama)")
    parser.add_argument("--layers", type=int, default=2, help="the tiny Llama's layers")
    args = parser.parse_args()
    device = training_examples.init_torchrun()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = checkpoint(args)
    batches = prompts(args, load_vocab(path), device)
    options = {"schedule": args.schedule, "inner": args.inner, "mode": args.mode}
    say: Callable[..., None] = print if rank == 0 else lambda *a, **k: None
    say(f"{path} with tp_plan='auto' on {world_size} ranks, commfuse {options}")
    report.reset()
    torch._dynamo.reset()
    fused = Generator(path, args, options)
    models = [fused]
    if args.compare:
        models.append(Generator(path, args, {**options, "schedule": "off"}))
    in_turn(models, batches, args.rounds)
    for (ids, _), out in zip(batches, fused.outputs, strict=False):
        say(f"prompt of {ids.shape[1]} tokens -> {out[:, ids.shape[1] :].tolist()}")
    say(f"\ngraphs the pass saw: {fused.graphs()}")
    say("sites (rank 0):\n" + format_summary(summarize(fused.sites)), flush=True)
    if args.compare:
        off = models[1]
        eager = Generator(path, args, None)
        for ids, mask in batches:
            eager(ids, mask)
        per_round = len(batches)
        equal = all(
            torch.equal(a, b) for a, b in zip(fused.outputs[:per_round], eager.outputs, strict=True)
        )
        with_pass, without = after_first_round(fused, per_round), after_first_round(off, per_round)
        say(
            f"\ntokens equal to eager TP's: {equal}; graphs with schedule='off': "
            f"{off.graphs()}\nmedian generate call after the first round (the two compiled "
            f"models in turn): {with_pass * 1e3:.1f} ms with the pass, {without * 1e3:.1f} ms "
            f"with schedule='off': {without / with_pass:.2f}x",
            flush=True,
        )
    if not args.model and rank == 0:  # every rank has loaded it
        shutil.rmtree(path, ignore_errors=True)
    training_examples.leave_torchrun()


def _lengths(text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",") if x.strip()]
    if not lengths or min(lengths) < 3:
        raise argparse.ArgumentTypeError(f"prompt lengths of 3 tokens or more, got {text!r}")
    return lengths


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
