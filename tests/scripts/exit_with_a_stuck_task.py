"""Exits while a task that never returns runs on lane 0 of two CPU lanes, for
test_process.py's test_exit_with_a_task_that_never_returns; run it with
PYDFLASH_EXIT_TIMEOUT set low.

    exit_with_a_stuck_task.py busy|sleeping|waiting N

The stuck task spins (busy), sleeps in a loop (sleeping) or blocks on an event that is
never set (waiting). N tasks are queued after it, alternately on lane 0 (each would
print "queued behind the stuck task ran") and on lane 1 (each returns its index). Prints
"exiting" once the stuck task runs, and exits.
"""

import sys
import threading
import time

import pydflash


def busy() -> None:
    while True:
        pass


def sleeping() -> None:
    while True:
        time.sleep(0.01)


def waiting() -> None:
    threading.Event().wait()


def tiny(i: int) -> int:
    return i


def main() -> tuple:
    kinds = {"busy": busy, "sleeping": sleeping, "waiting": waiting}
    if len(sys.argv) != 3 or sys.argv[1] not in kinds:
        sys.exit(f"expected busy|sleeping|waiting N, got {sys.argv[1:]}")
    forever, queued = kinds[sys.argv[1]], int(sys.argv[2])
    d = pydflash.Dispatcher(["cpu", "cpu"], guard=())
    stuck = d.lanes[0].submit(forever)
    futures = [
        d.lanes[0].submit(print, "queued behind the stuck task ran", i)
        if i % 2 == 0
        else d.lanes[1].submit(tiny, i)
        for i in range(queued)
    ]
    while not stuck.running():  # exit while it runs, not before it started
        time.sleep(0.001)
    print("exiting", flush=True)
    return d, stuck, futures


if __name__ == "__main__":
    # Held to the end, as a script's globals are: exit meets a live dispatcher.
    held = main()
