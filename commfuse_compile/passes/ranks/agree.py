"""The ranks' agreement on one graph: before any transfer of a rewritten graph runs, the
ranks of its groups compare what they compiled (``exchange.exchange``) and fall back
together where their programs could not run together.

Ranks need not compile the same graphs. A branch on the rank, a graph break or a
recompile on one rank, or a rank that runs the code uncompiled gives each rank graphs of
its own. Only those graphs keep their collectives; the graphs every rank compiled alike
are still compared and rewritten, on every rank alike:

* each graph is exchanged under its digest as it came (and how many graphs of that
  digest this rank exchanged before), so the graphs compiled alike pair whatever came
  before them on each rank;
* a graph not every rank of its groups compiles is given up on by the exchange's rules
  (at once when its ranks wait for graphs of their own, soon when they run other code
  after the group differed, else after ``exchange_timeout``): the first rank to decide
  sets the verdict in the store and every rank that compiled the graph takes it, then
  or later; one warning per group says what differed and how to find it;
* a recompiled graph (another digest) with the decisions and transfers of a graph the
  group agreed on (a float that became an input) runs as the group agreed then once
  its peers are seen running that one (``exchange.AGREED``), or is compared with theirs
  if they recompile it too.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

from torch.fx import Graph

from ...options import Options
from ...report import SiteRecord, log
from ...runtime import exchange, groups
from ..fx.declines import Declined, decline, failed
from . import sequence

_known: dict[str, tuple[int, Declined | None]] = {}  # transfers agreed on -> (digest, verdict)
_warned: set[str] = set()  # groups whose ranks were warned of graphs given up on
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


def agree(
    records: list[SiteRecord],
    planned: dict[str, tuple[groups.Group, dict[str, Any]]],
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
    exchange.watch_compiles(compiling=True)
    if not planned or not exchange.exchanging():
        return None
    started = time.perf_counter()
    try:
        if events is None:
            events = sequence.from_graph(graph, groups.ranks_of)
    except Exception as err:  # noqa: BLE001 - a fault of the reading: decline, never break
        failed(err, options.strict, "this graph's transfers are not compared across the ranks")
        events = None
    member_of = {g.name: g.ranks for g, _ in planned.values()}
    member_of |= {e.group: e.ranks for e in events or () if e.ranks}
    digest, ops = identity
    mine = {
        "inputs": _inputs(planned),
        "decisions": [[r.kind, r.decision, r.schedule] for r in records],
        "sequence": None if events is None else [e.as_json() for e in events],
    }
    # a recompiled graph (another digest) with the transfers of one the group agreed on:
    # peers that did not recompile run that one, and are seen running, not compiling
    # (``exchange``'s AGREED). The same graph compiled again is compared again: every
    # rank that compiles it exchanges, whatever its program.
    key = json.dumps([sorted(member_of), _renumbered(mine)], sort_keys=True)
    recompiled = key in _known and _known[key][0] != digest
    wait_s = options.exchange_timeout or min(map(groups.group_timeout_s, member_of)) / 2
    read = time.perf_counter()
    exchanged = exchange.exchange(
        {**mine, "ops": ops}, digest, member_of, wait_s, _difference, agreed_before=recompiled
    )
    if exchanged is None:
        return None
    exchanged_at = time.perf_counter()
    why = _given_up(exchanged.given_up)
    if why is None and exchanged.agreed:
        log.info("commfuse: a recompile with the transfers agreed on before: its verdict stands")
        return _known[key][1] if key in _known else _unmatched(member_of)
    if why is None:
        exchange.check_inputs(exchanged.seen)
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


def _inputs(planned: dict[str, tuple[groups.Group, dict[str, Any]]]) -> dict[str, list[Any]]:
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


def _given_up(given_up: dict[str, exchange.GivenUp]) -> Declined | None:
    """Why this graph keeps its collectives when some ranks of its groups did not come
    to it: they compiled graphs of their own, or none. The first time on a group, one
    warning says so (the decline of every later graph is in the report and the log)."""
    if not given_up:
        return None
    names = sorted(given_up)
    graphs = [g for g in names if given_up[g].rule == "graphs"]
    if graphs:
        why = decline(
            "compiler.rank_graphs", group=_named(graphs), detail=given_up[graphs[0]].detail
        )
    else:
        missing = sorted({r for g in given_up.values() for r in g.missing})
        why = decline(
            "compiler.rank_absent",
            group=_named(names),
            ranks=missing,
            why=_absence(given_up[names[0]]),
        )
    if set(names) <= _warned:
        log.info("commfuse: %s; this graph keeps its collectives", why.reason)
        return why
    _warned.update(names)
    warnings.warn(
        f"commfuse: {why.reason}. This graph keeps its collectives on every rank that "
        "compiled it; the graphs the ranks compile alike are still rewritten "
        f"(TORCH_LOGS=+commfuse logs each graph given up on): {HINT}",
        stacklevel=5,
    )
    return why


def _unmatched(member_of: dict[str, tuple[int, ...]]) -> Declined:
    """Why a graph falls back whose peers run one agreed on before, without this rank."""
    me = groups.this_rank()
    peers = sorted({r for ranks in member_of.values() for r in ranks} - {me})
    why = "they run a graph agreed on before, whose transfers this rank's do not match"
    return decline("compiler.rank_absent", group=_named(sorted(member_of)), ranks=peers, why=why)


def _absence(given_up: exchange.GivenUp) -> str:
    """Why ranks that compiled no graph of their own were given up on."""
    if given_up.rule == "grace":
        return (
            f"they ran other code for {given_up.waited_s:.0f} s, after the group's ranks "
            "were given up on before"
        )
    if given_up.rule == "again":
        return "they ran other code, as when the group's ranks were given up on before"
    return f"not within {given_up.waited_s:.0f} s (the option exchange_timeout)"


def _named(names: list[str]) -> str:
    return ", ".join(f"group {g!r}" for g in names) or "this graph's groups"


def _difference(payloads: dict[int, dict[str, Any]]) -> str:
    """Which ranks compiled what: the first op where a rank's graph differs from the
    lowest rank's."""
    ops = {r: p["ops"] for r, p in sorted(payloads.items())}
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
