"""The pass inside ``backend="inductor"``: for frameworks that hard-code Inductor.

torchtitan compiles FlexAttention models only with ``inductor`` or ``aot_eager``; other
code names no backend at all. ``install_inductor_pass()`` puts the pass into Inductor's
``post_grad_custom_pre_pass`` slot, the way async-TP's ``_micro_pipeline_tp`` flag puts
its pass into the same post-grad passes. Inductor calls the slot on each forward,
backward and inference graph it compiles, after AOTAutograd and Inductor's
decompositions and before its own pattern passes: the graph the backend rewrites, with
functional collectives and fake-tensor values. The pipeline is the backend's
(``passes.rewrite_graph``): the same matching, planning, lowering, verification, report
and dump, and the ranks' agreement on the graph's order of transfers, which
``control_deps`` pin through Inductor's scheduler. What the hook cannot do is read back
the program Inductor generates and fall back if it breaks a transfer: the backend does.

While the pass is installed Inductor's FX graph cache and AOTAutograd's cache are
bypassed (``uuid()`` is None): a rank that hit the cache would skip the pass and the
ranks' agreement while its peers wait for it, and run whatever the cached program does.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass
from torch.fx import Graph

from . import deferred_logging
from .options import CommfuseOptionError, Options, given_options
from .passes import PASSED, decline_graph, joint, resolve_options, rewrite_graph
from .passes.fx.declines import decline
from .passes.joint import JointPass, slot_passes, slot_value

SLOT = "post_grad_custom_pre_pass"


class CommfuseInductorPass(CustomInferenceAwareGraphPass):
    """The pass, as Inductor's post-grad custom pass, with options fixed at install."""

    def __init__(self, options: Options) -> None:
        self.options = options

    # torch's own base class adds ``is_inference`` to CustomGraphPass's signature
    def __call__(self, graph: Graph, is_inference: bool) -> None:  # type: ignore[override]
        gm = graph.owning_module
        if gm is None or PASSED in gm.meta:  # backend="commfuse" rewrote it already
            return
        role = graph_role(graph, is_inference)
        later = comm_passes_after()
        if later:
            why = decline("compiler.comm_passes", passes=", ".join(later))
            warnings.warn(f"commfuse: {why.reason}; the graph is left as it is", stacklevel=2)
            decline_graph(gm, role, self.options, why)
            return
        rewrite_graph(gm, role, self.options)

    def uuid(self) -> None:
        """None: Inductor's caches are bypassed (see the module's docstring)."""
        return None

    def __repr__(self) -> str:
        return f"CommfuseInductorPass({self.options.described()})"


def graph_role(graph: Graph, is_inference: bool) -> str:
    """The graph's role, as the report and the dump name it: AOTAutograd names the
    backward graph's incoming gradients ``tangents_*``."""
    if is_inference:
        return "inference"
    placeholders = graph.find_nodes(op="placeholder")
    return "backward" if any(p.name.startswith("tangents") for p in placeholders) else "forward"


def comm_passes_after() -> list[str]:
    """Inductor's post-grad passes switched on that merge, split, replace or reorder
    collectives after the slot (all off by default): what the ranks agreed on would not
    be what Inductor compiles."""
    distributed = inductor_config.aten_distributed_optimizations
    switched = {
        "_micro_pipeline_tp": inductor_config._micro_pipeline_tp,
        "_fuse_ddp_communication": inductor_config._fuse_ddp_communication,
        "dedup_reduce_scatters": inductor_config.dedup_reduce_scatters,
        "bucket_reduce_scatters_fx": inductor_config.bucket_reduce_scatters_fx != "none",
        "bucket_all_reduces_fx": inductor_config.bucket_all_reduces_fx != "none",
        "bucket_all_gathers_fx": inductor_config.bucket_all_gathers_fx != "none",
        "aten_distributed_optimizations.enable_overlap_scheduling": (
            distributed.enable_overlap_scheduling
        ),
        "aten_distributed_optimizations.allow_comms_decompositions": (
            distributed.allow_comms_decompositions
        ),
        "aten_distributed_optimizations.enable_low_contention_collectives": (
            distributed.enable_low_contention_collectives
        ),
    }
    return [name for name, on in switched.items() if on]


def install_inductor_pass(
    options: Mapping[str, Any] | None = None, **more: Any
) -> CommfuseInductorPass:
    """Run the pass inside every ``torch.compile(..., backend="inductor")`` from now on.

    Options are the backend's, given as a mapping or as keywords, each else from its
    environment variable (``COMMFUSE_SCHEDULE``, ...), read now; ``inner`` is Inductor.
    Installing again replaces the installed pass (same place, the new options). A pass of
    the user's own already in Inductor's ``post_grad_custom_pre_pass`` stays and runs
    first: the slot becomes a list. Returns the installed pass."""
    given = given_options("commfuse_compile.install_inductor_pass", options, more)
    if given.get("inner", "inductor") != "inductor":
        raise CommfuseOptionError(
            f"commfuse_compile.install_inductor_pass: option 'inner' cannot be "
            f"{given['inner']!r}: the pass runs inside Inductor; for another inner compiler "
            "use torch.compile(model, backend='commfuse', options={'inner': ...})"
        )
    if given.get("mode", "default") != "default":
        raise CommfuseOptionError(
            f"commfuse_compile.install_inductor_pass: option 'mode' cannot be "
            f"{given['mode']!r}: Inductor takes its mode from torch.compile(model, mode=...)"
        )
    fixed = resolve_options({**given, "inner": "inductor"})
    installed = CommfuseInductorPass(fixed)
    _install(SLOT, installed)
    _install(joint.SLOT, JointPass(fixed))
    deferred_logging.install()  # as the backend's import does: rank-only logging, one graph
    return installed


def uninstall_inductor_pass() -> bool:
    """Take the pass out of Inductor's slots, leaving any other pass there as it was.
    Returns whether it was installed."""
    _uninstall(joint.SLOT, JointPass)
    return _uninstall(SLOT, CommfuseInductorPass)


def installed_inductor_pass() -> CommfuseInductorPass | None:
    """The installed pass, or None."""
    current = slot_passes(getattr(inductor_config, SLOT))
    return next((p for p in current if isinstance(p, CommfuseInductorPass)), None)


def _install(slot: str, installed: Any) -> None:
    """``installed`` in Inductor's ``slot``: in place of one of its class, else last."""
    current = slot_passes(getattr(inductor_config, slot))
    if any(isinstance(p, type(installed)) for p in current):
        passes = [installed if isinstance(p, type(installed)) else p for p in current]
    else:
        passes = [*current, installed]
    setattr(inductor_config, slot, slot_value(passes))


def _uninstall(slot: str, kind: type) -> bool:
    current = slot_passes(getattr(inductor_config, slot))
    kept = [p for p in current if not isinstance(p, kind)]
    setattr(inductor_config, slot, slot_value(kept))
    return len(kept) < len(current)


__all__ = [
    "CommfuseInductorPass",
    "comm_passes_after",
    "install_inductor_pass",
    "installed_inductor_pass",
    "uninstall_inductor_pass",
]
