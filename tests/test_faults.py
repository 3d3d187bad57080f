"""Fault injection: tasks that raise, hang, run out of memory or assert on the device, and
what the waiter and the other lanes see. Ctrl-C, interpreter exit and fork are in
test_process.py."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import random
import re
import threading
import time

import pytest

import pydflash

SUBPROCESS_TIMEOUT_S = 120  # only a hang reaches it


def lane_label(lane: pydflash.Lane) -> str:
    return f"lane {lane.index} ({lane.device})"


def names_lane(error: BaseException, lane: pydflash.Lane) -> bool:
    label = lane_label(lane)
    return label in str(error) or any(label in note for note in getattr(error, "__notes__", ()))


@pytest.fixture
def dispatcher():
    d = pydflash.Dispatcher(["cpu"] * 6, guard=())
    yield d
    d.shutdown(cancel_futures=True)


# --- several lanes failing at once ------------------------------------------------------


@pytest.mark.parametrize("failing", [1, 3, 6])
def test_every_failure_of_k_lanes_is_reported(
    dispatcher: pydflash.Dispatcher, failing: int
) -> None:
    lanes = dispatcher.lanes
    rng = random.Random(failing)
    for _ in range(20):
        bad = set(rng.sample(range(len(lanes)), failing))
        together = threading.Barrier(len(lanes))  # every lane's task runs at once

        def task(i: int, together=together, bad=bad) -> int:
            together.wait(timeout=30)
            if i in bad:
                raise ValueError(f"task {i} failed")
            return i * 10

        futures = [lane.submit(task, i) for i, lane in enumerate(lanes)]
        with pytest.raises(ExceptionGroup) as caught:
            pydflash.wait_all(futures)
        errors = caught.value.exceptions
        assert len(errors) == failing
        assert [str(e) for e in errors] == [f"task {i} failed" for i in sorted(bad)]
        for i, error in zip(sorted(bad), errors, strict=True):
            assert isinstance(error, ValueError)
            assert names_lane(error, lanes[i])
            assert futures[i].exception() is error
        for i in set(range(len(lanes))) - bad:
            assert futures[i].result() == i * 10
    # The lanes that raised keep working.
    assert pydflash.wait_all([lane.submit(int, "7") for lane in lanes]) == [7] * len(lanes)


def test_wait_all_returns_results_in_order(dispatcher: pydflash.Dispatcher) -> None:
    futures = [dispatcher.submit(pow, i, 2) for i in range(200)]
    assert pydflash.wait_all(futures) == [i * i for i in range(200)]
    assert pydflash.wait_all([]) == []


def test_wait_all_reports_cancelled_tasks_with_their_lane(dispatcher: pydflash.Dispatcher) -> None:
    lane = dispatcher.lanes[2]
    gate = threading.Event()
    blocker = lane.submit(gate.wait)
    queued = lane.submit(int, "1")
    assert queued.cancel()
    gate.set()
    with pytest.raises(ExceptionGroup) as caught:
        pydflash.wait_all([blocker, queued])
    (error,) = caught.value.exceptions
    assert isinstance(error, concurrent.futures.CancelledError)
    assert names_lane(error, lane)


def test_wait_all_rejects_bad_arguments(dispatcher: pydflash.Dispatcher) -> None:
    future = dispatcher.submit(int)
    expected = r"expected concurrent.futures.Future objects, got int at index 1"
    with pytest.raises(TypeError, match=expected):
        pydflash.wait_all([future, 3])
    with pytest.raises(TypeError, match=r"expected a timeout in seconds or None, got str"):
        pydflash.wait_all([future], timeout="1")


def test_cancelling_twice_counts_once_for_an_all_completed_waiter(
    dispatcher: pydflash.Dispatcher,
) -> None:
    # concurrent.futures.wait(ALL_COMPLETED) counts its waiter down once per notification:
    # two threads cancelling the same future must notify it once, or the wait returns
    # while the other future is still pending.
    lane = dispatcher.lanes[0]
    for _ in range(50):
        gate = threading.Event()
        lane.submit(gate.wait)
        first, second = lane.submit(int), lane.submit(int)
        waiting = threading.Thread(target=concurrent.futures.wait, args=([first, second],))
        waiting.start()
        while not (first._waiters and second._waiters):  # installed on both
            threading.Event().wait(0.001)
        waiter = second._waiters[0]
        start = threading.Barrier(2)
        results = []

        def cancel_first(start=start, results=results, first=first) -> None:
            start.wait()
            results.append(first.cancel())

        canceller = threading.Thread(target=cancel_first)
        canceller.start()
        try:
            cancel_first()
            canceller.join()
            assert results == [True, True]
            assert waiter.num_pending_calls == 1 and not waiter.event.is_set()
        finally:
            gate.set()
        waiting.join(30)
        assert not waiting.is_alive() and second.result() == 0


@pytest.mark.parametrize("slot", [None, "cpu"])
def test_compile_queue_holder_failing_while_other_lanes_wait(
    dispatcher: pydflash.Dispatcher, slot: str | None
) -> None:
    from pydflash import compile_queue

    lanes = dispatcher.lanes
    for attempt in range(10):
        key = f"test_faults.holder_fails.{slot}.{attempt}"
        ran: list[int] = []

        def waiters(key: str = key) -> int:
            return sum(f["waiters"] for f in compile_queue.in_flight() if f["key"] == key)

        def tune(i: int, key: str = key, ran: list[int] = ran) -> None:
            ran.append(i)
            deadline = time.monotonic() + 30  # fail once every other lane waits on the key
            while waiters() < len(lanes) - 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            raise ValueError(f"autotune of {key} failed in task {i}")

        futures = [
            lane.submit(compile_queue.run, key, functools.partial(tune, i), slot=slot)
            for i, lane in enumerate(lanes)
        ]
        with pytest.raises(ExceptionGroup) as caught:
            pydflash.wait_all(futures, timeout=60)
        errors = caught.value.exceptions
        assert len(ran) == 1, ran  # one holder ran; the other lanes received its error
        assert [str(e) for e in errors] == [f"autotune of {key} failed in task {ran[0]}"] * 6
        for lane, error in zip(lanes, errors, strict=True):
            assert names_lane(error, lane)
            assert any(f"holding {key!r}" in note for note in error.__notes__)
        stats = compile_queue.stats()["keys"][key]
        assert (stats["runs"], stats["failures"], stats["shared"]) == (1, 1, len(lanes) - 1)
        # The failure is not remembered: the next call on the key runs.
        assert lanes[0].submit(compile_queue.run, key, lambda: 7).result(timeout=30) == 7


# --- a task that never returns -----------------------------------------------------------


def test_stuck_task_times_out_and_shutdown_cancels_the_queue() -> None:
    d = pydflash.Dispatcher(["cpu", "cpu"], guard=())
    stuck_lane, other_lane = d.lanes
    release = threading.Event()
    ran: list[int] = []
    stuck = stuck_lane.submit(release.wait)
    queued = [stuck_lane.submit(ran.append, i) for i in range(50)]
    try:
        with pytest.raises(TimeoutError):
            stuck.result(timeout=0.05)
        busy = f"51 of 51 futures not done after 0.05 s (on pydflash {lane_label(stuck_lane)})"
        with pytest.raises(TimeoutError, match=re.escape(busy)):
            pydflash.wait_all([stuck, *queued], timeout=0.05)
        assert other_lane.submit(sum, [1, 2]).result(timeout=30) == 3  # its neighbour works

        d.shutdown(wait=False, cancel_futures=True)
        assert all(f.done() and f.cancelled() for f in queued)
        assert stuck.running()
        assert stuck_lane.stats()["cancelled"] == 50
        with pytest.raises(RuntimeError, match="after shutdown"):
            d.submit(int)
    finally:
        release.set()  # let the test end
    assert stuck.result(timeout=30) is True
    d.shutdown(wait=True)
    assert ran == []
    stats = stuck_lane.stats()
    assert stats["completed"] + stats["cancelled"] == stats["submitted"] == 51


# --- out of memory -------------------------------------------------------------------------


def test_memory_error_reaches_the_waiter_and_the_lane_keeps_working(
    dispatcher: pydflash.Dispatcher,
) -> None:
    for lane in dispatcher.lanes:
        failed = lane.submit(bytearray, 1 << 62)  # malloc fails: a real allocation failure
        after = [lane.submit(bytes, 1 << 20) for _ in range(5)]
        with pytest.raises(MemoryError) as caught:
            failed.result(timeout=30)
        assert names_lane(caught.value, lane)
        assert [len(b) for b in pydflash.wait_all(after)] == [1 << 20] * 5


def test_torch_allocation_failure_reaches_the_waiter(dispatcher: pydflash.Dispatcher) -> None:
    torch = pytest.importorskip("torch")
    lane = dispatcher.lanes[0]
    failed = lane.submit(torch.empty, 1 << 62, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="can't allocate memory") as caught:
        failed.result(timeout=30)
    assert names_lane(caught.value, lane)
    assert lane.submit(lambda: torch.ones(1000).sum().item()).result(timeout=30) == 1000.0


@pytest.mark.gpu
def test_gpu_out_of_memory_names_the_lane_and_the_lane_keeps_working() -> None:
    import torch

    d = pydflash.Dispatcher([0], guard=())
    try:
        lane = d.lanes[0]
        total = torch.cuda.get_device_properties(0).total_memory
        failed = lane.submit(torch.empty, 2 * total, dtype=torch.uint8, device="cuda:0")
        with pytest.raises(torch.OutOfMemoryError) as caught:
            failed.result(timeout=60)
        assert names_lane(caught.value, lane)

        def small() -> float:
            return torch.ones(1 << 20, device="cuda:0").sum().item()

        assert lane.submit(small).result(timeout=60) == float(1 << 20)
    finally:
        d.shutdown()


# --- device-side assert ---------------------------------------------------------------------


@pytest.mark.gpu
def test_device_side_assert_names_the_lane_and_poisons_the_device(run_child_script) -> None:
    # In a subprocess: a device-side assert leaves the CUDA context unusable for the rest
    # of the process (a sticky error), so it must not happen inside the test runner.
    done = run_child_script("device_side_assert.py", timeout=SUBPROCESS_TIMEOUT_S)
    line = next((x for x in done.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert line is not None, f"no report (rc={done.returncode}):\n{done.stdout}\n{done.stderr}"
    report = json.loads(line[len("REPORT ") :])
    print(json.dumps(report, indent=1))  # what the other lanes saw, for docs/reliability.md
    failure = report["assert"]
    assert failure.get("runtime_error") is True, report  # torch.AcceleratorError on newer torch
    assert "device-side assert" in failure["message"], report
    assert any(report["labels"][0] in note for note in failure["notes"]), report
    # The error is sticky in the device's context: every later CUDA call there fails,
    # on any lane of that device, with an error rather than a hang or a wrong result.
    for key in ("same_lane_after", "same_device_other_lane_after"):
        assert "error" in report[key] and "device-side assert" in report[key]["message"], report
    if "other_device_after" in report:
        # Another GPU has its own context; whether it survives is recorded, not assumed,
        # but it must answer: a right result or an error, not a wrong result or a hang.
        other = report["other_device_after"]
        assert other.get("ok") == 8.0 or other.get("error") not in (None, "TimeoutError"), report
    assert done.returncode == 0, done.stderr[-5000:]
