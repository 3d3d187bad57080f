"""Many producer threads on a barrier: nothing lost, nothing run twice."""

import collections
import threading

import pydflash

PRODUCERS = 8
TASKS_EACH = 400
ROUNDS = 5


def producers_round(d: pydflash.Dispatcher) -> None:
    runs = collections.Counter()
    runs_lock = threading.Lock()
    barrier = threading.Barrier(PRODUCERS)
    futures: dict[int, list] = {}

    def task(key):
        with runs_lock:
            runs[key] += 1
        return key

    def produce(p):
        barrier.wait()
        futures[p] = [
            (d if i % 2 else d.lanes[i % 4]).submit(task, (p, i)) for i in range(TASKS_EACH)
        ]

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, fs in futures.items():
        assert [f.result(timeout=30) for f in fs] == [(p, i) for i in range(TASKS_EACH)]
    assert len(runs) == PRODUCERS * TASKS_EACH
    assert set(runs.values()) == {1}


def test_many_producers_nothing_lost_or_doubled():
    with pydflash.Dispatcher(["cpu"] * 4, guard=()) as d:
        for _ in range(ROUNDS):
            producers_round(d)
        stats = d.stats()["lanes"]
        assert sum(s["completed"] for s in stats) == ROUNDS * PRODUCERS * TASKS_EACH


def waiters_round(d: pydflash.Dispatcher) -> None:
    gate = threading.Event()
    f = d.submit(gate.wait)
    barrier = threading.Barrier(9)
    got = []

    def waiter():
        barrier.wait()
        got.append(f.result(timeout=10))

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    barrier.wait()
    gate.set()
    for t in threads:
        t.join()
    assert got == [True] * 8


def test_waiters_on_other_threads_all_wake():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        for _ in range(50):
            waiters_round(d)


def test_tasks_submitting_to_other_lanes():
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        a, b = d.lanes

        def fan_out(n):
            return sum(f.result() for f in [b.submit(pow, i, 2) for i in range(n)])

        assert a.submit(fan_out, 100).result(timeout=30) == sum(i * i for i in range(100))


def test_a_task_waiting_on_another_lane_never_holds_back_earlier_results():
    # Lane b waits on f1; lane a then runs a task that waits on lane b. f1 must be
    # published as soon as it finishes, not when lane a next lets go of the GIL.
    with pydflash.Dispatcher(["cpu"] * 2, guard=()) as d:
        a, b = d.lanes
        for _ in range(20):
            gate = threading.Event()
            a.submit(gate.wait)
            f1 = a.submit(lambda: "f1")
            g = b.submit(lambda f1=f1: f1.result(timeout=10))
            f2 = a.submit(lambda g=g: g.result(timeout=5))
            gate.set()
            assert f2.result(timeout=10) == "f1"


def test_a_done_callback_may_read_the_result():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        seen = []
        for i in range(50):
            gate = threading.Event()
            f = d.submit(lambda i=i, gate=gate: (gate.wait(), i)[1])
            f.add_done_callback(lambda fut: seen.append(fut.result()))
            gate.set()
            assert d.submit(lambda: "next").result(timeout=10) == "next"
        assert seen == list(range(50))
