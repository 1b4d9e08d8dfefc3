"""User-facing options of the pass, validated once so that a typo is a clear error."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEDULES = ("auto", "ring", "bidir", "push", "slicing", "off")
INNER_COMPILERS = ("inductor", "eager")
DEBUG_DIR_ENV = "COMMFUSE_DEBUG_DIR"
DISABLE_ENV = "COMMFUSE_DISABLE"
# What ``disable`` can switch off, for bisecting: site kinds, matmul roles, schedules.
DISABLEABLE = (
    "ag_mm",
    "mm_rs",
    "a2a_mm",
    "mm_a2a",
    "rows",
    "contract",
    "columns",
    "contract_left",
    "contract_k",
    "ring",
    "bidir",
    "push",
    "slicing",
)
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
    "slices": "COMMFUSE_SLICES",
    "measure": "COMMFUSE_MEASURE",
    "profile": PROFILE_ENV,
    "debug_dir": DEBUG_DIR_ENV,
    "disable": DISABLE_ENV,
}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
UNSET_BY_NONE = frozenset({"debug_dir", "profile", "disable"})  # None: not given


@dataclasses.dataclass(frozen=True)
class Options:
    schedule: str = "auto"
    inner: str = "inductor"
    debug_dir: str | None = None
    disable: frozenset[str] = frozenset()
    profile: str | None = None  # built-in profile name or profile file; None: by device
    slices: int = 2  # chunks of the slicing schedule
    measure: bool = False  # time each rewritten site's P2P steps into report.json
    # option -> where its value came from: "option", "environment variable NAME", "default"
    origins: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any] | None) -> Options:
        given = {k: v for k, v in (given or {}).items() if k != "origins"}
        known = {f.name for f in dataclasses.fields(cls)} - {"origins"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise CommfuseOptionError(
                f"commfuse: unknown option(s) {unknown}; valid options are {sorted(known)}"
            )
        values, where = {}, {}
        for name in ENV:
            values[name], where[name] = _given_or_env(given, name)
        _check_choice(where["schedule"], values["schedule"], SCHEDULES)
        _check_choice(where["inner"], values["inner"], INNER_COMPILERS)
        values["debug_dir"] = _debug_dir(values["debug_dir"], where["debug_dir"])
        values["disable"] = _disable(values["disable"], where["disable"])
        values["profile"] = _profile(values["profile"], where["profile"])
        values["slices"] = _slices(values["slices"], where["slices"])
        values["measure"] = _measure(values["measure"], where["measure"])
        origins = tuple((name, _origin(where[name], values[name])) for name in ENV)
        return cls(**{k: v for k, v in values.items() if v is not None}, origins=origins)

    def described(self) -> dict[str, dict[str, Any]]:
        """Each option's value and where it came from (report.json's ``options``)."""
        return {
            name: {"value": _plain(getattr(self, name)), "from": origin}
            for name, origin in self.origins
        }


def _given_or_env(given: Mapping[str, Any], name: str) -> tuple[Any, str]:
    """The option's value, else its environment variable's (a string), else None; and
    where it came from, as messages name it."""
    if given.get(name) is not None or (name in given and name not in UNSET_BY_NONE):
        return given[name], f"option {name!r}"
    raw = os.environ.get(ENV[name], "").strip()
    return (raw or None), f"environment variable {ENV[name]} (option {name!r})"


def _origin(where: str, value: object) -> str:
    if where.startswith("option"):
        return "option"
    return where.split(" (")[0] if value is not None and value != frozenset() else "default"


def _plain(value: object) -> object:
    return sorted(value) if isinstance(value, frozenset) else value


def _debug_dir(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise CommfuseOptionError(f"commfuse: {where} must be a path, got {value!r}")
    path = os.fspath(value)
    problem = dump_dir_problem(path)
    if problem:
        raise CommfuseOptionError(f"commfuse: {where}: {problem}")
    return path


def _disable(value: Any, where: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str) and where.startswith("environment"):
        value = [d for d in value.split(",") if d.strip()]
    if isinstance(value, str) or not all(isinstance(d, str) for d in value):
        raise CommfuseOptionError(f"commfuse: {where} must be a list of names, got {value!r}")
    names = frozenset(d.strip() for d in value)
    if names - set(DISABLEABLE):
        raise CommfuseOptionError(
            f"commfuse: {where}: cannot disable {sorted(names - set(DISABLEABLE))}; "
            f"names are {list(DISABLEABLE)}"
        )
    return names


def _profile(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise CommfuseOptionError(
            f"commfuse: {where} must be a profile name or a path, got {value!r}"
        )
    from .cost.profiles import ProfileError, load

    try:
        load(value)
    except ProfileError as err:
        raise CommfuseOptionError(f"commfuse: {where}: {err}") from None
    return os.fspath(value)


def _slices(value: Any, where: str) -> int:
    if value is None and _unset(where):
        return 2
    if isinstance(value, str) and where.startswith("environment") and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 < value <= MAX_SLICES:
        raise CommfuseOptionError(
            f"commfuse: {where} must be an integer in 2..{MAX_SLICES}, got {value!r}"
        )
    return value


def _measure(value: Any, where: str) -> bool:
    if value is None and _unset(where):
        return False
    if isinstance(value, str) and where.startswith("environment"):
        if value.lower() not in TRUE + FALSE:
            raise CommfuseOptionError(
                f"commfuse: {where} must be one of {list(TRUE + FALSE)}, got {value!r}"
            )
        return value.lower() in TRUE
    if not isinstance(value, bool):
        raise CommfuseOptionError(f"commfuse: {where} must be True or False, got {value!r}")
    return value


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


def _unset(where: str) -> bool:
    """A None that means "not given": neither the option nor its variable is set."""
    return where.startswith("environment")


def _check_choice(where: str, value: object, choices: tuple[str, ...]) -> None:
    if not (value is None and _unset(where)) and value not in choices:
        raise CommfuseOptionError(
            f"commfuse: {where} must be one of {list(choices)}, got {value!r}"
        )
