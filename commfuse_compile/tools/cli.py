"""The ``commfuse`` command."""

from __future__ import annotations

import argparse
import sys

from ..options import INNER_COMPILERS, SCHEDULES
from .sim import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commfuse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="TP+SP transformer block on local CPU ranks")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="ring",
        help="'ring' (default here) forces the rewrite; 'auto' lets the cost "
        "model keep collectives it predicts faster",
    )
    demo.add_argument(
        "--inner",
        choices=INNER_COMPILERS,
        default="eager",
        help="compiler after the pass: 'eager' (default here: seconds) or "
        "'inductor' (about a minute of C++ compilation on 2 cores, cold)",
    )
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--debug-dir", default=None, help="write the debug dump here")
    inspect = commands.add_parser(
        "inspect", help="a debug dump as DIR/report.html and DIR/trace.json (Perfetto)"
    )
    inspect.add_argument("dir", help="the debug_dir the pass wrote (all rank<r> inside)")
    calibrate = commands.add_parser(
        "calibrate", help="measure this machine's gloo ranks and write a profile file"
    )
    calibrate.add_argument("--world-size", type=int, default=2)
    calibrate.add_argument("--out", default="commfuse-profile.json")
    calibrate.add_argument("--reps", type=int, default=20, help="repetitions per measurement")
    sim = commands.add_parser(
        "sim", help="simulate a model's layer for every schedule on a machine profile"
    )
    sim.add_argument("--model", choices=sorted(PRESETS), default="llama3-8b")
    sim.add_argument("--profile", default="h100-nvlink4", help="built-in name or profile file")
    sim.add_argument("--group-size", default="2,4,8,16,32,64", help="comma-separated sizes")
    sim.add_argument("--slices", type=int, default=2, help="chunks of the slicing schedule")
    sim.add_argument("--tokens", type=int, default=None, help="tokens per step (sequence)")
    sim.add_argument("--out", default=None, help="write a Chrome trace per group size here")
    bench = commands.add_parser(
        "bench",
        help="measure every schedule on gloo ranks behind a throttled link (root: netns + tbf)",
    )
    bench.add_argument("--quick", action="store_true", help="one size, fewer rows (~2 min)")
    bench.add_argument("--out", default="commfuse-bench", help="results directory")
    bench.add_argument("--world-size", type=int, default=2)
    bench.add_argument(
        "--network",
        choices=["veth", "lo", "none"],
        default=None,
        help="link topology (default: veth, else lo, else unthrottled)",
    )
    args = parser.parse_args(argv)

    if args.command == "sim":
        return _sim(parser, args)

    if args.command == "bench":
        from .bench import main as bench_main

        if args.world_size < 2:
            parser.error("--world-size must be at least 2")
        return bench_main(args.quick, args.out, args.world_size, args.network)

    if args.command == "calibrate":
        from .calibrate import run as calibrate_run

        if args.world_size < 2:
            parser.error("--world-size must be at least 2")
        profile = calibrate_run(args.world_size, args.out, args.reps)
        for field, value in profile.as_json().items():
            if field != "collectives":
                print(f"{field:>22}: {value}")
        for kind, curves in profile.collectives.items():
            for n, curve in sorted(curves.items()):
                print(
                    f"{kind:>14} on {n} ranks: {curve.latency_s * 1e6:8.1f} us + "
                    f"{1 / curve.seconds_per_byte / 1e9:.3f} GB/s of a rank's block"
                )
        print(f"wrote {args.out}; use it with options={{'profile': {args.out!r}}}")
        return 0

    if args.command == "demo":
        from .demo import DemoConfig, run

        if args.world_size < 2:
            parser.error("--world-size must be at least 2")
        return run(
            DemoConfig(
                world_size=args.world_size,
                schedule=args.schedule,
                inner=args.inner,
                steps=args.steps,
                debug_dir=args.debug_dir,
            )
        )
    if args.command == "inspect":
        from .inspect import NotADumpError, inspect_dump

        try:
            written = inspect_dump(args.dir)
        except NotADumpError as err:
            parser.error(str(err))
        for path in written:
            print(path)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


def _sim(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from ..cost.profiles import ProfileError, load
    from .sim import format_table, simulate_layer, write_traces

    try:
        profile = load(args.profile)
        sizes = [int(size) for size in args.group_size.split(",")]
    except (ProfileError, ValueError) as err:
        parser.error(str(err))
    if any(size < 2 for size in sizes) or args.slices < 2:
        parser.error("group sizes and --slices must be at least 2")
    model = PRESETS[args.model]
    if args.tokens:
        model = dataclasses.replace(model, tokens=args.tokens)
    results = [simulate_layer(model, n, profile, args.slices) for n in sizes]
    print(format_table(model, profile, results))
    if args.out:
        for path in write_traces(results, Path(args.out)):
            print(f"wrote {path} (open in https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
