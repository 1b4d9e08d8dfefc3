"""What the torchrun training examples (``examples/train_*.py``) share: their command
line, their model, joining and leaving the group, and what rank 0 prints."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ...options import Options
from .checkpointing import CHECKPOINT_MODES
from .fronts import TrainConfig
from .loop import (
    TrainResult,
    format_summary,
    max_relative_diff,
    summarize,
    train,
    train_interleaved,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every training example takes."""
    from ...options import SCHEDULES

    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (default 5)")
    parser.add_argument(
        "--compare", action="store_true", help="also train uncompiled; print the loss difference"
    )
    parser.add_argument(
        "--inner",
        default="eager",
        choices=["eager", "inductor"],
        help="compiler after the pass (default eager)",
    )
    parser.add_argument(
        "--schedule", default="ring", choices=SCHEDULES, help="the pass's schedule (default ring)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="block",
        default=None,
        choices=CHECKPOINT_MODES,
        help="checkpoint every block: 'block' (the default when given without a value) "
        "saves only the attention output; 'op' is torchtitan's op-level policy (saves "
        "every mm, reduce-scatter and attention output)",
    )
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--debug-dir", default=None, help="write commfuse's debug dump here")


def ulysses_example(front: str, description: str) -> None:
    """The Ulysses examples' ``main`` (``front`` "ulysses" or "deepspeed"): the common
    options and ``--gqa``/``--fused-qkv``; the whole batch on every rank, 32 tokens per
    rank (the sequence is sharded)."""
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    parser.add_argument("--gqa", type=int, default=0, help="k/v heads (default: all 8 heads)")
    parser.add_argument("--fused-qkv", action="store_true", help="q, k and v as one linear")
    args = parser.parse_args()
    device = init_torchrun()
    seq = 32 * dist.get_world_size()
    extra = {"gqa_kv_heads": args.gqa, "fused_qkv": args.fused_qkv}
    run_and_print(example_config(args, front, 1, 4, seq, device, **extra), args)
    leave_torchrun()


def example_config(
    args: argparse.Namespace,
    front: str,
    tp: int,
    batch: int,
    seq: int,
    device: str,
    **extra: Any,
) -> TrainConfig:
    """The examples' model (128 wide, 8 heads, SwiGLU 384) with the command line's options
    (``extra``: more ``TrainConfig`` fields)."""
    return TrainConfig(
        front=front,
        tp=tp,
        blocks=args.blocks,
        dim=128,
        heads=8,
        hidden=384,
        batch=batch,
        seq=seq,
        steps=args.steps,
        activation_checkpointing=args.activation_checkpointing or False,
        device=device,
        **extra,
    )


def init_torchrun() -> str:
    """Initialize the default group from torchrun's environment: NCCL on CUDA if there is
    one, else gloo on CPU. Returns the device type."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return device


def leave_torchrun(code: int = 0) -> NoReturn:
    """End this rank of a torchrun job once its work is done: wait for every rank
    (``barrier``: none closes its connections while a peer still talks to it), destroy
    the process group, run what the interpreter runs at exit (``atexit`` handlers, such as
    the report's ``measure`` rewrite and logging's flush), then end the process with
    ``code`` without finalizing the interpreter (``os._exit``).

    Why not a plain return: with gloo, each collective's work is released by torch's
    worker thread (``ProcessGroupGloo::runLoop``) after the waiting thread has gone on,
    and releasing a tensor that Python also knew takes the GIL
    (``TensorImpl::decref_pyobject``). The barrier itself is such a work: its worker
    drops it, and the prior works it holds, just after ``barrier()`` returns. A worker
    that comes for the GIL once interpreter finalization has begun is ended by Python
    with ``pthread_exit``, whose unwinding through torch's ``noexcept`` destructors calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT, exit
    code -6 after all the output (seen 2 times in ~75 example runs on 2 loaded cores).
    ``destroy_process_group`` cannot stop those threads here: what still holds the group
    (a compiled graph that traced it, a device mesh) keeps it alive, so its destructor,
    which joins them, runs only during finalization or never. Ending
    the process with ``os._exit`` leaves no finalization for a worker to run into.
    Nothing is lost that the interpreter would have saved: output is flushed, atexit
    handlers have run, non-daemon threads are joined."""
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing(code)


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """What the interpreter does when a script ends, up to its finalization: threading's
    shutdown (its exit hooks, such as idle executors' workers told to stop, then the
    non-daemon threads joined), the ``atexit`` handlers, the standard streams flushed;
    then ``os._exit(code)`` instead of the finalization (see :func:`leave_torchrun`)."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # none, or closed
            stream.flush()
    os._exit(code)


def run_and_print(cfg: TrainConfig, args: argparse.Namespace) -> None:
    """Train with the pass and, step by step in turn, the same compile with
    ``schedule="off"`` (what the pass buys: the speed line compares the two under the
    same load), and with ``--compare`` plain eager too (the losses must agree); rank 0
    prints each step, the sites and the comparisons."""
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def show(step: int, loss: float, seconds: float, which: str = "") -> None:
        if rank == 0:
            print(f"step {step:>3}  loss {loss:.6f}  {seconds * 1e3:8.1f} ms{which}", flush=True)

    def show_pair(which: str, step: int, loss: float, seconds: float) -> None:
        show(step, loss, seconds, "  (schedule='off')" if which == "baseline" else "")

    options = {"schedule": args.schedule, "inner": args.inner, "debug_dir": args.debug_dir}
    if rank == 0:
        print(
            f"with commfuse ({options}) and, step by step in turn, the same compile with "
            f"schedule='off' (every collective kept), {world_size} ranks:\n{cfg}",
            flush=True,
        )
    fused, off = train_interleaved(
        cfg, rank, world_size, options, _baseline(options), on_step=show_pair
    )
    if rank == 0:
        print("\nsites (rank 0):\n" + format_summary(summarize(fused.sites)), flush=True)
        print("\n" + speed_line(fused, off), flush=True)
    if args.compare:
        if rank == 0:
            print("\nwithout the pass (plain eager):", flush=True)
        eager = train(cfg, rank, world_size, None, on_step=show)
        if rank == 0:
            diff = max_relative_diff(fused.losses, eager.losses)
            print(f"\nlargest relative loss difference over {cfg.steps} steps: {diff:.3e}")


def _baseline(options: dict[str, Any]) -> dict[str, Any]:
    """The same compile with ``schedule="off"``; where a dump is on (``--debug-dir`` or
    ``COMMFUSE_DEBUG_DIR``), it goes beside the pass's own, never over it."""
    dump = Options.from_mapping({"debug_dir": options["debug_dir"]}).debug_dir
    off_dump = str(Path(dump) / "schedule-off") if dump else None
    return {**options, "schedule": "off", "debug_dir": off_dump}


def speed_line(fused: TrainResult, off: TrainResult) -> str:
    """The median step after the first (which compiles), with the pass and without (the
    two run in turn, step by step), and the schedules the rewritten sites ran. With one
    step there is no step after the first: the line says so and gives that step's time,
    compile included."""
    ran = sorted({s["schedule"] for s in fused.sites if s["decision"] == "rewritten"})
    sites = f"sites ran: {', '.join(ran) or 'none rewritten'}"
    if min(len(fused.step_s), len(off.step_s)) < 2:
        with_pass, without = (sum(r.step_s) for r in (fused, off))
        return (
            f"no step after the first (which compiles), so no speed comparison: "
            f"{with_pass * 1e3:.1f} ms with the pass ({sites}), {without * 1e3:.1f} ms with "
            "schedule='off', compile included (run 2 or more --steps to compare)"
        )
    with_pass, without = (statistics.median(r.step_s[1:]) for r in (fused, off))
    return (
        f"median step after the first: {with_pass * 1e3:.1f} ms with the pass "
        f"({sites}), {without * 1e3:.1f} ms with "
        f"schedule='off': {without / with_pass:.2f}x"
    )
