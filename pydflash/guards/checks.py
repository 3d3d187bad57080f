"""Drift checks: the Triton guard reproduces or wraps Triton internals, so before it
patches anything it checks that each of them still reads as in the releases it was
written against, and refuses to install (listing every difference) when one moved."""

from __future__ import annotations

import inspect
from typing import Any

from .._version import __version__
from ..errors import UnsupportedTritonError
from .patching import MISSING

# Triton releases whose internals were read when this guard was written. Others are
# accepted when the same internals are found (checked at install), refused otherwise.
CHECKED_TRITON_VERSIONS = ("3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.9.0")


def _squash(text: str) -> str:
    return "".join(text.split())


def _source(obj: Any) -> str | None:
    try:
        return _squash(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


class Checker:
    """Collects every internal that is missing, so one error lists them all."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def source_has(self, what: str, obj: Any, snippets: tuple[str, ...]) -> bool:
        source = _source(obj)
        if source is None:
            self.problems.append(f"{what}: source not available")
            return False
        missing = [s for s in snippets if _squash(s) not in source]
        for s in missing:
            self.problems.append(f"{what} no longer contains `{s}`")
        return not missing

    def has_attr(self, what: str, owner: Any, name: str) -> bool:
        if getattr(owner, name, MISSING) is MISSING:
            self.problems.append(f"{what} has no `{name}`")
            return False
        return True

    def raise_if_any(self, triton: Any) -> None:
        if self.problems:
            raise UnsupportedTritonError(
                f"pydflash {__version__} cannot guard Triton {getattr(triton, '__version__', '?')}"
                f" (read for {', '.join(CHECKED_TRITON_VERSIONS)}): "
                + "; ".join(self.problems)
                + ". Without the guard, autotuning from several threads is unsafe; pass "
                "Dispatcher(guard=()) to run without it."
            )
