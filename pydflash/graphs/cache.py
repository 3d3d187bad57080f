"""Graphs per lane, keyed by any hashable key: captured on first use, replayed after.

The mechanism any stage that captures CUDA graphs on lanes shares (through
pydflash/graphs/bucketed.py). It owns each lane's memory pools, the least-recently-used
limit `max_graphs`, the byte cap `max_pool_bytes` with `on_full`, the eager fallbacks and
their warnings, the `Policy` (pydflash/graphs/policy.py) and the stats. It never pads,
copies inputs or outputs: that is the stage's.

Contract. `cache = GraphCache(name, ...)`, one per stage object; `cache.lane(lane)` gives
that lane's `LaneGraphCache`. `cache.stats()` and `cache.lane()` may be called from any
thread; everything else of a LaneGraphCache only from tasks on its lane's worker, with
the lane stream current (as a lane task always has it). `lc.get_or_capture(key, make,
label=..., pool=...)` returns a `GraphEntry`, or None: run this call eagerly (counted).
In order:
1. A graph cached for `key`: its entry, marked most recently used; under Policy.AUTO,
   once its timed replays show it no faster than eager, dropped (step 5).
2. `key` recorded as eager (a capture that failed, the memory cap, the policy): None.
   Note [Capture failures]: a failure is never tried again for the same reason; only
   "device busy" and "memory cap", whose causes can pass, are retried, boundedly.
3. Under Policy.AUTO, a key not worth a capture yet: None (Note [A policy for the whole
   step]: its eager call not timed yet, or found GPU-bound, seen fewer than
   `capture_after` times, past `capture_budget`, or predicted GPU-bound). The stage then
   runs it through `lc.run_eagerly(key, call)`, which times the call the policy needs.
4. Otherwise `make()` returns `(fn, data)`: fn() is what the graph records (it closes
   over its static input buffers), data is kept as `entry.data`. fn runs `warmup` times
   eagerly first (an optimizer step warms up on its own and passes warmup=0), then
   `pydflash.graphs.capture_graph` captures it into the lane's pool named `pool`
   (Note [Capturing beside other lanes] in pydflash/graphs/lane_graph.py).
   `entry.outputs` is what fn returned during capture: the buffers every replay writes.
   Any error while capturing becomes a fallback (GraphFallbackWarning, once per kind
   per cache): "capture failed", "device busy"; only `on_full="raise"` raises,
   GraphMemoryError.
5. `lc.replay(entry)` replays on the current stream and counts it. With Policy.AUTO and
   a timed warm-up, its first TIMED_REPLAYS replays are timed with CUDA events, read by
   a later `get_or_capture` once the GPU passed them (no host sync): a graph taking at
   least `gpu_bound_ratio` of the eager call's cost is dropped, and
   `stats()["eager_buckets"]` lists it. A key got with timed=False is neither timed nor
   judged, eagerly or as a graph: once captured, it stays.
6. A pool whose graphs are all gone (the policy, the memory cap, evictions, `refuse`)
   gives its memory back (Note [Giving a pool back] in pydflash/graphs/pools.py).
Besides: `lc.fall_back(kind, detail)` counts an eager run that no key serves;
`lc.refuse(key, kind, detail)` records `key` as eager for good (a step whose optimizer
keeps state on the host), said once like a fallback. `stats()` counts per lane
capture_attempts and capture_failures apart from the eager runs they cause (a fallback's
count is eager runs of its kind). Every counter, the LRU order and the eager records
change under one lock, which `stats()` takes too: a snapshot is consistent (captures ==
evictions + dropped + graphs held, for each lane).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from .._checks import counted
from ..errors import GraphFallbackWarning
from . import lane_graph
from .lane_cache import BUSY_RETRIES, MEMORY_RETRIES, GraphEntry, LaneGraphCache
from .policy import (
    DEFAULT_GPU_BOUND_RATIO,
    POLICIES,
    TIMED_REPLAYS,
    Policy,
    positive,
)

ON_FULL = ("eager", "raise")
__all__ = [
    "BUSY_RETRIES",
    "MEMORY_RETRIES",
    "POLICIES",
    "TIMED_REPLAYS",
    "GraphCache",
    "GraphEntry",
    "LaneGraphCache",
    "Policy",
]


class _Fallbacks:
    """Eager runs by kind: a count and the latest detail; each kind warns once."""

    def __init__(self) -> None:
        self.by_kind: dict[str, dict[str, Any]] = {}

    def add(self, kind: str, detail: str) -> bool:
        """Counts one; True the first time `kind` is seen (the caller warns)."""
        seen = self.by_kind.get(kind)
        if seen is None:
            self.by_kind[kind] = {"count": 1, "latest": detail}
            return True
        seen["count"] += 1
        seen["latest"] = detail
        return False


class GraphCache:
    """The graphs of one stage on all its lanes. See the module's contract.

    Args:
        name: names the stage in warnings and compile-queue keys.
        warmup: eager calls before each capture (default `lane_graph.DEFAULT_WARMUP`).
        max_graphs: graphs kept per lane; beyond it the least recently used is dropped.
        max_pool_bytes: the most a lane's graph pool may hold after a capture.
        on_full: past max_pool_bytes, "eager" runs that key eagerly (with a warning),
            "raise" raises GraphMemoryError.
        policy: a `Policy` or its string: "auto" captures and keeps graphs where they pay
            (Note [A policy for the whole step]), "graphs" keeps every graph, "eager"
            captures nothing.
        gpu_bound_ratio: with "auto", a graph taking at least this fraction of the eager
            call's GPU time is dropped.
        capture_after: with "auto", a key is captured at its capture_after-th call.
        capture_budget: with "auto", the most seconds a lane spends capturing (None: no
            limit).
        quiet_timeout: seconds a capture waits for the device's other lanes to pause.
    """

    def __init__(
        self,
        name: str,
        *,
        warmup: int = lane_graph.DEFAULT_WARMUP,
        max_graphs: int | None = None,
        max_pool_bytes: int | None = None,
        on_full: str = "eager",
        policy: Policy | str = Policy.AUTO,
        gpu_bound_ratio: float = DEFAULT_GPU_BOUND_RATIO,
        capture_after: int = 1,
        capture_budget: float | None = None,
        quiet_timeout: float = lane_graph.DEFAULT_QUIET_TIMEOUT,
    ) -> None:
        self.name = name
        self.warmup = counted(warmup, "warmup", minimum=0)
        self.max_graphs = None if max_graphs is None else counted(max_graphs, "max_graphs")
        self.max_pool_bytes = (
            None if max_pool_bytes is None else counted(max_pool_bytes, "max_pool_bytes")
        )
        if on_full not in ON_FULL:
            raise ValueError(f"expected on_full in {ON_FULL}, got {on_full!r}")
        self.on_full = on_full
        self.policy = Policy.of(policy)
        self.gpu_bound_ratio = positive(gpu_bound_ratio, "gpu_bound_ratio")
        self.capture_after = counted(capture_after, "capture_after")
        self.capture_budget = (
            None if capture_budget is None else positive(capture_budget, "capture_budget")
        )
        self.quiet_timeout = quiet_timeout
        self._lock = threading.Lock()
        self._lanes: dict[Any, LaneGraphCache] = {}
        self._fallbacks = _Fallbacks()
        self._eager_buckets: list[dict[str, Any]] = []

    def lane(self, lane: Any) -> LaneGraphCache:
        with self._lock:
            cache = self._lanes.get(lane)
            if cache is None:
                cache = self._lanes[lane] = LaneGraphCache(self, lane)
            return cache

    def lanes(self) -> list[LaneGraphCache]:
        with self._lock:
            return list(self._lanes.values())

    def stats(self) -> dict[str, Any]:
        """Per lane label: the labels of the graphs held, captures, capture attempts and
        failures, capture seconds, replays, eager runs, evictions, graphs dropped, the
        bytes its pools reserve and the pools given back; "fallbacks": per kind, the eager
        runs it caused and the latest detail; "eager_buckets": the graphs the policy
        dropped, with both timings. Per lane, "policy_choices" counts the keys run
        eagerly per reason. A pool given back while someone still held one of its graphs
        or outputs is tried again here (Note [Giving a pool back])."""
        for cache in self.lanes():
            if cache.retiring:
                cache._give_back_pools()
        with self._lock:
            return {
                "lanes": {c.label: c._stats_locked() for c in self._lanes.values()},
                "fallbacks": {k: dict(v) for k, v in self._fallbacks.by_kind.items()},
                "eager_buckets": [dict(e) for e in self._eager_buckets],
            }

    def _fell_back(self, cache: LaneGraphCache, kind: str, detail: str) -> None:
        with self._lock:
            cache.eager_runs += 1
            first = self._fallbacks.add(kind, detail)
        if first:
            warnings.warn(
                f"{self.name} runs eagerly ({kind}): {detail}", GraphFallbackWarning, stacklevel=4
            )
