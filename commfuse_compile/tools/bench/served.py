"""``commfuse bench``'s served cells: plain tensor parallelism as a server runs it.

A served plain-TP block's sublayer (the ``mm_ar_mm`` cell: the down-projection's partial
sums all-reduced, the residual added and RMSNorm'd, the next up-projection) at the
token counts of a prefill (one prompt of each length: what time to first token is made
of) and of a decode step (one token per sequence of each batch: time per output
token), all on one throttled link, as a server runs on one: its rate is chosen once,
so that the middle prompt's all-reduce alone takes ``ratio`` times its matmuls. Every
row (``off``, each schedule with steps for the split all-reduce, ``auto``) is measured
per token count as ``cells.measure_site`` measures a cell; ``auto`` decides on the
profile calibrated on this link. A token count the ranks do not divide is rounded down
to one they do (``SiteShape.fitted``), as every cell's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from . import figures
from .cells import SiteJob, measure_site
from .config import SERVED_SITE, Progress, ServedBench, SiteShape, Variant
from .link import LinkProfiles, choose_rate


def run_served(
    spec: ServedBench,
    network: Any,
    ranks: Any,
    base: LinkProfiles,
    rows: list[Variant],
    reps: tuple[int, int, float],
    out: Path,
    progress: Progress,
) -> dict[str, Any]:
    """Every served cell on one link rate; ``reps``: warm-up and timed calls per row, and
    the least time they are timed over."""
    n = ranks.world_size
    middle = SiteShape(spec.prompts[len(spec.prompts) // 2], spec.dim, spec.ffn)
    middle = middle.fitted(n, SERVED_SITE)
    rate, tries = math.inf, list[dict[str, float]]()
    if network.topology != "none":
        progress.stage(f"served: choosing the link rate ({middle.label}, ratio {spec.ratio:g})")
        rate, tries = choose_rate(network, ranks, SERVED_SITE, middle, spec.ratio, reps[1])
    profile = base.file(rate, out / "profiles" / "served.json")
    cells = []
    for phase, shape in spec.shapes():
        shape = shape.fitted(n, SERVED_SITE)
        progress.stage(f"served {phase} {shape.seq} tokens: {len(rows) + 4} rows")
        job = SiteJob(SERVED_SITE, shape, tuple(rows), profile, *reps)
        per_rank = ranks.run(measure_site, job)
        cell = figures.site_cell(SERVED_SITE, shape, spec.ratio, rate, [], per_rank, rows, n)
        cells.append({"phase": phase, "tokens": shape.seq, **cell})
        progress.echo(figures.format_cell(cell))
    return {
        "dim": spec.dim,
        "ffn": spec.ffn,
        "rate_bits_per_s": rate if math.isfinite(rate) else None,
        "rate_tries": tries,
        "cells": cells,
    }
