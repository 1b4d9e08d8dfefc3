"""The training runs of the MoE front ends (``moe``: expert parallelism; ``moe_etp``: experts
tensor parallel too): blocks compiled one by one as torchtitan compiles them, SGD steps
with the pass and without from the same initialization and data, and a ``RankPool`` job
that compares the two. A front end's config is a :class:`Setup`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ... import report


class Setup(Protocol):
    """What a run needs of a front end's config."""

    steps: int
    lr: float

    def build(self) -> nn.Module:
        """The model, from one seed on every rank: ``blocks`` (an ``nn.ModuleList``) and
        ``forward(x, target)``, this rank's loss."""
        ...

    def inputs(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens and targets at ``step``."""
        ...

    def sync(self, model: nn.Module) -> None:
        """Sum the gradients that the ranks hold parts of, after the backward."""
        ...

    def router(self, model: nn.Module) -> nn.Module | None:
        """A router whose third output (tokens per expert) is recorded, or None."""
        ...


class CompileCounter:
    """How many graphs Dynamo handed the backend (one per compile or recompile)."""

    def __init__(self) -> None:
        self.frames = 0

    def wrap(self, options: Mapping[str, Any] | None) -> Callable[..., Any]:
        """The commfuse backend with ``options``; None: Inductor (the pass, if installed
        with :func:`commfuse_compile.install_inductor_pass`, runs inside it)."""
        from torch._inductor.compile_fx import compile_fx

        from ...backend import commfuse_backend

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.frames += 1
            if options is None:
                return compile_fx(gm, example_inputs)
            return commfuse_backend(gm, example_inputs, options)

        return backend


def compile_blocks(
    model: nn.Module, options: Mapping[str, Any] | None, counter: CompileCounter
) -> None:
    """torchtitan's ``apply_compile``: each block compiled on its own, ``fullgraph=True``,
    to be called, and the blocks run, under ``torch._dynamo.config.patch(
    capture_scalar_outputs=True)`` (torchtitan sets it for good: the dropless block's
    ``.tolist()`` splits become unbacked sizes; :func:`train` patches it for its run)."""
    backend = counter.wrap(None if options is None else dict(options))
    blocks = model.blocks
    assert isinstance(blocks, nn.ModuleList)
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend=backend, fullgraph=True)  # type: ignore[assignment]


@dataclasses.dataclass
class MoEResult:
    """Per step: this rank's loss and wall time; the replicated and expert gradients
    after the first backward (synced); the sites the pass recorded; the compiles; without
    the pass, the tokens per expert of the first block's router (``Setup.router``) at
    each step."""

    losses: list[float]
    step_s: list[float]
    grads: dict[str, torch.Tensor]
    sites: list[dict[str, Any]]
    compiles: int
    routing: list[list[int]] = dataclasses.field(default_factory=list)  # uncompiled only


def train(
    cfg: Setup,
    options: Mapping[str, Any] | None,
    on_step: Callable[[int, float, float], None] | None = None,
    inductor_pass: bool = False,
) -> MoEResult:
    """``cfg.steps`` SGD steps; ``options`` None: uncompiled, else each block compiled
    with ``backend="commfuse"`` and ``options``; with ``inductor_pass``, compiled by
    Inductor with the pass installed in it with ``options`` (how a framework that
    insists on ``backend="inductor"`` runs it)."""
    from ... import inductor_pass as hook

    report.reset()
    torch._dynamo.reset()
    model = cfg.build()
    counter = CompileCounter()
    if inductor_pass:
        assert options is not None, "the pass's options"
        hook.install_inductor_pass(**options)
        compile_blocks(model, None, counter)
    elif options is not None:
        compile_blocks(model, options, counter)
    result = MoEResult([], [], {}, [], 0)
    router = cfg.router(model) if options is None else None
    if router is not None:  # the first block's tokens per expert
        router.register_forward_hook(
            lambda _module, _args, out: result.routing.append(out[2].tolist())
        )
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            _steps(cfg, model, sgd, result, on_step)
    finally:
        if inductor_pass:
            hook.uninstall_inductor_pass()
    result.sites = [s.as_json() for s in report.REPORT.sites]
    result.compiles = counter.frames
    return result


def _steps(
    cfg: Setup,
    model: nn.Module,
    sgd: torch.optim.Optimizer,
    result: MoEResult,
    on_step: Callable[[int, float, float], None] | None,
) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in range(cfg.steps):
        x, target = cfg.inputs(step, rank)
        start = time.perf_counter()
        loss = model(x, target)
        (loss / n).backward()
        cfg.sync(model)
        if step == 0:
            result.grads = {
                k.replace("._orig_mod", ""): p.grad.detach().clone()
                for k, p in model.named_parameters()
                if p.grad is not None
            }
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        result.step_s.append(time.perf_counter() - start)
        result.losses.append(loss.item())
        if on_step is not None:
            on_step(step, result.losses[-1], result.step_s[-1])


def compare(
    rank: int, n: int, cfg: Setup, options: Mapping[str, Any], inductor_pass: bool = False
) -> dict[str, Any]:
    """A ``RankPool`` job: the run with the pass and without; the losses, the largest
    gradient difference, the sites as (graph, kind, decision, decline code), compiles."""
    import torch._inductor.config

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    fused, plain = train(cfg, options, inductor_pass=inductor_pass), train(cfg, None)
    grad_diff = max(
        ((fused.grads[k] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
        for k, g in plain.grads.items()
    )
    return {
        "losses": (fused.losses, plain.losses),
        "grad_diff": grad_diff,
        "grad_names": sorted(plain.grads) == sorted(fused.grads),
        "sites": [(s["graph"], s["kind"], s["decision"], s["decline_code"]) for s in fused.sites],
        "compiles": fused.compiles,
        "step_s": fused.step_s,
        "routing": plain.routing,
    }
