"""Graphs per lane, keyed by any hashable key: captured on first use, replayed after.

The mechanism any stage that captures CUDA graphs on lanes shares (`pydflash.TargetGraphs`
for a target's forward per bucket; a drafter stage for its training step). It owns one
memory pool per lane, the least-recently-used limit `max_graphs`, the byte cap
`max_pool_bytes` with `on_full`, the eager fallbacks and their warnings, the policy that
drops graphs no faster than eager, and the stats. It never pads, copies inputs or
outputs: that is the stage's.

Contract:
- `cache = GraphCache(name, ...)`, one per stage object; `cache.lane(lane)` gives that
  lane's `LaneGraphCache`. `cache.stats()` and `cache.lane()` may be called from any
  thread; everything else of a LaneGraphCache only from tasks on its lane's worker, with
  the lane stream current (as a lane task always has it).
- `lc.get_or_capture(key, make, label=...)` -> `GraphEntry` or None:
  - a graph cached for `key`: its entry, marked most recently used;
  - `key` recorded as eager (a failed capture, the memory cap, the policy): None;
  - otherwise `make()` is called and returns `(fn, data)`: fn() is what the graph
    records (it closes over its static input buffers), data is kept as `entry.data`.
    fn runs `warmup` times eagerly first (so it must be safe to repeat: an optimizer step
    warms up on its own and passes warmup=0), then is captured into the lane's pool by
    `pydflash.graphs.capture_graph` (Note [Capturing beside other lanes] there).
    `entry.outputs` is what fn returned during capture: the buffers every replay writes.
  - None means: run this call eagerly. The eager run is counted, and a fallback's kind
    warns once (GraphFallbackWarning) per GraphCache. No capture error is raised: any
    error while capturing becomes a fallback of kind "capture failed" (recorded: the key
    stays eager) or "device busy" (not recorded: a later call tries again, up to
    `BUSY_RETRIES` times). Only `on_full="raise"` raises, GraphMemoryError.
- `lc.replay(entry)` replays on the current stream and counts it. With policy "auto" and
  a timed warm-up, its first `TIMED_REPLAYS` replays are timed with CUDA events, and a
  later `get_or_capture` of that key reads them once the GPU has passed them (no host
  sync): a graph taking at least `gpu_bound_ratio` of the eager call's time is dropped,
  the key runs eagerly from then on, and `stats()["eager_buckets"]` lists it with both
  timings. Where replays must not repeat work (an optimizer step), pass timed=False.
- `lc.fall_back(kind, detail)` counts an eager run that no key serves (a length above
  every bucket).
- Every counter, the LRU order and the eager records change under one lock, which
  `stats()` takes too: a snapshot is consistent (captures == evictions + dropped +
  graphs held, for each lane).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .._checks import counted
from ..errors import GraphFallbackWarning, GraphMemoryError
from . import _cuda_capture, lane_graph

ON_FULL = ("eager", "raise")
POLICIES = ("auto", "graphs", "eager")
DEFAULT_GPU_BOUND_RATIO = 0.9
TIMED_REPLAYS = 2
BUSY_RETRIES = 3


@dataclass
class GraphEntry:
    """One captured graph: `graph` (a torch.cuda.CUDAGraph), `outputs` (what fn returned
    while captured), `data` (what make() gave besides fn) and `label` (how stats name it)."""

    graph: Any
    outputs: Any
    data: Any
    label: Any
    eager_ms: float | None = None
    graph_ms: list[float] = field(default_factory=list)
    exec_handle: int | None = None  # its cudaGraphExec_t, once a native launch looked it up
    _events: list[tuple[Any, Any]] = field(default_factory=list)


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
        policy: "auto" drops graphs no faster than eager (timed during warm-up and the
            first replays), "graphs" keeps every graph, "eager" captures nothing.
        gpu_bound_ratio: with "auto", a graph taking at least this fraction of the eager
            call's GPU time is dropped.
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
        policy: str = "auto",
        gpu_bound_ratio: float = DEFAULT_GPU_BOUND_RATIO,
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
        if policy not in POLICIES:
            raise ValueError(f"expected policy in {POLICIES}, got {policy!r}")
        self.policy = policy
        if isinstance(gpu_bound_ratio, bool) or not isinstance(gpu_bound_ratio, (int, float)):
            raise TypeError(
                f"expected gpu_bound_ratio to be a number, got {type(gpu_bound_ratio).__name__}"
            )
        if gpu_bound_ratio <= 0:
            raise ValueError(f"expected gpu_bound_ratio > 0, got {gpu_bound_ratio}")
        self.gpu_bound_ratio = float(gpu_bound_ratio)
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
        """Per lane label: the labels of the graphs held, captures, replays, eager runs,
        evictions and the bytes its pool reserves; "fallbacks": per kind, count and the
        latest detail; "eager_buckets": the graphs the policy dropped, with both timings."""
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


class LaneGraphCache:
    """One lane's graphs (see the module's contract); made by `GraphCache.lane`."""

    def __init__(self, owner: GraphCache, lane: Any) -> None:
        self.owner = owner
        self.lane = lane
        self.label = lane.label
        self.pool: Any = None
        self.graphs: OrderedDict[Hashable, GraphEntry] = OrderedDict()  # LRU first
        self.eager: dict[Hashable, tuple[str, str]] = {}  # key -> (kind, detail)
        self.busy: dict[Hashable, int] = {}  # key -> "device busy" fallbacks so far
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0
        self.evictions = 0
        self.dropped = 0  # captured graphs let go by the memory cap or the policy
        self.pool_bytes = 0

    # --- on the lane's worker ---------------------------------------------------------
    def get_or_capture(
        self,
        key: Hashable,
        make: Callable[[], tuple[Callable[[], Any], Any]],
        *,
        label: Any = None,
        warmup: int | None = None,
        timed: bool | None = None,
    ) -> GraphEntry | None:
        """The graph for `key`, captured from make()'s fn on a miss; None: run this call
        eagerly (counted, the reason recorded). `label` names the key in stats and
        warnings; `warmup` and `timed` override the cache's for this capture."""
        owner = self.owner
        with owner._lock:
            entry = self.graphs.get(key)
            if entry is not None:
                self.graphs.move_to_end(key)
            why = self.eager.get(key)
        if entry is not None:
            if entry._events and not self._keep(key, entry):
                return self._eager_run(key)
            return entry
        if why is not None or owner.policy == "eager":
            return self._eager_run(key)
        return self._capture(key, make, key if label is None else label, warmup, timed)

    def replay(self, entry: GraphEntry) -> None:
        """entry.graph.replay() on the current stream, counted (and timed, see contract)."""
        if len(entry._events) + len(entry.graph_ms) < TIMED_REPLAYS and entry.eager_ms is not None:
            start, end = _cuda_capture.timing_events()
            start.record()
            entry.graph.replay()
            end.record()
            entry._events.append((start, end))
        else:
            entry.graph.replay()
        self.replayed()

    def ready(self, key: Hashable) -> GraphEntry | None:
        """The graph cached for `key` when replaying it needs no decision first: captured,
        and under policy "auto" its timed replays read and kept. Marks it most recently
        used. For a launch made elsewhere (a stream program, Note [Native microbatch] in
        pydflash/pipeline/native_microbatch.py), which counts itself with `replayed`. Any thread."""
        with self.owner._lock:
            entry = self.graphs.get(key)
            if entry is None or entry._events:
                return None
            if entry.eager_ms is not None and len(entry.graph_ms) < TIMED_REPLAYS:
                return None
            self.graphs.move_to_end(key)
            return entry

    def replayed(self) -> None:
        """Counts a replay: replay()'s own, or one launched elsewhere (see `ready`). Any
        thread."""
        with self.owner._lock:
            self.replays += 1

    def fall_back(self, kind: str, detail: str) -> None:
        """Counts an eager run that no key serves."""
        self.owner._fell_back(self, kind, detail)

    # --- inside ------------------------------------------------------------------------
    def _eager_run(self, key: Hashable) -> None:
        with self.owner._lock:
            kind, detail = self.eager.get(key, ("policy", ""))
            if kind in ("gpu-bound", "policy"):
                self.eager_runs += 1  # the policy's choice, not a fallback
                return None
        self.owner._fell_back(self, kind, detail)
        return None

    def _capture(
        self,
        key: Hashable,
        make: Callable[[], tuple[Callable[[], Any], Any]],
        label: Any,
        warmup: int | None,
        timed: bool | None,
    ) -> GraphEntry | None:
        owner = self.owner
        with owner._lock:
            if owner.max_graphs is not None:
                while len(self.graphs) >= owner.max_graphs:
                    self.graphs.popitem(last=False)
                    self.evictions += 1
            if not self.graphs:
                self.pool = None  # Note [A failed capture]: a pool with no graph is not reused
            if self.pool is None:
                self.pool = _new_pool()
            pool = self.pool
        if timed is None:
            timed = owner.policy == "auto"
        name = f"{owner.name} {label}"
        try:
            fn, data = make()
            captured = lane_graph.capture_graph(
                fn,
                self.lane,
                pool=pool,
                warmup=owner.warmup if warmup is None else warmup,
                timed=timed,
                turn=name,
                quiet_timeout=owner.quiet_timeout,
            )
        except Exception as exc:  # noqa: BLE001 - never crash the step: run eagerly
            return self._capture_failed(key, label, exc)
        entry = GraphEntry(captured.graph, captured.outputs, data, label, captured.eager_ms)
        measured = pool_bytes(pool, self.lane.device_index)
        with owner._lock:
            self.captures += 1
            self.pool_bytes = measured
            self.busy.pop(key, None)
            over = owner.max_pool_bytes is not None and measured > owner.max_pool_bytes
            if over:
                self.dropped += 1
                message = (
                    f"expected the graph pool of {self.label} to stay within max_pool_bytes="
                    f"{owner.max_pool_bytes}, got {measured} bytes after capturing {label}"
                )
                if owner.on_full == "eager":
                    self.eager[key] = ("memory cap", message)
            else:
                self.graphs[key] = entry
        if not over:
            return entry
        del entry, captured
        if owner.on_full == "raise":
            raise GraphMemoryError(message + "; raise max_pool_bytes or use fewer buckets")
        return self._eager_run(key)

    def _capture_failed(self, key: Hashable, label: Any, exc: Exception) -> None:
        kind = getattr(exc, "kind", "capture failed")
        detail = (
            getattr(exc, "detail", None) or f"{type(exc).__name__}: {lane_graph.first_line(exc)}"
        )
        detail = f"{label} on {self.label}: {detail}"
        with self.owner._lock:
            if kind == "device busy":
                self.busy[key] = tries = self.busy.get(key, 0) + 1
                if tries >= BUSY_RETRIES:
                    self.eager[key] = (kind, detail)
            else:
                self.eager[key] = (kind, detail)
            if kind == "capture failed":
                self.pool = None  # Note [A failed capture]: the next capture takes a fresh one
        self.owner._fell_back(self, kind, detail)
        return None

    def _keep(self, key: Hashable, entry: GraphEntry) -> bool:
        """Reads finished replay timings; False when the policy drops the graph."""
        while entry._events and entry._events[0][1].query():
            start, end = entry._events.pop(0)
            entry.graph_ms.append(float(start.elapsed_time(end)))
        if len(entry.graph_ms) < TIMED_REPLAYS or entry.eager_ms is None:
            return True
        graph_ms = min(entry.graph_ms)
        owner = self.owner
        if graph_ms < owner.gpu_bound_ratio * entry.eager_ms:
            return True
        reason = (
            f"GPU-bound: its graph took {graph_ms:.3g} ms against {entry.eager_ms:.3g} ms eager "
            f"(gpu_bound_ratio={owner.gpu_bound_ratio:g})"
        )
        with owner._lock:
            if self.graphs.pop(key, None) is not None:
                self.dropped += 1
            self.eager[key] = ("gpu-bound", reason)
            owner._eager_buckets.append(
                {
                    "lane": self.label,
                    "bucket": entry.label,
                    "reason": reason,
                    "eager_ms": entry.eager_ms,
                    "graph_ms": graph_ms,
                }
            )
        return False

    def _stats_locked(self) -> dict[str, Any]:
        return {
            "graphs": [entry.label for entry in self.graphs.values()],
            "captures": self.captures,
            "replays": self.replays,
            "eager_runs": self.eager_runs,
            "evictions": self.evictions,
            "dropped": self.dropped,
            "pool_bytes": self.pool_bytes,
        }


def _new_pool() -> Any:
    import torch

    return torch.cuda.graph_pool_handle()


def pool_bytes(pool: Any, device: int | None) -> int:
    """Bytes the caching allocator reserves for graph pool `pool` on `device`."""
    import torch

    pool = tuple(pool)
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", ())) == pool and segment.get("device") == device
    )
