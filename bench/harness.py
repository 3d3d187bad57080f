"""The alternatives every DFlash-style section measures pydflash against, written once.

bench/common.py holds what a section *is* (its context, its rows, how a target is met,
the timing windows); this module holds what a section *runs*: the baselines over a
stream of microbatches that each section used to build by hand.

- One step over microbatches (one forward each): the sequential loop, a
  ThreadPoolExecutor with a stream per thread, and pydflash lanes (eager or graph
  stages).
- One optimizer step of the DFlash example's training loop (`bench.pipeline.Setup`):
  the sequential loop and the ThreadPoolExecutor loop, beside which a section times its
  PipelineLoop.
- The rates the rows report: samples/s and tokens/s.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from pydflash import TargetGraphs


def n_lanes(n: int) -> str:
    return f"{n} lane" if n == 1 else f"{n} lanes"


def rate(seconds: float, microbatches: int, batch: int, seq: int) -> str:
    """What `microbatches` microbatches of batch x seq tokens in `seconds` come to."""
    samples = microbatches * batch / seconds
    return f"{samples:,.1f} samples/s, {samples * seq:,.0f} tokens/s"


def on_device(device: Any) -> Any:
    """The device current for kernels that launch on the current device."""
    return torch.cuda.device(device) if torch.device(device).type == "cuda" else nullcontext()


# --- one step over microbatches -------------------------------------------------------------
def sequential_step(
    forward: Callable, batches: Sequence[dict], synchronize: Callable[[], None]
) -> None:
    """The eager loop: one forward after another on the calling thread."""
    with torch.no_grad():
        for batch in batches:
            forward(batch)
    synchronize()


def executor_step(
    forwards: Sequence[Callable],
    batches: Sequence[dict],
    pool: concurrent.futures.Executor,
    streams: Sequence[Any],
    synchronize: Callable[[], None],
    *,
    set_device: bool = False,
) -> None:
    """forwards[i](batches[i]) on the pool's threads, on streams[i] (None: the CPU).
    `set_device` makes the stream's device current first, for forwards on several
    GPUs."""

    def one(i: int) -> None:
        with torch.no_grad():
            if streams[i] is None:
                forwards[i](batches[i])
                return
            # The inputs were made on the default stream, long before: no wait needed.
            device = on_device(streams[i].device) if set_device else nullcontext()
            with device, torch.cuda.stream(streams[i]):
                forwards[i](batches[i])

    list(pool.map(one, range(len(batches))))
    synchronize()


def lanes_step(
    stages: Sequence[Any],
    lanes: Sequence[Any],
    batches: Sequence[dict],
    synchronize: Callable[[], None],
) -> None:
    """stages[i].submit(lanes[i], batches[i]) for every i, then every result."""
    futures = [
        stage.submit(lane, batch) for stage, lane, batch in zip(stages, lanes, batches, strict=True)
    ]
    results = [future.result() for future in futures]
    synchronize()
    for stage, result in zip(stages, results, strict=True):
        if isinstance(stage, TargetGraphs):
            stage.release(result)  # its output buffers serve the next replays


# --- one optimizer step of the training loop ------------------------------------------------
def loop_baselines(
    setup: Any, models: Any, progress: Callable[[str], None], label: str
) -> dict[str, float]:
    """Seconds per optimizer step of the sequential loop and of the ThreadPoolExecutor
    loop (prefetch depth 2), over `setup`'s microbatches (bench.pipeline.Setup)."""
    from bench.pipeline import step_time
    from examples.dflash.loops import executor_steps, sequential_steps

    job, placement = setup.job, setup.placement
    times = {}
    progress(f"{label}sequential loop")
    times["sequential"] = step_time(
        setup, lambda b, n: sequential_steps(models, placement, job, b, n)
    )
    progress(f"{label}ThreadPoolExecutor loop")
    times["executor"] = step_time(
        setup, lambda b, n: executor_steps(models, placement, job, b, n, depth=2)
    )
    return times
