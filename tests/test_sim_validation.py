"""The simulator against this machine: calibrate 2 gloo ranks, then time a mid-size
all-gather -> matmul and matmul -> reduce-scatter site run as the collective and as the
ring, and compare with what the pass predicts for them on the calibrated profile.

Timings on a shared 2-core machine are noisy and no test asserts a timing: this checks
that calibration, prediction and measurement ran and gave well-formed numbers, and
``pytest -s`` prints the relative errors. The model's error is a benchmark output:
``commfuse bench`` reports predicted against measured for every cell.
"""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch.distributed as dist
from cases import AgMm, MmRs, trace

from commfuse_compile.cost.profiles import save
from commfuse_compile.options import Options
from commfuse_compile.passes import rewrite_graph
from commfuse_compile.tools import calibrate

pytestmark = pytest.mark.slow

N = 2
SITES = {
    # [512, 512] gathered from [256, 512] shards, @ [512, 1024]: ~0.5 GFLOP, 0.5 MiB shards
    "AG->MM": AgMm(shard=(256, 512), dim=0, n_out=1024, consumers=1, bias=False),
    # [512, 512] @ [512, 1024] reduce-scattered over rows: 1 MiB partial sums
    "MM->RS": MmRs(lead=(512,), k=512, n_out=1024, dim=0, bias=False),
}
REPS = 3  # timed runs of each variant, after one warm-up


def _time_sites(rank: int, n: int, profile_path: str) -> dict[str, dict[str, float]]:
    """Per site, this rank's median time as the collective and as the ring (runs
    interleaved, so both see the same machine), and the pass's predictions."""
    out = {}
    for label, case in SITES.items():
        inputs = case.inputs(rank, 0, n) if isinstance(case, AgMm) else case.inputs(rank, 0)
        variants = {}
        for schedule in ("off", "ring"):
            gm = copy.deepcopy(trace(case, n, inputs))
            options = Options.from_mapping(
                {"schedule": schedule, "inner": "eager", "profile": profile_path}
            )
            (record,) = rewrite_graph(gm, "export", options)
            assert record.decision == ("declined" if schedule == "off" else "rewritten")
            variants[schedule] = gm
        predicted_us = record.predicted_us  # the ring's compile predicts them all
        times: dict[str, list[float]] = {"off": [], "ring": []}
        for _ in range(REPS + 1):
            for schedule, gm in variants.items():
                dist.barrier()
                start = time.perf_counter()
                gm(*inputs)
                times[schedule].append(time.perf_counter() - start)
        out[label] = {
            "collective measured": statistics.median(times["off"][1:]),
            "ring measured": statistics.median(times["ring"][1:]),
            "collective predicted": predicted_us["collective"] * 1e-6,
            "ring predicted": predicted_us["ring"] * 1e-6,
        }
    return out


def test_calibrate_predict_and_measure_give_well_formed_times(ranks, tmp_path):
    pool = ranks(N)
    measurements = pool.run(calibrate.measure, 5)[0]
    profile = calibrate.profile_from(measurements, N, "calibrated-test", "test_sim_validation")
    path = tmp_path / "profile.json"
    save(profile, path)
    per_rank = pool.run(_time_sites, str(path))
    print(f"\ncalibrated: {profile}")
    for label in SITES:
        for schedule in ("collective", "ring"):
            # the site ends when its slowest rank does; both ranks predict the same
            measured = max(r[label][f"{schedule} measured"] for r in per_rank)
            predicted = per_rank[0][label][f"{schedule} predicted"]
            assert all(r[label][f"{schedule} predicted"] == predicted for r in per_rank)
            assert 0 < measured < 60 and 0 < predicted < 60, (label, schedule)
            print(
                f"{label} {schedule:>10}: measured {measured * 1e3:7.2f} ms, "
                f"predicted {predicted * 1e3:7.2f} ms, error {predicted / measured - 1:+.0%}"
            )
