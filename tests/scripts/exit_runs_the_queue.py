"""Exits while a task runs on a CPU lane and 100 more are queued behind it, for
test_process.py's test_exit_lets_the_running_task_finish_then_runs_the_queue.

    exit_runs_the_queue.py [--shutdown-without-wait]

Prints "exiting" once the lane has started the running task, then, with the option,
calls `shutdown(wait=False)` (which, as concurrent.futures' does, leaves the queue to
run), and leaves. The running task returns once the lane is closed, printing "running
task saw the lane closed: True" (False if it gave up after 60 s); each queued task
prints "queued task ran" and its index.
"""

import sys
import threading
import time

import pydflash


def main() -> tuple:
    if sys.argv[1:] not in ([], ["--shutdown-without-wait"]):
        sys.exit(f"expected no argument or --shutdown-without-wait, got {sys.argv[1:]}")
    d = pydflash.Dispatcher(["cpu"])  # with the triton guard, as by default
    lane = d.lanes[0]
    started = threading.Event()

    def running() -> None:
        started.set()
        deadline = time.monotonic() + 60  # bounded, so that a bug cannot hang
        while not lane.closed and time.monotonic() < deadline:
            time.sleep(0.001)
        print("running task saw the lane closed:", lane.closed, flush=True)

    d.submit(running)
    queued = [d.submit(print, "queued task ran", i, flush=True) for i in range(100)]
    started.wait(60)  # exit while it runs, not before the lane picked it up
    print("exiting", flush=True)
    if sys.argv[1:]:
        d.shutdown(wait=False)
    return d, queued


if __name__ == "__main__":
    # Held to the end, as a script's globals are: exit meets a live dispatcher.
    held = main()
