"""The ranks' agreement on one graph: before any transfer of a rewritten graph runs, the
ranks of its groups compare what they compiled (``groups.exchange``) and fall back
together where their programs could not run together.

Ranks need not compile the same graphs. A graph break or a recompile that depends on
the rank (logging on rank 0 inside the model, as Megatron-Core does; a guard that fails
on one rank) gives each rank its own graphs. Three rules keep such a job running as it
would without the pass, on every rank alike:

* graphs that differ are seen at once by their digests (the n-th exchange on a group
  pairs each rank's n-th graph on it): every rank falls back, and the group is marked
  diverged on every rank of it, from the same exchange;
* a rank that never comes is waited for at most ``exchange_timeout`` (half the group's
  timeout by default, so that a peer blocked meanwhile in a collective outlasts the
  wait); the first rank to give up sets the verdict in the store and every rank that
  reads that exchange, then or later, takes it;
* on a diverged group, sites keep their collectives without any exchange
  (``site.ranks_diverged``); and a recompiled graph (another digest) with the
  decisions and transfers of a graph the group agreed on (a float that became an
  input) runs as the group agreed then, without waiting for peers that never compile it.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

from torch.fx import Graph

from ..options import Options
from ..report import SiteRecord, log
from ..runtime import groups
from . import sequence
from .declines import Declined, decline

_known: dict[str, tuple[int, Declined | None]] = {}  # transfers agreed on -> (digest, verdict)
WARNED = frozenset({"compiler.rank_graphs", "compiler.rank_absent"})  # warned here
HINT = (
    "a graph break or recompile that depends on the rank (rank-0-only logging or "
    "warnings, a branch on the rank), or code compiled on some ranks only, gives the "
    "ranks different graphs; find it with TORCH_LOGS=graph_breaks,recompiles and keep "
    "rank-dependent Python out of compiled code (or list the logging function in "
    "torch._dynamo.config.reorderable_logging_functions)"
)


def graph_ops(graph: Graph) -> list[str]:
    """The graph's ops in order, as a warning names the first that differs."""
    return [
        getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else n.op
        for n in graph.nodes
    ]


def check_group(name: str) -> None:
    """Decline a site on a group whose ranks compiled different graphs earlier."""
    why = groups.diverged(name)
    if why is not None:
        raise decline("site.ranks_diverged", group=name, why=why)


def agree(
    records: list[SiteRecord],
    planned: dict[int, tuple[groups.Group, dict[str, Any]]],
    graph: Graph,
    identity: tuple[int, list[str]],
    options: Options,
    events: list[sequence.Event] | None = None,
) -> Declined | None:
    """Compare this graph across the ranks of its groups: they must have been given the
    same inputs (else ``RankMismatchError``), have compiled the same graph, have decided
    alike, start their transfers in one order, and their programs run together must
    complete (``sequence.simulate``). ``planned``: site id -> its group and what its
    decision depended on besides the graph; ``identity``: the graph's digest and ops as
    it came; ``events``: the compiled program's transfers, if it was read, else the
    graph's in node order. Returns why the graph falls back, the same on every rank."""
    if not planned or not groups.exchanging():
        return None
    started = time.perf_counter()
    try:
        if events is None:
            events = sequence.from_graph(graph, groups.ranks_of)
    except Exception as err:  # noqa: BLE001 - a fault of the reading: decline, never break
        log.warning("commfuse: cannot read this graph's transfers: %s", err)
        events = None
    member_of = {g.name: g.ranks for g, _ in planned.values()}
    member_of |= {e.group: e.ranks for e in events or () if e.ranks}
    member_of = {g: r for g, r in member_of.items() if groups.diverged(g) is None}
    digest, ops = identity
    mine = {
        "inputs": _inputs(planned),
        "decisions": [[r.kind, r.decision, r.schedule] for r in records],
        "sequence": None if events is None else [e.as_json() for e in events],
    }
    # a recompiled graph (another digest) with the transfers of one the group agreed on:
    # peers that did not recompile run that one. The same graph compiled again is
    # compared again: every rank that compiles it exchanges, whatever its program.
    key = json.dumps([sorted(member_of), _renumbered(mine)], sort_keys=True)
    if key in _known and _known[key][0] != digest:
        log.info("commfuse: a recompile with the transfers agreed on before: its verdict stands")
        return _known[key][1]
    wait_s = options.exchange_timeout or min(map(groups.group_timeout_s, member_of)) / 2
    read = time.perf_counter()
    exchanged = groups.exchange({**mine, "digest": digest, "ops": ops}, member_of, wait_s)
    if exchanged is None:
        return None
    exchanged_at = time.perf_counter()
    why = _diverging(exchanged, member_of, wait_s)
    if why is None:
        groups.check_inputs(exchanged.seen)
        why = _verdict(exchanged.seen)
        _known[key] = (digest, why)
    log.info(
        "commfuse: ranks %s: %d transfer events read in %.1f ms, exchanged in %.1f ms "
        "(waiting for the slowest rank's compile), compared in %.1f ms: %s",
        sorted(exchanged.seen),
        len(events or ()),
        (read - started) * 1e3,
        (exchanged_at - read) * 1e3,
        (time.perf_counter() - exchanged_at) * 1e3,
        "ok" if why is None else why.reason,
    )
    return why


def _inputs(planned: dict[int, tuple[groups.Group, dict[str, Any]]]) -> dict[str, list[Any]]:
    """What the sites' decisions depended on besides the graph, merged over the sites."""
    merged: dict[str, list[Any]] = {}
    for _, site_inputs in planned.values():
        for k, v in site_inputs.items():
            merged[k] = sorted({*merged.get(k, []), v})
    return merged


def _renumbered(mine: dict[str, Any]) -> dict[str, Any]:
    """``mine`` without this process's site numbering, which a recompile advances."""
    if mine["sequence"] is None:
        return mine
    labels = sequence.renumbered([e[2] for e in mine["sequence"]])
    events = [
        [e[0], e[1], label, *e[3:]] for e, label in zip(mine["sequence"], labels, strict=True)
    ]
    return {**mine, "sequence": events}


def _diverging(
    exchanged: groups.Exchanged, member_of: dict[str, tuple[int, ...]], wait_s: float
) -> Declined | None:
    """Why the ranks cannot compare this graph at all: one of them did not come in time,
    or they compiled different graphs. Each of this rank's groups where that happened
    is marked diverged (its other ranks read the same exchange and mark it too); one
    warning says what differed and what follows."""
    seen, absent = exchanged.seen, exchanged.absent
    if absent:
        names = sorted(absent)
        missing = sorted({r for a in absent.values() for r in a})
        why = decline("compiler.rank_absent", group=_named(names), ranks=missing, wait_s=wait_s)
    elif len({s["digest"] for s in seen.values()}) > 1:
        names = [g for g, ranks in member_of.items() if len({seen[r]["digest"] for r in ranks}) > 1]
        ranks = sorted({r for g in names for r in member_of[g]} or seen)
        why = decline("compiler.rank_graphs", group=_named(names), detail=_difference(seen, ranks))
    else:
        return None
    marked = [g for g in names if g in member_of and groups.mark_diverged(g, why.reason)]
    if marked:
        warnings.warn(
            f"commfuse: {why.reason}. The sites on {_named(marked)} keep their collectives "
            f"from now on, on every rank: {HINT}",
            stacklevel=5,
        )
    return why


def _named(names: list[str]) -> str:
    return ", ".join(f"group {g!r}" for g in names) or "this graph's groups"


def _difference(seen: dict[int, dict[str, Any]], ranks: Any) -> str:
    """Which ranks compiled what: the first op where two ranks' graphs differ."""
    ops = {r: seen[r]["ops"] for r in ranks}
    first = min(ops)
    for rank in sorted(ops):
        theirs, base = ops[rank], ops[first]
        for i in range(max(len(base), len(theirs))):
            a = base[i] if i < len(base) else "nothing more"
            b = theirs[i] if i < len(theirs) else "nothing more"
            if a != b:
                return (
                    f"rank {first}: {len(base)} ops, rank {rank}: {len(theirs)} ops; first "
                    f"difference at op {i}: rank {first} {a}, rank {rank} {b}"
                )
    return "the same ops with other shapes or dtypes"


def _verdict(seen: dict[int, dict[str, Any]]) -> Declined | None:
    """Why the ranks' programs cannot run together, from every rank's exchange."""
    if not any(d[1] == "rewritten" for s in seen.values() for d in s["decisions"]):
        return None  # nothing of the pass's runs: the graphs as they came
    decisions = {r: s["decisions"] for r, s in seen.items()}
    differ = sorted(r for r, d in decisions.items() if d != decisions[min(decisions)])
    if differ:
        detail = "; ".join(f"rank {r}: {decisions[r]}" for r in [min(decisions), *differ])
        return decline("compiler.rank_decisions", ranks=differ, detail=detail[:600])
    unread = sorted(r for r, s in seen.items() if s["sequence"] is None)
    if unread:
        return decline("compiler.unverifiable", error=f"ranks {unread} could not read theirs")
    programs = {r: [sequence.Event.from_json(e) for e in s["sequence"]] for r, s in seen.items()}
    digests = {r: sequence.digest(events) for r, events in programs.items()}
    where = sequence.first_divergence(digests)
    if where is not None:
        return decline("compiler.rank_order", detail=sequence.divergence_text(digests, where))
    stuck = sequence.simulate(programs)
    if stuck is not None:
        return decline("compiler.rank_deadlock", detail=str(stuck)[:600])
    return None
