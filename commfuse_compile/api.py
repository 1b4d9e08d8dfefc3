"""``commfuse_compile.apply``: the pass on a graph the user already has."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.fx import GraphModule

from .options import CommfuseOptionError, Options
from .passes import rewrite_graph

G = TypeVar("G", GraphModule, torch.export.ExportedProgram)


def apply(obj: G, **options: Any) -> G:
    """Rewrite an aten-level ``GraphModule`` or ``ExportedProgram`` in place and return it.

    Options are those of the backend (``schedule``, ``debug_dir``); the result runs as
    it is, so the graph keeps its node order (``inner`` does not apply here).
    """
    opts = Options.from_mapping({**options, "inner": "eager"})
    if isinstance(obj, torch.export.ExportedProgram):
        rewrite_graph(obj.graph_module, "export", opts)
        return obj
    if isinstance(obj, GraphModule):
        rewrite_graph(obj, "export", opts)
        return obj
    raise CommfuseOptionError(
        f"commfuse_compile.apply takes a torch.fx.GraphModule or torch.export.ExportedProgram, "
        f"got {type(obj).__name__}"
    )
