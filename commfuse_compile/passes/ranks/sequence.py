"""A rank's transfers in program order, and whether the ranks' programs, run together,
complete.

Each rank runs its own compiled program. Inductor may fuse and order independent work
differently on different ranks (a rank's own block sits at another offset), so two
ranks can start the rings of two independent sites in opposite orders. Nothing is
wrong with either program alone; together they hang. The pass pins one order of starts
(``order.keep_order``); this module checks what the compiler produced:

* ``Event``: one start or wait of a transfer (a P2P op or a collective), read from the
  generated code (``program.check``) or from the FX graph (eager execution);
* ``digest``: the order of starts with everything rank-specific left out (peers, group
  names, line numbers): every rank of a job must have the same one;
* ``simulate``: the ranks' sequences run together under the transport's rule. A start
  never blocks; a P2P op's wait completes once every peer has started the matching
  receive or send (same tag, n-th with n-th, as gloo and NCCL match them); a
  collective's wait completes once every rank of its group has started its n-th
  collective on that group. If no rank can move and some have not finished, the
  programs deadlock: ``Stuck`` names who waits on what.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch.fx import Graph, Node

from ..fx.collectives import P2P, WAIT_TENSOR, is_transfer_start

START, WAIT = "start", "wait"


@dataclasses.dataclass(frozen=True)
class Event:
    """One start or wait of transfer ``transfer`` (numbered per rank, by start)."""

    action: str  # START or WAIT
    transfer: int
    label: str  # "site 0.3 step 1 (ag_mm)", or a collective's op name
    group: str = ""  # the process group's name
    tag: int | None = None  # P2P only
    sends: tuple[int, ...] = ()  # P2P: global ranks sent to
    recvs: tuple[int, ...] = ()  # P2P: global ranks received from
    ranks: tuple[int, ...] = ()  # a collective: its group's global ranks

    def as_json(self) -> list[Any]:
        return [
            self.action,
            self.transfer,
            self.label,
            self.group,
            self.tag,
            list(self.sends),
            list(self.recvs),
            list(self.ranks),
        ]

    @classmethod
    def from_json(cls, item: Sequence[Any]) -> Event:
        action, transfer, label, group, tag, sends, recvs, ranks = item
        return cls(action, transfer, label, group, tag, tuple(sends), tuple(recvs), tuple(ranks))


def digest(events: Iterable[Event]) -> list[str]:
    """The order of starts as every rank must share it: which transfer, not with whom."""
    return [e.label for e in events if e.action == START]


_SITE = re.compile(r"\bsite \d+\.(\d+)")


def renumbered(labels: Sequence[str]) -> list[str]:
    """``labels`` without their graph's number in the site ids (``report.site_id``): the
    sites of one graph are numbered alike on every rank, the graph by how many this
    process compiled before (a rank that recompiled one numbers it otherwise)."""
    return [_SITE.sub(r"site *.\1", label) for label in labels]


def first_divergence(digests: Mapping[int, Sequence[str]]) -> tuple[int, int, int] | None:
    """``(position, rank, other rank)`` of the first start where two ranks differ, or None
    (site ids without their graph's number: ``renumbered``)."""
    ranks = sorted(digests)
    first = renumbered(digests[ranks[0]])
    for rank in ranks[1:]:
        other = renumbered(digests[rank])
        for i in range(max(len(first), len(other))):
            if i >= len(first) or i >= len(other) or first[i] != other[i]:
                return i, ranks[0], rank
    return None


def divergence_text(digests: Mapping[int, Sequence[str]], where: tuple[int, int, int]) -> str:
    i, a, b = where

    def at(rank: int) -> str:
        items = digests[rank]
        return repr(items[i]) if i < len(items) else "nothing more"

    return f"start {i}: rank {a} starts {at(a)}, rank {b} starts {at(b)}"


@dataclasses.dataclass(frozen=True)
class Stuck:
    """The ranks' programs cannot all finish: each rank listed waits on ``waiting``."""

    waiting: dict[int, str]  # rank -> the label of the transfer it cannot complete

    def __str__(self) -> str:
        return "; ".join(f"rank {r} waits on {label}" for r, label in sorted(self.waiting.items()))


def simulate(programs: Mapping[int, Sequence[Event]]) -> Stuck | None:
    """Run every rank's sequence together (see the module's docstring); None if all
    finish. Cost: linear in the events (each is passed once per round, rounds are few)."""
    needs = _needs(programs)
    started: set[tuple[int, int]] = set()
    position = dict.fromkeys(programs, 0)
    moved = True
    while moved:
        moved = False
        for rank, events in programs.items():
            while position[rank] < len(events):
                event = events[position[rank]]
                key = (rank, event.transfer)
                if event.action == WAIT and not all(n in started for n in needs[key]):
                    break
                if event.action == START:
                    started.add(key)
                position[rank] += 1
                moved = True
    waiting = {
        rank: events[position[rank]].label
        for rank, events in programs.items()
        if position[rank] < len(events)
    }
    return Stuck(waiting) if waiting else None


_NEVER = (-1, -1)  # a counterpart no rank starts: its wait can never complete


def _needs(programs: Mapping[int, Sequence[Event]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(rank, transfer) -> the starts on other ranks its wait needs."""
    p2p: dict[tuple[str, int, int, int | None], list[int]] = collections.defaultdict(list)
    collectives: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    nth: dict[tuple[int, int], int] = {}  # (rank, collective) -> its index on its group
    for rank, events in programs.items():
        for e in events:
            if e.action != START:
                continue
            if e.ranks:
                nth[(rank, e.transfer)] = len(collectives[(e.group, rank)])
                collectives[(e.group, rank)].append(e.transfer)
            for peer in e.sends:
                p2p[("send", rank, peer, e.tag)].append(e.transfer)
            for peer in e.recvs:
                p2p[("recv", peer, rank, e.tag)].append(e.transfer)
    needs: dict[tuple[int, int], list[tuple[int, int]]] = collections.defaultdict(list)
    for (direction, src, dst, tag), transfers in p2p.items():
        other = p2p.get(("recv" if direction == "send" else "send", src, dst, tag), [])
        me, peer = (src, dst) if direction == "send" else (dst, src)
        for i, transfer in enumerate(transfers):
            needs[(me, transfer)].append((peer, other[i]) if i < len(other) else _NEVER)
    for rank, events in programs.items():
        for e in events:
            if e.action != START or not e.ranks:
                continue
            index = nth[(rank, e.transfer)]
            for member in e.ranks:
                theirs = collectives.get((e.group, member), [])
                in_job = member in programs and index < len(theirs)
                needs[(rank, e.transfer)].append((member, theirs[index]) if in_job else _NEVER)
    return needs


def from_graph(graph: Graph, group_ranks: Callable[[str], tuple[int, ...]]) -> list[Event]:
    """The sequence of a graph executed node by node (eager FX): starts at P2P ops and
    functional collectives, waits at the ``wait_tensor`` of a transfer's tensor."""
    events: list[Event] = []
    pending: dict[Node, list[Event]] = collections.defaultdict(list)  # tensor -> transfers
    for node in graph.nodes:
        if node.target is WAIT_TENSOR:
            tensor = node.args[0]
            if tensor.target is operator.getitem and tensor.args[0].target is P2P:
                tensor = tensor.args[0]
            events += [dataclasses.replace(e, action=WAIT) for e in pending.pop(tensor, [])]
            continue
        if not is_transfer_start(node):
            continue
        if node.target is P2P:
            sends, send_peers, _, recv_peers, tag, group, label, *_ = node.args
            event = Event(
                START, len(events), label, group, tag, tuple(send_peers), tuple(recv_peers)
            )
            for tensor in [*sends, node]:
                pending[tensor].append(event)
        else:
            group = next(a for a in reversed(node.args) if isinstance(a, str))
            event = Event(START, len(events), node.target._opname, group, ranks=group_ranks(group))
            pending[node].append(event)
        events.append(event)
    return events
