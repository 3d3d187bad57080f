"""What a pipeline has in flight: the window of microbatches between target submit and
drafter completion (at most `depth`), the hidden-state bytes they hold, and each step's
optimizer tasks. None of these is locked: the pipeline's Tracker (_tracker.py) calls
them under its condition.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class Flight:
    """One microbatch in the window: the event recorded after its drafter task's GPU
    work (GPU lanes), whether that task has ended (its done callback has run, so the
    pipeline's counts include it), and, for stream programs, what they read."""

    __slots__ = ("ended", "event", "held", "k")

    def __init__(self, k: int) -> None:
        self.k = k
        self.event: Any = None
        self.ended = False
        self.held: Any = None  # what its stream programs read, kept until `event` passed


class FlightWindow:
    """The microbatches in flight, oldest first: one deque of at most `depth` flights.

    Microbatch k enters once microbatch k - depth has left: its drafter task ended and
    its GPU work passed (`leave_oldest`). Flights are consecutive microbatches of one
    run; a run starts with the window empty."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._flights: deque[Flight] = deque()

    @property
    def full(self) -> bool:
        return len(self._flights) == self.depth

    def oldest(self) -> Flight:
        return self._flights[0]

    def leave_oldest(self) -> Flight:
        """Removes the oldest flight, whose task has ended; the caller waits on its event."""
        assert self._flights[0].ended, self._flights[0].k
        return self._flights.popleft()

    def enter(self, k: int) -> Flight:
        assert not self.full and (not self._flights or self._flights[-1].k == k - 1), k
        flight = Flight(k)
        self._flights.append(flight)
        return flight

    def cancel_newest(self) -> Flight:
        """Removes the newest flight, whose tasks were never submitted."""
        return self._flights.pop()

    def clear(self) -> None:
        self._flights.clear()

    def holds_buffers(self) -> bool:
        """Whether a flight holds what its stream programs read (until their GPU work ends)."""
        return any(f.held is not None for f in self._flights)

    def in_flight(self) -> int:
        """Microbatches whose drafter task has not ended."""
        return sum(not flight.ended for flight in self._flights)


class HiddenBytes:
    """The bytes of hidden states a pipeline holds: each microbatch's target result from
    when it is produced, plus its copy on another device, until the microbatch leaves.

    Invariant: `held` is the sum of the open microbatches' entries, `peak` the most
    `held` has been, and `per_microbatch` the most one entry has been. A microbatch is
    open from when it enters the window (`open`) until it leaves (`release`), so at most
    the window's depth are open and the ledger stays that small however long a run is.
    Bytes of a microbatch that is not open, such as its target's arriving after it left,
    are not counted."""

    def __init__(self) -> None:
        self._by_microbatch: dict[int, int] = {}  # the open microbatches' bytes
        self._held = 0
        self._peak = 0
        self._per_microbatch = 0

    def __len__(self) -> int:
        """The microbatches the ledger keeps an entry for: the open ones."""
        return len(self._by_microbatch)

    def open(self, k: int) -> None:
        """Microbatch k entered the window: its bytes count from now until it leaves."""
        self._by_microbatch.setdefault(k, 0)

    def hold(self, k: int, nbytes: int) -> None:
        """Counts `nbytes` more for microbatch k, unless it is not open."""
        if k not in self._by_microbatch:
            return
        held = self._by_microbatch[k] + nbytes
        self._by_microbatch[k] = held
        self._per_microbatch = max(self._per_microbatch, held)
        self._held += nbytes
        self._peak = max(self._peak, self._held)

    def release(self, k: int) -> None:
        """Microbatch k left: its bytes no longer count, nor do any that come later (the
        target's done-callback can run after the drafter has finished)."""
        self._held -= self._by_microbatch.pop(k, 0)

    def release_all(self) -> None:
        """Every microbatch left (the pipeline stopped)."""
        self._by_microbatch.clear()
        self._held = 0

    def stats(self) -> dict[str, int]:
        return {
            "hidden_bytes_held": self._held,
            "hidden_bytes_peak": self._peak,
            "hidden_bytes_per_microbatch": self._per_microbatch,
        }


class StepTasks:
    """The optimizer tasks of one step (one per drafter lane): the step is applied once
    all of them have ended, and only if all succeeded."""

    def __init__(self, count: int) -> None:
        self._pending = count
        self._failed = False

    @property
    def ended(self) -> bool:
        return self._pending == 0

    def task_ended(self, ok: bool) -> bool:
        """Counts one task's end; True when it was the last and the step applied."""
        self._failed |= not ok
        self._pending -= 1
        return self._pending == 0 and not self._failed
