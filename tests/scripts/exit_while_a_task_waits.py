"""Exits while a task waits in a pydflash result() that cannot end, for test_process.py's
test_exit_gives_up_on_a_task_waiting_in_result; run it with PYDFLASH_EXIT_TIMEOUT set low.

    exit_while_a_task_waits.py own-lane|other-dispatcher

own-lane: the task waits for a future queued behind it on its own lane. other-dispatcher:
the task waits for a future of a second dispatcher, whose lane runs a task that never
returns. Prints "exiting" once the waiting task runs, and exits: the exit gives up on
the lanes, and the waiting thread must not bring the process down as the interpreter
finalizes (Note [Never retaking the GIL at exit]).
"""

import sys
import threading
import time

import pydflash


def main() -> tuple:
    if sys.argv[1:] not in (["own-lane"], ["other-dispatcher"]):
        sys.exit(f"expected own-lane|other-dispatcher, got {sys.argv[1:]}")
    waiting = pydflash.Dispatcher(["cpu"], guard=())
    lane = waiting.lanes[0]
    if sys.argv[1] == "own-lane":
        held = []

        def wait_behind_itself() -> None:
            held.append(lane.submit(int, 1))
            held[0].result()

        task = lane.submit(wait_behind_itself)
    else:
        other = pydflash.Dispatcher(["cpu"], guard=())
        held = [other, other.submit(threading.Event().wait)]
        task = lane.submit(held[1].result)
    while not task.running():  # exit while it waits, not before it started
        time.sleep(0.001)
    time.sleep(0.05)
    print("exiting", flush=True)
    return waiting, task, held


if __name__ == "__main__":
    # Held to the end, as a script's globals are: exit meets live dispatchers.
    kept = main()
