"""Match stage: every site of a graph, of every kind, found before anything is rewritten.

Nothing here changes the graph. A found site either carries what the lowering needs, or
the reason it cannot be rewritten (``Site.declined``). Each kind matches from its
collective, looking only at the nodes around it (``kinds/``); a collective two kinds
match is claimed by one of them (``_settled``), and a collective no kind claims (one that
touches no matmul) is a declined site of its own (``kinds/unclaimed.py``), so that every
collective has its record.
"""

from __future__ import annotations

import dataclasses

from torch.fx import Graph, Node

from .fx.declines import decline
from .fx.matmuls import is_matmul
from .kinds import KINDS, of, unclaimed
from .kit.rewrite import Taken
from .kit.site import Site


def find_sites(graph: Graph) -> list[Site]:
    """Every site of the graph (a declined one for each collective no kind claims), in
    graph order, except that sites sharing a matmul with an earlier site that can nest,
    on another group (a 2-D matmul: both operands gathered, or gathered and
    reduce-scattered, one on each dim of a mesh), come first: the site rewritten first
    splits the matmul by the steps of its ring, and the nesting one runs inside that
    ring's first window. (On one group the blocks of the two would have to line up
    instead: the first site takes the matmul.)"""
    found = _settled([site for kind in KINDS.values() for site in kind.find(graph)])
    found += unclaimed.declined_sites(graph, {c for site in found for c in site.collectives})
    return _nesting_last(sorted(found, key=lambda s: s.anchor._sort_key))


def _settled(sites: list[Site]) -> list[Site]:
    """``sites`` (in ``KINDS`` order) with every collective claimed once: where two
    kinds' sites share a collective, the first kind's site that matched (one declined as
    found only where none did) keeps it, and the others are declined ``site.claimed``."""
    owner: dict[Node, Site] = {}
    for site in sorted(sites, key=lambda s: s.declined is not None):  # stable: KINDS order
        for collective in site.collectives:
            owner.setdefault(collective, site)
    settled = []
    for site in sites:
        winner = next((owner[c] for c in site.collectives if owner[c] is not site), None)
        if winner is not None:
            taken = next(c for c in site.collectives if owner[c] is winner)
            why = decline("site.claimed", collective=taken.name, winner=winner.kind)
            site = dataclasses.replace(site, declined=why.kept())
        settled.append(site)
    return settled


def _nesting_last(sites: list[Site]) -> list[Site]:
    """``sites`` in groups that share matmuls through a nesting site, each group where
    its first site stood, latest site first."""
    parent = list(range(len(sites)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    first_reader: dict[Node, int] = {}
    for i, site in enumerate(sites):
        for node in site.replaced():
            if is_matmul(node):
                j = first_reader.setdefault(node, i)
                if j != i and of(sites[j]).nests and sites[j].group_name != site.group_name:
                    parent[root(i)] = root(j)
    groups: dict[int, list[Site]] = {}
    for i, site in enumerate(sites):
        groups.setdefault(root(i), []).append(site)
    return [site for group in groups.values() for site in reversed(group)]


def rematch(site: Site, taken: Taken) -> Site:
    """``site`` matched again where it stands, after other sites were rewritten (their
    results may now be its operands, or its matmul may be one they took: ``taken``)."""
    again = of(site).rematch(site, taken)
    if again is None:  # pragma: no cover - a site's collective keeps its matmul neighbour
        return dataclasses.replace(site, declined=decline("site.lost").kept())
    return again
