"""pydflash.Future: a concurrent.futures.Future whose completion is native.

The state machine and the wait live in C++ (`_C.FutureState`). A Python task's
result or exception is stored here by the worker. The stdlib's waiting machinery
(`_condition`, `_waiters`, done callbacks) is created only when something uses it:
touching `_condition` marks the future observed, and only observed futures cost the
worker a notification (Note [Observed futures] in csrc/core/future.h).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures._base as _base
import threading
from typing import TYPE_CHECKING, Any, Callable

from .errors import CudaError, PydflashError

if TYPE_CHECKING:
    from .lane import Lane

_PENDING, _RUNNING, _CANCELLED, _FINISHED = range(4)
_STATE_NAMES = (_base.PENDING, _base.RUNNING, _base.CANCELLED_AND_NOTIFIED, _base.FINISHED)
_NATIVE_ERRORS = {1: CudaError, 2: PydflashError}


class Future(concurrent.futures.Future):
    """The result of a task on a lane. Works with concurrent.futures.wait,
    as_completed, add_done_callback and asyncio.wrap_future; GPU results also carry
    a CUDA event (see `wait_stream`)."""

    # No super().__init__(): its Condition costs more than the whole native submit.
    def __init__(self, native: Any, lane: Any) -> None:  # noqa: D107
        self._native = native
        self._lane = lane
        self._result = None
        self._exception = None
        self._cond = None
        self._callbacks: list[Callable[[Future], Any]] = []
        self._waiters: list[Any] = []

    # --- what the stdlib's wait()/as_completed() read -------------------------------
    @property
    def _condition(self) -> threading.Condition:
        if self._cond is None:
            self._native.mark_observed()
            self._cond = threading.Condition()
        return self._cond

    @property
    def _state(self) -> str:
        return _STATE_NAMES[self._native.status]

    def _notify(self) -> None:
        """Called once the future is done and observed (by the worker, or by cancel)."""
        with self._condition:
            status = self._native.status
            for waiter in self._waiters:
                if status == _CANCELLED:
                    waiter.add_cancelled(self)
                elif self._failure() is not None:
                    waiter.add_exception(self)
                else:
                    waiter.add_result(self)
            self._condition.notify_all()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._invoke(callback)

    def _invoke(self, callback: Callable[[Future], Any]) -> None:
        try:
            callback(self)
        except Exception:
            _base.LOGGER.exception("exception calling callback for %r", self)

    def _failure(self) -> BaseException | None:
        if self._exception is not None:
            return self._exception
        native_error = self._native.native_error
        if native_error is not None:
            kind, message = native_error
            self._exception = _NATIVE_ERRORS.get(kind, PydflashError)(message)
        return self._exception

    # --- the public Future API --------------------------------------------------------
    @property
    def lane(self) -> Lane:
        """The lane that ran (or will run) the task."""
        return self._lane

    def cancel(self) -> bool:
        if self._native.cancel():
            self._notify()
            return True
        return False

    def cancelled(self) -> bool:
        return self._native.status == _CANCELLED

    def running(self) -> bool:
        return self._native.status == _RUNNING

    def done(self) -> bool:
        return self._native.published()

    def result(self, timeout: float | None = None) -> Any:
        if not self._native.wait(timeout):
            raise TimeoutError()
        if self._native.status == _CANCELLED:
            raise concurrent.futures.CancelledError()
        failure = self._failure()
        if failure is not None:
            try:
                raise failure
            finally:
                self = None  # break the frame -> exception -> frame cycle, as the stdlib does
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._native.wait(timeout):
            raise TimeoutError()
        if self._native.status == _CANCELLED:
            raise concurrent.futures.CancelledError()
        return self._failure()

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        with self._condition:
            if not self._native.done():
                self._callbacks.append(fn)
                return
        self._invoke(fn)

    # Futures complete on their lane, never by hand.
    def set_running_or_notify_cancel(self) -> bool:
        raise RuntimeError("pydflash futures are run by their lane")

    def set_result(self, result: Any) -> None:
        raise RuntimeError("pydflash futures are completed by their lane")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("pydflash futures are completed by their lane")

    # --- CUDA ---------------------------------------------------------------------------
    @property
    def event(self) -> int:
        """The cudaEvent_t (as an int) recorded on the lane stream after the task; 0 on
        CPU lanes."""
        return self._native.event

    def wait_stream(self, stream: Any = None) -> Any:
        """Makes `stream` (default: torch's current stream) wait for this task's GPU work
        without blocking the host, and marks the result's tensors as used on it so the
        caching allocator does not reuse their memory early. Returns the result.
        A no-op wait on CPU lanes."""
        from .handoff import hand_over

        result = self.result()
        if self.event:
            hand_over(result, self.event, stream)
        return result

    def __repr__(self) -> str:
        return f"<pydflash.Future id={self._native.id} state={self._state.lower()}>"
