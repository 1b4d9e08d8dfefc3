"""The CommFuse pass over one aten-level FX graph: its pipeline is ``pipeline``, one module
per stage beside it (canonical -> match -> plan -> lower -> verify; the ranks' agreement
in ``agree``)."""

from . import joint
from .pipeline import PASSED, decline_graph, rewrite_and_compile, rewrite_graph

__all__ = ["PASSED", "decline_graph", "joint", "rewrite_and_compile", "rewrite_graph"]
