"""Exits with 40 short tasks queued on a live dispatcher of two CPU lanes and 40 on a
dropped one, for test_process.py's
test_exit_runs_the_queues_of_live_and_dropped_dispatchers.

Prints "leaving" as it exits; then an atexit handler, which runs after the lanes'
queues (as after ThreadPoolExecutor's), prints for the live and then the dropped
dispatcher whether each of its 40 tasks ran ("True True" when all did).
"""

import atexit
import gc
import time

import pydflash

ran: dict[str, list[int]] = {"live": [], "dropped": []}


def task(name: str, i: int) -> None:
    time.sleep(0.002)
    ran[name].append(i)


def report() -> None:
    print(*(sorted(v) == list(range(40)) for v in ran.values()))


def main() -> pydflash.Dispatcher:
    atexit.register(report)
    live = pydflash.Dispatcher(["cpu", "cpu"], guard=())
    dropped = pydflash.Dispatcher(["cpu"], guard=())
    for i in range(40):
        live.submit(task, "live", i)
        dropped.submit(task, "dropped", i)
    del dropped
    gc.collect()
    print("leaving", flush=True)
    return live


if __name__ == "__main__":
    # Held to the end, as a script's globals are: exit meets a live dispatcher.
    live = main()
