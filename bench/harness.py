"""The alternatives every DFlash-style section measures pydflash against, written once.

bench/common.py holds what a section *is*: its context and mode, its rows and how a
target is met, and the timing of one callable (warm-up, then the median of timed runs,
alternatives sampled in turn). This module holds what a DFlash-style section *runs*:
the baselines over a stream of microbatches that each section used to build by hand.

- One step over microbatches (one forward each): the sequential loop, a
  ThreadPoolExecutor with a stream per thread, and pydflash lanes (eager or graph
  stages).
- One optimizer step of the DFlash example's training loop: `Setup` (the job, its
  placement and the timing window: warm-up steps, then timed steps, the median over
  repetitions), `step_time` of a loop, the sequential loop and the ThreadPoolExecutor
  loop beside which a section times its PipelineLoop, and each stage timed alone
  (`drafter_stage`, `time_stages`).
- The rates the rows report: samples/s and tokens/s; the DFlash objective they train.
- CPU lanes' setting: one intra-op thread each.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from bench.common import Context
from examples.dflash.data import MarkovTokens
from examples.dflash.loops import Job, Placement, drafter_loss, executor_steps, sequential_steps
from examples.dflash.models import DrafterConfig
from pydflash import TargetGraphs


def n_lanes(n: int) -> str:
    return f"{n} lane" if n == 1 else f"{n} lanes"


def rate(seconds: float, microbatches: int, batch: int, seq: int) -> str:
    """What `microbatches` microbatches of batch x seq tokens in `seconds` come to."""
    samples = microbatches * batch / seconds
    return f"{samples:,.1f} samples/s, {samples * seq:,.0f} tokens/s"


def objective(drafter: DrafterConfig) -> str:
    """The DFlash objective `drafter` trains on the example's synthetic tokens
    (examples/dflash/objective.py), for a row's note: its gamma, block and anchors."""
    anchors = f"{drafter.anchors} anchors" if drafter.anchors else "an anchor every block"
    return (
        f"loss: DFlash's, slot k weighted exp(-(k-1)/{drafter.gamma_:g}) at block "
        f"{drafter.block}; no loss mask (synthetic tokens: every position supervised, "
        f"{anchors} uniform over the sequence)"
    )


def on_device(device: Any) -> Any:
    """The device current for kernels that launch on the current device."""
    return torch.cuda.device(device) if torch.device(device).type == "cuda" else nullcontext()


@contextmanager
def cpu_lanes() -> Iterator[None]:
    """One intra-op thread while CPU lanes run: the lanes share the host's cores, and
    OpenMP teams on top of them wait on descheduled threads, which would dominate every
    timing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
@dataclasses.dataclass
class Setup:
    job: Job
    placement: Placement
    steps: int  # timed steps per repetition
    reps: int
    warmup: int  # untimed steps first
    on_gpu: bool
    _made: list[dict] = dataclasses.field(default_factory=list, repr=False)

    @classmethod
    def for_model(
        cls, ctx: Context, job: Job, placement: Placement, *, steps: int | None, on_gpu: bool
    ) -> Setup:
        """A real model's pipeline timing (real_target, scale_out): `steps` timed steps
        per repetition, default 8 (3 with --quick)."""
        return cls(
            job,
            placement,
            steps=steps or ctx.reps(8, 3, default=4),
            reps=ctx.reps(3, 1, default=1),
            warmup=ctx.reps(2, 1, default=1),
            on_gpu=on_gpu,
        )

    def batches(self, count: int) -> list[dict]:
        # Made once and reused by every loop: long sequences take seconds to generate.
        if len(self._made) < count:
            data = MarkovTokens(
                self.job.target.vocab, self.job.seq, self.job.batch, seed=self.job.seed
            )
            self._made = data.batches(0, count, pin=self.on_gpu)
        return self._made[:count]


def synchronize(setup: Setup) -> None:
    for device in set(setup.placement.lanes):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def step_time(
    setup: Setup, make_steps: Callable[[list[dict], int], Iterator[Any]], *, run_ahead: bool = False
) -> float:
    """Median over repetitions of (wall time of `steps` steps) / steps, in seconds, after
    `warmup` steps. Each repetition runs on data it has not seen. With run_ahead (a loop
    that keeps microbatches of the next step in flight), the loop gets one step more than
    is timed, so that the window ends as it starts; that step's queued work is cancelled."""
    per_run = setup.warmup + setup.steps + run_ahead
    size = per_run * setup.job.accumulate
    batches = setup.batches(size * setup.reps)
    samples = []
    for rep in range(setup.reps):
        steps = make_steps(batches[rep * size : (rep + 1) * size], per_run)
        try:
            for _ in range(setup.warmup):
                next(steps)
            synchronize(setup)
            start = time.perf_counter()
            for _ in range(setup.steps):
                next(steps)
            synchronize(setup)
            samples.append((time.perf_counter() - start) / setup.steps)
        finally:
            steps.close()
    return statistics.median(samples)


def drafter_stage(
    setup: Setup, lane: Any, drafter: Any, optimizer: Any, inputs: list[dict]
) -> Callable[[], None]:
    """One step of the drafter stage alone, as the pipeline runs it on `lane`: a
    forward/backward pass per input (already on the drafter's device), then the
    optimizer step."""

    def train() -> None:
        for x in inputs:
            with torch.autograd.set_multithreading_enabled(False):  # as the pipeline
                (drafter_loss(drafter, x) / setup.job.accumulate).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        lane.submit(train).result()
        synchronize(setup)

    return step


def time_stages(
    setup: Setup,
    stages: dict[str, Callable[[], None]],
    announce: Callable[[str], None] = lambda name: None,
) -> dict[str, float]:
    """Median seconds per step of each stage, after `setup.warmup` untimed steps."""
    result = {}
    for name, step in stages.items():
        announce(name)
        for _ in range(setup.warmup):
            step()
        samples = []
        for _ in range(setup.reps):
            start = time.perf_counter()
            for _ in range(setup.steps):
                step()
            samples.append((time.perf_counter() - start) / setup.steps)
        result[name] = statistics.median(samples)
    return result


def loop_baselines(
    setup: Setup, models: Any, progress: Callable[[str], None], label: str
) -> dict[str, float]:
    """Seconds per optimizer step of the sequential loop and of the ThreadPoolExecutor
    loop (prefetch depth 2), over `setup`'s microbatches."""
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
