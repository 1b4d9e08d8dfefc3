"""Device readiness: what a short stay on one GPU must bring back, in one command.

Nothing in this project has run on a GPU yet: the GPU profiles behind ``auto`` and
``commfuse sim`` are datasheet figures, and the program check has only read Inductor's
C++ wrapper code. GPU time comes rarely and briefly, so this script is prepared and
tested on CPU and collects, on one CUDA GPU in a few minutes:

1. **Split-GEMM efficiency.** For the tensor-parallel shapes of the ``llama3-8b`` and
   ``llama3-70b`` sim presets on n = 2, 4, 8 ranks, one rank's bf16 matmul whole against
   its n blocks back to back, cut three ways: ``rows`` (the forward MLP input
   projection's gathered input, ag_mm rows), ``columns`` (the same product cut into
   column blocks, as a gathered weight makes it) and ``contracting`` (that projection's
   weight gradient, the gathered tokens contracted, accumulated block by block); and the
   blocks again with a copy of one ring step's message between each two (the cost of a
   P2P-sized copy between kernels). From these, ``profile.json`` (the ``commfuse
   calibrate`` format: ``options={"profile": ...}``, ``commfuse sim --profile``):
   matmul throughput and call latency fitted on every whole and block matmul, memory
   bandwidth from an element-wise add, the step overhead from the copies; the link and
   collective fields stay the built-in profile's (one device has no link to measure).
   It is printed beside the built-in profile, with ``commfuse sim``'s layer on both.
2. **The program check on Inductor's wrapper code.** A TP+SP transformer block
   (``tools/training/fronts.py``, one block, final norm and head), traced on torch's fake
   process group at world size 4, compiled with ``backend="commfuse"`` and Inductor for
   every schedule; each generated program (Triton kernels and streams on CUDA) is
   checked with ``passes/program.check``: it must parse, keep every transfer's buffer,
   and every site must stay rewritten. ``exposed_steps`` are printed.
3. **The rewritten block, run.** The fake group runs collectives and point-to-point ops
   as no-ops (nothing moves; a received tensor is left unwritten), so each compiled block
   is timed for its compute side alone (forward + backward), against the same compile
   with ``schedule="off"``; the ring's step is recorded with ``torch.profiler``.

Everything goes under ``--out``: ``summary.md`` and ``summary.json`` (the tables),
``profile.json``, ``programs/`` (each generated program), ``trace_ring.json`` (Chrome
trace: Perfetto) and ``profile_ring.txt`` (the profiler's top ops). On a GPU:

    python benchmarks/gpu_check.py --out gpu/

CPU dry mode (tiny shapes, Inductor for CPU, every other code path the same; the test
suite runs it so that the script cannot rot; about a minute on 2 cores once Inductor's
cache is warm):

    python benchmarks/gpu_check.py --cpu --out gpu-dry/

(``--schedules off,ring`` compiles the block for those schedules only: the test suite's
default run checks the dry mode so, ``pytest -m matrix`` with every schedule.)

Part 1 is ``gpu_check_parts/split_gemm.py``, parts 2 and 3 ``gpu_check_parts/block.py``
(where it runs and how big: ``gpu_check_parts/mode.py``); this file runs them and writes
the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from gpu_check_parts.block import FAKE_GROUP_NOTE, TIMED, block_part
from gpu_check_parts.mode import DTYPE_NAME, RANK, WORLD_SIZE, cpu_mode, gpu_mode
from gpu_check_parts.split_gemm import split_gemm_part

from commfuse_compile.cost.profiles import for_device

DRY_NOTE = (
    " Dry mode: tiny shapes on a CPU; the numbers only show that every path runs, they "
    "measure nothing worth keeping."
)


# ----------------------------------------------------------------------------------------
# the run and its summary


def table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def summary_markdown(summary: dict[str, Any]) -> str:
    base, measured = summary["base_profile"], summary["profile"]
    lines = [
        f"# gpu_check on {summary['device_name']} ({summary['mode']} mode)",
        "",
        f"torch {summary['torch']}, {summary['date']}, {summary['seconds']:.0f} s."
        + (DRY_NOTE if summary["mode"] == "cpu" else ""),
        "",
        "## Split GEMMs: whole matmul against its n blocks",
        "",
        f"dtype {summary['dtype']}; shapes M x K x N of one rank's matmul (the presets' sizes"
        + (f" divided by {summary['shrink']}" if summary["shrink"] > 1 else "")
        + "). Efficiency = whole / blocks (1.00: splitting costs nothing); the model's "
        "efficiency is the same ratio as the measured profile and the built-in one predict "
        "it; copy = the added time of one message-sized copy between two block matmuls.",
        "",
    ]
    lines += table(
        [
            "model",
            "n",
            "direction",
            "M x K x N",
            "whole us",
            "blocks us",
            "efficiency",
            "model: measured / built-in",
            "copy us (bytes)",
        ],
        [
            [
                c["model"],
                c["n"],
                c["direction"],
                " x ".join(map(str, c["shape"])),
                f"{c['whole_us']:.1f}",
                f"{c['blocks_us']:.1f}",
                f"{c['efficiency']:.2f}",
                f"{c['model_efficiency']:.2f} / {c['base_model_efficiency']:.2f}",
                f"{c['copy_us']:.1f} ({c['message_bytes']})",
            ]
            for c in summary["split_gemm"]
        ],
    )
    lines += ["", f"## Profile: measured beside `{base['name']}`", ""]
    lines += table(
        ["field", "measured", base["name"]],
        [
            [field, _number(measured[field]), _number(base[field])]
            for field in (
                "matmul_flops",
                "matmul_latency_s",
                "memory_bytes_per_s",
                "step_overhead_s",
            )
        ],
    )
    lines += [
        "",
        "Written to `profile.json` (`commfuse sim --profile`); the other fields are "
        f"`{base['name']}`'s.",
        "",
        "## commfuse sim: one TP+SP layer's sites, collective against auto",
        "",
    ]
    lines += table(
        ["profile", "model", "n", "collective us", "auto us", "speedup"],
        [
            [
                r["profile"],
                r["model"],
                r["n"],
                f"{r['collective_us']:.1f}",
                f"{r['auto_us']:.1f}",
                f"{r['collective_us'] / r['auto_us']:.2f}x",
            ]
            for r in summary["sim"]
        ],
    )
    off = next((r["step_s"] for r in summary["block"] if r["schedule"] == "off"), None)
    lines += [
        "",
        "## The TP+SP block: Inductor's programs checked, the compute side timed",
        "",
        f"{summary['block_config']}, on the fake process group (rank {RANK} of "
        f"{WORLD_SIZE}); {FAKE_GROUP_NOTE}. Transfers: starts the program check read; "
        "waits without matmul: every transfer waited with none in flight (collectives "
        "the pass keeps included); exposed steps: the rewritten sites' (report.json).",
        "",
    ]
    lines += table(
        [
            "schedule",
            "programs",
            "sites rewritten",
            "transfers",
            "violations",
            "waits without matmul",
            "exposed steps",
            "step ms",
            "vs off",
            "verdict",
        ],
        [
            [
                r["schedule"],
                r["programs"],
                f"{r['rewritten']}/{r['sites']}",
                r["transfers"],
                len(r["violations"]),
                r["waits_without_matmul"],
                len(r["exposed_steps"]),
                "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.2f}",
                "-" if r["step_s"] is None or off is None else f"{off / r['step_s']:.2f}x",
                r["verdict"],
            ]
            for r in summary["block"]
        ],
    )
    exposed = [f"{r['schedule']}: {e}" for r in summary["block"] for e in r["exposed_steps"]]
    lines += ["", "exposed_steps: " + ("; ".join(exposed) if exposed else "none")]
    for part, error in summary["errors"].items():
        lines += ["", f"## Error: {part}", "", "```", error.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--cpu", action="store_true", help="dry mode: tiny shapes, Inductor for CPU"
    )
    parser.add_argument(
        "--schedules",
        type=lambda text: text.split(","),
        default=list(TIMED),
        help="parts 2 and 3 for these schedules only (comma-separated; default: every one)",
    )
    args = parser.parse_args(argv)
    if unknown := [s for s in args.schedules if s not in TIMED]:
        parser.error(f"--schedules: unknown {','.join(unknown)} (known: {','.join(TIMED)})")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: --cpu runs the dry mode")
    mode = cpu_mode() if args.cpu else gpu_mode()
    (args.out / "programs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", flush=True)

    block = mode.block
    summary: dict[str, Any] = {
        "mode": mode.device,
        "device_name": mode.device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dtype": DTYPE_NAME,
        "shrink": mode.shrink,
        "base_profile": for_device(mode.device).as_json(),
        "block_config": (
            f"1 block (dim {block.dim}, {block.heads} heads, FFN {block.hidden}, batch "
            f"{block.batch} x sequence {block.seq}, {block.dtype}) with final norm and head, "
            "forward + backward"
        ),
    }
    say(f"gpu_check on {mode.device_name()}, {mode.device} mode, output in {args.out}")
    errors: dict[str, str] = {}
    try:
        summary.update(split_gemm_part(mode, args.out, say))
    except Exception:  # noqa: BLE001 - one part failing must not cost the others' facts
        errors["split GEMMs"] = traceback.format_exc()
        say(f"split GEMMs failed:\n{errors['split GEMMs']}")
        summary.update(profile=summary["base_profile"], split_gemm=[], sim=[])
    runs = block_part(mode, args.out, say, errors, args.schedules)
    summary.update(
        block=[r.as_json() for r in runs], errors=errors, seconds=time.perf_counter() - started
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    markdown = summary_markdown(summary)
    (args.out / "summary.md").write_text(markdown)
    print("\n" + markdown)
    ok = not errors and all(r.verdict == "pass" for r in runs)
    say("done: " + ("every check passed" if ok else "FAILED (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
