"""pydflash.trace and Dispatcher(trace=True): what is recorded, and that the export is
a valid Chrome/Perfetto trace."""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter, defaultdict

import pytest

import pydflash
from pydflash import trace


def validate(document: dict) -> list[dict]:
    """Checks the Chrome trace event format (the JSON object form) and returns the events."""
    assert set(document) >= {"traceEvents"}
    events = document["traceEvents"]
    assert isinstance(events, list)
    open_async: dict[tuple, float] = {}
    for event in events:
        assert isinstance(event["name"], str) and event["name"]
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        phase = event["ph"]
        if phase == "M":
            assert event["name"] in ("process_name", "thread_name")
            assert isinstance(event["args"]["name"], str)
        elif phase == "X":
            assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float))
            assert event["dur"] >= 0
        elif phase in ("b", "e"):
            key = (event["pid"], event["cat"], event["id"])
            if phase == "b":
                assert key not in open_async, f"async span {key} begun twice"
                open_async[key] = event["ts"]
            else:
                assert event["ts"] >= open_async.pop(key), f"async span {key} ends before it begins"
        else:
            raise AssertionError(f"unexpected phase {phase!r} in {event}")
    assert not open_async, f"async spans never ended: {sorted(open_async)}"
    return events


def host_spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and e["tid"] == trace.HOST_TID]


def add(a, b):
    return a + b


def mul(a, b):
    return a * b


@pytest.fixture
def traced():
    dispatcher = pydflash.Dispatcher(["cpu", "cpu"], trace=True)
    yield dispatcher
    dispatcher.shutdown()


def test_export_writes_a_valid_trace_with_one_span_per_task(traced, tmp_path):
    per_lane = 40
    futures = []
    for lane in traced.lanes:
        for i in range(per_lane):
            futures.append(lane.submit(add if i % 2 else mul, i, 2))
    for future in futures:
        future.result()
    path = tmp_path / "trace.json"
    returned = traced.export_trace(path)
    with open(path) as f:
        document = json.load(f)
    assert document == json.loads(json.dumps(returned))
    events = validate(document)

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names[(0, 0)] == "lane 0 (cpu)" and names[(1, 0)] == "lane 1 (cpu)"
    assert names[(0, trace.HOST_TID)] == "host"
    assert not [e for e in events if e.get("tid") == trace.GPU_TID]  # CPU lanes have no GPU row

    spans = host_spans(events)
    assert Counter(e["pid"] for e in spans) == {0: per_lane, 1: per_lane}
    assert Counter(e["name"] for e in spans) == {"add": per_lane, "mul": per_lane}
    waits = {(e["pid"], e["id"]): e for e in events if e["ph"] in ("b", "e")}
    assert len(waits) == 2 * per_lane
    for pid in (0, 1):
        mine = sorted((e for e in spans if e["pid"] == pid), key=lambda e: e["args"]["task"])
        assert [e["args"]["task"] for e in mine] == list(range(1, per_lane + 1))
        for earlier, later in itertools.pairwise(mine):  # one worker, FIFO: spans never overlap
            assert later["ts"] >= earlier["ts"] + earlier["dur"] - 1e-3
        for e in mine:
            assert e["args"]["queue_wait_us"] >= 0
            wait = waits[(pid, f"lane{pid}-task{e['args']['task']}")]
            assert wait["name"] == f"queued: {e['name']}"


def test_spans_are_on_the_clock_that_now_ns_reads(traced):
    lane = traced.lanes[0]
    before = trace.now_ns()
    lane.submit(add, 1, 2).result()
    after = trace.now_ns()
    (span,) = host_spans(trace.collect([lane]))
    assert before / 1e3 <= span["ts"] <= span["ts"] + span["dur"] <= after / 1e3


def test_tracing_off_records_nothing():
    dispatcher = pydflash.Dispatcher(["cpu"])
    try:
        for _ in range(50):
            dispatcher.submit(add, 1, 2).result()
        events = trace.collect(dispatcher.lanes)
        assert {e["ph"] for e in events} == {"M"}
        dispatcher.set_tracing(True)
        dispatcher.submit(add, 1, 2).result()
        dispatcher.set_tracing(False)
        for _ in range(50):
            dispatcher.submit(mul, 1, 2).result()
        assert [e["name"] for e in host_spans(trace.collect(dispatcher.lanes))] == ["add"]
    finally:
        dispatcher.shutdown()


def test_collect_takes_what_was_recorded(traced):
    traced.submit(add, 1, 2).result()
    assert len(host_spans(trace.collect(traced.lanes))) == 1
    assert host_spans(trace.collect(traced.lanes)) == []


def test_recording_traces_only_inside_the_block():
    dispatcher = pydflash.Dispatcher(["cpu"])
    try:
        dispatcher.submit(mul, 1, 2).result()
        with trace.recording(dispatcher.lanes) as events:
            dispatcher.submit(add, 1, 2).result()
            assert events == []  # filled on exit
        dispatcher.submit(mul, 1, 2).result()
        validate({"traceEvents": events})
        assert [e["name"] for e in host_spans(events)] == ["add"]
        assert host_spans(trace.collect(dispatcher.lanes)) == []
    finally:
        dispatcher.shutdown()


def test_extra_events_are_exported_after_the_lanes(traced, tmp_path):
    traced.submit(add, 1, 2).result()
    start = trace.now_ns()
    extra = [
        trace.track("process_name", 100, 0, "compile queue"),
        trace.span(
            "compile matmul_kernel",
            start,
            start + 2_000,
            pid=100,
            tid=1,
            args={"key": "k"},
            category="compile_queue",
        ),
        *trace.async_span(
            "wait matmul_kernel",
            start,
            start + 1_000,
            pid=100,
            tid=1,
            span_id="cq-1",
            category="compile_queue",
        ),
    ]
    document = trace.export(traced.lanes, tmp_path / "t.json", extra=extra)
    events = validate(json.loads((tmp_path / "t.json").read_text()))
    assert events[-4:] == extra and document["traceEvents"][-4:] == extra
    assert extra[1]["dur"] == 2.0 and extra[1]["cat"] == "compile_queue"


def test_concurrent_submitters_get_every_task_traced(traced):
    threads, per_thread = 4, 200
    barrier = threading.Barrier(threads)

    def submitter():
        barrier.wait()
        futures = [traced.submit(add, i, 1) for i in range(per_thread)]
        for future in futures:
            future.result()

    workers = [threading.Thread(target=submitter) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    events = trace.collect(traced.lanes)
    validate({"traceEvents": events})
    spans = host_spans(events)
    assert len(spans) == threads * per_thread
    ids = defaultdict(list)
    for e in spans:
        ids[e["pid"]].append(e["args"]["task"])
    for pid, tasks in ids.items():
        assert sorted(tasks) == list(range(1, len(tasks) + 1)), f"lane {pid} lost or repeated spans"


@pytest.mark.gpu
@pytest.mark.skipif(
    pydflash._C.device_count() == 0,
    reason="needs a CUDA device (GPU spans come from lane-stream events)",
)
def test_gpu_lane_records_a_gpu_span_per_task():
    from pydflash import _C

    dispatcher = pydflash.Dispatcher([0], trace=True)
    try:
        lane = dispatcher.lanes[0]
        for _ in range(5):
            lane.submit(_C.busy_wait, lane.stream_ptr, 2_000_000).result()
        events = validate({"traceEvents": trace.collect(dispatcher.lanes)})
    finally:
        dispatcher.shutdown()
    gpu = [e for e in events if e["ph"] == "X" and e["tid"] == trace.GPU_TID]
    host = host_spans(events)
    assert len(gpu) == len(host) == 5
    assert sorted(e["args"]["task"] for e in gpu) == sorted(e["args"]["task"] for e in host)
    assert all(e["dur"] > 0 for e in gpu)
