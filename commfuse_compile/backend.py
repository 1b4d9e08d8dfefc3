"""``torch.compile(model, backend="commfuse")``: the pass inside AOTAutograd.

AOTAutograd (functorch) turns the captured program into aten-level forward and backward
graphs; the pass rewrites each one before the inner compiler (Inductor, or eager FX
execution) compiles it. The backward graph is compiled lazily, on the first backward.
Before AOTAutograd partitions a training graph, plain tensor parallelism's all-reduces
are split on its joint graph (``passes/joint.py``): as AOTAutograd's partition function
with eager, in Inductor's joint-graph slot with Inductor.
"""

from __future__ import annotations

import functools
import inspect
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


def commfuse_backend(
    gm: GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    try:
        opts = resolve_options(options)
    except CommfuseOptionError as err:
        # the traceback starts here, at the backend, not in Dynamo's frames
        raise BackendOptionError(str(err), first_useful_frame=inspect.currentframe()) from None
    if opts.inner == "eager":
        return eager(gm, example_inputs, opts)
    return _inductor(gm, example_inputs, opts)


def _graph_role(is_backward: bool, is_inference: bool) -> str:
    return "backward" if is_backward else "inference" if is_inference else "forward"


def _inductor(gm: GraphModule, example_inputs: Sequence[Any], opts: Options) -> Any:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        kind = _graph_role(kwargs.get("is_backward", False), kwargs.get("is_inference", False))

        def compile_once(gm: GraphModule) -> Any:
            # A fallback compiles the graph a second time in the same tracing context,
            # whose output strides the first compile already reported (Inductor asserts
            # that list is empty): the second compile's are the ones that hold.
            context = torch._guards.TracingContext.try_get()
            if context is not None and context.output_strides:
                context.output_strides.clear()
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
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


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
