"""What every benchmark section shares: the context it runs in, the rows it returns,
and the timing helpers. A section is a module with `run(ctx) -> list[Row]`."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass
class Row:
    """One measured figure, compared with an alternative measured in the same run."""

    section: str
    name: str
    value: float  # median
    unit: str  # "us", "ms", "x", "fraction", "bytes", "count"
    baseline_name: str | None = None  # what `ratio` compares against
    baseline: float | None = None  # the alternative's median, same unit
    ratio: float | None = None  # value / baseline (lower is better for times)
    target: str | None = None  # e.g. "<= 0.25": the goal for `ratio` (or value)
    met: bool | None = None  # whether target holds; None when there is no target
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    quick: bool  # CI: few iterations, small sizes
    gpus: int  # visible CUDA devices (0: CPU lanes only)
    progress: Callable[[str], None]  # one-line status for the progress display
    artifacts: dict[str, Any] = field(default_factory=dict)  # e.g. traces for the plot

    def reps(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in seconds over `reps` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def check(ratio: float, bound: float) -> bool:
    return ratio <= bound
