"""``commfuse sim``: the projections of a model's layer, by parallelism."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ...cost.profiles import load
from .layer import PRESETS, UP_GROUP_SIZES, UP_SEQUENCES
from .moe import MOE_GROUP_SIZES, MOE_PRESETS, MOE_TOKENS


def run_sim(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The parsed ``commfuse sim`` command line, run."""
    cluster = args.parallelism == "cluster"
    args.profile = args.profile or load("h100-ib400" if cluster else "h100-nvlink4")
    if cluster:
        return _sim_cluster(args)
    if args.parallelism == "moe":
        return _sim_moe(parser, args)
    if args.model in MOE_PRESETS:
        parser.error(f"argument --model: {args.model} is an MoE preset: --parallelism moe")
    args.model = args.model or "llama3-8b"
    if args.parallelism == "up":
        return _sim_ulysses(parser, args)
    return _sim(args)


def _sim(args: argparse.Namespace) -> int:
    from .layer import (
        format_plain_tp,
        format_table,
        simulate_layer,
        simulate_plain_tp,
        write_traces,
    )

    model = PRESETS[args.model]
    if args.tokens is not None:
        model = dataclasses.replace(model, tokens=args.tokens)
    sizes = args.group_size or [2, 4, 8, 16, 32, 64]
    results = [simulate_layer(model, n, args.profile, args.slices) for n in sizes]
    print(format_table(model, args.profile, results))
    plain = [simulate_plain_tp(model, r.n, args.profile, args.slices, r) for r in results]
    print("\n" + format_plain_tp(model, args.profile, plain))
    if args.out:
        for path in write_traces(results, Path(args.out)):
            print(f"wrote {path} (open in https://ui.perfetto.dev)")
    return 0


def _sim_cluster(args: argparse.Namespace) -> int:
    from .cluster import cluster_rows, format_cluster
    from .layer import write_traces

    if args.profile.across_nodes is None:
        args.command_parser.error(
            f"argument --profile: {args.profile.name} has no links across nodes: give "
            "h100-ib400, a100-ib200 or a file calibrated under a multi-node launch"
        )
    rows = cluster_rows(args.profile, args.slices)
    print(format_cluster(args.profile, rows))
    if args.out:
        for row in rows:
            if row.result is not None:
                prefix = "cluster-" + "-".join(row.job.replace(",", "").split()[:6])
                for path in write_traces([row.result], Path(args.out), prefix):
                    print(f"wrote {path} (open in https://ui.perfetto.dev)")
    return 0


def _sim_ulysses(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The Ulysses layer: a table per sequence length, then one summary of them all."""
    from .layer import (
        format_table,
        format_ulysses_summary,
        simulate_ulysses,
        ulysses_problem,
        write_traces,
    )

    sizes = args.group_size or list(UP_GROUP_SIZES)
    for n in sizes:
        problem = ulysses_problem(PRESETS[args.model], n)
        if problem:
            parser.error(f"argument --group-size: {problem}")
    sequences = [args.tokens] if args.tokens is not None else list(UP_SEQUENCES)
    summary = {}
    for seq in sequences:
        model = dataclasses.replace(PRESETS[args.model], tokens=seq)
        results = [simulate_ulysses(model, n, args.profile) for n in sizes]
        summary[seq] = results
        print(format_table(model, args.profile, results, "layer under Ulysses (UP)") + "\n")
        if args.out:
            for path in write_traces(results, Path(args.out), f"trace_up_s{seq}"):
                print(f"wrote {path} (open in https://ui.perfetto.dev)")
    print(format_ulysses_summary(PRESETS[args.model], args.profile, summary))
    return 0


def _sim_moe(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The MoE layer's expert parallelism: one section of projections per preset."""
    from .moe import format_moe, moe_problem, simulate_moe

    name = args.model or "deepseek-v3-moe"
    if name not in MOE_PRESETS:
        parser.error(f"argument --model: --parallelism moe takes {', '.join(sorted(MOE_PRESETS))}")
    sizes = args.group_size or list(MOE_GROUP_SIZES)
    for n in sizes:
        problem = moe_problem(MOE_PRESETS[name], n)
        if problem:
            parser.error(f"argument --group-size: {problem}")
    tokens = [args.tokens] if args.tokens is not None else list(MOE_TOKENS)
    results = [
        simulate_moe(dataclasses.replace(MOE_PRESETS[name], tokens=t), n, args.profile)
        for t in tokens
        for n in sizes
    ]
    print(format_moe(MOE_PRESETS[name], args.profile, results))
    return 0
