"""Chrome/Perfetto trace export of lane spans (chrome://tracing, ui.perfetto.dev).

Each lane is a process row with two threads: host spans (the task on the worker) and
GPU spans (lane-stream events around the task, GPU lanes only); each task's wait in the
queue, from submit to start, is an async span beside them. Other parts of pydflash (the
compile queue) add their own events through `export(..., extra=...)`, built with `span`
and timed with `now_ns`, the clock the lanes use.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from .lanes.lane import Lane

HOST_TID, GPU_TID = 1, 2
QUEUE_CATEGORY = "queue"

# The lanes time spans with std::chrono::steady_clock, which is CLOCK_MONOTONIC on
# Linux, as is time.monotonic_ns: events from Python line up with the lanes' spans.
now_ns = time.monotonic_ns


def collect(lanes: Iterable[Lane]) -> list[dict[str, Any]]:
    """Takes the spans recorded so far from each lane as trace events (times in µs)."""
    events: list[dict[str, Any]] = []
    for lane in lanes:
        pid = lane.index
        events.append(track("process_name", pid, 0, f"lane {lane.index} ({lane.device})"))
        events.append(track("thread_name", pid, HOST_TID, "host"))
        if lane.is_gpu:
            events.append(track("thread_name", pid, GPU_TID, "gpu"))
        for task_id, label, submit_ns, start_ns, end_ns, gpu in lane.take_trace():
            name = label or "task"
            args = {"task": task_id, "queue_wait_us": (start_ns - submit_ns) / 1e3}
            events += async_span(
                f"queued: {name}",
                submit_ns,
                start_ns,
                pid=pid,
                tid=HOST_TID,
                span_id=f"lane{pid}-task{task_id}",
                args={"task": task_id},
            )
            events.append(span(name, start_ns, end_ns, pid=pid, tid=HOST_TID, args=args))
            if gpu is not None:
                events.append(
                    span(name, gpu[0], gpu[1], pid=pid, tid=GPU_TID, args={"task": task_id})
                )
    return events


def export(lanes: Iterable[Lane], path: str | os.PathLike[str], extra: Iterable[dict] = ()) -> dict:
    """Writes the lanes' spans, then `extra` events, as a trace JSON and returns it."""
    _check_path(path)  # before the spans are taken
    return write(collect(lanes) + list(extra), path)


def _check_path(path: Any) -> None:
    # open() would take an int as a file descriptor, write to it and close it.
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"expected a file path (str or os.PathLike), got {type(path).__name__}")


def write(events: Iterable[dict], path: str | os.PathLike[str]) -> dict:
    """Writes `events` as a Chrome/Perfetto trace JSON file and returns the trace."""
    _check_path(path)
    trace = {"traceEvents": list(events), "displayTimeUnit": "ms"}
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace


@contextlib.contextmanager
def recording(lanes: Iterable[Lane]) -> Iterator[list[dict[str, Any]]]:
    """Traces `lanes` inside the block; the yielded list holds the events afterwards.
    Tracing is off again on exit (whatever it was before)."""
    lanes = list(lanes)
    events: list[dict[str, Any]] = []
    for lane in lanes:
        lane.set_tracing(True)
    try:
        yield events
    finally:
        for lane in lanes:
            lane.set_tracing(False)
        events.extend(collect(lanes))


def span(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    pid: int,
    tid: int,
    args: dict | None = None,
    category: str | None = None,
) -> dict:
    """A complete event from start_ns to end_ns (`now_ns` clock) on one track."""
    event = {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start_ns / 1e3,
        "dur": max(end_ns - start_ns, 0) / 1e3,
        "args": args or {},
    }
    if category is not None:
        event["cat"] = category
    return event


def async_span(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    pid: int,
    tid: int,
    span_id: str,
    args: dict | None = None,
    category: str = QUEUE_CATEGORY,
) -> list[dict]:
    """A begin/end pair for a span that may overlap others on its track (queue waits:
    64 tasks submitted at once all wait together). `span_id` must be unique."""
    base = {"name": name, "cat": category, "id": span_id, "pid": pid, "tid": tid}
    return [
        {**base, "ph": "b", "ts": start_ns / 1e3, "args": args or {}},
        {**base, "ph": "e", "ts": max(end_ns, start_ns) / 1e3},
    ]


def track(kind: str, pid: int, tid: int, name: str) -> dict:
    """A metadata event naming a process ("process_name") or thread ("thread_name")."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
