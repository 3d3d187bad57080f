"""pydflash.lanes.quiesce.device_quiet on CPU lanes, whose device is "cpu": the real mechanism,
with threads that overlap (tasks meet on barriers, many rounds). Lanes on other devices
and graph launches are covered natively (tests/native/test_device_quiet.cpp)."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time

import pytest

import pydflash
from pydflash.lanes.quiesce import device_quiet

ROUNDS = 30
WAIT_S = 10  # what a test waits for at most where it expects no wait at all


class Activity:
    """What the lanes' tasks do, as a quiet sees it: how many run now, and every task
    that started while a quiet was held (a breach)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.quiet = False
        self.breaches: list[str] = []
        self.ran = 0

    def task(self, name: str, seconds: float = 0.0005) -> str:
        with self.lock:
            if self.quiet:
                self.breaches.append(f"{name} started while the device was quiet")
            self.running += 1
        time.sleep(seconds)  # lets the GIL go, so the lanes' tasks overlap
        with self.lock:
            self.running -= 1
            self.ran += 1
        return name

    def hold(self, lane: pydflash.Lane, seconds: float = 0.002, timeout: float = WAIT_S) -> bool:
        """What a capture does, from a task on `lane`: quiets the device and checks that
        nothing else runs while it holds it."""
        with device_quiet(lane, timeout=timeout) as quiet:
            if not quiet:
                return False
            with self.lock:
                if self.running:
                    self.breaches.append(f"{self.running} tasks running when the quiet began")
                self.quiet = True
            time.sleep(seconds)
            with self.lock:
                self.quiet = False
        return True


class Floods:
    """One producer thread per lane, each submitting `count` tasks to its lane once all
    have met on `barrier`."""

    def __init__(self, lanes, activity: Activity, count: int, barrier: threading.Barrier):
        self.futures: list = []
        self.threads = [
            threading.Thread(target=self._flood, args=(lane, activity, count, barrier))
            for lane in lanes
        ]
        for t in self.threads:
            t.start()

    def _flood(self, lane, activity, count, barrier):
        barrier.wait()
        self.futures += [lane.submit(activity.task, f"{lane.label} #{i}") for i in range(count)]

    def finish(self) -> None:
        for t in self.threads:
            t.join()
        for f in self.futures:
            f.result(timeout=WAIT_S)


def test_no_task_of_another_lane_starts_while_quiet():
    # Two dispatchers: a quiet covers every lane of the device in the process.
    first = pydflash.Dispatcher(["cpu"] * 3, guard=())
    second = pydflash.Dispatcher(["cpu"] * 2, guard=())
    lanes = first.lanes + second.lanes
    activity = Activity()
    try:
        for _ in range(ROUNDS):
            barrier = threading.Barrier(len(lanes))
            floods = Floods(lanes[1:], activity, 30, barrier)
            barrier.wait()
            held = [lanes[0].submit(activity.hold, lanes[0]) for _ in range(3)]
            floods.finish()
            assert [f.result(timeout=WAIT_S) for f in held] == [True] * 3
        assert activity.breaches == []
        assert activity.ran == ROUNDS * 30 * (len(lanes) - 1)
        stats = [lane.stats() for lane in lanes]
        assert stats[0]["quiets"] == 3 * ROUNDS and stats[0]["quiet_timeouts"] == 0
        assert sum(s["pauses"] for s in stats[1:]) > 0
        assert all(s["paused_s"] >= 0 for s in stats)
    finally:
        first.shutdown()
        second.shutdown()


def test_an_idle_lane_pauses_and_a_task_submitted_to_it_waits():
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        capturer, idle = d.lanes

        def capture():
            with device_quiet(capturer, timeout=WAIT_S) as quiet:
                assert quiet
                f = idle.submit(time.monotonic)
                time.sleep(0.05)
                started_inside = f.running() or f.done()
                left = time.monotonic()
            return started_inside, left, f

        started_inside, left, f = capturer.submit(capture).result(timeout=WAIT_S)
        assert not started_inside
        assert f.result(timeout=WAIT_S) >= left
        assert idle.stats()["pauses"] >= 1
        assert idle.stats()["paused_s"] > 0.04


def test_two_lanes_quiet_the_device_at_once_one_after_the_other():
    with pydflash.Dispatcher(["cpu"] * 4, guard=()) as d:
        a, b, *others = d.lanes
        activity = Activity()
        spans: list[tuple[float, float]] = []
        spans_lock = threading.Lock()

        def capture(lane, barrier):
            barrier.wait()
            with device_quiet(lane, timeout=WAIT_S) as quiet:
                begin = time.monotonic()
                with activity.lock:
                    if activity.running:
                        activity.breaches.append("a task ran when a quiet began")
                time.sleep(0.002)
                end = time.monotonic()
            with spans_lock:
                spans.append((begin, end))
            return quiet

        for _ in range(ROUNDS):
            barrier = threading.Barrier(2 + len(others))
            floods = Floods(others, activity, 10, barrier)
            quiets = [a.submit(capture, a, barrier), b.submit(capture, b, barrier)]
            assert [f.result(timeout=2 * WAIT_S) for f in quiets] == [True, True]
            floods.finish()
        assert activity.breaches == []
        spans.sort()
        for (_, end), (begin, _) in itertools.pairwise(spans):
            assert end <= begin, "two quiets of one device overlapped"
        assert a.stats()["quiets"] + b.stats()["quiets"] == 2 * ROUNDS


def test_a_lane_busy_in_its_task_makes_the_capturer_time_out_and_nothing_stays_paused():
    with pydflash.Dispatcher(["cpu"] * 3, guard=()) as d:
        capturer, busy, free = d.lanes
        start, release = threading.Event(), threading.Event()

        def capture():
            start.wait(WAIT_S)
            begin = time.monotonic()
            with device_quiet(capturer, timeout=0.3) as quiet:
                waited = time.monotonic() - begin
                # Nothing stays paused: a lane that had paused runs work now.
                on_free = free.submit(lambda: "free ran").result(timeout=WAIT_S)
            return quiet, waited, on_free

        quiet_future = capturer.submit(capture)
        # busy's current task waits in Python, not on a pydflash future: it is busy.
        busy_future = busy.submit(release.wait, WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not busy_future.running() and time.monotonic() < deadline:
            time.sleep(0.001)
        start.set()
        quiet, waited, on_free = quiet_future.result(timeout=WAIT_S)
        release.set()
        assert quiet is False
        assert 0.25 <= waited < WAIT_S
        assert on_free == "free ran"
        assert busy_future.result(timeout=WAIT_S) is True
        assert capturer.stats()["quiet_timeouts"] == 1
        assert capturer.stats()["quiets"] == 0


def _waiting_beside_a_capture(d, capture, wait, box=None):
    """Runs `wait` on lane 1 and, once it runs, `capture` on lane 0, with a future queued
    on lane 0 behind the capture (what a drafter waits for while its target captures;
    appended to `box`, if given, before the capture runs). Returns the futures of the
    capture, of the wait and the one behind."""
    capturer, waiter = d.lanes[:2]
    running, gate = threading.Event(), threading.Event()
    capturer.submit(gate.wait, WAIT_S)  # holds lane 0 until the waiter waits
    quiet_future = capturer.submit(capture)
    behind = capturer.submit(lambda: "from behind the capture")
    if box is not None:
        box.append(behind)

    def task():
        running.set()
        return wait(behind)

    waiting = waiter.submit(task)
    assert running.wait(WAIT_S)
    time.sleep(0.05)  # in its wait by now (the test passes either way)
    gate.set()
    return quiet_future, waiting, behind


@pytest.mark.parametrize("how", ["result", "exception", "wait_all"])
def test_a_lane_blocked_on_a_future_counts_as_paused(how):
    wait = {
        "result": lambda f: f.result(timeout=WAIT_S),
        "exception": lambda f: (f.exception(timeout=WAIT_S), f.result())[1],
        "wait_all": lambda f: pydflash.wait_all([f], timeout=WAIT_S)[0],
    }[how]
    with pydflash.Dispatcher(["cpu"] * 3, guard=()) as d:
        capturer = d.lanes[0]

        def capture():
            begin = time.monotonic()
            with device_quiet(capturer, timeout=WAIT_S) as quiet:
                return quiet, time.monotonic() - begin

        quiet_future, waiting, _ = _waiting_beside_a_capture(d, capture, wait)
        quiet, took = quiet_future.result(timeout=2 * WAIT_S)
        assert quiet is True
        assert took < WAIT_S / 4
        assert waiting.result(timeout=WAIT_S) == "from behind the capture"
        assert capturer.stats()["quiets"] == 1
        assert capturer.stats()["quiet_timeouts"] == 0


@pytest.mark.parametrize("ends_by", ["timeout", "cancel"])
def test_a_wait_that_ends_inside_a_quiet_returns_to_python_once_the_quiet_ends(ends_by):
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        capturer, waiter = d.lanes
        behind: list = []
        quiet_ended: list[float] = []
        main_woke: list[float] = []

        def capture():
            with device_quiet(capturer, timeout=WAIT_S) as quiet:
                if ends_by == "cancel":
                    assert behind[0].cancel()
                time.sleep(0.8)  # the waiter's wait ends meanwhile
                quiet_ended.append(time.monotonic())
            return quiet

        def wait(f):
            try:
                f.result(timeout=0.3 if ends_by == "timeout" else WAIT_S)
            except (TimeoutError, concurrent.futures.CancelledError) as e:
                return type(e).__name__, time.monotonic()
            return "returned", time.monotonic()

        quiet_future, waiting, f = _waiting_beside_a_capture(d, capture, wait, behind)
        if ends_by == "cancel":
            # The main thread, no lane's worker, returns as soon as the wait ends.
            with pytest.raises(concurrent.futures.CancelledError):
                f.result(timeout=WAIT_S)
            main_woke.append(time.monotonic())
        assert quiet_future.result(timeout=WAIT_S) is True
        outcome, returned_at = waiting.result(timeout=WAIT_S)
        assert outcome == {"timeout": "TimeoutError", "cancel": "CancelledError"}[ends_by]
        assert returned_at >= quiet_ended[0]
        assert all(t < quiet_ended[0] for t in main_woke)
        assert waiter.stats()["pauses"] >= 1


def test_shutdown_with_cancel_of_a_paused_lane_cancels_at_once_and_exits_after_the_quiet():
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        capturer, paused = d.lanes
        quiet_now, done = threading.Event(), threading.Event()

        def capture():
            with device_quiet(capturer, timeout=WAIT_S) as quiet:
                quiet_now.set()
                done.wait(WAIT_S)
            return quiet

        held = capturer.submit(capture)
        assert quiet_now.wait(WAIT_S)
        queued = [paused.submit(time.sleep, 0) for _ in range(5)]
        paused.shutdown(wait=False, cancel_futures=True)
        # The queue is cancelled at once, the lane goes on pausing while the quiet lasts.
        assert sum(f.cancelled() for f in queued) >= 4  # its worker may hold the first
        assert not paused._core.join(0.1)
        done.set()
        assert paused._core.join(WAIT_S), "a paused lane shut down did not exit"
        assert held.result(timeout=WAIT_S) is True


def test_shutdown_without_cancel_runs_the_queue_once_the_quiet_ends():
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        capturer, paused = d.lanes
        quiet_now, done = threading.Event(), threading.Event()
        ended: list[float] = []

        def capture():
            with device_quiet(capturer, timeout=WAIT_S) as quiet:
                quiet_now.set()
                done.wait(WAIT_S)
                ended.append(time.monotonic())
            return quiet

        held = capturer.submit(capture)
        assert quiet_now.wait(WAIT_S)
        queued = [paused.submit(time.monotonic) for _ in range(5)]
        closer = threading.Thread(target=paused.shutdown)  # wait=True
        closer.start()
        closer.join(0.1)
        assert closer.is_alive(), "the paused lane finished its queue during the quiet"
        done.set()
        closer.join(WAIT_S)
        assert not closer.is_alive()
        assert held.result(timeout=WAIT_S) is True
        assert all(f.result() >= ended[0] for f in queued)


def test_called_from_another_thread_is_an_error():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        outside = device_quiet(d.lanes[0])
        with pytest.raises(RuntimeError, match=r"expected a call from a task running on lane 0"):
            outside.__enter__()
        with pytest.raises(RuntimeError, match=r"to hold its device quiet, but it holds none"):
            d.lanes[0].submit(d.lanes[0].release_device_quiet).result(timeout=WAIT_S)


def test_nested_quiets_and_a_quiet_that_outlives_its_task_ends_with_it():
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        capturer, other = d.lanes

        def nested():
            with device_quiet(capturer) as outer, device_quiet(capturer) as inner:
                pass
            return outer, inner

        assert capturer.submit(nested).result(timeout=WAIT_S) == (True, True)
        assert other.submit(lambda: "runs").result(timeout=WAIT_S) == "runs"
        # Held and never released by its task: ended before the lane's next task.
        assert capturer.submit(capturer.hold_device_quiet, WAIT_S).result(timeout=WAIT_S)
        capturer.submit(lambda: None).result(timeout=WAIT_S)
        assert other.submit(lambda: "runs again").result(timeout=WAIT_S) == "runs again"


def test_timeout_reads_as_the_one_timeout_rule():
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        lane = d.lanes[0]

        def quiet_with(timeout):
            with device_quiet(lane, timeout=timeout) as quiet:
                return quiet

        # The other lane is idle: it pauses at once. None and infinity wait forever; zero
        # and less do not wait (an idle lane may not have paused yet); a finite timeout
        # past threading.TIMEOUT_MAX is an OverflowError, as the stdlib's waits make it.
        for timeout in (None, 0.5, 5, float("inf")):
            assert lane.submit(quiet_with, timeout).result(timeout=WAIT_S) is True
        for timeout in (0, -1):
            assert lane.submit(quiet_with, timeout).result(timeout=WAIT_S) in (True, False)
        with pytest.raises(OverflowError, match=r"at most threading\.TIMEOUT_MAX"):
            lane.submit(quiet_with, 1e300).result(timeout=WAIT_S)
        with pytest.raises(TypeError, match="expected a timeout in seconds or None"):
            lane.submit(quiet_with, "soon").result(timeout=WAIT_S)


def test_exit_while_a_lane_is_paused_does_not_hang(run_child_script):
    # The exit waits for a quiet that ends (each lane finishes within the timeout) and
    # gives up on one that does not.
    for holder, exit_timeout in (("returns", "10"), ("never_returns", "0.5")):
        done = run_child_script(
            "exit_while_quiet.py",
            holder,
            timeout=60,
            env={"PYDFLASH_EXIT_TIMEOUT": exit_timeout},
        )
        assert done.returncode == 0, done.stderr
        if holder == "returns":
            assert "queued ran: 20" in done.stdout, done.stdout + done.stderr
        else:
            assert "exit stopped waiting for lane 0 (cpu)" in done.stderr, done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_inherit_a_quiet(run_child_script):
    done = run_child_script("fork_while_quiet.py", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "child ran 4 tasks" in done.stdout, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not pydflash._C.device_count(), reason="needs a CUDA device (graph launches run on GPUs)"
)
def test_gpu_graph_launches_of_another_lane_wait_while_quiet():
    import torch

    from pydflash.graphs import lane_graph as graphs

    with pydflash.Dispatcher([0, 0], guard=()) as d:
        capturer, other = d.lanes
        captured = graphs.capture(lambda x: x * 2 + 1, torch.zeros(4, device="cuda"), other)
        assert captured.native

        def capture():
            with device_quiet(capturer, timeout=WAIT_S) as quiet:
                launched = other.submit_graph(captured)
                time.sleep(0.05)
                held_back = not launched.done()
            return quiet, held_back, launched

        quiet, held_back, launched = capturer.submit(capture).result(timeout=WAIT_S)
        assert quiet and held_back
        assert launched.result(timeout=WAIT_S) is None  # a graph launch's future holds no value
        assert other.stats()["pauses"] >= 1
