"""Counts the calls of a patched `concurrent.futures` waiter method, for
test_future.py's test_a_patched_waiter_method_is_called: the patch is made before the
first wait, after pydflash read the waiter classes at import.

Waits with `concurrent.futures.wait` on three tasks queued behind a gate that opens
after 0.05 s; prints how many futures were done and not done, and how many times the
patched `_AllCompletedWaiter.add_result` ran ("3 0 3").
"""

import concurrent.futures as cf
import concurrent.futures._base as base
import threading

import pydflash

calls: list[cf.Future] = []
add_result = base._AllCompletedWaiter.add_result


def counted(self, future: cf.Future) -> None:
    calls.append(future)
    add_result(self, future)


def main() -> None:
    base._AllCompletedWaiter.add_result = counted
    d = pydflash.Dispatcher(["cpu"], guard=())
    gate = threading.Event()
    d.submit(gate.wait)
    futures = [d.submit(int, i) for i in range(3)]
    threading.Timer(0.05, gate.set).start()
    done, not_done = cf.wait(futures)
    print(len(done), len(not_done), len(calls))
    d.shutdown()


if __name__ == "__main__":
    main()
