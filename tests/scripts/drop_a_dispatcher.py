"""Queues 50 tasks on a CPU lane and drops its dispatcher, for test_process.py's
test_dropped_dispatcher_finishes_its_queue.

Prints how many of the 50 futures resolved to the task's result (None) and how many
tasks ran: "50 50" when the dropped dispatcher's queue ran to the end.
"""

import gc

import pydflash


def main() -> None:
    done: list[int] = []
    d = pydflash.Dispatcher(["cpu"], guard=())
    fs = [d.submit(done.append, i) for i in range(50)]
    del d
    gc.collect()
    print(sum(f.result(timeout=10) is None for f in fs), len(done))


if __name__ == "__main__":
    main()
