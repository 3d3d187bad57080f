"""Property-based tests: random sequences of submit, cancel, map, wait, callbacks and
shutdown across CPU lanes, checked against what must hold whatever the interleaving:
every future resolves exactly once, results are right, nothing is lost, nothing runs
after a successful cancel, and each lane runs its tasks in order.

PYDFLASH_FUZZ_EXAMPLES sets how many sequences run (default 100)."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pydflash

LANES = 3
EXAMPLES = int(os.environ.get("PYDFLASH_FUZZ_EXAMPLES", "100"))
WAIT_S = 60  # only a hang reaches it

index = st.integers(0, 10_000)  # picks among what exists, modulo its length
operations = st.lists(
    st.one_of(
        # Listed more than once: drawn more often.
        st.tuples(st.just("submit"), st.integers(-1, LANES - 1), st.integers(0, 50)),
        st.tuples(st.just("submit"), st.integers(-1, LANES - 1), st.integers(0, 50)),
        st.tuples(st.just("submit"), st.integers(-1, LANES - 1), st.integers(0, 50)),
        st.tuples(st.just("block"), st.integers(0, LANES - 1)),
        st.tuples(st.just("block"), st.integers(0, LANES - 1)),
        st.tuples(st.just("release"), index),
        st.tuples(st.just("cancel"), index),
        st.tuples(st.just("map"), st.lists(st.integers(0, 50), max_size=6)),
        st.tuples(st.just("result"), index),
        st.tuples(
            st.just("wait"),
            st.lists(index, max_size=5),
            st.sampled_from([concurrent.futures.FIRST_COMPLETED, concurrent.futures.ALL_COMPLETED]),
        ),
        st.tuples(st.just("wait_all"), st.lists(index, max_size=5)),
        st.tuples(st.just("callback"), index),
        st.tuples(st.just("shutdown"), st.integers(-1, LANES - 1), st.booleans()),
    ),
    min_size=10,
    max_size=60,
)


def fails(value: int) -> bool:
    return value % 7 == 3


@dataclass
class Task:
    tid: int
    future: concurrent.futures.Future
    expected: Any  # the result, or the message of the ValueError it raises
    raises: bool = False
    cancel_won: bool = False
    callbacks: list[int] = field(default_factory=list)  # one counter per registration


class Model:
    """The sequence being run: what was submitted, and what the tasks did."""

    def __init__(self) -> None:
        self.dispatcher = pydflash.Dispatcher(["cpu"] * LANES, guard=())
        self.lanes = self.dispatcher.lanes
        self.closed = [False] * LANES
        self.tasks: list[Task] = []
        self.gates: list[threading.Event] = []
        self.maps: list[tuple[Any, list[int]]] = []
        self.runs: collections.Counter[int] = collections.Counter()
        self.run_order: dict[int, list[int]] = collections.defaultdict(list)  # by worker thread
        self.cancelled_by_shutdown: set[int] = set()
        self.next_tid = 0
        self.lock = threading.Lock()

    def new_tid(self) -> int:
        self.next_tid += 1
        return self.next_tid

    def record_run(self, tid: int) -> None:
        with self.lock:
            self.runs[tid] += 1
            self.run_order[threading.get_ident()].append(tid)

    def work(self, tid: int, value: int) -> int:
        self.record_run(tid)
        if fails(value):
            raise ValueError(f"task {tid}")
        return value * 2 + 1

    def gate_wait(self, tid: int, gate: threading.Event) -> bool:
        self.record_run(tid)
        return gate.wait(WAIT_S)

    def pick(self, i: int) -> Task | None:
        return self.tasks[i % len(self.tasks)] if self.tasks else None

    def open_for(self, lane: int) -> bool:
        return not (all(self.closed) if lane < 0 else self.closed[lane])

    # --- operations ---------------------------------------------------------------------
    def submit(self, lane: int, fn: Any, *args: Any) -> concurrent.futures.Future | None:
        executor = self.dispatcher if lane < 0 else self.lanes[lane]
        if not self.open_for(lane):
            with pytest.raises(RuntimeError, match="after shutdown"):
                executor.submit(fn, *args)
            return None
        return executor.submit(fn, *args)

    def op_submit(self, lane: int, value: int) -> None:
        tid = self.new_tid()
        future = self.submit(lane, self.work, tid, value)
        if future is not None:
            expected = f"task {tid}" if fails(value) else value * 2 + 1
            self.tasks.append(Task(tid, future, expected, raises=fails(value)))

    def op_block(self, lane: int) -> None:
        tid, gate = self.new_tid(), threading.Event()
        future = self.submit(lane, self.gate_wait, tid, gate)
        if future is not None:
            self.gates.append(gate)
            self.tasks.append(Task(tid, future, True))

    def op_release(self, i: int) -> None:
        if self.gates:
            self.gates[i % len(self.gates)].set()

    def op_cancel(self, i: int) -> None:
        task = self.pick(i)
        if task is not None and task.future.cancel():
            task.cancel_won = True
            assert task.future.cancelled() and task.future.done()

    def op_map(self, values: list[int]) -> None:
        tids = [self.new_tid() for _ in values]
        if values and not self.open_for(-1):
            with pytest.raises(RuntimeError, match="after shutdown"):
                self.dispatcher.map(self.work, tids, values)
            return
        self.maps.append((self.dispatcher.map(self.work, tids, values), values))

    def op_result(self, i: int) -> None:
        task = self.pick(i)
        if task is None:
            return
        try:
            result = task.future.result(timeout=0)
        except TimeoutError:
            return
        except concurrent.futures.CancelledError:
            assert task.future.cancelled()
            return
        except ValueError as e:
            assert task.raises and str(e) == task.expected
            return
        assert not task.raises and result == task.expected

    def op_wait(self, picks: list[int], return_when: str) -> None:
        chosen = {self.pick(i).future for i in picks} if self.tasks else set()
        done, not_done = concurrent.futures.wait(chosen, timeout=0, return_when=return_when)
        assert done | not_done == chosen and not done & not_done
        assert all(f.done() for f in done)

    def op_wait_all(self, picks: list[int]) -> None:
        chosen = [self.pick(i) for i in picks] if self.tasks else []
        all_done_before = all(t.future.done() for t in chosen)
        try:
            results = pydflash.wait_all([t.future for t in chosen], timeout=0)
        except TimeoutError:
            assert not all_done_before  # done futures stay done
            return
        except ExceptionGroup as group:
            failed = [t for t in chosen if t.future.cancelled() or t.raises]
            assert len(group.exceptions) == len(failed) > 0
            return
        assert results == [t.expected for t in chosen] and not any(t.raises for t in chosen)

    def op_callback(self, i: int) -> None:
        task = self.pick(i)
        if task is None:
            return
        slot = len(task.callbacks)
        task.callbacks.append(0)

        def called(future: concurrent.futures.Future) -> None:
            assert future is task.future and future.done()
            task.callbacks[slot] += 1

        task.future.add_done_callback(called)

    def op_shutdown(self, lane: int, cancel_futures: bool) -> None:
        lanes = range(LANES) if lane < 0 else [lane]
        if lane < 0:
            self.dispatcher.shutdown(wait=False, cancel_futures=cancel_futures)
        else:
            self.lanes[lane].shutdown(wait=False, cancel_futures=cancel_futures)
        for i in lanes:
            self.closed[i] = True
        if cancel_futures:
            # Only what a worker holds, or the first task of an idle lane, which its worker
            # takes next (Note [Taken is running]), can still be pending: one per lane.
            for i in lanes:
                on_lane = [t for t in self.tasks if t.future.lane is self.lanes[i]]
                pending = [t for t in on_lane if not t.future.done()]
                assert len(pending) <= 1, pending

    # --- the end ------------------------------------------------------------------------
    def finish(self) -> None:
        for gate in self.gates:
            gate.set()
        self.dispatcher.shutdown(wait=True)

    def check(self) -> None:
        for iterator, values in self.maps:
            got = []
            try:
                for result in iterator:
                    got.append(result)
            except ValueError as e:
                # map stops at the first failing task, which must be the first failing value.
                assert fails(values[len(got)]), (values, got, e)
            except concurrent.futures.CancelledError:
                pass  # a shutdown with cancel_futures cancelled the rest
            assert got == [v * 2 + 1 for v in values[: len(got)]]

        for task in self.tasks:
            future = task.future
            assert future.done()
            if future.cancelled():
                assert self.runs[task.tid] == 0, f"task {task.tid} ran after it was cancelled"
            else:
                assert not task.cancel_won
                assert self.runs[task.tid] == 1, f"task {task.tid} ran {self.runs[task.tid]} times"
                if task.raises:
                    assert str(future.exception()) == task.expected
                else:
                    assert future.result() == task.expected
            assert all(calls == 1 for calls in task.callbacks), task.callbacks

        assert all(n <= 1 for n in self.runs.values())
        for order in self.run_order.values():
            assert order == sorted(order), "a lane ran its tasks out of order"
        for lane in self.lanes:
            stats = lane.stats()
            assert stats["queued"] == stats["running"] == 0
            assert stats["completed"] + stats["cancelled"] == stats["submitted"], stats


def test_random_sequences_of_executor_calls() -> None:
    seen = collections.Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(operations)
    def run(ops: list[tuple]) -> None:
        model = Model()
        try:
            for name, *args in ops:
                getattr(model, "op_" + name)(*args)
                seen[name] += 1
        finally:
            model.finish()
        model.check()
        seen["sequences"] += 1
        seen["operations"] += len(ops)
        seen["futures"] += len(model.tasks) + sum(len(v) for _, v in model.maps)

    run()
    # Figures for docs/reliability.md.
    print(dict(seen))
    assert seen["sequences"] >= EXAMPLES  # hypothesis ran what was asked (replays add more)


def test_dispatcher_submit_skips_a_lane_shut_down_on_its_own() -> None:
    d = pydflash.Dispatcher(["cpu"] * LANES, guard=())
    try:
        d.lanes[0].shutdown()
        futures = [d.submit(int, str(i)) for i in range(30)]
        assert pydflash.wait_all(futures) == list(range(30))
        assert all(f.lane is not d.lanes[0] for f in futures)
    finally:
        d.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        d.submit(int)
