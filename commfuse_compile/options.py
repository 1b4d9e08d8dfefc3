"""User-facing options of the pass, validated once so that a typo is a clear error."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist
from torch._inductor import list_mode_options

from .runtime.topology import Topology, TopologyError, parse
from .schedules import NAMES

SCHEDULES = ("auto", *NAMES, "off")
INNER_COMPILERS = ("inductor", "eager")
MODES = tuple(list_mode_options())  # torch.compile's modes: Inductor's config per mode
DEBUG_DIR_ENV = "COMMFUSE_DEBUG_DIR"
DISABLE_ENV = "COMMFUSE_DISABLE"
PROFILE_ENV = "COMMFUSE_PROFILE"
MAX_SLICES = 64


class CommfuseOptionError(ValueError):
    """An option given to the backend or to ``apply`` is not valid."""


# Every option can come from the environment, for frameworks that pass only a backend
# name (torchtitan's ``compile.backend``, Hugging Face's ``torch_compile_backend``,
# Lightning): an option given explicitly wins over its variable.
ENV = {
    "schedule": "COMMFUSE_SCHEDULE",
    "inner": "COMMFUSE_INNER",
    "mode": "COMMFUSE_MODE",
    "slices": "COMMFUSE_SLICES",
    "measure": "COMMFUSE_MEASURE",
    "profile": PROFILE_ENV,
    "debug_dir": DEBUG_DIR_ENV,
    "disable": DISABLE_ENV,
    "exchange_timeout": "COMMFUSE_EXCHANGE_TIMEOUT",
    "topology": "COMMFUSE_TOPOLOGY",
    "strict": "COMMFUSE_STRICT",
}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# None: unset
UNSET_BY_NONE = frozenset({"debug_dir", "profile", "disable", "exchange_timeout", "topology"})


@dataclasses.dataclass(frozen=True)
class Options:
    schedule: str = "auto"
    inner: str = "inductor"
    # torch.compile's ``mode`` for the inner Inductor; an option too, because torch.compile
    # refuses ``mode`` and ``options`` together
    mode: str = "default"
    debug_dir: str | None = None
    disable: frozenset[str] = frozenset()
    profile: str | None = None  # built-in profile name or profile file; None: by device
    slices: int = 2  # chunks of the slicing schedule
    measure: bool = False  # time each rewritten site's P2P steps into report.json
    # how long a rank waits for its peers' view of a graph, in seconds; None: half the
    # process group's timeout (a peer blocked in a collective meanwhile must outlast it)
    exchange_timeout: float | None = None
    # ranks per node, or the node of every rank (``runtime.topology``); None: the launcher's
    topology: Topology | None = None
    # re-raise an unexpected error inside the pass instead of declining the site (tests,
    # and a user reporting a bug: the traceback as it happened); unless given, from the
    # environment, also for options built directly (the test suite runs strict)
    strict: bool = dataclasses.field(default_factory=lambda: _flag(_given_or_env({}, "strict")))
    # option -> where its value came from: "option", "environment variable NAME", "default"
    origins: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:  # ``Options(topology=2)`` as ``from_mapping`` reads it
        if self.topology is not None and not isinstance(self.topology, Topology):
            object.__setattr__(self, "topology", _topology(_Given(self.topology, "", "option")))

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any] | None) -> Options:
        given = {k: v for k, v in (given or {}).items() if k != "origins"}
        known = {f.name for f in dataclasses.fields(cls)} - {"origins"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise CommfuseOptionError(
                f"commfuse: unknown option(s) {unknown}; valid options are {sorted(known)}"
            )
        got = {name: _given_or_env(given, name) for name in ENV}
        _check_choice(got["schedule"], SCHEDULES)
        _check_choice(got["inner"], INNER_COMPILERS)
        _check_choice(got["mode"], MODES)
        values = {
            "schedule": got["schedule"].value,
            "inner": got["inner"].value,
            "mode": got["mode"].value,
            "debug_dir": _debug_dir(got["debug_dir"]),
            "disable": _disable(got["disable"]),
            "profile": _profile(got["profile"]),
            "slices": _slices(got["slices"]),
            "measure": _flag(got["measure"]),
            "strict": _flag(got["strict"]),
            "exchange_timeout": _seconds(got["exchange_timeout"]),
            "topology": _topology(got["topology"]),
        }
        origins = tuple((name, got[name].origin) for name in ENV)
        return cls(**{k: v for k, v in values.items() if v is not None}, origins=origins)

    def described(self) -> dict[str, dict[str, Any]]:
        """Each option's value and where it came from (report.json's ``options``)."""
        return {
            name: {"value": _plain(getattr(self, name)), "from": origin}
            for name, origin in self.origins
        }


def given_options(
    caller: str, options: Mapping[str, Any] | None, keywords: Mapping[str, Any]
) -> dict[str, Any]:
    """Options given to a function as a mapping or as keywords, not both."""
    if options is not None and keywords:
        raise CommfuseOptionError(
            f"{caller}: give the options as options={{...}} or as keywords, not both"
        )
    return dict(options if options is not None else keywords)


class _Given(NamedTuple):
    """An option's raw value, where messages say it came from, and its origin."""

    value: Any
    where: str  # "option 'x'" or "environment variable NAME (option 'x')"
    origin: str  # "option", "environment variable NAME" or "default" (neither is set)

    @property
    def from_env(self) -> bool:
        return self.origin.startswith("environment")


def _given_or_env(given: Mapping[str, Any], name: str) -> _Given:
    """The option's value, else its environment variable's (a string), else None."""
    if given.get(name) is not None or (name in given and name not in UNSET_BY_NONE):
        return _Given(given[name], where(name, "option"), "option")
    variable = f"environment variable {ENV[name]}"
    raw = os.environ.get(ENV[name], "").strip()
    return _Given(raw or None, where(name, variable), variable if raw else "default")


def where(name: str, origin: str) -> str:
    """Where messages say option ``name`` came from (``origin``: as ``Options.origins``)."""
    return f"option {name!r}" if origin == "option" else f"{origin} (option {name!r})"


def _plain(value: object) -> object:
    if isinstance(value, Topology):
        return value.describe()
    return sorted(value) if isinstance(value, frozenset) else value


def _check_choice(got: _Given, choices: tuple[str, ...]) -> None:
    if got.origin != "default" and got.value not in choices:
        raise CommfuseOptionError(
            f"commfuse: {got.where} must be one of {list(choices)}, got {got.value!r}"
        )


def _debug_dir(got: _Given) -> str | None:
    if got.value is None:
        return None
    if not isinstance(got.value, (str, os.PathLike)):
        raise CommfuseOptionError(f"commfuse: {got.where} must be a path, got {got.value!r}")
    path = os.fspath(got.value)
    problem = dump_dir_problem(path)
    if problem:
        raise CommfuseOptionError(f"commfuse: {got.where}: {problem}")
    return path


def _disable(got: _Given) -> frozenset[str]:
    value = got.value
    if value is None:
        return frozenset()
    if isinstance(value, str) and got.from_env:
        value = [d for d in value.split(",") if d.strip()]
    if isinstance(value, str) or not all(isinstance(d, str) for d in value):
        raise CommfuseOptionError(f"commfuse: {got.where} must be a list of names, got {value!r}")
    return frozenset(d.strip() for d in value)  # names: ``passes.kinds.check_disable``


def _profile(got: _Given) -> str | None:
    if got.value is None:
        return None
    if not isinstance(got.value, (str, os.PathLike)):
        raise CommfuseOptionError(
            f"commfuse: {got.where} must be a profile name or a path, got {got.value!r}"
        )
    from .cost.profiles import ProfileError, load

    try:
        load(got.value)
    except ProfileError as err:
        raise CommfuseOptionError(f"commfuse: {got.where}: {err}") from None
    return os.fspath(got.value)


def _topology(got: _Given) -> Topology | None:
    try:
        topology = parse(got.value)
    except TopologyError as err:
        raise CommfuseOptionError(f"commfuse: {got.where} {err}") from None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if topology is not None and topology.nodes and world not in (None, len(topology.nodes)):
        raise CommfuseOptionError(
            f"commfuse: {got.where} names the node of {len(topology.nodes)} ranks, but the "
            f"job has {world}: give the node of every rank, or the ranks per node"
        )
    return topology


def _slices(got: _Given) -> int:
    if got.origin == "default":
        return 2
    value = got.value
    if isinstance(value, str) and got.from_env and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 < value <= MAX_SLICES:
        raise CommfuseOptionError(
            f"commfuse: {got.where} must be an integer in 2..{MAX_SLICES}, got {value!r}"
        )
    return value


def _seconds(got: _Given) -> float | None:
    if got.value is None:
        return None
    value = got.value
    if isinstance(value, str) and got.from_env:
        with contextlib.suppress(ValueError):
            value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise CommfuseOptionError(
            f"commfuse: {got.where} must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


def _flag(got: _Given) -> bool:
    if got.origin == "default":
        return False
    if isinstance(got.value, str) and got.from_env:
        if got.value.lower() not in TRUE + FALSE:
            raise CommfuseOptionError(
                f"commfuse: {got.where} must be one of {list(TRUE + FALSE)}, got {got.value!r}"
            )
        return got.value.lower() in TRUE
    if not isinstance(got.value, bool):
        raise CommfuseOptionError(f"commfuse: {got.where} must be True or False, got {got.value!r}")
    return got.value


def dump_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be a debug dump's directory (it, or its nearest existing
    parent, is a file), or None. Checked with the options: the dump is written deep
    inside the compile."""
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            if part.is_dir():
                return None
            what = "is a file" if part == Path(path) else f"is inside the file {str(part)!r}"
            return f"{path!r} {what}; give a directory (it is created if missing)"
    return None
