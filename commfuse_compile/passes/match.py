"""Match stage: every site of a graph, of every kind, found before anything is rewritten.

Nothing here changes the graph. A found site either carries what the lowering needs, or
the reason it cannot be rewritten (``Site.declined``); collectives that touch no matmul
are not sites at all. Each kind matches from its collective, looking only at the nodes
around it (``kinds/``).
"""

from __future__ import annotations

import dataclasses

from torch.fx import Graph

from .declines import decline
from .kinds import KINDS, of
from .site import Site


def find_sites(graph: Graph) -> list[Site]:
    """Every site of the graph, in graph order."""
    found = [site for kind in KINDS.values() for site in kind.find(graph)]
    return sorted(found, key=lambda s: s.anchor._sort_key)


def rematch(site: Site) -> Site:
    """``site`` matched again where it stands, after other sites were rewritten (their
    results may now be its operands, or its matmul may be one they took)."""
    again = of(site).rematch(site)
    if again is None:  # pragma: no cover - a site's collective keeps its matmul neighbour
        return dataclasses.replace(site, declined=decline("site.lost").kept())
    return again
