"""What every benchmark section shares: the context it runs in, the rows it returns,
and the timing helpers. A section is a module with `run(ctx) -> list[Row]`; the
baselines the DFlash-style sections measure against are in bench/harness.py."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# Seconds per unit, for the units a time can be reported in.
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass
class Row:
    """One measured figure, compared with an alternative measured in the same run."""

    section: str
    name: str
    value: float | None  # median; None when the figure was not measured (see `not_run`)
    unit: str  # "us", "ms", "x", "fraction", "bytes", "count"
    baseline_name: str | None = None  # what `ratio` compares against
    baseline: float | None = None  # the alternative's median, same unit
    ratio: float | None = None  # value / baseline (lower is better for times)
    target: str | None = None  # the goal, see `meets`: "<= 0.25", "speedup >= 1.8"
    met: bool | None = None  # whether target holds; None when there is no target
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def measured(self) -> bool:
        return self.value is not None

    @property
    def speedup(self) -> float | None:
        """baseline / value for times: how many times faster than the baseline."""
        if self.unit not in TIME_UNITS or not self.value or self.baseline is None:
            return None
        return self.baseline / self.value

    def figure(self, metric: str) -> float | None:
        """One of the figures a target can name: value, ratio, speedup, or added
        (value - baseline, in the row's unit)."""
        added = None if self.value is None or self.baseline is None else self.value - self.baseline
        return {"value": self.value, "ratio": self.ratio, "speedup": self.speedup, "added": added}[
            metric
        ]


def compare(
    section: str,
    name: str,
    value: float,
    unit: str,
    baseline_name: str | None = None,
    baseline: float | None = None,
    target: str | None = None,
    note: str = "",
    **extra: Any,
) -> Row:
    """A measured row: the ratio and whether the target is met follow from the figures."""
    ratio = value / baseline if baseline else None
    row = Row(section, name, value, unit, baseline_name, baseline, ratio, target, None, note, extra)
    row.met = meets(row)
    return row


def not_run(section: str, name: str, reason: str, target: str | None = None) -> Row:
    """A row for a figure this machine cannot measure (e.g. "needs a GPU")."""
    return Row(section, name, None, "", target=target, note=reason, extra={"status": "not run"})


_TARGET_RE = re.compile(r"^\s*(?:(value|ratio|speedup|added)\s+)?(<=|>=|<|>)\s*([0-9.eE+-]+)\s*$")


def parse_target(target: str) -> tuple[str | None, str, float]:
    """("ratio" | "value" | "speedup" | "added" | None, op, bound); None means ratio when
    the row has one, else value; "added" is value - baseline, in the row's unit. Raises
    ValueError on anything else."""
    match = _TARGET_RE.match(target)
    if match is None:
        raise ValueError(
            f"expected a target like '<= 0.25', 'ratio <= 0.1', 'value >= 0.95' or "
            f"'speedup >= 1.8' or 'added < 1.0', got {target!r}"
        )
    metric, op, bound = match.groups()
    return metric, op, float(bound)


def meets(row: Row) -> bool | None:
    """Whether the row's figures satisfy its target; None without a target or figures."""
    if row.target is None or row.value is None:
        return None
    metric, op, bound = parse_target(row.target)
    if metric is None:
        metric = "ratio" if row.ratio is not None else "value"
    figure = row.figure(metric)
    if figure is None or math.isnan(figure):
        return None
    return {
        "<=": figure <= bound,
        ">=": figure >= bound,
        "<": figure < bound,
        ">": figure > bound,
    }[op]


# How long a run may take: "quick" is the CI smoke run (few iterations, small sizes),
# "default" the run the README names (about 3 minutes on one H200, each section at a size
# that answers its question), "full" every size and repetition.
MODES = ("quick", "default", "full")


@dataclass
class Context:
    quick: bool  # CI: few iterations, small sizes
    gpus: int  # visible CUDA devices (0: CPU lanes only)
    progress: Callable[[str], None]  # one-line status for the progress display
    artifacts: dict[str, Any] = field(default_factory=dict)  # e.g. traces for the plot
    # Sections' own settings by section name, from a section's command line
    # (python -m bench.<name>); a section without an entry takes its defaults.
    options: dict[str, Any] = field(default_factory=dict)
    full: bool = False  # --full: every size and repetition (ignored with quick)

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full" if self.full else "default"

    def reps(self, full: int, quick: int, default: int | None = None) -> int:
        """The count for this run's mode; `default` (the README's run) is `full` unless
        given."""
        if self.quick:
            return quick
        return full if self.full or default is None else default

    def pick(self, full: Any, quick: Any, default: Any) -> Any:
        """Any setting by mode, as `reps` picks counts."""
        return {"quick": quick, "default": default, "full": full}[self.mode]


def samples(fn: Callable[[], Any], reps: int, warmup: int = 3) -> list[float]:
    """Wall times of fn() in seconds over `reps` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in seconds over `reps` runs after `warmup` runs."""
    return statistics.median(samples(fn, reps, warmup))


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2
) -> dict[str, float]:
    """Median wall time in seconds of each fn, sampled in turn (a, b, c, a, b, c, ...)
    so that a change in machine load during the run affects every alternative alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def check(ratio: float, bound: float) -> bool:
    return ratio <= bound


def counts_arg(what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type for comma-separated positive counts, e.g. counts_arg("lane", "1,2,4")."""
    import argparse

    def parse(text: str) -> tuple[int, ...]:
        try:
            counts = tuple(int(n) for n in text.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            raise argparse.ArgumentTypeError(f"expected {what} counts like {example}, got {text!r}")
        return counts

    return parse
