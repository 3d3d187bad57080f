"""Forks while lane 0 of two CPU lanes holds its device quiet (lane 1 paused), for
test_quiesce.py's test_a_forked_child_does_not_inherit_a_quiet.

The child makes a dispatcher of its own on the same device and runs 4 tasks on it,
printing "child ran 4 tasks"; a child that inherited the quiet would pause them and time
out. The parent prints the child's exit status, ends the quiet and checks that lane 1
runs again; exits 0 when all of that held.
"""

import os
import threading
import warnings

import pydflash
from pydflash.lanes.quiesce import device_quiet


def hold(lane: pydflash.Lane, held: threading.Event, release: threading.Event) -> bool:
    with device_quiet(lane, timeout=10) as quiet:
        held.set()
        release.wait(30)
    return quiet


def child() -> int:
    with pydflash.Dispatcher(["cpu", "cpu"], guard=()) as own:
        futures = [own.lanes[i % 2].submit(pow, 2, i) for i in range(4)]
        results = [f.result(timeout=10) for f in futures]
    assert results == [1, 2, 4, 8], results
    print("child ran", len(results), "tasks", flush=True)
    return 0


def main() -> int:
    d = pydflash.Dispatcher(["cpu", "cpu"], guard=())
    held, release = threading.Event(), threading.Event()
    quiet = d.lanes[0].submit(hold, d.lanes[0], held, release)
    assert held.wait(10)
    paused = d.lanes[1].submit(int, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:
        try:
            code = child()
        except BaseException as e:  # noqa: BLE001 - reported, then the child exits
            print("child failed:", repr(e), flush=True)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("child exit status", os.waitstatus_to_exitcode(status), flush=True)
    assert not paused.done(), "lane 1 ran during the quiet"
    release.set()
    assert quiet.result(timeout=10) is True
    assert paused.result(timeout=10) == 7
    d.shutdown()
    return os.waitstatus_to_exitcode(status)


raise SystemExit(main())
