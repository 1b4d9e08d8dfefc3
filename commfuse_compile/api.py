"""``commfuse_compile.apply``: the pass on a graph the user already has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch.fx import GraphModule

from .options import CommfuseOptionError, given_options
from .passes import resolve_options, rewrite_graph

G = TypeVar("G", GraphModule, torch.export.ExportedProgram)


def apply(obj: G, options: Mapping[str, Any] | None = None, **more: Any) -> G:
    """Rewrite an aten-level ``GraphModule`` or ``ExportedProgram`` in place and return it.

    Options are the backend's (``schedule``, ``profile``, ``debug_dir``, ...), given as
    the backend takes them (``options={"schedule": "ring"}``) or as keywords
    (``schedule="ring"``), not both. ``apply`` compiles nothing: the result runs as it
    is, in its node order, which is ``inner="eager"``; ``inner="inductor"`` is refused.
    """
    given = given_options("commfuse_compile.apply", options, more)
    if given.get("inner", "eager") != "eager":
        raise CommfuseOptionError(
            f"commfuse_compile.apply: option 'inner' cannot be {given['inner']!r}: apply "
            "rewrites the graph and compiles nothing (it runs as it is, as with 'eager'); "
            "compile the result yourself, or use torch.compile(model, backend='commfuse', "
            "options={'inner': 'inductor'})"
        )
    if given.get("mode", "default") != "default":
        raise CommfuseOptionError(
            f"commfuse_compile.apply: option 'mode' cannot be {given['mode']!r}: a mode "
            "configures Inductor, which apply does not run; compile the result yourself "
            "with that mode"
        )
    opts = resolve_options({**given, "inner": "eager"})
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
