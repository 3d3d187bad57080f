"""What the dflash_scale section's parts share: `Scale`, the workload and how long to
time it; the harness's timing setup on the job's own data; and the synchronize and
peak-memory helpers (bench/dflash_scale.py reports; bench/dflash_scale_stages.py times
each stage alone, bench/dflash_scale_parallel.py the data-parallel drafters)."""

from __future__ import annotations

import dataclasses

import torch

from bench.harness import Setup
from examples.dflash.loops import Job, Placement


@dataclasses.dataclass
class Scale:
    """The workload and how long to time it."""

    job: Job
    placement: Placement
    steps: int  # timed optimizer steps per loop
    reps: int  # repetitions of a timed measurement
    warmup: int  # untimed steps first

    @property
    def on_gpu(self) -> bool:
        return self.placement.targets[0].startswith("cuda")

    @property
    def samples_per_step(self) -> int:
        return self.job.accumulate * self.job.batch


class JobSetup(Setup):
    """The harness's timing setup, with the job's own data (tokens and anchors)."""

    def batches(self, count: int) -> list[dict]:
        if len(self._made) < count:
            self._made = self.job.data(seed=self.job.seed).batches(0, count, pin=self.on_gpu)
        return self._made[:count]


def timing_setup(scale: Scale, placement: Placement | None = None) -> JobSetup:
    return JobSetup(
        scale.job,
        placement or scale.placement,
        steps=scale.steps,
        reps=scale.reps,
        warmup=scale.warmup,
        on_gpu=scale.on_gpu,
    )


def synchronize(scale: Scale) -> None:
    for device in {*scale.placement.lanes}:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def peak_bytes(scale: Scale) -> int | None:
    return torch.cuda.max_memory_allocated(0) if scale.on_gpu else None


def reset_peak(scale: Scale) -> None:
    if scale.on_gpu:
        synchronize(scale)
        torch.cuda.reset_peak_memory_stats(0)
