"""The compile queue: work that must not run twice at once, from any thread.

`run(key, fn)` runs fn() in the first thread that asks for `key`; threads asking for the
same key meanwhile wait (without the GIL, interruptible by Ctrl-C) and receive its result,
or its exception. `slot="cuda:0"` also makes the work exclusive on that slot: slots serve
their callers first come, first served, so one GPU runs one autotune benchmark at a time
while other GPUs, and work without a slot (JIT compiles), go on. A thread may re-enter
a key or slot it holds. See Note [Compile queue fairness] in csrc/core/compile_queue.h.

The guards (pydflash/guards/) route autotuning and compiles through here;
`stats()` says how often each key ran and how long callers waited for it.

PYDFLASH_COMPILE_TIMEOUT (seconds) sets the default wait limit; unset waits forever.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ._native import C

T = TypeVar("T")

_TIMEOUT_ENV = "PYDFLASH_COMPILE_TIMEOUT"


def slot_for_device(device: int | None) -> str:
    """The slot name of a device: 'cuda:N', or 'cpu' for None or -1."""
    return "cpu" if device is None or device < 0 else f"cuda:{device}"


def run(
    key: str, fn: Callable[[], T], *, slot: str | None = None, timeout: float | None = None
) -> T:
    """Runs fn() as the holder of `key`, or waits for the current holder and returns its
    result (or raises a copy of its exception, one per caller). `slot`: a resource held
    exclusively while fn runs, e.g. `slot_for_device(0)`. `timeout`: seconds to wait before
    raising pydflash.CompileQueueTimeout (default: `get_timeout()`); 0 or less does not
    wait (Note [One timeout rule] in csrc/python/timeout.h)."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"expected a non-empty str key, got {key!r}")
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    if slot is not None and not isinstance(slot, str):
        raise TypeError(f"expected slot as a str or None, got {type(slot).__name__}")
    label = threading.current_thread().name
    try:
        return C.compile_queue_run(key, _noting(key, label, fn), slot or "", label, timeout)
    except Exception as exc:
        # The holder's exception object is shared by every caller of the key: each
        # raises its own copy, so what one caller adds (a lane names itself) stays its own.
        mine = _own_copy(exc)
        if mine is exc:
            raise
        try:
            raise mine from exc.__cause__
        finally:
            mine = exc = None  # break the frame -> exception -> frame cycle


def _noting(key: str, label: str, fn: Callable[[], T]) -> Callable[[], T]:
    # Waiters re-raise the holder's exception: say where it came from.
    def work() -> T:
        try:
            return fn()
        except Exception as exc:
            exc.add_note(f"raised in the pydflash compile queue by {label}, holding {key!r}")
            raise

    return work


def _own_copy(exc: Exception) -> Exception:
    """A copy of `exc` with its notes and traceback; `exc` itself when its type cannot
    be copied."""
    try:
        mine = copy.copy(exc)
    except Exception:  # noqa: BLE001 - any type copy.copy cannot copy is shared instead
        return exc
    if type(mine) is not type(exc):
        return exc
    mine.__notes__ = list(getattr(exc, "__notes__", ()))  # copy.copy shares the list
    return mine.with_traceback(exc.__traceback__)


def stats() -> dict[str, Any]:
    """Per key: runs (times fn ran), shared (results handed to waiters), waits (calls that
    blocked), failures, wait_s, max_wait_s, run_s; plus totals over all keys."""
    keys = C.compile_queue_stats()
    totals = {
        "runs": sum(s["runs"] for s in keys.values()),
        "shared": sum(s["shared"] for s in keys.values()),
        "waits": sum(s["waits"] for s in keys.values()),
        "failures": sum(s["failures"] for s in keys.values()),
        "wait_s": sum(s["wait_s"] for s in keys.values()),
        "max_wait_s": max((s["max_wait_s"] for s in keys.values()), default=0.0),
    }
    return {**totals, "keys": keys}


def reset_stats() -> None:
    C.compile_queue_reset_stats()


def in_flight() -> list[dict[str, Any]]:
    """Keys being run or waited for now: key, slot, holder (thread name), running,
    since_ns, waiters."""
    return C.compile_queue_in_flight()


def set_timeout(seconds: float | None) -> None:
    """Default wait limit for `run`, in seconds; None waits forever, and 0 or less does
    not wait (Note [One timeout rule] in csrc/python/timeout.h)."""
    C.compile_queue_set_timeout(seconds)


def get_timeout() -> float | None:
    return C.compile_queue_timeout()


def _timeout_from_env() -> None:
    value = os.environ.get(_TIMEOUT_ENV)
    if not value:
        return
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"expected {_TIMEOUT_ENV} in seconds, got {value!r}") from None
    set_timeout(seconds)


_timeout_from_env()
