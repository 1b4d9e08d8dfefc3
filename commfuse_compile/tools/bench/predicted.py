"""The cost model's time of a row's whole program, the bench's ``predicted`` column.

A row runs more than its site: the dropless MoE cell exchanges its token counts, reads
them back as splits and sorts its rows by expert before the site; the plain-TP cell adds
the residual and RMSNorms it between its matmuls. Each part is priced as the model
prices it where ``auto`` decides: a rewritten site at its schedule's prediction, a site
kept as written at its collective then its matmuls, and what no site holds op by op (a
matmul at its FLOPs and the weight it reads, a collective as the plan times one, an
op that moves data at its bytes, ``Profile.memory_op_s``). Measured before this: the
dropless cells' rows spent 1.2 of 3.8 ms outside their matmuls and collectives, which
the model left out (-37 to -50 %).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from ... import report
from ...cost.profiles import Profile, for_device, load
from ...options import Options
from ...passes import match, plan
from ...passes.fx.graph import moved_bytes, nbytes
from ...passes.fx.matmuls import flops_of, rate_class_of, weight_bytes_of
from .sites import SiteProgram


def program_us(
    gm: torch.fx.GraphModule, records: Sequence[report.SiteRecord], profile: str | None
) -> float | None:
    """``gm`` (a row's program: the pass applied, ``records`` its sites) as the model
    times it, one op after another; None where a rewritten site has no prediction."""
    rewritten = [r.predicted_us.get(r.schedule) for r in records if r.decision == "rewritten"]
    if None in rewritten:
        return None
    options = Options(schedule="auto", inner="eager", profile=profile)
    kept = [
        (site, times)
        for site in match.find_sites(copy.deepcopy(gm).graph)
        if (times := plan.site_times(site, options)) is not None
    ]
    held = {node.name for site, _ in kept for node in site.replaced()}
    p = load(profile) if profile is not None else for_device("cpu")
    outside = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name in held or "commfuse" in node.meta:
            continue  # a kept site's, or emitted by a rewritten site (its prediction)
        if (flops := flops_of(node)) > 0:
            outside += p.matmul_s(flops, weight_bytes_of(node), rate_class_of(node))
        elif node.target in plan.TIMED_COLLECTIVES:
            outside += plan.collective_seconds(node, nbytes(node.all_input_nodes[0]), p)
        elif isinstance(node.target, torch._ops.OpOverload):
            outside += p.memory_op_s(moved_bytes(node))
    kept_s = sum(t.written_s for _, t in kept)
    return sum(r or 0.0 for r in rewritten) + (kept_s + outside) * 1e6


def matmul_alone_s(site: SiteProgram, p: Profile) -> float:
    """The model's time of a cell's matmul alone (``SiteProgram.matmul``)."""
    calls = site.calls
    return calls * p.matmul_s(site.flops / calls, site.weight_bytes / calls, site.matmul_class)
