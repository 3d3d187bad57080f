"""Reversible patches: how every guard changes a module or class, and takes it back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

MISSING = object()


class Change(Protocol):
    def apply(self) -> None: ...

    def undo(self) -> None: ...


@dataclass
class Patch:
    """Sets `owner.name` to `value`; `undo` puts back what `owner.__dict__` held."""

    owner: Any
    name: str
    value: Any
    original: Any = MISSING  # what owner.__dict__ held before

    def apply(self) -> None:
        self.original = vars(self.owner).get(self.name, MISSING)
        setattr(self.owner, self.name, self.value)

    def undo(self) -> None:
        if vars(self.owner).get(self.name, MISSING) is not self.value:
            return  # replaced again since; leave the newer value alone
        if self.original is MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


class Installed:
    """One installed guard: what it could enable here (`features`) and the changes it
    applied, undone in reverse by `uninstall`."""

    def __init__(self) -> None:
        self.features: dict[str, bool] = {}
        self.changes: list[Change] = []

    def apply(self, change: Change) -> None:
        change.apply()
        self.changes.append(change)

    def uninstall(self) -> None:
        for change in reversed(self.changes):
            change.undo()
        self.changes.clear()
