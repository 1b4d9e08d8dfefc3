"""The site kinds the pass knows, one module each, longest pattern first (``unclaimed``:
the declined sites of collectives none of them claims, not a kind)."""

from __future__ import annotations

from typing import Any

from ..site import Site
from ..site_kind import SiteKind
from . import a2a_mm, ag_mm, mm_a2a, mm_ar, mm_rs, moe

KINDS: dict[str, SiteKind[Any]] = {
    kind.name: kind
    for kind in (moe.KIND, ag_mm.KIND, mm_rs.KIND, a2a_mm.KIND, mm_a2a.KIND, mm_ar.KIND)
}


def of(site: Site) -> SiteKind[Any]:
    return KINDS[site.kind]
