"""The example's training driver: one run of a loop (sequential, executor or pipeline),
segment by segment between checkpoints, with Ctrl-C caught (Note [Resume] in
checkpoint.py), its steps logged, and its scalars written."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from . import checkpoint, loops, metrics


def log(line: str) -> None:
    """Prints a line on stdout, above the progress bar when there is one."""
    with tqdm.external_write_mode():
        print(line, flush=True)


@dataclasses.dataclass
class Run:
    """How one training run goes, beside the job and the placement."""

    steps: int  # the run's total optimizer steps
    depth: int
    rank: int = 0
    world: int = 1  # processes under torchrun; above 1, the drafter is a DDP module
    log_every: int = 10
    trace: Path | None = None
    graphs: bool = False
    drafter_graphs: bool = False
    checkpoint: Path | None = None  # where checkpoints go; None: none are written
    every: int | None = None  # steps between checkpoints
    stop_after: int | None = None  # steps this process trains before it stops
    resume: dict | None = None  # a loaded checkpoint to continue from
    identity: dict | None = None  # what a checkpoint of this run must match
    scalars: metrics.Scalars | None = None

    def segments(self, start: int) -> list[tuple[int, int]]:
        """(first step, steps) of each stretch between checkpoints (Note [Resume])."""
        end = self.steps if self.stop_after is None else min(self.steps, start + self.stop_after)
        cuts = set(range(start, end, self.every or end or 1)) | {end}
        bounds = sorted(c for c in cuts if c >= start)
        return [(a, b - a) for a, b in itertools.pairwise(bounds)]


@dataclasses.dataclass
class Outcome:
    mode: str
    losses: list[list[float]]  # per step, per microbatch
    wall_s: float
    models: loops.Models
    first_step: int = 1
    interrupted: bool = False
    pipeline_stats: dict | None = None
    graph_stats: list[dict] | None = None  # per TargetGraphs, with --target-graphs
    drafter_graph_stats: dict | None = None  # DrafterGraphs.stats(), with --drafter-graphs


def synchronize(placement: loops.Placement) -> None:
    for device in set(placement.lanes):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def train(mode: str, job: loops.Job, placement: loops.Placement, run: Run) -> Outcome:
    """Trains with `mode`'s loop, segment by segment with a checkpoint after each, from
    the checkpoint `run.resume` if given; rank 0 logs and shows a progress bar."""
    verbose = run.rank == 0
    models = loops.build_models(job, placement, ddp=run.world > 1)
    start = 0 if run.resume is None else checkpoint.restore(run.resume, models)
    data = job.data(seed=job.seed)
    pin = placement.on_gpu
    warm = job.data(seed=job.seed + 1).batch(0)
    loop = None
    if mode == "pipeline":
        loop = loops.PipelineLoop(
            models,
            placement,
            job,
            run.depth,
            trace=run.trace is not None,
            graphs=run.graphs,
            drafter_graphs=run.drafter_graphs,
        )
        loop.warm_up(warm)
    else:
        with torch.no_grad():  # the same Triton warm-up as the pipeline's
            for target, device in zip(models.targets, placement.targets, strict=True):
                loops.target_forward(target)({k: t.to(device) for k, t in warm.items()})
    if run.resume is not None:
        checkpoint.set_rng_state(run.resume["rng"])

    def microbatches(first: int, count: int) -> list[int]:
        # Rank r trains on microbatches r, r + world, ...: one stream of data split by rank.
        return [run.rank + run.world * (first * job.accumulate + i) for i in range(count)]

    def steps_of(first: int, count: int) -> Any:
        indices = microbatches(first, count * job.accumulate)
        if job.samples is None:  # synthetic tokens are slow to make: all up front
            batches: Any = data.batches(indices[0], len(indices), stride=run.world, pin=pin)
        else:  # a file's: made as the loop asks, so a long run holds only those in flight
            batches = (data.batches(i, 1, pin=pin)[0] for i in indices)
        if loop is not None:
            return loop.steps(batches, count)
        if mode == "sequential":
            return loops.sequential_steps(models, placement, job, batches, count)
        return loops.executor_steps(models, placement, job, batches, count, run.depth)

    synchronize(placement)
    if verbose:
        params = [p for p in models.drafters[0].parameters()]
        trainable = sum(p.numel() for p in params if p.requires_grad)
        log(
            f"{mode}: target lanes {list(placement.targets)}, drafter lanes "
            f"{list(placement.drafters)}, {job.accumulate * job.batch} samples per step; "
            f"drafter {trainable:,} trainable parameters, "
            f"{sum(p.numel() for p in params) - trainable:,} frozen"
            + (f"; resumed after step {start}" if start else "")
        )
    collected = []
    interrupted = False
    # disable=None: a bar only where stderr is a terminal; elsewhere the log lines alone.
    bar = tqdm(
        total=run.steps, initial=start, desc=mode, unit="step", disable=None if verbose else True
    )
    begin = window_start = time.perf_counter()
    window_tokens = window_steps = 0
    try:
        for first, count in run.segments(start):
            for step, step_losses in enumerate(steps_of(first, count), first + 1):
                collected.append(step_losses)
                bar.update()
                window_steps += 1
                window_tokens += sum(data.tokens(i) for i in microbatches(step - 1, job.accumulate))
                if step % run.log_every == 0 or step == run.steps:
                    losses = step_losses()  # syncs: only every log_every steps
                    now = time.perf_counter()
                    report(
                        mode,
                        run,
                        models,
                        placement,
                        job,
                        step,
                        losses,
                        window_steps,
                        window_tokens,
                        now - window_start,
                    )
                    window_start, window_tokens, window_steps = now, 0, 0
            if run.checkpoint is not None and verbose:
                synchronize(placement)
                checkpoint.save(run.checkpoint, models, first + count, run.identity)
        synchronize(placement)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        wall = time.perf_counter() - begin
        stats = loop.pipe.stats() if loop is not None else None
        graph_stats = loop.graph_stats() if loop is not None and run.graphs else None
        drafter_stats = loop.drafter_graph_stats() if loop is not None else None
        if loop is not None:
            if run.trace is not None:
                loop.dispatcher.export_trace(run.trace)
            loop.close()
        bar.close()
    if interrupted:
        done = checkpoint.completed_steps(models.schedulers)
        collected = collected[: done - start]
        if run.checkpoint is not None and verbose:
            synchronize(placement)
            checkpoint.save(run.checkpoint, models, done, run.identity)
            log(f"interrupted after step {done}: wrote {run.checkpoint} (--resume continues)")
    losses = [f() for f in collected]
    return Outcome(
        mode, losses, wall, models, start + 1, interrupted, stats, graph_stats, drafter_stats
    )


def report(
    mode: str,
    run: Run,
    models: loops.Models,
    placement: loops.Placement,
    job: loops.Job,
    step: int,
    losses: list[float],
    steps: int,
    tokens: int,
    seconds: float,
) -> None:
    """Logs step `step` (the last of `steps` steps and `tokens` tokens per rank over
    `seconds`) on rank 0, and writes its scalars when the run keeps them."""
    if run.rank:
        return
    loss = sum(losses) / len(losses)
    rate = tokens * run.world / seconds
    log(f"{mode} step {step}/{run.steps}  loss {loss:.4f}  tokens/s {rate:,.0f}")
    if run.scalars is not None:
        run.scalars.add(
            {
                "step": step,
                "loss": loss,
                "lr": float(models.schedulers[0].get_last_lr()[0]),
                "samples_per_s": steps * job.accumulate * job.batch * run.world / seconds,
                "tokens_per_s": rate,
                "memory_bytes": metrics.memory_bytes(placement.drafters[0]),
            }
        )
