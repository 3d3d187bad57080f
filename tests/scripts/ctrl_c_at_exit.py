"""Waits on a 60 s task with one task queued behind it, for test_process.py's
test_ctrl_c_at_exit_says_what_it_waits_for_and_a_second_ends_it, which sends SIGINT
twice: once to end the wait (so that the interpreter exits with work on the lane), once
during the exit.

Prints "started" once the long task runs; the queued task would print "queued task ran".
"""

import time

import pydflash


def main() -> None:
    d = pydflash.Dispatcher(["cpu"], guard=())
    long = d.submit(time.sleep, 60)
    d.submit(print, "queued task ran")
    while not long.running():
        time.sleep(0.001)
    print("started", flush=True)
    long.result()


if __name__ == "__main__":
    main()
