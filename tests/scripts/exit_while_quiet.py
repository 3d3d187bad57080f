"""Exits while lane 1 of two CPU lanes is paused by a quiet that lane 0 holds, for
test_quiesce.py's test_exit_while_a_lane_is_paused_does_not_hang; run it with
PYDFLASH_EXIT_TIMEOUT set low.

    exit_while_quiet.py returns|never_returns

Lane 0 holds its device quiet for 0.3 s (returns) or forever (never_returns); 20 tasks
are queued on lane 1 once the quiet is held, and the main thread exits. With `returns`
the exit waits for the quiet to end, lane 1 runs its queue and an exit hook prints
"queued ran: 20"; with `never_returns` the exit gives up on both lanes after the timeout.
"""

import atexit
import sys
import threading
import time

import pydflash
from pydflash.lanes.quiesce import device_quiet

ran = []


def hold(lane: pydflash.Lane, held: threading.Event, forever: bool) -> None:
    with device_quiet(lane, timeout=10) as quiet:
        assert quiet
        held.set()
        if forever:
            threading.Event().wait()
        time.sleep(0.3)


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("returns", "never_returns"):
        sys.exit(f"expected returns|never_returns, got {sys.argv[1:]}")
    d = pydflash.Dispatcher(["cpu", "cpu"], guard=())
    held = threading.Event()
    d.lanes[0].submit(hold, d.lanes[0], held, sys.argv[1] == "never_returns")
    assert held.wait(10)
    for i in range(20):
        d.lanes[1].submit(ran.append, i)
    # Registered after pydflash's: runs after the lanes have finished at exit.
    atexit.register(lambda: print("queued ran:", len(ran), flush=True))
    print("exiting", flush=True)


main()
