"""Chrome/Perfetto trace export of lane spans (chrome://tracing, ui.perfetto.dev).

Each lane is a process row with two threads: host spans (the task on the worker, with
its queue wait) and GPU spans (lane-stream events around the task, GPU lanes only).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from .lane import Lane

_HOST, _GPU = 1, 2


def collect(lanes: Iterable[Lane]) -> list[dict[str, Any]]:
    """Takes the spans recorded so far from each lane as trace events (times in µs)."""
    events: list[dict[str, Any]] = []
    for lane in lanes:
        pid = lane.index
        events.append(_meta("process_name", pid, 0, f"lane {lane.index} ({lane.device})"))
        events.append(_meta("thread_name", pid, _HOST, "host"))
        if lane.is_gpu:
            events.append(_meta("thread_name", pid, _GPU, "gpu"))
        for task_id, label, submit_ns, start_ns, end_ns, gpu in lane._native.take_trace():
            args = {"task": task_id, "queue_wait_us": (start_ns - submit_ns) / 1e3}
            events.append(_span(label, pid, _HOST, start_ns, end_ns, args))
            if gpu is not None:
                events.append(_span(label, pid, _GPU, gpu[0], gpu[1], {"task": task_id}))
    return events


def export(lanes: Iterable[Lane], path: str | os.PathLike[str], extra: Iterable[dict] = ()) -> dict:
    trace = {"traceEvents": collect(lanes) + list(extra), "displayTimeUnit": "ms"}
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace


def _span(name: str, pid: int, tid: int, start_ns: int, end_ns: int, args: dict) -> dict:
    return {
        "name": name or "task",
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start_ns / 1e3,
        "dur": max(end_ns - start_ns, 0) / 1e3,
        "args": args,
    }


def _meta(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
