"""The interpreter: under `TRITON_INTERPRET=1` interpreted launches are serialized,
because the interpreter keeps its launch state (grid position, patched
`triton.language`) in globals."""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .checks import Checker
from .patching import Change, Patch

_lock = threading.RLock()


def interpreting() -> bool:
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def plan(check: Checker) -> list[Change]:
    from triton.runtime import interpreter

    if not check.has_attr("triton.runtime.interpreter", interpreter, "GridExecutor"):
        return []
    executor = interpreter.GridExecutor
    if "__call__" not in vars(executor):
        check.problems.append("triton.runtime.interpreter.GridExecutor defines no __call__")
        return []
    # Every interpreted launch, whichever way it was made, runs a GridExecutor.
    return [Patch(executor, "__call__", _make_serialized(executor.__call__))]


def _make_serialized(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            return original(self, *args, **kwargs)

    functools.update_wrapper(run, original)
    return run
