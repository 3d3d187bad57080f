"""Every lane's first torch task, `import torch`, starts while another lane is still
importing it; the main thread submits then too, and never imports torch itself.

Eight lanes start together; all but the first wait until torch's import has begun (on
the first). Prints the nine outcomes: 2 for a task that ran, else the exception's repr.
"""

import concurrent.futures
import sys
import threading
import time

import pydflash

LANES = 8
started = threading.Barrier(LANES)


def wait_for_an_import(index: int) -> None:
    started.wait()
    while index and "torch" not in sys.modules:
        time.sleep(0.0001)


def first_torch_task() -> int:
    import torch

    return int(torch.ones(2).sum())


def main() -> None:
    with pydflash.Dispatcher(["cpu"] * LANES) as d:
        assert "torch" not in sys.modules
        futures = []
        for index, lane in enumerate(d.lanes):
            lane.submit(wait_for_an_import, index)
            futures.append(lane.submit(first_torch_task))
        while "torch" not in sys.modules:
            time.sleep(0.0001)
        try:  # the submit reads the caller's torch state
            futures.append(d.submit(first_torch_task))
        except Exception as e:  # noqa: BLE001 - printed as this submit's outcome
            futures.append(concurrent.futures.Future())
            futures[-1].set_exception(e)
        outcomes = [f.exception() or f.result() for f in futures]
    print([o if o == 2 else repr(o) for o in outcomes])


if __name__ == "__main__":
    main()
