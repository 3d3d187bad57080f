"""A quiet device while one lane captures a CUDA graph: every other lane of the device, in
any Dispatcher of the process, finishes its current task and waits before its next one.
What a capture requires of the rest of the process, and why this is enough: Note [Quiet
device for capture] in csrc/core/device_quiet.h."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lane import Lane

DEFAULT_TIMEOUT_S = 30.0


@contextlib.contextmanager
def device_quiet(lane: Lane, *, timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[bool]:
    """Called from a task running on `lane`'s worker. On entry, every other lane on lane's
    device finishes its current task and pauses before its next one; yields True once all
    are paused, or False if they were not all paused within `timeout` seconds (then nothing
    stays paused and the caller should not capture). On exit, the paused lanes resume.

    Python tasks and graph launches alike wait; paused lanes hold no GIL. If another lane
    of the device holds it quiet already, this one waits for that to end first (and counts
    as paused meanwhile); `timeout` starts once it is this lane's turn. Stats:
    `lane.stats()` counts "quiets" and "quiet_timeouts" of the capturer and "pauses" and
    "paused_s" of the lanes that waited. Raises RuntimeError when called from another
    thread than lane's worker.
    """
    quiet = lane.hold_device_quiet(timeout)
    try:
        yield quiet
    finally:
        if quiet:
            lane.release_device_quiet()
