"""What a pipeline shares between its driver, its lane tasks and their done-callbacks:
the futures outstanding and the first failure, the microbatches in flight, the hidden
bytes they hold and the counters, all under one condition.

The driver (the thread iterating `Pipeline.run`) submits and waits; lane workers run the
tasks and then the done-callbacks, which count what ended and wake the driver. Every
method here takes the condition itself, so no caller touches the state without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PipelineError
from ._failures import Outstanding, failure_of
from ._flight import Flight, FlightWindow, HiddenBytes, StepTasks

if TYPE_CHECKING:
    from ..lanes._future import Future
    from ..lanes.lane import Lane


@dataclass(frozen=True, slots=True)
class Task:
    """What a submitted future is: its stage (one of _failures.STAGES) on `lane`, for
    microbatch `k` or optimizer `step`; a drafter task's `flight`, which ends with it;
    and whether a stop may cancel it."""

    stage: str
    lane: Lane
    k: int | None = None
    step: int | None = None
    flight: Flight | None = None
    cancellable: bool = True


class Tracker:
    """The pipeline's shared state; see the comment at `_cond` for what it holds."""

    def __init__(self, depth: int, replicas: int) -> None:
        # Guards every field below, the fields of each Flight while it is in the window
        # (after it left, only the driver touches it) and each StepTasks from watch_step.
        # Must be held to read or change them; a change the driver may wait for notifies
        # it. Nothing that blocks (a future's result, an event's synchronize, a lane
        # submit) runs while it is held.
        self._cond = threading.Condition()
        self._active = False  # a run is going
        self._outstanding = Outstanding()  # futures not seen end; the first failure
        self._window = FlightWindow(depth)  # the microbatches in flight
        self._hidden = HiddenBytes()  # the hidden-state bytes they hold
        self._last_drafter: list[Future | None] = [None] * replicas  # per replica, latest
        self._microbatches = 0  # trained (forward and backward done)
        self._steps = 0  # applied on every replica

    # --- runs -----------------------------------------------------------------------------
    @property
    def failure(self) -> PipelineError | None:
        with self._cond:
            return self._outstanding.failure

    @property
    def steps(self) -> int:
        with self._cond:
            return self._steps

    def check_usable(self) -> None:
        """A PipelineError once a failure stopped the pipeline."""
        with self._cond:
            self._check_usable()

    def _check_usable(self) -> None:
        failure = self._outstanding.failure
        if failure is not None:
            raise PipelineError(
                "this pipeline stopped after a failure; build a new one", stage=failure.stage
            ) from failure

    def start_run(self) -> None:
        """Marks a run going, with an empty window; a PipelineError if one is already, or
        after a failure."""
        with self._cond:
            self._check_usable()
            if self._active:
                raise PipelineError("this pipeline is already running")
            self._active = True
            self._window.clear()
            self._last_drafter = [None] * len(self._last_drafter)

    def end_run(self) -> None:
        with self._cond:
            self._active = False

    def _wait_for(self, predicate: Callable[[], bool]) -> None:
        """Waits until `predicate()` (called with the condition held) or a failure."""
        with self._cond:
            self._cond.wait_for(lambda: self._outstanding.failure is not None or predicate())

    def wait_ended(self, flight: Flight) -> None:
        """Waits until `flight`'s drafter task ended, or a failure."""
        self._wait_for(lambda: flight.ended)

    def wait_idle(self) -> None:
        """Waits until no future is outstanding, or a failure."""
        self._wait_for(lambda: not self._outstanding)

    def fail(self, error: PipelineError) -> None:
        with self._cond:
            self._outstanding.fail(error)
            self._cond.notify_all()

    # --- the window -------------------------------------------------------------------------
    def oldest_to_leave(self) -> Flight | None:
        """The flight microbatch k waits for before it enters: the oldest, when full."""
        with self._cond:
            return self._window.oldest() if self._window.full else None

    def leave_oldest(self) -> None:
        with self._cond:
            self._window.leave_oldest()

    def enter(self, k: int) -> Flight:
        with self._cond:
            flight = self._window.enter(k)
            self._hidden.open(k)
            return flight

    def cancel_newest(self) -> None:
        """The newest flight's tasks were never submitted: it leaves."""
        with self._cond:
            self._hidden.release(self._window.cancel_newest().k)
            self._cond.notify_all()

    def set_event(self, flight: Flight, event: Any, held: Any = None) -> None:
        """The event after `flight`'s GPU work, and what its stream programs read."""
        with self._cond:
            flight.event, flight.held = event, held

    def hold(self, k: int, nbytes: int) -> None:
        with self._cond:
            self._hidden.hold(k, nbytes)

    def last_drafter(self, replica: int) -> Future | None:
        with self._cond:
            return self._last_drafter[replica]

    def drafter_submitted(self, replica: int, future: Future) -> None:
        with self._cond:
            self._last_drafter[replica] = future

    # --- futures ----------------------------------------------------------------------------
    def track(
        self,
        future: Future,
        task: Task,
        *,
        on_result: Callable[[Future], None] | None = None,
        upstream: tuple[Future, Task] | None = None,
    ) -> None:
        """Counts `future` outstanding until its done callback, which calls `on_result`
        when it succeeded. `upstream`: a target future this one waits for, with no
        callback of its own (Note [Native microbatch]): counted outstanding here too, and
        ended by this one's callback, first, so that its failure is the one reported."""
        with self._cond:
            if upstream is not None:
                self._outstanding.add(upstream[0], cancellable=upstream[1].cancellable)
            self._outstanding.add(future, cancellable=task.cancellable)

        def done(f: Future) -> None:
            if upstream is not None:
                target, target_task = upstream
                if target.done():
                    self._ended(target, target_task)
                else:  # cancelled before it waited for the target
                    target.add_done_callback(lambda t: self._ended(t, target_task))
            self._ended(f, task, on_result)

        future.add_done_callback(done)

    def _ended(
        self, f: Future, task: Task, on_result: Callable[[Future], None] | None = None
    ) -> None:
        trained = not f.cancelled() and f.exception() is None
        if trained and on_result is not None:
            on_result(f)
        failure = failure_of(f, task.stage, task.k, task.lane, step=task.step)
        with self._cond:
            self._outstanding.ended(f)
            if failure is not None:
                self._outstanding.fail(failure)
            if task.flight is not None:
                task.flight.ended = True
                self._hidden.release(task.flight.k)
                self._microbatches += trained
            self._cond.notify_all()

    def watch_step(self, futures: list[Future]) -> StepTasks:
        """Counts the step applied once all its optimizer tasks ended well."""
        tasks = StepTasks(len(futures))

        def done(f: Future) -> None:
            ok = not f.cancelled() and f.exception() is None
            with self._cond:
                self._steps += tasks.task_ended(ok)
                self._cond.notify_all()

        for future in futures:
            future.add_done_callback(done)
        return tasks

    def step_ended(self, tasks: StepTasks) -> bool:
        with self._cond:
            return tasks.ended

    def wait_step(self, tasks: StepTasks) -> None:
        """Waits until the step's optimizer tasks all ended, or a failure."""
        self._wait_for(lambda: tasks.ended)

    # --- stopping ---------------------------------------------------------------------------
    def to_stop(self) -> tuple[list[Future], list[Future]]:
        """Every outstanding future and those a stop cancels, newest first."""
        with self._cond:
            return self._outstanding.to_stop()

    def holds_buffers(self) -> bool:
        with self._cond:
            return self._window.holds_buffers()

    def stopped(self) -> int:
        """Every microbatch left (the pipeline stopped); the steps applied."""
        with self._cond:
            self._window.clear()
            self._hidden.release_all()
            return self._steps

    def hidden_entries(self) -> int:
        """The microbatches the hidden-byte ledger keeps an entry for (at most depth)."""
        with self._cond:
            return len(self._hidden)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "steps": self._steps,
                "microbatches": self._microbatches,
                "cancelled": self._outstanding.cancelled,
                "in_flight": self._window.in_flight(),
                **self._hidden.stats(),
            }
