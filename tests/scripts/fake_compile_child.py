"""A stand-in for the torch.compile child of bench/real_target.py, for the tests of
`compile_child`: it behaves as its one argument says.

    sleep      reports the phase "built", then hangs past any limit
    crash      exits with status 1 and an error as its last line on stderr
    no-graphs  logs inductor's "skipping cudagraphs" on stderr, then reports "timed"
"""

import json
import sys
import time


def report(phase: str) -> None:
    print(json.dumps({"phase": phase}), flush=True)


def main() -> None:
    behaviour = sys.argv[1] if len(sys.argv) == 2 else None
    if behaviour == "sleep":
        report("built")
        time.sleep(60)
    elif behaviour == "crash":
        sys.exit("RuntimeError: no compiler")
    elif behaviour == "no-graphs":
        print("skipping cudagraphs due to mutated inputs", file=sys.stderr)
        report("timed")
    else:
        sys.exit(f"expected one of sleep, crash, no-graphs, got {sys.argv[1:]}")


if __name__ == "__main__":
    main()
