"""Waiting for several futures at once and reporting every failure, not only the first."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Iterable
from typing import Any


def _lane_name(future: concurrent.futures.Future) -> str:
    lane = getattr(future, "lane", None)
    return f"pydflash {lane.label}" if lane is not None else "an executor outside pydflash"


def wait_all(
    futures: Iterable[concurrent.futures.Future], timeout: float | None = None
) -> list[Any]:
    """Waits until every future is done and returns their results, in order.

    If any task raised or was cancelled, raises an ExceptionGroup of all of them (in
    order) once every future is done; each carries a note naming the lane it ran on.
    Raises TimeoutError, naming the lanes still busy, when they are not all done
    within `timeout` seconds; None waits forever, and 0 or less does not wait, as in
    concurrent.futures (Note [One timeout rule] in csrc/python/timeout.h). Ctrl-C
    interrupts the wait.
    """
    futures = list(futures)
    for i, future in enumerate(futures):
        if not isinstance(future, concurrent.futures.Future):
            raise TypeError(
                f"expected concurrent.futures.Future objects, got {type(future).__name__} "
                f"at index {i}"
            )
    if timeout is not None and not isinstance(timeout, (int, float)):
        raise TypeError(f"expected a timeout in seconds or None, got {type(timeout).__name__}")
    if timeout == math.inf:  # waits forever, as None does (Note [One timeout rule])
        timeout = None
    elif timeout is not None and timeout > threading.TIMEOUT_MAX:
        try:
            got = repr(float(timeout) and timeout)
        except OverflowError:  # its digits would fill the screen
            got = "an int too large to convert to float"
        raise OverflowError(
            "expected a timeout of at most threading.TIMEOUT_MAX "
            f"({threading.TIMEOUT_MAX:.0f} s), or None or float('inf') to wait forever, "
            f"got {got}"
        )

    deadline = None if timeout is None else time.monotonic() + (timeout if timeout > 0 else 0.0)
    for future in futures:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            future.exception(remaining)
        except concurrent.futures.CancelledError:
            pass
        except TimeoutError:
            busy = [f for f in futures if not f.done()]
            lanes = sorted({_lane_name(f) for f in busy})
            raise TimeoutError(
                f"{len(busy)} of {len(futures)} futures not done after {timeout} s "
                f"(on {', '.join(lanes)})"
            ) from None

    results: list[Any] = []
    failures: list[BaseException] = []
    for future in futures:
        if future.cancelled():
            cancelled = concurrent.futures.CancelledError(
                f"cancelled before it ran on {_lane_name(future)}"
            )
            failures.append(cancelled)
            continue
        error = future.exception()
        if error is None:
            results.append(future.result())
            continue
        note = f"raised in {_lane_name(future)}"
        if not any(note in n for n in getattr(error, "__notes__", ())):
            error.add_note(note)
        failures.append(error)
    if failures:
        # BaseExceptionGroup builds a plain ExceptionGroup unless a task raised a
        # BaseException (KeyboardInterrupt, SystemExit), which ExceptionGroup refuses.
        raise BaseExceptionGroup(f"{len(failures)} of {len(futures)} tasks failed", failures)
    return results
