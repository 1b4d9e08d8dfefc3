"""The split on the joint graph: plain tensor parallelism turned into sequence
parallelism, forward and backward, before AOTAutograd partitions a training graph.

AOTAutograd traces a training step as one joint graph (forward and backward), then a
partitioner cuts it in two and decides which forward values the backward reads (saved,
or recomputed). Split there (``shard_tokens``), plain TP's all-reduces become what
hand-written sequence parallelism runs in *both* directions:

    # forward                                # backward
    y = reduce_scatter(x @ w_o)              g = reduce_scatter(dq @ w_q + dk @ w_k + ...)
    h = norm(residual[rows] + y)             dh = norm_backward(g, h, ...)   # 1/n tokens
    q = all_gather(h) @ w_q                  do = all_gather(dh + ...) @ w_o.T

and what the backward reads of the token-wise region (the residual, the norm's
statistics, its input) is the rank's shard: the partitioner saves shards. Split after
partitioning instead, those values would stay whole, saved or gathered again.

Entry points: ``partition`` (the backend's partition function, around the partitioner
AOTAutograd would use) and ``JointPass`` (Inductor's ``joint_custom_pre_pass`` slot, for
``backend="commfuse"`` with Inductor and for ``install_inductor_pass``). The ranks agree
on the split before any rank keeps it (``agree``): each sends the joint graph's digest
as it came and which all-reduces it split; where they differ, no rank splits. What the
split decided rides on the nodes' meta into the forward and backward graphs, which the
pipeline then rewrites as any other (``mm_rs`` and ``ag_mm`` sites; all-reduces left
whole say why, and are not split again there).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, GraphModule

from ..options import Options
from ..report import REPORT, SiteRecord, dump_code, log
from ..runtime import groups
from . import plan
from .fx.declines import Declined, decline, failed
from .kit.rewrite import graph_digest
from .prepare import shard_tokens
from .prepare.canonical import canonicalize
from .ranks import agree

SLOT = "joint_custom_pre_pass"  # Inductor's config: passes on the joint graph, first
META = shard_tokens.META
DONE = "commfuse_joint"  # GraphModule.meta key: the joint graph was seen (the split's count)


def is_joint(graph: Graph) -> bool:
    """A graph with both halves: AOTAutograd names the backward's incoming gradients
    ``tangents_*`` (an inference graph, or a forward or backward alone, has none or no
    primals)."""
    names = [p.name for p in graph.find_nodes(op="placeholder")]
    return any(n.startswith("tangents") for n in names) and any(
        n.startswith("primals") for n in names
    )


def split_joint(gm: GraphModule, options: Options) -> int:
    """Split ``gm``'s all-reduces in place where the plan and the ranks agree; returns
    how many were split. Never raises: a fault warns and leaves the graph as it was
    (the forward and backward graphs are then rewritten as they come)."""
    if DONE in gm.meta or not is_joint(gm.graph) or options.schedule == "off":
        return gm.meta.get(DONE, 0)
    gm.meta[DONE] = 0
    if not gm.graph.find_nodes(op="call_function", target=shard_tokens.ALL_REDUCE):
        return 0  # nothing to split (in-place spellings traced as a functional all-reduce)
    came = copy.deepcopy(gm.graph)
    identity = (graph_digest(gm.graph), agree.graph_ops(gm.graph))
    try:
        gm.meta[DONE] = _split_agreed(gm, options, identity)
    except Exception as err:  # noqa: BLE001 - never break the user's compile
        gm.graph = came
        failed(err, options.strict, "the joint graph left as it was")
        return 0
    gm.recompile()
    if gm.meta[DONE]:
        index = REPORT.new_graph(options.described())
        dump_code(options.debug_dir, index, "joint", "before", lambda: came.python_code("self").src)
        dump_code(options.debug_dir, index, "joint", "after", lambda: gm.code)
    return gm.meta[DONE]


def _split_agreed(gm: GraphModule, options: Options, identity: tuple[int, list[str]]) -> int:
    """Canonical form, then the split; kept if every rank split alike, else the canonical
    graph with every all-reduce marked as left whole. The ranks exchange only where this
    one split: a rank that split waits for its peers' split; one whose peers compiled
    another graph is seen waiting on another exchange (``agree``)."""
    canonicalize(gm.graph, before_change=lambda: None)
    canonical = copy.deepcopy(gm.graph)
    candidates = [n.name for n in _all_reduces(gm.graph)]
    if not shard_tokens.split_planned(gm, options, lambda: None):
        return 0  # every rank with this graph and these options leaves it so
    left = {n.name for n in _all_reduces(gm.graph) if "not_split" in n.meta.get(META, {})}
    split = [name for name in candidates if name not in left]
    why = _disagreement(gm.graph, candidates, split, options, identity)
    if why is not None:
        gm.graph = canonical
        for node in _all_reduces(canonical):
            node.meta.setdefault(META, shard_tokens.not_split(why, node))
        split = []
    log.info(
        "commfuse: joint graph: %d of %d all-reduces split into sequence parallelism%s",
        len(split),
        len(candidates),
        "" if why is None else f" ({why.reason})",
    )
    return len(split)


def _all_reduces(graph: Graph) -> list[Any]:
    return [n for n in graph.find_nodes(op="call_function", target=shard_tokens.ALL_REDUCE)]


def _disagreement(
    graph: Graph,
    candidates: list[str],
    split: list[str],
    options: Options,
    identity: tuple[int, list[str]],
) -> Declined | None:
    """Why the ranks cannot keep this split: their joint graphs or their splits differ
    (``agree``), the same verdict on every rank. Each all-reduce is a record, "rewritten"
    where it was split."""
    records = [
        SiteRecord(kind="mm_ar", graph="joint", decision="rewritten" if n in split else "declined")
        for n in candidates
    ]
    planned: dict[str, tuple[groups.Group, dict[str, Any]]] = {}
    for i, node in enumerate(_all_reduces(graph)):
        group = groups.resolve(node.args[2], len(groups.ranks_of(str(node.args[2]))))
        planned[str(i)] = (group, plan.decision_inputs(options, plan.profile_of(node, options)))
    why = agree.agree(records, planned, graph, identity, options)
    if why is None:
        return None
    return decline("split.ranks", detail=why.reason)


def partition(
    joint: GraphModule,
    joint_inputs: Sequence[Any],
    *,
    options: Options,
    partitioner: Callable[..., tuple[GraphModule, GraphModule]],
    **kwargs: Any,
) -> tuple[GraphModule, GraphModule]:
    """AOTAutograd's partition function: the split, then ``partitioner``."""
    split_joint(joint, options)
    return partitioner(joint, joint_inputs, **kwargs)


class JointPass(CustomGraphPass):
    """The split, as Inductor's ``joint_custom_pre_pass``: Inductor runs the slot on
    every graph before its own joint-graph patterns, inference graphs included (left
    alone here)."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, graph: Graph) -> None:
        gm = graph.owning_module
        if isinstance(gm, GraphModule):
            split_joint(gm, self.options)

    def uuid(self) -> None:
        """None: Inductor's and AOTAutograd's caches are bypassed (a cached program
        would skip the split and the ranks' agreement)."""
        return None

    def __repr__(self) -> str:
        return f"JointPass({self.options.described()})"


@contextlib.contextmanager
def in_inductor(options: Options) -> Iterator[None]:
    """Inductor's joint-graph slot with the split added (replacing any installed one,
    whose options these override), for one compile; a user's own passes stay first."""
    kept = [p for p in slot_passes(getattr(inductor_config, SLOT)) if not isinstance(p, JointPass)]
    with inductor_config.patch({SLOT: slot_value([*kept, JointPass(options)])}):
        yield


def slot_passes(slot: Any) -> list[Any]:
    """An Inductor custom-pass slot's passes: it holds None, one pass, or a list or tuple."""
    if slot is None:
        return []
    return list(slot) if isinstance(slot, (list, tuple)) else [slot]


def slot_value(passes: list[Any]) -> Any:
    """The slot as Inductor reads it: None, the one pass, or the list."""
    return None if not passes else passes[0] if len(passes) == 1 else passes
