"""Decline reasons as data: every code the pass raises is registered, every registered
code is raised somewhere, and the table of decline codes in the docs (DECLINES_PAGE) is
the registry's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import commfuse_compile
from commfuse_compile.passes.fx.declines import REASONS, Declined, decline, markdown_table

PACKAGE = Path(commfuse_compile.__file__).parent
# the docs page that holds the generated table, between its "declines" markers
DECLINES_PAGE = PACKAGE.parent / "docs" / "rewrites.md"
RAISED = re.compile(r"""decline\(\s*["']([a-z_]+\.[a-z_]+)["']""")
PREFIXES = "rs|ar|ag|a2a|moe|site|plan|lower|size|compiler|internal|split|bucket"
CHOSEN = re.compile(rf"""["']((?:{PREFIXES})\.[a-z_]+)["']""")


def _codes_in_code() -> set[str]:
    codes = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name == "declines.py":  # its code, not its table of reasons
            text = text.split("_REASONS = (")[0] + text.split("\nREASONS = ")[1]
        codes |= set(RAISED.findall(text)) | set(CHOSEN.findall(text))
    return codes


def test_every_code_raised_is_registered_and_every_registered_code_is_raised():
    used = _codes_in_code()
    assert used - set(REASONS) == set()
    assert set(REASONS) - used == set()


def test_docs_table_is_generated_from_the_registry():
    text = DECLINES_PAGE.read_text()
    begin, end = "<!-- declines: begin -->\n", "<!-- declines: end -->"
    assert begin in text and end in text, f"{DECLINES_PAGE} has no declines markers"
    table = text.split(begin)[1].split(end)[0].strip()
    assert table == markdown_table(), (
        f"the table in {DECLINES_PAGE} is not the registry's: put the output of "
        "`python -m commfuse_compile.passes.fx.declines` between its declines markers"
    )


def test_decline_fills_the_template_and_carries_code_and_kind():
    err = decline("rs.not_sum", op="max")
    assert isinstance(err, Declined)
    assert (err.code, err.category, err.reason) == (
        "rs.not_sum",
        "unsupported",
        "reduce op 'max' is neither 'sum' nor 'avg'",
    )
    assert decline("plan.off").category == "off"
    with pytest.raises(KeyError):
        decline("rs.no_such_code")
