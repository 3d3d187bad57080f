"""Lanes at interpreter exit: as with concurrent.futures, the program exits once the work
queued on its lanes has run.

A hook that runs before non-daemon threads are joined (where concurrent.futures runs its
own) closes every lane and waits for each to finish what it has. A lane on which no
task has ended for PYDFLASH_EXIT_TIMEOUT seconds (a stuck task), or every lane at Ctrl-C
during the wait, is left: its queued tasks are cancelled and stderr names the lane and
the counts.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lane import Lane

EXIT_TIMEOUT_S = float(os.environ.get("PYDFLASH_EXIT_TIMEOUT", "30"))
_POLL_S = 0.05  # how often the wait looks for progress; Ctrl-C is seen this soon

# Every lane whose worker may still run, also once its dispatcher is gone: a dropped
# dispatcher's queue still runs. A lane is forgotten once its worker has exited. Kept
# as the native lane (_C.Lane) with its dispatcher's name: holding the pydflash.Lane
# would keep it open (Note [Lanes open while held], pydflash/lanes/lane.py).
_lanes: dict[Any, str] = {}  # native lane -> owner, in the order they were made


def track(lanes: Iterable[Lane]) -> None:
    for native in list(_lanes):
        if native.exited or native.forked:
            del _lanes[native]
    _lanes.update((lane._core, lane.owner) for lane in lanes)


class _Progress:
    """A closed lane finishing its queue; stuck once no task of it has ended for
    EXIT_TIMEOUT_S. `lane` is a native lane (_C.Lane)."""

    def __init__(self, lane: Any, name: str) -> None:
        self.lane = lane
        self.name = name
        self.left = lane.load()
        self.since = time.monotonic()
        self.abandoned = False

    @property
    def done(self) -> bool:
        return self.abandoned or self.lane.exited

    def stuck(self) -> bool:
        left, now = self.lane.load(), time.monotonic()
        if left != self.left:
            self.left, self.since = left, now
        return now - self.since >= EXIT_TIMEOUT_S

    def abandon(self, why: str) -> None:
        """Cancels what is still queued and says what is left."""
        if self.done:
            return
        self.abandoned = True
        cancelled = self.lane.shutdown(True)
        running = self.lane.load()  # what is left once the queue is cancelled
        if running or cancelled:
            _say(
                f"exit stopped waiting for {self.name} ({why}): "
                f"{_tasks(running)} left running, {_tasks(cancelled, 'queued')} cancelled"
            )


def _tasks(n: int, kind: str = "") -> str:
    return f"{n} {kind} task{'' if n == 1 else 's'}".replace("  ", " ")


def _say(line: str) -> None:
    if sys.stderr is not None:
        print(f"pydflash: {line}", file=sys.stderr, flush=True)


def _after_ctrl_c() -> bool:
    # The exception that ended the main script, as the interpreter recorded it.
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return isinstance(last, KeyboardInterrupt)


def _names(lanes: list[Any]) -> list[str]:
    """Each native lane as exit messages name it: its label, and its dispatcher when the
    lanes belong to more than one."""
    if len({_lanes[lane] for lane in lanes}) <= 1:
        return [lane.label for lane in lanes]
    return [f"{lane.label} of {_lanes[lane] or 'a lane made alone'}" for lane in lanes]


def _say_waiting(busy: list[_Progress]) -> None:
    stats = [p.lane.stats() for p in busy]
    running = sum(s["running"] + s["on_device"] for s in stats)
    queued = sum(s["queued"] for s in stats)
    labels = ", ".join(p.name for p in busy)
    _say(
        f"exit waits for {labels} to finish {running} running and {_tasks(queued, 'queued')}; "
        f"press Ctrl-C again to stop waiting (a task running longer than "
        f"PYDFLASH_EXIT_TIMEOUT={EXIT_TIMEOUT_S:g} s is left behind)"
    )


def _finish_at_exit() -> None:
    lanes = [lane for lane in list(_lanes) if not (lane.forked or lane.exited)]
    busy = [_Progress(lane, name) for lane, name in zip(lanes, _names(lanes), strict=True)]
    try:
        for progress in busy:
            progress.lane.shutdown(False)  # no new work; what is queued runs
        busy = [p for p in busy if not p.done]
        if busy and _after_ctrl_c():
            _say_waiting(busy)
        while busy:
            busy[0].lane.join(_POLL_S)
            for p in busy:
                if not p.done and p.stuck():
                    p.abandon(f"a task ran past PYDFLASH_EXIT_TIMEOUT={EXIT_TIMEOUT_S:g} s")
            busy = [p for p in busy if not p.done]
    except KeyboardInterrupt:
        for p in busy:
            p.abandon("Ctrl-C")


# Where concurrent.futures' ThreadPoolExecutor registers its own exit hook.
threading._register_atexit(_finish_at_exit)
