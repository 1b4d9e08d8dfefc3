"""The site kinds by name, with the matmul roles each can leave out of a site: the
vocabulary the options (``disable``), the reports and the kinds (``passes.kinds``, each
of which takes its roles from here) share."""

from __future__ import annotations

ROLES: dict[str, tuple[str, ...]] = {
    "ag_mm": ("rows", "contract", "columns", "contract_left", "contract_k"),
    "mm_rs": (),
    "a2a_mm": ("rows", "contract", "columns", "contract_left"),
    "mm_a2a": (),
}
EVERY_ROLE = tuple(dict.fromkeys(role for roles in ROLES.values() for role in roles))
