"""Which calls of a graph stage run as graphs: the `Policy`, and under Policy.AUTO what a
graph must pay back (Note [A policy for the whole step])."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import StrEnum
from time import perf_counter
from typing import Any

from . import _cuda_capture as _cuda


class Policy(StrEnum):
    """Which calls a graph stage replays as graphs. A str, so "auto" == Policy.AUTO."""

    AUTO = "auto"  # graphs where they pay (Note [A policy for the whole step])
    GRAPHS = "graphs"  # a graph for every key that captures
    EAGER = "eager"  # no graph at all

    @classmethod
    def of(cls, value: Any) -> Policy:
        """`value` (a Policy or its string) as a Policy, or a ValueError."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"expected policy in {POLICIES}, got {value!r}") from None


POLICIES = tuple(p.value for p in Policy)
DEFAULT_GPU_BOUND_RATIO = 0.9
TIMED_REPLAYS = 2
PREDICT_AFTER = 2  # keys measured in a pool before the policy predicts for the rest
PROBE_AT = 2  # the eager call of a key that is timed: its second (the first compiles); 0: none
LAUNCH_BOUND_READINGS = 2  # timed eager calls that must all find a key launch-bound
DEVICE_BUSY = 0.95  # a device busy this share of the time (NVML) gains nothing from graphs

# Note [A policy for the whole step]: a graph saves the host the time to launch a call
# and costs its capture (warm-up calls, then the capture, with the device's other lanes
# paused), its pool's memory, and its padding: the GPU runs the whole bucket. In a
# pipeline whose GPU is busy anyway (a large target, or a drafter sharing its device), the
# host launches eagerly while the GPU works, so saved launches buy nothing and padding
# costs GPU time: that made graph stages slower than eager. So a call is worth a graph
# only where its host, not its GPU, limits it. Under Policy.AUTO:
# - a key is captured only once seen `capture_after` times: one seen once may never come
#   back, and its eager run is unpadded;
# - a lane spends at most `capture_budget` seconds capturing (None: no limit); past it,
#   new keys run eagerly;
# - a key's eager calls come first: its PROBE_AT-th, unpadded, is timed where it runs, on
#   the GPU (CUDA events, read once passed: no host sync) and on the host; where the host
#   launched it in less than `gpu_bound_ratio` of its GPU time, the GPU limits the call
#   (`gpu_bound_eagerly`): it is never warmed up nor captured, and runs eagerly and
#   unpadded, at no cost beyond two events;
# - so is a key whose timed call looks launch-bound on a device that ran kernels at least
#   DEVICE_BUSY of NVML's last sample period (`device_saturated`): its lane's launches
#   overlap other lanes' kernels, and a step bound by the device's work gains nothing
#   from them. On a Qwen3-8B-shaped target beside its drafter (H200, 2026-12-02) the GPU
#   ran 96-99 % of each step; a target bucket whose launch, slowed by the GIL it shares
#   with the drafter's thread, came within 0.9 of its GPU time was captured in 1.4 s, its
#   graph faster than the eager call, and the steps no faster;
# - a key is found launch-bound only by LAUNCH_BOUND_READINGS timed eager calls in a row
#   (its PROBE_AT-th and the next ones), each judged so; one GPU-bound reading settles it.
#   A reading is a sample of a moving quantity (the GIL's other holders, the other lanes'
#   phase, NVML's period), and a wrong capture costs warm-up calls and a pause of the
#   device's other lanes, where a missed one costs an eager call: in that H200 run, a
#   target bucket read launch-bound once, and its warm-up then found it GPU-bound (0.24 s
#   of warm-up calls spent for nothing);
# - a key found launch-bound so is captured, and the last warm-up call is timed again,
#   from an idle stream, and judged the same way before the capture;
# - otherwise the graph's first replays are timed; one no faster than `gpu_bound_ratio`
#   of what the eager call costs a pipeline, the lesser of its GPU time and its launch
#   time, is dropped, runs eagerly and unpadded, and its pool is given back once empty
#   (Note [Giving a pool back]);
# - once PREDICT_AFTER keys of a pool were measured and every one was GPU-bound, the
#   keys not judged yet are predicted GPU-bound too and never timed: a forward
#   that fills the GPU at one length fills it at the others;
# - once graphs of a pool were measured, a new key is captured only when it would repay
#   its capture (`repaid`): the GPU time a replay saved in that pool (the median over
#   its measured keys) times the key's uses, counting as many uses to come as it has
#   had so far, against the seconds a capture took there (the fastest, without a cold
#   start's compiling). A key not worth it yet runs eagerly and unpadded, and is weighed
#   again at its next call: a frequent bucket gets its graph, a rare one never does.
#   A pool's memory is not priced here: max_pool_bytes caps it.
# What stays is a graph of a launch-bound call, measured faster than eager: the
# launch-bound gains. The timings are taken where the stage runs, beside the device's
# other lanes: a GPU another lane keeps busy makes a call's GPU time longer, and it is
# judged GPU-bound, as it is in that pipeline.


# Kinds of eager record that are the policy's choice, not a fallback: no warning.
CHOSEN = ("gpu-bound", "policy", "rare", "capture budget", "predicted GPU-bound", "timed first")


def choices(eager: dict[Hashable, tuple[str, str]]) -> dict[str, int]:
    """How many keys run eagerly per kind of reason."""
    counts: dict[str, int] = {}
    for kind, _ in eager.values():
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected {name} to be a number, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"expected {name} > 0, got {value}")
    return float(value)


def not_worth_capturing(
    measured: tuple[int, int], capture_seconds: float, budget: float | None, where: str
) -> tuple[str, str] | None:
    """(kind, detail) when Policy.AUTO captures no new key of a pool for good, else None:
    `measured` is (graphs measured in the pool, of which GPU-bound), `capture_seconds`
    what the lane spent capturing, `budget` its capture_budget."""
    count, bound = measured
    if count >= PREDICT_AFTER and bound == count:
        return ("predicted GPU-bound", f"all {count} graphs measured in {where} were GPU-bound")
    if budget is not None and capture_seconds >= budget:
        return (
            "capture budget",
            f"{where} spent {capture_seconds:.3g} s capturing, its capture_budget={budget:g}",
        )
    return None


def gpu_bound_eagerly(eager_ms: float, host_ms: float, ratio: float) -> str | None:
    """Before a capture: why an eager call whose launch took the host `host_ms` and the
    GPU `eager_ms` is GPU-bound (the host launched it in less than `ratio` of the GPU's
    time), or None: its launches limit it, a graph may pay."""
    if host_ms >= ratio * eager_ms:
        return None
    return (
        f"GPU-bound: launching it eagerly took the host {host_ms:.3g} ms, running it the GPU "
        f"{eager_ms:.3g} ms (gpu_bound_ratio={ratio:g})"
    )


def device_saturated(share: float | None, limit: float = DEVICE_BUSY) -> str | None:
    """Why a launch-bound call is GPU-bound all the same: its device ran kernels `share`
    of NVML's last sample period, at least `limit`; None where less, or unknown."""
    if share is None or share < limit:
        return None
    return (
        f"GPU-bound: its device ran kernels {share:.0%} of NVML's last sample period (at "
        f"least {limit:.0%}): no launch a graph saves can shorten its steps"
    )


def eager_cost(eager_ms: float, host_ms: float | None) -> float:
    """What an eager call costs a pipeline: the lesser of its GPU time and, where timed,
    its launch's host time (Note [A policy for the whole step])."""
    return eager_ms if host_ms is None else min(eager_ms, host_ms)


def gpu_bound(graph_ms: float, eager_ms: float, host_ms: float | None, ratio: float) -> str | None:
    """After a capture: why a graph no faster than `ratio` of its eager call's cost
    (`eager_cost`) is dropped, or None."""
    if graph_ms < ratio * eager_cost(eager_ms, host_ms):
        return None
    launch = "" if host_ms is None else f", launched in {host_ms:.3g} ms"
    return (
        f"GPU-bound: its graph took {graph_ms:.3g} ms against {eager_ms:.3g} ms eager"
        f"{launch} (gpu_bound_ratio={ratio:g})"
    )


def repaid(seen: int, savings_ms: list[float], costs_s: list[float]) -> tuple[str, str] | None:
    """("rare", why) when a key used `seen` times would not yet repay its capture, by
    what the pool's measured keys saved per replay (`savings_ms`) and what its captures
    took (`costs_s`); None (capture it) before anything was measured."""
    if not savings_ms or not costs_s:
        return None
    saved = sorted(savings_ms)[len(savings_ms) // 2]
    cost = min(costs_s)
    if seen * saved / 1000 >= cost:
        return None
    return (
        "rare",
        f"seen {seen} times; at {saved:.3g} ms saved per replay it repays a {cost:.3g} s "
        f"capture only after {math.ceil(1000 * cost / saved) if saved else 'no number of'} uses",
    )


# --- timing a call, for Policy.AUTO ---------------------------------------------------------
@dataclass
class TimedCall:
    """A call timed by `timed_call`: `read()` gives its (GPU ms, host ms) once `passed()`;
    `key`, `pool` and `label` say what it was a call of, where a cache keeps it to read."""

    read: Callable[[], tuple[float, float]]
    end: Any  # the CUDA event after the call
    key: Hashable = None
    pool: str = ""
    label: Any = None

    def passed(self) -> bool:
        return bool(self.end.query())


def timed_call(fn: Callable[[], Any]) -> tuple[Any, TimedCall]:
    """fn() on the current stream, timed with two CUDA events and the host's clock: (its
    result, the TimedCall). The host's time is the wall time of launching it, GIL waits
    included: what a graph's replay saves the host (Note [A policy for the whole step])."""
    start, end = _cuda.timing_events()
    start.record()
    began = perf_counter()
    out = fn()
    host_ms = 1000 * (perf_counter() - began)
    end.record()
    return out, TimedCall(lambda: (float(start.elapsed_time(end)), host_ms), end)


class NotWorthCapturing(Exception):
    """What `capture_graph` raises when its `judge` found the timed warm-up call not worth
    a graph: `reason` says why; nothing was captured. A choice, not a failure."""

    def __init__(self, reason: str, eager_ms: float, host_ms: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.eager_ms = eager_ms
        self.host_ms = host_ms
