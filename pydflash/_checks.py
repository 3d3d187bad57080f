"""Argument checks shared by the public classes, so each message reads the same."""

from __future__ import annotations

from typing import Any


def counted(value: Any, name: str, *, minimum: int = 1) -> int:
    """`value` as a count of at least `minimum`: a TypeError for a non-int (bool included),
    a ValueError below the minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected {name} to be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"expected {name} >= {minimum}, got {value}")
    return value
