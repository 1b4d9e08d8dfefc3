"""The CommFuse pass over one aten-level FX graph. Its pipeline is ``pipeline``, one module
per stage beside it in the order they run (match -> plan -> lower -> verify; ``joint``:
the split on a training step's joint graph). Below them: ``prepare/`` the rewrites
before matching, ``ranks/`` the ranks' agreement and the reading of Inductor's program,
``kinds/`` the site kinds, ``kit/`` what a kind builds with, ``fx/`` the FX vocabulary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..options import Options
from . import joint, kinds
from .pipeline import PASSED, decline_graph, rewrite_and_compile, rewrite_graph

__all__ = [
    "PASSED",
    "decline_graph",
    "joint",
    "resolve_options",
    "rewrite_and_compile",
    "rewrite_graph",
]


def resolve_options(given: Mapping[str, Any] | None) -> Options:
    """The options as the pass takes them (``Options.from_mapping``), the names
    ``disable`` gives checked against the kinds' and schedules' (``kinds.check_disable``)."""
    return kinds.check_disable(Options.from_mapping(given))
