"""pydflash's benchmarks; `python -m bench.run` runs them (bench/run.py)."""

from __future__ import annotations

import os


def cupti_teardown_safe(cuda: str | None) -> bool:
    """Whether Kineto may tear CUPTI down after each profile of a process that replays
    CUDA graphs: from CUDA 12.6 on. Before it, re-initializing CUPTI after a teardown
    crashed with graphs, and torch's profiler turns teardown off there itself."""
    try:
        major, minor = (int(part) for part in (cuda or "").split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (12, 6)


def _torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


# Note [No profiler left behind]: once a profiled window ends, Kineto keeps CUPTI's
# callbacks on every CUDA call of the process unless told to tear CUPTI down. Every
# unprofiled figure measured after the first profiled one then carries that cost: on the
# H200 (2026-12-01), the launch-bound pipeline's lane workers went from 0.6 and 1.0 ms to
# 2.2 ms of CPU per step after one profiled window, and not with teardown. Kineto reads
# this when each trace stops, and re-initializes CUPTI lazily for the next one. A user's
# own setting wins.
if cupti_teardown_safe(_torch_cuda()):
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
