"""Small training runs that feed the pass real forward and backward graphs.

Shared by the training examples (``examples/train_*.py``, through
:mod:`.examples`) and the tests. The front ends (the model, how it is
parallelized, the inputs) are :mod:`.fronts`. :func:`train` runs the same steps with the
pass (``torch.compile(backend="commfuse")``) or without it (plain eager), from the same
initialization and data; :func:`summarize` groups the sites the pass recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ... import report
from .fronts import TrainConfig, build, compile_blocks


@dataclasses.dataclass
class TrainResult:
    """Per step: the loss (averaged over data-parallel ranks) and the wall time."""

    losses: list[float]
    step_s: list[float]
    sites: list[dict[str, Any]]  # the report's sites recorded during this run (as JSON)


def train(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    options: Mapping[str, Any] | None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> TrainResult:
    """``cfg.steps`` AdamW steps; ``options`` None: plain eager (no pass), else the
    ``torch.compile(backend="commfuse")`` options. ``on_step(step, loss, seconds)``."""
    report.reset()
    torch._dynamo.reset()  # a fresh compile per run: no cached graph, no recompile limit
    run = _stepper(cfg, rank, world_size, options)
    result = TrainResult(losses=[], step_s=[], sites=[])
    for step in range(cfg.steps):
        run(step, result, on_step)
    result.sites = [s.as_json() for s in report.REPORT.sites]
    return result


def train_interleaved(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    options: Mapping[str, Any],
    baseline: Mapping[str, Any],
    on_step: Callable[[str, int, float, float], None] | None = None,
) -> tuple[TrainResult, TrainResult]:
    """The same steps compiled with ``options`` and with ``baseline``, two models from
    the same initialization, step by step in turn (which goes first alternates), so that
    the machine's load changes both runs' times alike. ``on_step(which, step, loss,
    seconds)``, ``which`` "pass" or "baseline"."""
    report.reset()
    torch._dynamo.reset()
    runs = {
        "pass": (_stepper(cfg, rank, world_size, options), TrainResult([], [], [])),
        "baseline": (_stepper(cfg, rank, world_size, baseline), TrainResult([], [], [])),
    }
    for step in range(cfg.steps):
        for which in list(runs)[:: 1 if step % 2 == 0 else -1]:
            run, result = runs[which]
            before = len(report.REPORT.sites)
            run(step, result, on_step and functools.partial(on_step, which))
            result.sites += [s.as_json() for s in report.REPORT.sites[before:]]
    return runs["pass"][1], runs["baseline"][1]


def _stepper(
    cfg: TrainConfig, rank: int, world_size: int, options: Mapping[str, Any] | None
) -> Callable[[int, TrainResult, Callable[[int, float, float], None] | None], None]:
    """The model set up (compiled with ``options``, or not for None) and a function that
    runs its step ``i`` into a result."""
    setup = build(cfg, rank, world_size)
    step_fn: Callable[..., torch.Tensor] = setup.loss_module
    if options is not None and cfg.compile_per_block:
        compile_blocks(setup.loss_module.model, options, cfg.clone_embedding)
    elif options is not None:
        step_fn = torch.compile(setup.loss_module, backend="commfuse", options=dict(options))
    opt = torch.optim.AdamW(setup.loss_module.parameters(), lr=cfg.lr)

    def run(
        step: int, result: TrainResult, on_step: Callable[[int, float, float], None] | None
    ) -> None:
        x, target = setup.inputs(step)
        start = time.perf_counter()
        loss = step_fn(x, target)
        (loss / setup.dp).backward()
        setup.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        value = loss.detach().clone()
        if setup.dp_group is not None:
            dist.all_reduce(value, group=setup.dp_group)
            value /= setup.dp
        result.losses.append(value.item())
        result.step_s.append(seconds)
        if on_step is not None:
            on_step(step, result.losses[-1], seconds)

    return run


def compare(
    rank: int, world_size: int, cfg: TrainConfig, options: Mapping[str, Any]
) -> tuple[TrainResult, TrainResult]:
    """(with the pass, without it): the same run twice; a ``RankPool`` job."""
    return train(cfg, rank, world_size, options), train(cfg, rank, world_size, None)


def gradients(
    rank: int, world_size: int, cfg: TrainConfig, options: Mapping[str, Any] | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict[str, Any]]]:
    """One forward and backward (``options`` None: plain eager, else compiled with
    ``backend="commfuse"``): the loss, this rank's shard of every parameter's gradient
    (float32), and the sites the pass recorded (a ``RankPool`` job)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None, "a parameter got no gradient"
        return (t.to_local() if isinstance(t, DTensor) else t).detach().float()

    report.reset()
    torch._dynamo.reset()
    setup = build(cfg, rank, world_size)
    step_fn: Callable[..., torch.Tensor] = setup.loss_module
    if options is not None:
        step_fn = torch.compile(setup.loss_module, backend="commfuse", options=dict(options))
    loss = step_fn(*setup.inputs(0))
    loss.backward()
    setup.sync_gradients()
    grads = {k: local(p.grad) for k, p in setup.loss_module.named_parameters()}
    return local(loss), grads, [s.as_json() for s in report.REPORT.sites]


def per_block_backward(
    rank: int, world_size: int, cfg: TrainConfig, backend: str, clone_embedding: bool
) -> str | None:
    """One forward and backward of ``cfg`` (front "tp" with ``vocab``) compiled per block
    with ``backend`` (no options: "aot_eager", "eager", ...): None if it ran, else the
    error as ``Type: message`` (a ``RankPool`` job; shows the torch fault of
    :func:`.fronts.clone_output`)."""
    torch._dynamo.reset()
    setup = build(cfg, rank, world_size)
    compile_blocks(setup.loss_module.model, None, clone_embedding, backend=backend)
    try:
        setup.loss_module(*setup.inputs(0)).backward()
    except Exception as error:  # noqa: BLE001 - the fault is the result
        return f"{type(error).__name__}: {error}"
    return None


def max_relative_diff(a: Iterable[float], b: Iterable[float]) -> float:
    """Largest ``|a - b| / |b|`` over steps (``b`` the reference)."""
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True)), default=0.0)


@dataclasses.dataclass
class SiteSummary:
    """The sites of one (graph, kind): how many, and why the declined ones were."""

    graph: str
    kind: str
    found: int = 0
    rewritten: int = 0
    declined: int = 0
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # decline code -> n
    # decline code -> its reasons as the sites gave them (filled in), each once
    reasons_given: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def summarize(sites: Iterable[Mapping[str, Any]]) -> list[SiteSummary]:
    """Group report sites (``SiteRecord.as_json()``) by graph and kind, in that order."""
    rows: dict[tuple[str, str], SiteSummary] = {}
    for site in sites:
        key = (site["graph"], site["kind"])
        row = rows.setdefault(key, SiteSummary(*key))
        row.found += 1
        if site["decision"] == "rewritten":
            row.rewritten += 1
        else:
            row.declined += 1
            code = site["decline_code"]
            row.reasons[code] = row.reasons.get(code, 0) + 1
            given = row.reasons_given.setdefault(code, [])
            if site["reason"] not in given:
                given.append(site["reason"])
    return sorted(rows.values(), key=lambda r: (r.graph != "forward", r.graph, r.kind))


def format_summary(rows: Iterable[SiteSummary]) -> str:
    """The summary as a text table, one line per (graph, kind), reasons indented below:
    each code's first reason as a site gave it, and how many others it gave."""
    lines = [f"{'graph':<9} {'site':<6} {'found':>5} {'rewritten':>9} {'declined':>8}"]
    for row in rows:
        lines.append(
            f"{row.graph:<9} {row.kind:<6} {row.found:>5} {row.rewritten:>9} {row.declined:>8}"
        )
        for code, n in sorted(row.reasons.items()):
            first, *others = row.reasons_given[code]
            more = f" (+{len(others)} other {'reason' if len(others) == 1 else 'reasons'})"
            more = more if others else ""
            lines.append(f"    {n} x declined {code}: {first}{more}")
    return "\n".join(lines)
