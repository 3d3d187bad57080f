"""pydflash.Future: a concurrent.futures.Future whose completion is native.

The state machine, the wait, result(), done() and cancel() are C (`_C.FutureBase`, in
csrc/python/future_object.cpp); a Python task's result or exception is stored there
by the worker. The stdlib's waiting machinery (`_condition`, `_waiters`, done
callbacks) is created only when something uses it: touching `_condition` marks the
future observed, and only observed futures cost the worker a notification, which it
makes natively (Note [Observed futures] in csrc/core/future.h).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures._base as _base
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._native import C

if TYPE_CHECKING:
    from .lane import Lane

_CANCELLED = 2
_FINISHED = 3
_STATE_NAMES = ("pending", "running", "cancelled", "finished")  # by _status


class Future(C.FutureBase, concurrent.futures.Future):
    """The result of a task on a lane. Works with concurrent.futures.wait,
    as_completed, add_done_callback and asyncio.wrap_future; GPU results also carry
    a CUDA event (`event`, `wait_stream`). Made by `Lane.submit`, never by hand."""

    # --- what the C half calls --------------------------------------------------------
    def _invoke(self, callback: Callable[[Future], Any]) -> None:
        # On the caller's thread (added when done, or a cancel): as the stdlib's Future.
        try:
            callback(self)
        except Exception:  # noqa: BLE001 - logged and swallowed, as the stdlib's Future does
            _base.LOGGER.exception("exception calling callback for %r", self)

    def _invoke_on_lane(self, callback: Callable[[Future], Any]) -> None:
        # On the lane's worker, which completed the future: whatever the callback raises,
        # SystemExit included, is logged and the lane goes on. A ThreadPoolExecutor
        # worker likewise logs what escapes its callbacks, and the process goes on.
        try:
            callback(self)
        except BaseException:  # noqa: BLE001 - nothing may end the lane's worker
            _base.LOGGER.exception("exception calling callback for %r", self)

    def _failure(self) -> BaseException | None:
        if self._exception is None:
            # A graph launch fails natively, as a typed C++ error (csrc/python/bind_errors.cpp).
            failure = self._native_failure
            if failure is not None:
                self._exception = failure
        return self._exception

    def _raise_failure(self) -> None:
        if self._status == _CANCELLED:
            raise concurrent.futures.CancelledError()
        try:
            raise self._failure()
        finally:
            self = None  # break the frame -> exception -> frame cycle, as the stdlib does

    # --- the public Future API (result, done, cancelled, running, cancel are C) ------
    @property
    def lane(self) -> Lane | None:
        """The lane that runs the task; None once nothing else holds that lane (a future
        does not keep its lanes open: Note [Lanes open while held] in pydflash/lanes/lane.py)."""
        return self._lane()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._wait(timeout):
            raise TimeoutError()
        if self._status == _CANCELLED:
            raise concurrent.futures.CancelledError()
        return self._failure()

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """As the stdlib's: `fn(future)` runs on the thread that completes the future (its
        lane's worker, or the thread that cancels it), or here at once when it is done."""
        if not self._add_callback(fn):
            self._invoke(fn)

    # Futures complete on their lane, never by hand.
    def set_running_or_notify_cancel(self) -> bool:
        raise RuntimeError("pydflash futures are run by their lane")

    def set_result(self, result: Any) -> None:
        raise RuntimeError("pydflash futures are completed by their lane")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("pydflash futures are completed by their lane")

    # --- for the code that submitted the task ------------------------------------------
    def replace_result(self, value: Any) -> None:
        """Replaces what result() returns: a graph launch (Lane.submit_graph), whose task
        has no value of its own, gets the graph's static outputs (pydflash.graphs); a
        consumer that has taken the result drops it (None) so that the future no longer
        keeps it alive (pydflash.pipeline). A failure of the task still wins."""
        self._result = value

    def forward_failure(self, failure: BaseException) -> None:
        """Makes this future fail with `failure`, the failure of work its task depends on,
        whatever the task itself does: a graph launch fails with the error of its copy-in
        (pydflash.graphs). Call it before the task finishes or before handing the future
        out; result(), exception() and concurrent.futures.wait then report `failure`."""
        if not isinstance(failure, BaseException):
            raise TypeError(f"expected an exception, got {type(failure).__name__}")
        self._exception = failure

    # --- CUDA ---------------------------------------------------------------------------
    def wait_stream(self, stream: Any = None) -> Any:
        """Makes `stream` (default: the current stream of the device each result tensor is
        on, where torch issues its reads) wait for this task's GPU work
        without blocking the host, and marks the result's tensors as used on it so the
        caching allocator does not reuse their memory early (Note [Tensors across
        streams] in pydflash/lanes/handoff.py). Returns the result. On CPU lanes: the result."""
        result = self.result()
        if self.event:
            from .handoff import hand_over

            hand_over(result, self.event, stream)
        return result

    def __repr__(self) -> str:
        # concurrent.futures.Future's form, which its tests and tools read.
        status = self._status
        head = f"<Future at {id(self):#x} state={_STATE_NAMES[status]}"
        if status != _FINISHED:
            return head + ">"
        failure = self._failure()
        if failure is not None:
            return f"{head} raised {type(failure).__name__}>"
        return f"{head} returned {type(self._result).__name__}>"
