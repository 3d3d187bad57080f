"""pydflash's benchmarks; `python -m bench.run` runs them (bench/run.py)."""

import os

# Note [No profiler left behind]: once a profiled window ends, Kineto keeps CUPTI's
# callbacks on every CUDA call of the process unless told to tear CUPTI down. Every
# unprofiled figure measured after the first profiled one then carries that cost: on the
# H200 (2026-12-01), the launch-bound pipeline's lane workers went from 0.6 and 1.0 ms to
# 2.2 ms of CPU per step after one profiled window, and not with teardown. Kineto reads
# this when each trace stops; CUDA >= 12.6 re-initializes CUPTI lazily for the next one.
# A user's own setting wins.
os.environ.setdefault("TEARDOWN_CUPTI", "1")
