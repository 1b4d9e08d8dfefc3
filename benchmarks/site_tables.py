"""Site tables and rewritten graphs of the demo and every example, to show that a change
to the pass's internals changes nothing it does (not a test: it runs many jobs).

Each run writes its debug dump; this script keeps, per run and rank, every site's table
row (graph, kind, decision, schedule, decline code, steps, P2P calls) and the graph the
pass produced, with P2P tags and site numbers renumbered in order of appearance (those
are identifiers, not behaviour). ``--compare`` prints what differs between two outputs.

    python benchmarks/site_tables.py --out /tmp/before        # about 8 minutes on 2 cores
    python benchmarks/site_tables.py --out /tmp/after
    python benchmarks/site_tables.py --compare /tmp/before /tmp/after
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = [sys.executable, "-m", "commfuse_compile.tools.cli", "demo", "--steps", "1"]
# (name, ranks, command after torchrun's own arguments, or the demo's)
RUNS: list[tuple[str, int, list[str]]] = [
    *(
        (f"demo-{n}-{s}", n, [*DEMO, "--world-size", str(n), "--schedule", s])
        for n, s in [
            (2, "ring"),
            (4, "ring"),
            (4, "bidir"),
            (4, "push"),
            (4, "slicing"),
            (4, "auto"),
        ]
    ),
    ("demo-4-ring-inductor", 4, [*DEMO, "--world-size", "4", "--inner", "inductor"]),
    ("tp_mlp-2", 2, ["examples/tp_mlp.py"]),
    ("tp-2-default", 2, ["examples/train_tp_transformer.py"]),  # its own options
    *(
        (name, ranks, [script, "--schedule", "ring", *more])
        for name, ranks, script, more in [
            ("tp-2", 2, "examples/train_tp_transformer.py", []),
            (
                "tp-4-ac-vocab",
                4,
                "examples/train_tp_transformer.py",
                ["--activation-checkpointing", "--vocab", "64"],
            ),
            ("tp-4-per-block", 4, "examples/train_tp_transformer.py", ["--compile-per-block"]),
            ("fsdp-2", 2, "examples/train_fsdp_style.py", []),
            ("fsdp-4-tp2", 4, "examples/train_fsdp_style.py", ["--tp", "2"]),
            ("ulysses-4-gqa-fused", 4, "examples/train_ulysses.py", ["--gqa", "4", "--fused-qkv"]),
            ("megatron-2", 2, "examples/train_megatron_style.py", []),
            ("megatron-4-inductor", 4, "examples/train_megatron_style.py", ["--inner", "inductor"]),
            ("megatron-4-float8", 4, "examples/train_megatron_style.py", ["--float8"]),
            ("deepspeed-2", 2, "examples/train_deepspeed_ulysses.py", []),
            (
                "deepspeed-4-gqa-fused",
                4,
                "examples/train_deepspeed_ulysses.py",
                ["--gqa", "4", "--fused-qkv"],
            ),
            ("tp-4-plain", 4, "examples/train_tp_transformer.py", ["--plain-tp"]),
            ("hf-tp-3", 3, "examples/train_hf_tp.py", []),  # plain TP split on the joint graph
            ("moe-3-capacity", 3, "examples/train_moe.py", []),
            ("moe-3-dropless", 3, "examples/train_moe.py", ["--moe", "dropless"]),
            ("moe-4-titan", 4, "examples/train_moe.py", ["--moe", "titan"]),
            ("moe-4-megatron", 4, "examples/train_moe.py", ["--moe", "megatron"]),
        ]
    ),
]
ROW = ("graph", "kind", "decision", "schedule", "decline_code", "steps", "p2p_ops", "matmuls")


def command(ranks: int, argv: list[str], dump: Path) -> tuple[list[str], dict[str, str]]:
    """The run's command line and environment: its dump through ``--debug-dir`` where it
    takes one (the examples' second, ``schedule="off"``, run then writes none), else
    through ``COMMFUSE_DEBUG_DIR``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if argv[0] == "examples/tp_mlp.py":
        env["COMMFUSE_DEBUG_DIR"] = str(dump)
        dump_args, steps = [], []
    else:
        dump_args, steps = ["--debug-dir", str(dump)], ["--steps", "1"]
    if argv[0] == sys.executable:
        return [*argv, *dump_args], env
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    return [*torchrun, *argv, *steps, *dump_args], env


def renumbered(code: str) -> str:
    """The graph's code with P2P tags and site numbers replaced by their order of appearance."""
    names: dict[str, str] = {}

    def name(prefix: str, value: str) -> str:
        return names.setdefault(f"{prefix}{value}", f"{prefix}#{len(names)}")

    code = re.sub(r"'site (\d+) ", lambda m: f"'{name('site ', m[1])} ", code)
    return re.sub(r"(\], )(\d{4,}|-\d+)(, ')", lambda m: m[1] + name("tag ", m[2]) + m[3], code)


def collect(dump: Path) -> dict[str, object]:
    ranks: dict[str, object] = {}
    for rank in sorted(dump.glob("rank*")):  # (the examples' baseline dumps beside them)
        sites = json.loads((rank / "report.json").read_text())["sites"]
        rows = [[str(s.get(k, "")) for k in ROW] for s in sites]
        graphs = {f.name: renumbered(f.read_text()) for f in sorted(rank.glob("*_after.py"))}
        ranks[rank.name] = {"sites": rows, "graphs": graphs}
    return ranks


def record(out: Path, only: set[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, ranks, argv in RUNS:
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            dump = Path(tmp) / "dump"
            args, env = command(ranks, argv, dump)
            done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
                continue
            (out / f"{name}.json").write_text(json.dumps(collect(dump), indent=1))
        table = json.loads((out / f"{name}.json").read_text())["rank0"]["sites"]
        rewritten = sum(row[2] == "rewritten" for row in table)
        print(f"{name}: {len(table)} sites on rank 0, {rewritten} rewritten")


def compare(before: Path, after: Path) -> int:
    differing = 0
    for path in sorted(before.glob("*.json")):
        other = after / path.name
        if not other.exists():
            print(f"{path.stem}: missing in {after}")
            differing += 1
            continue
        old, new = json.loads(path.read_text()), json.loads(other.read_text())
        for rank in sorted(set(old) | set(new)):
            a, b = old.get(rank, {}), new.get(rank, {})
            if a.get("sites") != b.get("sites"):
                print(f"{path.stem} {rank}: site tables differ")
                differing += 1
            for graph in sorted(set(a.get("graphs", {})) | set(b.get("graphs", {}))):
                if a.get("graphs", {}).get(graph) != b.get("graphs", {}).get(graph):
                    print(f"{path.stem} {rank}: {graph} differs")
                    differing += 1
    runs = len(list(before.glob("*.json")))
    print(f"{runs} runs compared: {'identical' if not differing else f'{differing} differences'}")
    return 1 if differing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the tables of every run here")
    parser.add_argument("--only", nargs="*", default=[], help="just these runs")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        parser.error("give --out DIR or --compare BEFORE AFTER")
    record(args.out, set(args.only))


if __name__ == "__main__":
    main()
