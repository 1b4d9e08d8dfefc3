"""The site kinds by name, with the matmul roles each gives its uses (and so can leave
out of a site): the names the ``disable`` option takes, declared once below the pass
(``passes.kinds`` implements the kinds; a test holds the two together)."""

from __future__ import annotations

ROLES: dict[str, tuple[str, ...]] = {
    "moe": (),
    "ag_mm": ("rows", "contract", "columns", "contract_left", "contract_k"),
    "mm_rs": (),
    "a2a_mm": ("rows", "contract", "columns", "contract_left"),
    "mm_a2a": (),
    "mm_ar": (),
}
EVERY_ROLE = tuple(dict.fromkeys(role for roles in ROLES.values() for role in roles))
