"""The ``commfuse`` command."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..cost.profiles import Curve, Profile, ProfileError, load
from ..options import INNER_COMPILERS, MAX_SLICES, SCHEDULES, dump_dir_problem
from .bench.config import CELL_KINDS, DROPLESS_KIND, MOE_KIND, parse_kinds
from .sim.layer import PRESETS, UP_GROUP_SIZES, UP_SEQUENCES
from .sim.moe import MOE_GROUP_SIZES, MOE_PRESETS, MOE_TOKENS

if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]  # add_subparsers' result

DESCRIPTION = """\
Tools for commfuse-compile, the torch.compile backend (backend="commfuse") that splits the
all-gathers and reduce-scatters next to matmuls into point-to-point steps the matmuls hide:
run it on a transformer block, read what it decided, measure this machine for its cost
model, simulate a real model's layer, or benchmark its schedules."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, except for flags without one or off by default
    (their help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in low..high (no upper bound if None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            pass
        else:
            if low <= value and (high is None or value <= high):
                return value
        bounds = f"in {low}..{high}" if high is not None else f">= {low}"
        raise argparse.ArgumentTypeError(f"must be an integer {bounds}{why}, got {text!r}")

    return parse


def _group_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated group sizes, each at least 2."""
    parse = _int_in(2, why=" (a group of ranks)")
    try:
        return [parse(size.strip()) for size in text.split(",")]
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"each comma-separated size {err}") from None


def _directory(text: str) -> str:
    """An argparse type: a directory this process can write, made now, so that a bad path
    fails before the work rather than after it (in every rank, for the demo)."""
    problem = dump_dir_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    try:
        Path(text).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=text).close()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write to {text!r}: {err.strerror}") from None
    return text


def _profile(text: str) -> Profile:
    """An argparse type: a built-in profile's name or a profile file, loaded."""
    try:
        return load(text)
    except ProfileError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _new_file(text: str) -> str:
    """An argparse type: a file path this process can write, checked before calibrating."""
    parent = Path(text).parent
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: {str(parent)!r} is not a writable directory"
        )
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commfuse", description=DESCRIPTION, formatter_class=_Help
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add in (_add_demo, _add_inspect, _add_calibrate, _add_sim, _add_bench):
        add(commands)
    return parser


def _command(commands: _Commands, name: str, what: str) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=what, description=what, formatter_class=_Help)
    command.set_defaults(command_parser=command)  # its errors say "commfuse NAME: error"
    return command


def _add_demo(commands: _Commands) -> None:
    demo = _command(
        commands,
        "demo",
        "Compile a tensor- and sequence-parallel transformer block with backend='commfuse' "
        "on local CPU ranks, check outputs and gradients against the uncompiled block, and "
        "show which sites were rewritten and the step times with and without the rewrite: "
        "behind a throttled 400 Mbit/s link as root (network namespaces), else on loopback "
        "with the cost model's figure for such a link.",
    )
    demo.add_argument(
        "--world-size",
        type=_int_in(2, why=" (one rank has no collectives to rewrite)"),
        default=2,
        help="local gloo ranks (processes) the block is sharded over",
    )
    demo.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="ring",
        help="'ring' forces the rewrite; 'auto' lets the cost model keep collectives it "
        "predicts faster",
    )
    demo.add_argument(
        "--inner",
        choices=INNER_COMPILERS,
        default="eager",
        help="compiler after the pass: 'eager' (seconds) or 'inductor' (about a minute of "
        "C++ compilation on 2 cores, cold)",
    )
    demo.add_argument(
        "--steps", type=_int_in(1), default=5, help="timed training steps of each variant"
    )
    demo.add_argument(
        "--nodes",
        type=_int_in(2, why=" (a job that spans nodes)"),
        help="the ranks over this many nodes, a network namespace each behind its own "
        "throttled NIC, one torchrun per node (c10d rendezvous; as root)",
    )
    demo.add_argument(
        "--debug-dir",
        type=_directory,
        help="write the pass's debug dump here (read it with `commfuse inspect DIR`)",
    )


def _add_inspect(commands: _Commands) -> None:
    inspect = _command(
        commands,
        "inspect",
        "Turn a debug dump (the debug_dir option) into DIR/report.html and DIR/trace.json "
        "(Perfetto) and print their paths.",
    )
    inspect.add_argument("dir", help="the debug_dir the pass wrote (all rank<r> inside)")


def _add_calibrate(commands: _Commands) -> None:
    calibrate = _command(
        commands,
        "calibrate",
        "Measure this machine on local gloo ranks (matmuls, transfers, collectives) and "
        "write a profile file for the cost model: options={'profile': FILE}.",
    )
    calibrate.add_argument(
        "--world-size",
        type=_int_in(2, why=" (it measures transfers between ranks)"),
        default=2,
        help="local gloo ranks; collectives are measured on every group size up to it",
    )
    calibrate.add_argument(
        "--out", type=_new_file, default="commfuse-profile.json", help="profile file to write"
    )
    calibrate.add_argument(
        "--reps", type=_int_in(1), default=20, help="repetitions per measurement"
    )
    calibrate.add_argument(
        "--ranks-per-nic",
        type=_int_in(1),
        default=None,
        help="under a multi-node torchrun launch: how many of a node's ranks share one NIC "
        "(default: all of them)",
    )


def _print_curves(collectives: dict[str, dict[int, Curve]], where: str) -> None:
    for kind, curves in collectives.items():
        for n, curve in sorted(curves.items()):
            print(
                f"{kind:>14} on {n} ranks{where}: {curve.latency_s * 1e6:8.1f} us + "
                f"{1 / curve.seconds_per_byte / 1e9:.3f} GB/s of a rank's block"
            )


def _add_sim(commands: _Commands) -> None:
    sim = _command(
        commands,
        "sim",
        "Simulate one layer of a real model under tensor + sequence parallelism (or, with "
        "--parallelism up, Ulysses sequence parallelism; with --parallelism moe, an MoE "
        "layer's expert parallelism, as projections) for every schedule on a machine "
        "profile: what the rewrite would buy, without a cluster.",
    )
    sim.add_argument(
        "--model",
        choices=sorted(PRESETS) + sorted(MOE_PRESETS),
        help="model shapes; default: llama3-8b (tpsp, up), deepseek-v3-moe (moe: the "
        + ", ".join(sorted(MOE_PRESETS))
        + " presets only)",
    )
    sim.add_argument(
        "--parallelism",
        choices=["tpsp", "up", "moe", "cluster"],
        default="tpsp",
        help="tpsp: the TP+SP layer's all-gathers and reduce-scatters; up: the Ulysses "
        "layer's all-to-alls around attention, at sequences "
        + ", ".join(map(str, UP_SEQUENCES))
        + " unless --tokens is given; moe: an MoE layer's expert-parallel dispatch and "
        "combine all-to-alls around its experts (projections), at "
        + ", ".join(map(str, MOE_TOKENS))
        + " tokens per rank unless --tokens is given; cluster: jobs that span nodes (Llama 3 "
        "70B TP 8 inside a node and sharded DP across 16-128 nodes, TP 16 over 2 nodes, "
        "DeepSeek-V3-like expert parallelism across nodes), each group priced by its level, "
        "as projections",
    )
    sim.add_argument(
        "--profile",
        type=_profile,
        help="built-in profile name or a file from `commfuse calibrate`; default: "
        "h100-nvlink4, h100-ib400 (cluster: a profile with links across nodes)",
    )
    sim.add_argument(
        "--group-size",
        type=_group_sizes,
        help="comma-separated group sizes; default: 2,4,8,16,32,64 (tpsp), "
        + ",".join(map(str, UP_GROUP_SIZES))
        + " (up: n must divide the k/v heads), "
        + ",".join(map(str, MOE_GROUP_SIZES))
        + " (moe: n must divide the experts)",
    )
    sim.add_argument(
        "--slices",
        type=_int_in(2, MAX_SLICES),
        default=2,
        help="chunks of the slicing schedule",
    )
    sim.add_argument(
        "--tokens",
        type=_int_in(1),
        help="tokens per step (sequence x micro-batch); default: the model's sequence",
    )
    sim.add_argument(
        "--out", type=_directory, help="write a Chrome trace per group size to this directory"
    )


def _add_bench(commands: _Commands) -> None:
    bench = _command(
        commands,
        "bench",
        "Measure every schedule on local gloo ranks behind a bandwidth-limited link (as "
        "root: network namespaces and tbf; without root: unthrottled, said in every output) "
        "and write results.json, results.md and a plot to --out.",
    )
    bench.add_argument(
        "--quick", action="store_true", help="one size, fewer rows (about 5 minutes)"
    )
    bench.add_argument("--out", type=_directory, default="commfuse-bench", help="results directory")
    bench.add_argument(
        "--world-size",
        type=_int_in(2, why=" (it measures transfers between ranks)"),
        default=2,
        help="local gloo ranks",
    )
    bench.add_argument(
        "--network",
        choices=["veth", "lo", "none"],
        help="veth: a namespace per rank; lo: one namespace, throttled loopback; none: "
        "unthrottled; default: veth, else lo, else none",
    )
    bench.add_argument(
        "--block-2d",
        action="store_true",
        help="also the 2-D block (data x tensor parallel: training's fsdp front with tp=2 "
        "on a 2 x 2 mesh), on 4 ranks of its own after the rest, with the pass and without",
    )
    bench.add_argument(
        "--nodes",
        type=_int_in(2, why=" (a job that spans nodes)"),
        help="instead: the 2-D block, TP+SP and an MoE layer on a job of this many nodes of "
        "--ranks-per-node ranks (as demo --nodes; about 6 minutes at 2 nodes)",
    )
    bench.add_argument("--ranks-per-node", type=_int_in(2), default=2, help="with --nodes")
    bench.add_argument(
        "--kinds",
        type=parse_kinds,
        metavar="KIND[,KIND...]",
        help=f"only the preset's cells of these kinds ({', '.join(CELL_KINDS)}) and the "
        "blocks made of them (the TP+SP blocks: ag_mm or mm_rs; the plain-TP block: "
        f"mm_ar_mm; the capacity-MoE block: {MOE_KIND}; the dropless-MoE block: "
        f"{DROPLESS_KIND}; the MoE ones in the full preset only)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    if args.command == "sim":
        from .sim.command import run_sim

        return run_sim(parser, args)

    if args.command == "bench" and args.nodes is not None:
        if args.network or args.block_2d or args.kinds or args.quick:
            parser.error(
                "argument --nodes: its own cells, no --quick, --network, --block-2d, --kinds"
            )
        from .bench.multinode import main as nodes_main

        return nodes_main(args.out, args.nodes, args.ranks_per_node)

    if args.command == "bench":
        from .bench.run import main as bench_main

        return bench_main(
            args.quick, args.out, args.world_size, args.network, args.block_2d, args.kinds
        )

    if args.command == "calibrate":
        from .calibrate import run as calibrate_run
        from .calibrate import run_launched

        if "LOCAL_WORLD_SIZE" in os.environ:  # the ranks of a torchrun job: every level
            launched = run_launched(args.out, args.reps, args.ranks_per_nic)
            if launched is None:
                return 0  # rank 0 writes and prints
            profile = launched
        else:
            profile = calibrate_run(args.world_size, args.out, args.reps)
        for field, value in profile.as_json().items():
            if field not in ("collectives", "across_nodes"):
                print(f"{field:>22}: {value}")
        _print_curves(profile.collectives, "")
        nic = profile.across_nodes
        if nic is not None:
            print(
                f"{'across nodes':>22}: {nic.alpha_s * 1e6:.1f} us + {nic.bytes_per_s / 1e9:.3f} "
                f"GB/s per NIC (one direction), {nic.ranks_per_nic} rank(s) per NIC; "
                f"step overhead {nic.step_overhead_s}, overlap slowdown {nic.overlap_slowdown}"
            )
            _print_curves(nic.collectives, " across nodes")
        print(f"wrote {args.out}; use it with options={{'profile': {args.out!r}}}")
        return 0

    if args.command == "demo":
        from .demo import DemoConfig, nodes_refusal, run

        if DemoConfig.heads % args.world_size:
            args.command_parser.error(
                f"argument --world-size: the block's {DemoConfig.heads} attention heads are "
                f"split over the ranks: give a world size that divides {DemoConfig.heads}"
            )
        refused = nodes_refusal(args.world_size, args.nodes)
        if refused is not None:
            args.command_parser.error(f"argument --nodes: {refused}")
        return run(
            DemoConfig(
                nodes=args.nodes,
                world_size=args.world_size,
                schedule=args.schedule,
                inner=args.inner,
                steps=args.steps,
                debug_dir=args.debug_dir,
            )
        )
    if args.command == "inspect":
        from .inspect.dump import NotADumpError
        from .inspect.run import inspect_dump

        try:
            written = inspect_dump(args.dir)
        except NotADumpError as err:
            parser.error(str(err))
        for path in written:
            print(path)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
