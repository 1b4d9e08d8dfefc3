"""The site kinds the pass knows, one module or package each, longest pattern first: the
one registry of their names, the matmul roles each gives its uses, and their classes
(``unclaimed``: the declined sites of collectives none of them claims, not a kind)."""

from __future__ import annotations

from typing import Any

from ...options import CommfuseOptionError, Options, where
from ...schedules import NAMES
from ..kit.site import Site
from ..kit.site_kind import SiteKind
from . import a2a_mm, ag_mm, mm_a2a, mm_ar, mm_rs, moe

KINDS: dict[str, SiteKind[Any]] = {
    kind.name: kind
    for kind in (moe.KIND, ag_mm.KIND, mm_rs.KIND, a2a_mm.KIND, mm_a2a.KIND, mm_ar.KIND)
}
EVERY_ROLE = tuple(dict.fromkeys(role for kind in KINDS.values() for role in kind.roles))
# What ``disable`` can switch off, for bisecting: site kinds, matmul roles, schedules, and
# the merging of the collectives the sites leave in place (``passes/bucket.py``).
DISABLEABLE = (*KINDS, *EVERY_ROLE, *NAMES, "bucket")


def of(site: Site) -> SiteKind[Any]:
    return KINDS[site.kind]


def check_disable(options: Options) -> Options:
    """``options``, if every name its ``disable`` gives is something to switch off."""
    unknown = sorted(options.disable - set(DISABLEABLE))
    if unknown:
        origin = dict(options.origins).get("disable", "option")
        raise CommfuseOptionError(
            f"commfuse: {where('disable', origin)}: cannot disable {unknown}; "
            f"names are {list(DISABLEABLE)}"
        )
    return options
