"""The seed workload's section (bench/seed_workload.py): what its modules share, the
section's name, the GPU's peak memory and freeing it, a failed row, and the time budget."""

from __future__ import annotations

import gc
import time

import torch

from bench.common import Row
from examples.dflash.loops import Models

SECTION = "seed_workload"


def peak(on_gpu: bool, reset: bool = False) -> int | None:
    if not on_gpu:
        return None
    torch.cuda.synchronize()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated()


def free(models: Models | None = None) -> None:
    for optimizer in models.optimizers if models is not None else ():
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA never started


def first_line(exc: BaseException, limit: int = 200) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().partition(chr(10))[0]}"[:limit]


def failed_row(name: str, exc: BaseException) -> Row:
    """A loop that failed (an OOM, a capture error): its row, with the error's first line."""
    why = f"failed: {first_line(exc)}"
    return Row(SECTION, name, None, "samples/s", note=why, extra={"status": "failed"})


class Budget:
    """Seconds left for the section's optional items (None: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.perf_counter() + seconds

    def over(self) -> bool:
        return self.end is not None and time.perf_counter() > self.end
