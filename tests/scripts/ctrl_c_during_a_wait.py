"""Ctrl-C while the main thread is blocked on a task that does not finish, for
test_process.py's test_ctrl_c_interrupts_a_blocked_wait_promptly.

Waits on the task with `result()`, `exception()` and `pydflash.wait_all()` in turn and
sends itself SIGINT 0.2 s into each wait. Prints one line per wait: its name and
"KeyboardInterrupt", then the seconds from the signal and from the start of the wait to
the exception (or its name and "returned" if the wait ended without one). Then it opens
the task's gate and prints "stuck returned" with the task's result.
"""

import os
import signal
import threading
import time

import pydflash


def interrupted(wait) -> str:
    sent: list[float] = []

    def interrupt() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(0.2, interrupt)
    start = time.monotonic()
    timer.start()
    try:
        wait()
        outcome = "returned"
    except KeyboardInterrupt:
        now = time.monotonic()
        outcome = f"KeyboardInterrupt {now - sent[0]:.4f} {now - start:.4f}"
    timer.join()
    return outcome


def main() -> None:
    d = pydflash.Dispatcher(["cpu"], guard=())
    gate = threading.Event()
    stuck = d.submit(gate.wait)
    waits = {
        "result": stuck.result,
        "exception": stuck.exception,
        "wait_all": lambda: pydflash.wait_all([stuck]),
    }
    for name, wait in waits.items():
        print(name, interrupted(wait), flush=True)
    gate.set()
    print("stuck returned", stuck.result(timeout=5), flush=True)
    d.shutdown()


if __name__ == "__main__":
    main()
