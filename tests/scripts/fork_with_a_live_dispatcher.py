"""Forks while a dispatcher of two CPU lanes has a finished task and one that waits on a
gate, for test_process.py's
test_forked_child_gets_clear_errors_and_can_make_its_own_dispatcher.

The child tries the parent's dispatcher, a lane of it and the waiting future, printing
for each "child <what> RuntimeError: <message>" (or "child <what> no error"), then the
finished future's result and what a dispatcher of its own computes ("child own" 2**5 and
1+2+3); it exits with status 0 if all of that ran, else 1 after a traceback. The parent
prints the child's exit status, opens the gate and prints the waiting future's result
and that of a task submitted after the fork.
"""

import concurrent.futures
import os
import threading
import traceback
import warnings

import pydflash


def child(d: pydflash.Dispatcher, pending, finished) -> None:
    attempts = [
        ("submit", lambda: d.submit(int)),
        ("lane submit", lambda: d.lanes[1].submit(int)),
        ("pending result", lambda: pending.result()),
        ("pending exception", lambda: pending.exception()),
        ("pending wait", lambda: concurrent.futures.wait([pending])),
        (
            "pending as_completed",
            lambda: next(concurrent.futures.as_completed([pending])),
        ),
    ]
    for what, call in attempts:
        try:
            call()
            print("child", what, "no error", flush=True)
        except RuntimeError as e:
            print("child", what, "RuntimeError:", e, flush=True)
    print("child finished result", finished.result(), flush=True)
    d.lanes[0].shutdown()  # a no-op for the parent's lanes, as is:
    d.shutdown()
    with pydflash.Dispatcher(["cpu"], guard=()) as own:
        power = own.submit(pow, 2, 5).result(timeout=10)
        total = own.submit(sum, [1, 2, 3]).result(timeout=10)
    print("child own", power, total, flush=True)


def main() -> None:
    d = pydflash.Dispatcher(["cpu", "cpu"], guard=())
    gate = threading.Event()
    pending = d.submit(gate.wait)
    finished = d.submit(int, "5")
    assert finished.result() == 5
    with warnings.catch_warnings():
        # Python 3.12 warns about forking a process with threads: that is the point.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child(d, pending, finished)
            code = 0
        except BaseException:  # noqa: BLE001 - shown, and the status says so
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)
    gate.set()
    after = d.submit(int, "9").result()
    print("parent pending", pending.result(), "submit", after, flush=True)
    d.shutdown()


if __name__ == "__main__":
    main()
