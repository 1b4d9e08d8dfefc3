"""Rank-only logging inside compiled code: the call runs after the graph, not between two.

Dynamo graph-breaks at ``print``, ``warnings.warn`` and ``logging`` calls. Inside
``if rank == 0:`` (Megatron-Core's ``RowParallelLinear`` path warns so on rank 0 only),
that break is on one rank only: the ranks compile different graphs and the pass has to
keep every collective of the group. :func:`install` makes Dynamo run such a call after
the graph, on the rank that makes it, as torch's ``reorderable_logging_functions`` means
to, so that every rank compiles the same graph. Torch 2.13's own handling of that set
cannot be used as it is: a listed call inside an inlined function (any call below the
compiled frame, all of Megatron-Core's) is dropped without a word, because only the
compiled frame's ``debug_locals`` are emitted; keyword arguments are dropped (``print``'s
``sep`` and ``end``, ``warnings.warn``'s ``stacklevel``); a category argument is refused;
``logging.Logger`` methods can only be ignored, which drops the message.

So the calls are taken over where Dynamo builds them (``DebuggingVariable.call_function``
for ``print``, ``warnings.warn`` and the ``logging`` module's functions, which are added
to ``reorderable_logging_functions`` for that; ``LoggingLoggerVariable.call_method`` for a
logger's ``debug`` ... ``critical`` and ``log``). A call whose arguments are all Python
values at trace time (strings, numbers, classes, f-strings of those: what Dynamo folds to
constants and guards) becomes a :class:`DeferredCall`, emitted after the graph in the
compiled frame. It runs as the call would have: every argument kept, a warning's
location (file, line, module, registry: its ``stacklevel`` counted through the traced
frames, then the real ones above the compiled frame) and a log record's ``pathname``,
``lineno`` and ``funcName`` as where the call is written, so filters, "once per
location" and formats print what they print without the compiler. Only the moment
differs: after the graph's work, before the code that follows the graph.

Any other call still breaks the graph, as before, and runs where it is written: a tensor
argument (its value would be read after the graph, and the graph would return it on the
logging rank only), ``print(..., file=...)`` with a stream, ``exc_info`` /
``stack_info``, a logger whose class overrides how records are made, a call inside a
higher-order op's subgraph. ``COMMFUSE_DEFER_LOGGING=0`` (read at each trace) turns the
deferral off: the calls break the graph as without commfuse. Installed when the backend
module is imported, for the process: every backend's tracing then defers these calls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

ENV = "COMMFUSE_DEFER_LOGGING"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
LOGGER_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}
MODULE_FUNCTIONS = {getattr(logging, name): name for name in (*LOGGER_LEVELS, "log")}
DEFERRED: dict[Callable[..., Any], str] = {
    print: "print",
    warnings.warn: "warn",
    **MODULE_FUNCTIONS,
}

log = logging.getLogger("commfuse")
_added: set[Callable[..., Any]] = set()  # added to Dynamo's set by install(), not the user
_installed = False
_announced = False


def enabled() -> bool:
    """Whether calls are deferred now: ``COMMFUSE_DEFER_LOGGING``, on unless it says off."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    from .options import CommfuseOptionError

    raise CommfuseOptionError(
        f"commfuse: environment variable {ENV}={value!r} must be one of {TRUE + FALSE}"
    )


@dataclasses.dataclass(frozen=True)
class Frame:
    """A traced frame at a call: where a warning or a log record says it was made."""

    filename: str
    lineno: int
    function: str
    module_globals: dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class DeferredCall:
    """One logging call as traced, run after the graph as it would have run in place.

    ``frames`` are the traced frames from the call's (first) to the compiled frame
    (last); levels above them are the real callers of the compiled frame at run time.
    A logger call is given its logger when it runs (rebuilt from its source, as Dynamo
    guards it); a ``logging`` module function's is the root logger."""

    what: str  # "print", "warn", or the logging level name / "log"
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    frames: tuple[Frame, ...]

    def __call__(self, logger: logging.Logger | None = None) -> None:
        if self.what == "print":
            print(*self.args, **self.kwargs)
        elif self.what == "warn":
            self._warn(*self.args, **self.kwargs)
        else:
            if logger is None:  # a logging module function: the root logger's method
                if not logging.root.handlers:
                    logging.basicConfig()
                logger = logging.root
            self._log(logger, *self.args, **self.kwargs)

    def _warn(
        self, message: Any, category: type[Warning] | None = None, stacklevel: int = 1
    ) -> None:
        level = max(stacklevel, 1)
        if level > len(self.frames):  # above the compiled frame: count the real frames
            # level 1 here is this method, 2 __call__, 3 the compiled frame
            warnings.warn(message, category, stacklevel=level - len(self.frames) + 3)
            return
        frame = self.frames[level - 1]
        registry = frame.module_globals.setdefault("__warningregistry__", {})
        module = frame.module_globals.get("__name__", "<string>")
        warnings.warn_explicit(
            message,
            category or UserWarning,
            frame.filename,
            frame.lineno,
            module,
            registry,
            frame.module_globals,
        )

    def _log(self, logger: logging.Logger, *args: Any, **kwargs: Any) -> None:
        if self.what == "log":
            level, msg, *rest = args
        else:
            level, (msg, *rest) = LOGGER_LEVELS[self.what], args
        if not logger.isEnabledFor(level):
            return
        filename, lineno, function = self._log_caller(kwargs.get("stacklevel", 1))
        record = logger.makeRecord(
            logger.name, level, filename, lineno, msg, tuple(rest), None, function,
            kwargs.get("extra"), None,
        )  # fmt: skip
        logger.handle(record)

    def _log_caller(self, stacklevel: int) -> tuple[str, int, str]:
        """``Logger.findCaller``'s answer had the call run in place: the ``stacklevel``-th
        frame that is not logging's own, or the outermost."""
        level = max(stacklevel, 1)
        for frame in self.frames:
            if not _internal(frame.filename):
                level -= 1
                if level == 0:
                    return frame.filename, frame.lineno, frame.function
        f = sys._getframe(3)  # the compiled frame: 1 is _log, 2 __call__
        while level > 0 and f.f_back is not None:
            f = f.f_back
            if not _internal(f.f_code.co_filename):
                level -= 1
        return f.f_code.co_filename, f.f_lineno, f.f_code.co_name


def _internal(filename: str) -> bool:
    """logging's ``_is_internal_frame``: logging's own file, importlib's bootstrap."""
    source = logging._srcfile  # type: ignore[attr-defined]
    return filename == source or ("importlib" in filename and "_bootstrap" in filename)


def _constants(vts: Any) -> tuple[Any, ...] | None:
    values = []
    for vt in vts:
        if vt.is_tensor() or not vt.is_python_constant():
            return None
        values.append(vt.as_python_constant())
    return tuple(values)


def _frames(tx: Any) -> tuple[Frame, ...]:
    frames = []
    while tx is not None:
        code = tx.f_code
        frames.append(Frame(code.co_filename, tx.lineno, code.co_name, tx.f_globals))
        tx = tx.parent
    return tuple(frames)


def _why_not(what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this call (its Python values) cannot run after the graph, or None."""
    if what == "print":
        return (
            "a keyword other than sep, end or flush"
            if set(kwargs) - {"sep", "end", "flush"}
            else None
        )
    if what == "warn":
        if set(kwargs) - {"category", "stacklevel"} or len(args) > 3:
            return "an argument other than message, category or stacklevel"
        category = kwargs.get("category", args[1] if len(args) > 1 else None)
        if isinstance(args[0] if args else None, Warning) or not (
            category is None or (isinstance(category, type) and issubclass(category, Warning))
        ):
            return "a message that is a Warning, or a category that is not one"
        return None
    if set(kwargs) - {"stacklevel", "extra", "exc_info", "stack_info"}:
        return "a keyword logging does not take"
    if kwargs.get("exc_info") or kwargs.get("stack_info"):
        return "exc_info or stack_info (they read the stack where the call is)"
    if len(args) < (2 if what == "log" else 1):
        return "no message"
    if what == "log" and not isinstance(args[0], int):
        return "a level that is not an int"
    return None


def _defer(
    tx: Any,
    what: str,
    args_vt: list[Any],
    kwargs_vt: dict[str, Any],
    logger_vt: Any = None,
) -> str | None:
    """Record the call to run after the graph; None if it is recorded, else why not."""
    if not tx.output.is_root_tracer():
        return "inside a higher-order op's subgraph"
    args, values = _constants(args_vt), _constants(kwargs_vt.values())
    if args is None or values is None:
        return "an argument that is not a Python value at trace time (a tensor, an object)"
    kwargs = dict(zip(kwargs_vt, values, strict=True))
    why = _why_not(what, args, kwargs)
    if why is not None:
        return why
    from torch._dynamo.source import GlobalSource
    from torch._dynamo.variables.misc import DebuggingVariable

    call = DeferredCall(what, args, kwargs, _frames(tx))
    name = tx.output.install_global_by_id("__commfuse_deferred_log", call)
    runs = DebuggingVariable(call, source=GlobalSource(name))
    tx.output.root_tx.debug_locals.append((runs, [] if logger_vt is None else [logger_vt]))
    _announce(call)
    return None


def _announce(call: DeferredCall) -> None:
    global _announced
    where = f"{call.frames[0].filename}:{call.frames[0].lineno}"
    if _announced:
        log.debug("commfuse: %s at %s runs after the graph", call.what, where)
        return
    _announced = True
    log.info(
        "commfuse: %s at %s (and every print, warnings.warn and logging call with Python "
        "values only) runs after the graph instead of breaking it, so that logging on some "
        "ranks does not give the ranks different graphs; %s=0 turns this off",
        call.what, where, ENV,
    )  # fmt: skip


def _graph_break(what: str, why: str) -> None:
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type="logging call kept in place (commfuse)",
        context=f"{what}: {why}",
        explanation=f"commfuse runs {what} after the graph only when its arguments are "
        f"Python values at trace time; here: {why}. The call runs where it is written, "
        "after a graph break (on a rank that logs alone, its graphs differ from its peers').",
        hints=[
            "Pass the call Python values (str, numbers), or keep it out of compiled code.",
            f"{ENV}=0 turns the deferral off altogether.",
        ],
    )


def install() -> None:
    """Take the calls over in Dynamo (once per process). A bad ``COMMFUSE_DEFER_LOGGING``
    raises here, at the import, rather than first inside Dynamo's trace."""
    global _installed
    enabled()
    if _installed:
        return
    _installed = True
    from torch._dynamo.variables.misc import DebuggingVariable, LoggingLoggerVariable

    reorderable = torch._dynamo.config.reorderable_logging_functions
    _added.update(fn for fn in DEFERRED if fn not in reorderable)
    reorderable.update(_added)
    debugging_call = DebuggingVariable.call_function
    logger_call = LoggingLoggerVariable.call_method

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        what = DEFERRED.get(self.value) if not tx.export else None
        if what is None:
            return debugging_call(self, tx, args, kwargs)
        why = _defer(tx, what, args, kwargs) if enabled() else f"{ENV} is off"
        if why is None:
            from torch._dynamo.variables import ConstantVariable

            return ConstantVariable.create(None)
        if self.value in _added:
            _graph_break(what, why)
        return debugging_call(self, tx, args, kwargs)  # the user's own listing: Dynamo's way

    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        ignored = torch._dynamo.config.ignore_logging_functions
        method = getattr(type(self.value), name, None)
        if (
            tx.export
            or name not in (*LOGGER_LEVELS, "log")
            or method in ignored
            or getattr(self.value, name, None) in ignored
        ):
            return logger_call(self, tx, name, args, kwargs)
        why = _logger_why_not(self, name) or (
            _defer(tx, name, args, kwargs, logger_vt=self) if enabled() else f"{ENV} is off"
        )
        if why is None:
            from torch._dynamo.variables import ConstantVariable

            return ConstantVariable.create(None)
        return logger_call(self, tx, name, args, kwargs)  # graph-breaks, as without commfuse

    DebuggingVariable.call_function = call_function  # type: ignore[method-assign]
    LoggingLoggerVariable.call_method = call_method  # type: ignore[method-assign]


def _logger_why_not(logger_vt: Any, name: str) -> str | None:
    kind = type(logger_vt.value)
    if logger_vt.source is None:
        return "a logger Dynamo cannot rebuild after the graph"
    overridden = [
        n
        for n in (name, "findCaller", "makeRecord", "handle", "_log", "isEnabledFor")
        if getattr(kind, n) is not getattr(logging.Logger, n)
    ]
    return f"a logger class overriding {', '.join(overridden)}" if overridden else None
