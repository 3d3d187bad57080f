"""Argument checks shared by the public classes, so each message reads the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def counted(value: Any, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """`value` as a count of at least `minimum` (and at most `maximum`): a TypeError for a
    non-int (bool included), a ValueError out of bounds."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected {name} to be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"expected {name} >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"expected {name} <= {maximum}, got {value}")
    return value


def per_lane(
    value: Any,
    count: int,
    name: str,
    kind: str,
    accepts: Callable[[Any], bool],
    *,
    one_each: str | None = None,
) -> list[Any]:
    """One value per lane: a sequence of `count` values, or a single value shared by all
    lanes. `one_each` names lanes that each need their own: one value is then refused
    for several lanes, and so is one object given twice. `kind` says in errors what
    `accepts` takes."""
    if accepts(value):
        if count > 1 and one_each is not None:
            raise ValueError(f"expected one {name} per {one_each} ({count}), got one {name}")
        return [value] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"expected {count} {name}s (one per lane), got {len(value)}")
        for item in value:
            if not accepts(item):
                raise TypeError(f"expected each {name} to be {kind}, got {type(item).__name__}")
        if one_each is not None:
            first: dict[int, int] = {}
            for i, item in enumerate(value):
                j = first.setdefault(id(item), i)
                if j != i:
                    raise ValueError(
                        f"expected a distinct {name} per {one_each}, got the same {name} for "
                        f"{one_each}s {j} and {i}"
                    )
        return list(value)
    raise TypeError(f"expected {name} to be {kind} or a list of them, got {type(value).__name__}")
