"""``torch.compile(model, backend="commfuse")``: the pass inside AOTAutograd.

AOTAutograd (functorch) turns the captured program into aten-level forward and backward
graphs; the pass rewrites each one before the inner compiler (Inductor, or eager FX
execution) compiles it. The backward graph is compiled lazily, on the first backward.
torch.compile's ``mode`` reaches the inner Inductor as with ``backend="inductor"``.
Before AOTAutograd partitions a training graph, plain tensor parallelism's all-reduces
are split on its joint graph (``passes/joint.py``): as AOTAutograd's partition function
with eager, in Inductor's joint-graph slot with Inductor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.exc import ShortenTraceback
from torch.fx import GraphModule

from . import async_collectives, deferred_logging
from .options import CommfuseOptionError, Options
from .passes import joint, resolve_options, rewrite_and_compile, rewrite_graph

# Dynamo traces the model before it calls a backend, so these are done when the backend is
# imported: hand-overlapped collectives (async_op=True, .wait() later) traced into the
# graph, and print / warnings / logging calls run after the graph instead of splitting it
# (logging on rank 0 only would give the ranks different graphs; COMMFUSE_DEFER_LOGGING=0)
async_collectives.install()
deferred_logging.install()


class BackendOptionError(ShortenTraceback, CommfuseOptionError):
    """A bad option, as Dynamo lets it reach the user: torch.compile hands the backend
    its options only at the first call, and wraps any other error there in a
    ``BackendCompilerFailed`` that reads like a bug in PyTorch."""


# compile_fx's keyword arguments a caller may give a backend (Dynamo gives
# ``config_patches``), passed on to the inner Inductor as the ``inductor`` backend does
COMPILE_FX_KEYWORDS = ("config_patches", "decompositions", "ignore_shape_env")


def commfuse_backend(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
    **more: Any,
) -> Callable[..., Any]:
    """The backend as torch.compile calls it: ``options`` are the pass's; ``mode`` is
    torch.compile's (``"max-autotune"``, ``"reduce-overhead"``, ...), for the inner
    Inductor (torch.compile gives ``mode`` or ``options``, not both: the ``mode`` option
    is the same thing); ``more``: compile_fx's keyword arguments, others ignored with a
    warning, as torch's AOTAutograd backends ignore them."""
    try:
        opts = resolve_options(_with_mode(options, mode))
    except CommfuseOptionError as err:
        # the traceback starts here, at the backend, not in Dynamo's frames
        raise BackendOptionError(str(err), first_useful_frame=inspect.currentframe()) from None
    unknown = sorted(set(more) - set(COMPILE_FX_KEYWORDS))
    if unknown:
        warnings.warn(f"commfuse: backend ignoring keyword arguments {unknown}", stacklevel=2)
    given = {k: v for k, v in more.items() if k in COMPILE_FX_KEYWORDS}
    if opts.inner == "eager":
        if opts.mode != "default" or given:
            noted = [f"mode={opts.mode!r}"] * (opts.mode != "default") + sorted(given)
            warnings.warn(
                f"commfuse: {', '.join(noted)} configure Inductor; they do not apply with "
                "inner='eager'",
                stacklevel=2,
            )
        return eager(gm, example_inputs, opts)
    return _inductor(gm, example_inputs, opts, given)


def _with_mode(options: Mapping[str, Any] | None, mode: str | None) -> Mapping[str, Any] | None:
    """The options with torch.compile's ``mode`` as the ``mode`` option."""
    if mode is None:
        return options
    given = dict(options or {})
    if given.get("mode", mode) != mode:
        raise CommfuseOptionError(
            f"commfuse: mode={mode!r} and option 'mode' {given['mode']!r} differ; give one"
        )
    return {**given, "mode": mode}


def _graph_role(is_backward: bool, is_inference: bool) -> str:
    return "backward" if is_backward else "inference" if is_inference else "forward"


def _inductor(
    gm: GraphModule, example_inputs: Sequence[Any], opts: Options, given: Mapping[str, Any]
) -> Any:
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    # the mode's config, then the caller's patches over it (as ``backend="inductor"``)
    patches = {**list_mode_options(opts.mode), **(given.get("config_patches") or {})}

    def inner_compile(graph: GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        kind = _graph_role(kwargs.get("is_backward", False), kwargs.get("is_inference", False))

        def compile_once(gm: GraphModule) -> Any:
            # A fallback compiles the graph a second time in the same tracing context,
            # whose output strides the first compile already reported (Inductor asserts
            # that list is empty): the second compile's are the ones that hold.
            context = torch._guards.TracingContext.try_get()
            if context is not None and context.output_strides:
                context.output_strides.clear()
            with _no_cudagraph_partitions(gm):
                return compile_fx_inner(gm, inputs, **kwargs)

        return rewrite_and_compile(
            graph,
            kind,
            opts,
            compile_once,
            program_of=lambda compiled: getattr(compiled, "source_code", None),
        )

    # The AOTAutograd cache key does not see a custom inner compiler: a hit would skip
    # the pass (or reuse another schedule's result), so it is off for this compile.
    with torch._functorch.config.patch(enable_autograd_cache=False), joint.in_inductor(opts):
        return compile_fx(
            gm,
            example_inputs,
            inner_compile=inner_compile,
            **{**given, "config_patches": patches or None},
        )


def _no_cudagraph_partitions(gm: GraphModule) -> Any:
    """No CUDA graph around the compute between a rewritten graph's P2P steps: under a
    mode with CUDA graphs (``reduce-overhead``, ``max-autotune``) such a graph runs
    without them, Inductor logging why ("disabling cudagraphs due to incompatible op
    commfuse.p2p.default"); graphs the pass left as they were (decode steps whose sites
    it declined) keep them. A replay does not run the P2P op's Python (its works, their
    waits), which partitions would take out of the graph while the waits stay in it."""
    from torch._inductor import config

    if not config.triton.cudagraphs or not gm.graph.find_nodes(
        op="call_function", target=torch.ops.commfuse.p2p.default
    ):
        return contextlib.nullcontext()
    return config.patch(graph_partition=False)


def eager(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    opts: Options,
    then: Callable[[GraphModule], None] | None = None,
) -> Any:
    """The pass, then eager FX execution of each graph; ``then`` changes each graph once
    the pass ran (``tools/bench/alone``: every transfer replaced by a local copy)."""
    from functorch.compile import default_partition, make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(graph: GraphModule, inputs: Sequence[Any], kind: str) -> Any:
        rewrite_graph(graph, kind, opts)
        if then is not None:
            then(graph)
        return make_boxed_func(graph)

    return aot_autograd(
        fw_compiler=functools.partial(compiler, kind="forward"),
        bw_compiler=functools.partial(compiler, kind="backward"),
        inference_compiler=functools.partial(compiler, kind="inference"),
        partition_fn=functools.partial(
            joint.partition, options=opts, partitioner=default_partition
        ),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
