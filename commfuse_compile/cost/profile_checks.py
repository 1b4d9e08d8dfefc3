"""Checks of a profile's JSON form (``profiles.from_json``): every field of the kind it
must be, so that a wrong file fails where it is loaded, naming the field, and not later
inside the pass."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

# what ``calibrate`` measures; a profile file may lack a collective (those written before
# all-to-alls or all-reduces were measured): the model then times that collective with the
# ring formula (an all-reduce: a reduce-scatter, then an all-gather)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


class ProfileError(ValueError):
    """A profile name or file that cannot be used."""


# divisors: > 0
RATES = (
    *("matmul_flops", "flops", "memory_bytes_per_s", "link_bytes_per_s", "bytes_per_s"),
    "ranks_per_nic",
)


def checked(
    cls: type,
    fields: object,
    where: str,
    by_caller: Sequence[str] = (),
    nullable: Sequence[str] = (),
) -> dict[str, Any]:
    """``fields`` as the keywords of dataclass ``cls``, each checked (but not converted):
    those in ``by_caller`` are checked by the caller, those in ``nullable`` may be null."""
    if not isinstance(fields, dict):
        raise ProfileError(f"{where} must hold a JSON object, got {type(fields).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    required = [
        n
        for n, f in known.items()
        if f.default is dataclasses.MISSING and (f.default_factory is dataclasses.MISSING)
    ]
    missing = [n for n in required if n not in fields]
    unknown = sorted(set(fields) - set(known))
    if missing or unknown:
        parts = [f"missing {missing}"] if missing else []
        parts += [f"unknown {unknown}"] if unknown else []
        raise ProfileError(f"{where}: fields {'; '.join(parts)}")
    for name, value in fields.items():
        if name in by_caller or (name in nullable and value is None):
            continue
        problem = (
            collectives_problem(value) if name == "collectives" else field_problem(name, value)
        )
        if problem:
            raise ProfileError(f"{where}: {name} {problem}")
    return dict(fields)


def collectives_problem(value: object) -> str | None:
    """``{"all_gather": {"2": {"latency_s", "seconds_per_byte", "points"}}}`` or why not."""
    if not isinstance(value, dict):
        return f"must be an object by collective, got {value!r}"
    for collective, curves in value.items():
        if collective not in COLLECTIVES or not isinstance(curves, dict):
            return f"has {collective!r}: collectives are {list(COLLECTIVES)}, each by group size"
        for n, curve in curves.items():
            if not str(n).isdigit() or int(n) < 2:
                return f"{collective}: group size {n!r} is not an integer >= 2"
            if not isinstance(curve, dict) or set(curve) != {
                "latency_s",
                "seconds_per_byte",
                "points",
            }:
                return f"{collective} {n}: needs latency_s, seconds_per_byte and points"
            for field in ("latency_s", "seconds_per_byte"):
                problem = field_problem(field, curve[field])
                if problem:
                    return f"{collective} {n} {field} {problem}"
            points = curve["points"]
            if not isinstance(points, list) or not all(
                isinstance(pair, list)
                and len(pair) == 2
                and not any(field_problem("points", v) for v in pair)
                for pair in points
            ):
                return (
                    f"{collective} {n}: points must be [block bytes, seconds] pairs, got {points!r}"
                )
    return None


def field_problem(name: str, value: object) -> str | None:
    """Why a loaded field cannot feed the model (a string where a rate belongs would
    only fail later, inside the pass), or None."""
    if name in ("name", "source"):
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    if name in ("duplex_neighbours", "duplex"):
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if name in ("ranks_per_nic", "ranks_per_node") and not (
        isinstance(value, int) and not isinstance(value, bool) and value >= 0
    ):
        return f"must be a whole number, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if name in RATES and value <= 0:
        return f"must be positive, got {value!r}"
    if value < 0:
        return f"must not be negative, got {value!r}"
    return None
