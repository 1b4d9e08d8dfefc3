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


@dataclasses.dataclass(frozen=True)
class Options:
    schedule: str = "auto"
    inner: str = "inductor"
    debug_dir: str | None = None
    disable: frozenset[str] = frozenset()
    profile: str | None = None  # built-in profile name or profile file; None: by device
    slices: int = 2  # chunks of the slicing schedule
    measure: bool = False  # time each rewritten site's P2P steps into report.json

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any] | None) -> Options:
        given = dict(given or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise CommfuseOptionError(
                f"commfuse: unknown option(s) {unknown}; valid options are {sorted(known)}"
            )
        _check_choice("schedule", given.get("schedule", "auto"), SCHEDULES)
        _check_choice("inner", given.get("inner", "inductor"), INNER_COMPILERS)
        debug_dir, where = _path_or_env(given, "debug_dir", DEBUG_DIR_ENV, "a path")
        if debug_dir is not None:
            debug_dir = os.fspath(debug_dir)
            problem = dump_dir_problem(debug_dir)
            if problem:
                raise CommfuseOptionError(f"commfuse: {where}: {problem}")
        given["debug_dir"] = debug_dir
        disable, where = given.get("disable"), "option 'disable'"
        if disable is None:
            where = _from_env(DISABLE_ENV, "disable")
            disable = [d for d in os.environ.get(DISABLE_ENV, "").split(",") if d.strip()]
        if isinstance(disable, str) or not all(isinstance(d, str) for d in disable):
            raise CommfuseOptionError(
                f"commfuse: option 'disable' must be a list of names, got {disable!r}"
            )
        names = frozenset(d.strip() for d in disable)
        if names - set(DISABLEABLE):
            raise CommfuseOptionError(
                f"commfuse: {where}: cannot disable {sorted(names - set(DISABLEABLE))}; "
                f"names are {list(DISABLEABLE)}"
            )
        given["disable"] = names
        profile, where = _path_or_env(given, "profile", PROFILE_ENV, "a profile name or a path")
        if profile is not None:
            from .cost.profiles import ProfileError, load

            try:
                load(profile)
            except ProfileError as err:
                raise CommfuseOptionError(f"commfuse: {where}: {err}") from None
            given["profile"] = os.fspath(profile)
        slices = given.get("slices", 2)
        if not isinstance(slices, int) or isinstance(slices, bool) or not 1 < slices <= MAX_SLICES:
            raise CommfuseOptionError(
                f"commfuse: option 'slices' must be an integer in 2..{MAX_SLICES}, got {slices!r}"
            )
        if not isinstance(given.get("measure", False), bool):
            raise CommfuseOptionError(
                f"commfuse: option 'measure' must be True or False, got {given['measure']!r}"
            )
        return cls(**given)


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


def _path_or_env(given: Mapping[str, Any], name: str, env: str, what: str) -> tuple[Any, str]:
    """The option's value, else the environment variable's, and where it came from (for
    messages); must be ``what`` (a path)."""
    value = given.get(name)
    if value is None:
        return os.environ.get(env) or None, _from_env(env, name)
    if not isinstance(value, (str, os.PathLike)):
        raise CommfuseOptionError(f"commfuse: option {name!r} must be {what}, got {value!r}")
    return value, f"option {name!r}"


def _from_env(env: str, name: str) -> str:
    return f"environment variable {env} (option {name!r})"


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise CommfuseOptionError(
            f"commfuse: option {name!r} must be one of {list(choices)}, got {value!r}"
        )
