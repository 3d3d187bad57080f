"""pydflash.compile_queue from Python: single flight, fairness, re-entry, errors, waits
that release the GIL and can be interrupted."""

from __future__ import annotations

import _thread
import itertools
import threading
import time

import pytest
from polling_helpers import eventually

import pydflash
from pydflash import compile_queue

THREADS = 8
_keys = itertools.count()


def fresh_key(name: str) -> str:
    return f"test:{name}:{next(_keys)}"


def flight(key: str) -> dict | None:
    return next((f for f in compile_queue.in_flight() if f["key"] == key), None)


def waiters(key: str) -> int:
    f = flight(key)
    return -1 if f is None else f["waiters"]


def run_threads(n: int, body) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = ("ok", body(i))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[i] = ("error", exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_one_thread_runs_a_key_and_every_caller_gets_its_result():
    for _ in range(30):
        key = fresh_key("single")
        ran = []

        def tune(key=key, ran=ran):
            ran.append(threading.current_thread().name)
            # Holding the key until the others wait also proves they released the GIL.
            eventually(lambda: waiters(key) == THREADS - 1, "all callers waiting")
            return object()

        results = run_threads(THREADS, lambda i, key=key: compile_queue.run(key, tune, timeout=60))
        assert len(ran) == 1
        assert all(kind == "ok" for kind, _ in results)
        assert len({id(value) for _, value in results}) == 1  # the very same object
        stats = compile_queue.stats()["keys"][key]
        assert (stats["runs"], stats["shared"], stats["waits"]) == (1, THREADS - 1, THREADS - 1)
        assert stats["max_wait_s"] > 0
    assert compile_queue.in_flight() == []


def test_the_holders_exception_is_raised_in_every_waiter():
    key = fresh_key("fails")

    def tune():
        eventually(lambda: waiters(key) == THREADS - 1, "all callers waiting")
        raise ValueError("bad config")

    results = run_threads(THREADS, lambda i: compile_queue.run(key, tune, timeout=60))
    errors = [value for kind, value in results if kind == "error"]
    assert len(errors) == THREADS
    assert all(isinstance(e, ValueError) and str(e) == "bad config" for e in errors)
    assert any("holding" in note and key in note for note in errors[0].__notes__)
    assert compile_queue.stats()["keys"][key]["failures"] == 1
    # A failure is not remembered: the next call runs again.
    assert compile_queue.run(key, lambda: 3) == 3


def test_each_waiter_gets_its_own_copy_of_the_holders_exception():
    key = fresh_key("fails-apart")

    def tune():
        eventually(lambda: waiters(key) == THREADS - 1, "all callers waiting")
        raise KeyError("bad config")

    def call(i):
        try:
            compile_queue.run(key, tune, timeout=60)
        except KeyError as exc:
            exc.add_note(f"seen by caller {i}")  # as a lane adds its name
            raise

    errors = [value for kind, value in run_threads(THREADS, call)]
    assert len({id(e) for e in errors}) == THREADS
    for error in errors:
        assert type(error) is KeyError and error.args == ("bad config",)
        assert [n for n in error.__notes__ if n.startswith("seen by")] == [error.__notes__[-1]]
        assert sum("holding" in note for note in error.__notes__) == 1
        assert error.__traceback__ is not None


def test_a_slot_serves_its_callers_in_arrival_order():
    release = threading.Event()
    order: list[int] = []
    first = fresh_key("first")
    holder = threading.Thread(
        target=compile_queue.run, args=(first, release.wait), kwargs={"slot": "cuda:7"}
    )
    holder.start()
    eventually(lambda: (flight(first) or {}).get("running"), "holder running")
    queued = []
    for i in range(5):
        key = fresh_key(f"next{i}")
        t = threading.Thread(
            target=compile_queue.run,
            args=(key, lambda i=i: order.append(i)),
            kwargs={"slot": "cuda:7"},
        )
        t.start()
        queued.append(t)
        eventually(lambda key=key: flight(key) is not None, f"{key} queued")
    release.set()
    for t in [holder, *queued]:
        t.join()
    assert order == [0, 1, 2, 3, 4]


def test_other_slots_proceed_while_one_is_held():
    release = threading.Event()
    busy = fresh_key("busy")
    holder = threading.Thread(
        target=compile_queue.run, args=(busy, release.wait), kwargs={"slot": "cuda:5"}
    )
    holder.start()
    eventually(lambda: (flight(busy) or {}).get("running"), "holder running")
    try:
        # A wrong wait would raise CompileQueueTimeout here rather than hang.
        assert compile_queue.run(fresh_key("other"), lambda: 1, slot="cuda:6", timeout=30) == 1
        assert compile_queue.run(fresh_key("jit"), lambda: 2, timeout=30) == 2
        assert flight(busy)["running"]
    finally:
        release.set()
        holder.join()


def test_the_holder_reenters_its_key_and_slot():
    outer = fresh_key("outer")

    def tune():
        same = compile_queue.run(outer, lambda: 10, slot="cuda:0", timeout=5)
        inner = compile_queue.run(fresh_key("inner"), lambda: 100, slot="cuda:0", timeout=5)
        return same + inner

    assert compile_queue.run(outer, tune, slot="cuda:0", timeout=5) == 110


def test_a_timeout_names_the_key_its_holder_and_how_long():
    key = fresh_key("slow")
    release = threading.Event()
    holder = threading.Thread(
        target=compile_queue.run, args=(key, release.wait), name="lane 3 (cuda:1)"
    )
    holder.start()
    eventually(lambda: (flight(key) or {}).get("running"), "holder running")
    try:
        with pytest.raises(pydflash.CompileQueueTimeout) as info:
            compile_queue.run(key, lambda: None, timeout=0.05)
        assert isinstance(info.value, TimeoutError)
        message = str(info.value)
        assert f"'{key}'" in message
        assert "held by lane 3 (cuda:1) for " in message
        assert "set_timeout" in message
        compile_queue.set_timeout(0.05)
        assert compile_queue.get_timeout() == 0.05
        with pytest.raises(pydflash.CompileQueueTimeout):
            compile_queue.run(key, lambda: None)
    finally:
        compile_queue.set_timeout(None)
        release.set()
        holder.join()
    assert compile_queue.get_timeout() is None


def test_ctrl_c_interrupts_a_wait():
    key = fresh_key("held")
    release = threading.Event()
    holder = threading.Thread(target=compile_queue.run, args=(key, release.wait))
    holder.start()
    eventually(lambda: (flight(key) or {}).get("running"), "holder running")
    interrupter = threading.Thread(
        target=lambda: (
            eventually(lambda: waiters(key) == 1, "main waiting"),
            _thread.interrupt_main(),
        )
    )
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            compile_queue.run(key, lambda: None, timeout=60)
        assert waiters(key) == 0
    finally:
        interrupter.join()
        release.set()
        holder.join()


def test_an_interrupted_holder_hands_its_key_to_a_waiter():
    key = fresh_key("handover")
    got = []

    def interrupted_tune():
        eventually(lambda: waiters(key) == 1, "a waiter")
        raise KeyboardInterrupt

    waiter = threading.Thread(
        target=lambda: got.append(compile_queue.run(key, lambda: "waiter ran it"))
    )

    def start_waiter():
        waiter.start()
        return interrupted_tune()

    with pytest.raises(KeyboardInterrupt):
        compile_queue.run(key, start_waiter)
    waiter.join()
    assert got == ["waiter ran it"]


def test_a_wait_that_would_deadlock_raises():
    a_key, b_key = fresh_key("a"), fresh_key("b")
    b_running = threading.Event()
    b_errors: list[BaseException] = []

    def b_body():
        def b_work():
            b_running.set()
            eventually(lambda: waiters(b_key) == 1, "A waiting for b")
            return compile_queue.run(fresh_key("c"), lambda: 1, slot="cuda:9")

        try:
            compile_queue.run(b_key, b_work)
        except RuntimeError as exc:
            b_errors.append(exc)

    b = threading.Thread(target=b_body, name="thread B")

    def a_work():
        b.start()
        b_running.wait()
        return compile_queue.run(b_key, lambda: 2)

    with pytest.raises(RuntimeError, match="would deadlock") as info:
        compile_queue.run(a_key, a_work, slot="cuda:9")
    b.join()
    assert "thread B waiting for the cuda:9 slot" in str(info.value)
    # A waited on b's key: it raises (its own copy of) B's error.
    assert (
        b_errors and type(b_errors[0]) is type(info.value) and str(b_errors[0]) == str(info.value)
    )


def test_many_threads_many_keys_stay_single_flight():
    keys = [fresh_key(f"mixed{i}") for i in range(5)]
    running = {key: 0 for key in keys}
    lock = threading.Lock()
    violations = []

    def body(i: int) -> list:
        out = []
        for j in range(60):
            key = keys[(i + j) % len(keys)]

            def work(key=key):
                with lock:
                    running[key] += 1
                    if running[key] != 1:
                        violations.append(key)
                time.sleep(0)
                with lock:
                    running[key] -= 1
                return key

            out.append(compile_queue.run(key, work, slot="cuda:1" if j % 2 else None) == key)
        return out

    results = run_threads(THREADS, body)
    assert violations == []
    assert all(kind == "ok" and all(value) for kind, value in results)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: compile_queue.run("", lambda: 1), TypeError, "non-empty str key"),
        (lambda: compile_queue.run(3, lambda: 1), TypeError, "non-empty str key"),
        (lambda: compile_queue.run("k", 5), TypeError, "expected a callable, got int"),
        (lambda: compile_queue.run("k", lambda: 1, slot=0), TypeError, "slot as a str"),
        (lambda: compile_queue.run("k", lambda: 1, timeout="1"), TypeError, "seconds or None"),
        (lambda: compile_queue.set_timeout("1"), TypeError, "seconds or None, got str"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_slot_names():
    assert compile_queue.slot_for_device(2) == "cuda:2"
    assert compile_queue.slot_for_device(-1) == "cpu"
    assert compile_queue.slot_for_device(None) == "cpu"


def test_dispatcher_stats_include_the_queue():
    key = fresh_key("dispatcher")
    compile_queue.run(key, lambda: None)
    dispatcher = pydflash.Dispatcher(["cpu"], guard=())
    try:
        stats = dispatcher.stats()["compile_queue"]
        assert stats["keys"][key]["runs"] == 1
        assert stats["runs"] >= 1
    finally:
        dispatcher.shutdown()
