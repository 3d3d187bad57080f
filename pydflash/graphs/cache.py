"""Graphs per lane, keyed by any hashable key: captured on first use, replayed after.

The mechanism any stage that captures CUDA graphs on lanes shares (`pydflash.TargetGraphs`
for a target's forward per bucket; a drafter stage for its training step). It owns one
memory pool per lane, the least-recently-used limit `max_graphs`, the byte cap
`max_pool_bytes` with `on_full`, the eager fallbacks and their warnings, the policy that
drops graphs no faster than eager, and the stats. It never pads, copies inputs or
outputs: that is the stage's.

Contract (the workflow of `LaneGraphCache.get_or_capture`, in order):
- `cache = GraphCache(name, ...)`, one per stage object; `cache.lane(lane)` gives that
  lane's `LaneGraphCache`. `cache.stats()` and `cache.lane()` may be called from any
  thread; everything else of a LaneGraphCache only from tasks on its lane's worker, with
  the lane stream current (as a lane task always has it).
- `lc.get_or_capture(key, make, label=..., pool=...)` -> `GraphEntry` or None:
  1. a graph cached for `key`: its entry, marked most recently used (under policy
     AUTO, dropped once its timed replays show it no faster than eager: step 6);
  2. `key` recorded as eager (a capture that failed, the memory cap, the policy): None.
     A failure is remembered per key and never tried again for the same reason; only
     "device busy" and "memory cap", whose causes can pass, are retried, a bounded
     number of times (Note [Capture failures]);
  3. under policy AUTO, a key that is not worth a capture yet runs eagerly: seen fewer
     than `capture_after` times, past the lane's `capture_budget` of capture seconds,
     or predicted GPU-bound because every graph measured in its pool so far was
     (Note [A policy for the whole step]);
  - otherwise `make()` is called and returns `(fn, data)`: fn() is what the graph
    records (it closes over its static input buffers), data is kept as `entry.data`.
    fn runs `warmup` times eagerly first (so it must be safe to repeat: an optimizer step
    warms up on its own and passes warmup=0), then is captured into the lane's pool by
    `pydflash.lane_graph.capture_graph` (Note [Capturing beside other lanes] there).
    `entry.outputs` is what fn returned during capture: the buffers every replay writes.
    `pool` names the lane's memory pool the graph goes into (default "graphs"): graphs
    of one pool share memory; a pool whose graphs are all gone is released (step 7).
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
  every bucket); `lc.refuse(key, kind, detail)` records `key` as eager without trying
  (a step whose optimizer keeps state on the host), said once like a fallback.
- Step 7, Note [Giving a pool back]: when the last graph of a pool leaves (the policy,
  the memory cap, evictions), the cache drops its references, and once no capture is
  open anywhere in the process it asks torch's caching allocator to free cached blocks
  (`torch.cuda.empty_cache()`): torch frees a graph pool's memory only when no graph
  uses it (`releasePool`, called by `CUDAGraph.reset` and the destructor), its tensors
  are gone, and cached blocks are freed. `stats()` shows the pool's bytes going to 0
  and counts `pools_released`; memory still held by someone else's reference (an
  output kept) shows as `pool_bytes` until a later release finds it gone.
- `stats()` counts per lane `capture_attempts` and `capture_failures` apart from the
  eager runs they cause (a fallback's count is eager runs of that kind, not attempts).
- Every counter, the LRU order and the eager records change under one lock, which
  `stats()` takes too: a snapshot is consistent (captures == evictions + dropped +
  graphs held, for each lane).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .._checks import counted
from ..errors import GraphFallbackWarning, GraphMemoryError
from . import _cuda_capture, lane_graph

ON_FULL = ("eager", "raise")


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
BUSY_RETRIES = 3
MEMORY_RETRIES = 2  # "memory cap" retries, each only after a pool of the lane was released
PREDICT_AFTER = 2  # graphs measured in a pool before the policy predicts for the rest
DEFAULT_POOL = "graphs"

# Note [Capture failures]: a capture that failed is remembered per key, with its kind, and
# not tried again for the same reason: a failure of the function or of torch ("capture
# failed") fails the same way each time. Two causes can pass: the device's other lanes
# not pausing in time ("device busy": retried at the next call, BUSY_RETRIES times in
# all), and the pool's byte cap ("memory cap": retried only after a pool of the lane was
# given back, MEMORY_RETRIES times). `stats()` counts attempts and failures per lane.
RETRIED = {"device busy": BUSY_RETRIES, "memory cap": MEMORY_RETRIES}

# Note [A policy for the whole step]: a graph saves host launch time and costs its capture
# (warm-up calls, then the capture, with the device's other lanes paused) and its pool's
# memory. Under Policy.AUTO:
# - a key is captured only once seen `capture_after` times: one seen once may never come
#   back, and its eager run is unpadded;
# - a lane spends at most `capture_budget` seconds capturing (None: no limit); past it,
#   new keys run eagerly;
# - each graph's first replays are timed against its eager warm-up call; one no faster
#   than `gpu_bound_ratio` of eager is dropped, runs eagerly and unpadded, and its pool is
#   given back once empty (Note [Giving a pool back]);
# - once PREDICT_AFTER graphs of a pool were measured and every one was GPU-bound, the
#   keys not captured yet are predicted GPU-bound too and never captured: a forward that
#   fills the GPU at one length fills it at the others, and capturing each bucket only to
#   drop it is what made graph stages slower than eager on large targets.
# What stays is a graph that was measured faster than eager: the launch-bound gains.


@dataclass
class GraphEntry:
    """One captured graph: `graph` (a torch.cuda.CUDAGraph), `outputs` (what fn returned
    while captured), `data` (what make() gave besides fn), `label` (how stats name it)
    and `pool` (the lane's pool it is in)."""

    graph: Any
    outputs: Any
    data: Any
    label: Any
    pool: Any = None  # a _Pool
    eager_ms: float | None = None
    graph_ms: list[float] = field(default_factory=list)
    exec_handle: int | None = None  # its cudaGraphExec_t, once `LaneGraphCache.exec_handle` read it
    _events: list[tuple[Any, Any]] = field(default_factory=list)


@dataclass
class _Pool:
    """One of a lane's memory pools: torch's handle and the bytes last measured in it."""

    name: str
    handle: Any
    bytes: int = 0


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
        self.gpu_bound_ratio = _positive(gpu_bound_ratio, "gpu_bound_ratio")
        self.capture_after = counted(capture_after, "capture_after")
        self.capture_budget = (
            None if capture_budget is None else _positive(capture_budget, "capture_budget")
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


# Kinds of eager record that are the policy's choice, not a fallback: no warning.
_CHOSEN = ("gpu-bound", "policy", "rare", "capture budget", "predicted GPU-bound")


class LaneGraphCache:
    """One lane's graphs (see the module's contract); made by `GraphCache.lane`."""

    def __init__(self, owner: GraphCache, lane: Any) -> None:
        self.owner = owner
        self.lane = lane
        self.label = lane.label
        self.pools: dict[str, _Pool] = {}
        self.graphs: OrderedDict[Hashable, GraphEntry] = OrderedDict()  # LRU first
        self.eager: dict[Hashable, tuple[str, str]] = {}  # key -> (kind, detail)
        self.tries: dict[Hashable, int] = {}  # key -> failed attempts of a RETRIED kind
        self.seen: dict[Hashable, int] = {}  # key -> calls while not captured
        self.retiring: list[_Pool] = []  # pools whose graphs are all gone
        # pool name -> [graphs whose timed replays were read, of which GPU-bound]
        self.measured: dict[str, list[int]] = {}
        self.captures = 0
        self.capture_attempts = 0
        self.capture_failures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self.eager_runs = 0
        self.evictions = 0
        self.dropped = 0  # captured graphs let go by the memory cap or the policy
        self.pools_released = 0
        self.released_bytes = 0

    @property
    def pool(self) -> Any:
        """The handle of the default pool, or None."""
        pool = self.pools.get(DEFAULT_POOL)
        return None if pool is None else pool.handle

    # --- on the lane's worker ---------------------------------------------------------
    def get_or_capture(
        self,
        key: Hashable,
        make: Callable[[], tuple[Callable[[], Any], Any]],
        *,
        label: Any = None,
        warmup: int | None = None,
        timed: bool | None = None,
        pool: str = DEFAULT_POOL,
        ahead: bool = False,
    ) -> GraphEntry | None:
        """The graph for `key`, captured from make()'s fn on a miss; None: run this call
        eagerly (counted, the reason recorded). `label` names the key in stats and
        warnings; `warmup` and `timed` override the cache's for this capture; `pool`
        names the lane's pool it goes into; `ahead`: a capture asked for in advance
        (a stage's warmup()), which the policy's rarity rule lets through."""
        owner = self.owner
        with owner._lock:
            entry = self.graphs.get(key)
            if entry is not None:
                self.graphs.move_to_end(key)
            why = self.eager.get(key)
            seen = self.seen[key] = self.seen.get(key, 0) + 1
        if entry is not None:
            if entry._events and not self._keep(key, entry):
                del entry  # the last reference: its graph gives its pool reference back
                self._give_back_pools()
                return self._eager_run(key)
            return entry
        if why is not None or owner.policy is Policy.EAGER:
            return self._eager_run(key)
        if owner.policy is Policy.AUTO:
            skip = self._not_worth_it(key, seen, pool, ahead)
            if skip is not None:
                return self._eager_run(key, skip)
        return self._capture(key, make, key if label is None else label, warmup, timed, pool)

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

    def exec_handle(self, entry: GraphEntry) -> int:
        """The cudaGraphExec_t of `entry`'s graph for a native launch on this lane, looked
        up once (pydflash/lanes/graph_exec.py); GraphCaptureError where torch has none."""
        if entry.exec_handle is None:
            from ..lanes.graph_exec import graph_exec_handle

            entry.exec_handle, _ = graph_exec_handle(entry.graph, self.lane)
        return entry.exec_handle

    def replayed(self) -> None:
        """Counts a replay: replay()'s own, or one launched elsewhere (see `ready`). Any
        thread."""
        with self.owner._lock:
            self.replays += 1

    def fall_back(self, kind: str, detail: str) -> None:
        """Counts an eager run that no key serves."""
        self.owner._fell_back(self, kind, detail)

    def refuse(self, key: Hashable, kind: str, detail: str) -> None:
        """Records `key` as eager for good, as a fallback of `kind` (warned once), and
        lets go of its graph if one was captured (a stage that found its outputs
        unusable); the call that found it out runs eagerly and is counted."""
        with self.owner._lock:
            self.eager[key] = (kind, detail)
            entry = self.graphs.pop(key, None)
            if entry is not None:
                self.dropped += 1
                self._retire_empty_locked(entry.pool)
        if entry is not None:
            del entry
            self._give_back_pools()
        self.owner._fell_back(self, kind, detail)

    def recorded(self, key: Hashable) -> bool:
        """Whether `key` is recorded to run eagerly."""
        with self.owner._lock:
            return key in self.eager

    # --- inside ------------------------------------------------------------------------
    def _eager_run(self, key: Hashable, chosen: tuple[str, str] | None = None) -> None:
        with self.owner._lock:
            kind, detail = chosen or self.eager.get(key, ("policy", ""))
            if kind in _CHOSEN:
                self.eager_runs += 1  # the policy's choice, not a fallback
                return None
        self.owner._fell_back(self, kind, detail)
        return None

    def _not_worth_it(
        self, key: Hashable, seen: int, pool: str, ahead: bool
    ) -> tuple[str, str] | None:
        """Why policy AUTO runs `key` eagerly for now (Note [A policy for the whole
        step]), or None: capture it."""
        owner = self.owner
        with owner._lock:
            measured, gpu_bound = self.measured.get(pool, (0, 0))
            if measured >= PREDICT_AFTER and gpu_bound == measured:
                why = (
                    "predicted GPU-bound",
                    f"all {measured} graphs measured in pool {pool!r} of {self.label} "
                    "were GPU-bound",
                )
                self.eager[key] = why
                return why
            if owner.capture_budget is not None and self.capture_seconds >= owner.capture_budget:
                why = (
                    "capture budget",
                    f"{self.label} spent {self.capture_seconds:.3g} s capturing, its "
                    f"capture_budget={owner.capture_budget:g}",
                )
                self.eager[key] = why
                return why
        if not ahead and seen < owner.capture_after:
            return ("rare", f"seen {seen} times, captured at {owner.capture_after}")
        return None

    def _pool_for(self, name: str) -> Any:
        """The handle of pool `name`, a fresh one where it has no graph (Note [A failed
        capture]: a pool with no graph is not captured into again). Under the lock."""
        pool = self.pools.get(name)
        if pool is not None:
            self._retire_empty_locked(pool)
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = _Pool(name, _new_pool())
        return pool

    def _capture(
        self,
        key: Hashable,
        make: Callable[[], tuple[Callable[[], Any], Any]],
        label: Any,
        warmup: int | None,
        timed: bool | None,
        pool_name: str,
    ) -> GraphEntry | None:
        owner = self.owner
        with owner._lock:
            if owner.max_graphs is not None:
                while len(self.graphs) >= owner.max_graphs:
                    _, evicted = self.graphs.popitem(last=False)
                    self.evictions += 1
                    self._retire_empty_locked(evicted.pool)
                    del evicted
            pool = self._pool_for(pool_name)  # a _Pool
            self.capture_attempts += 1
        if self.retiring:
            self._give_back_pools()
        if timed is None:
            timed = owner.policy is Policy.AUTO
        name = f"{owner.name} {label}"
        began = time.perf_counter()
        try:
            fn, data = make()
            captured = lane_graph.capture_graph(
                fn,
                self.lane,
                pool=pool.handle,
                warmup=owner.warmup if warmup is None else warmup,
                timed=timed,
                turn=name,
                quiet_timeout=owner.quiet_timeout,
            )
        except Exception as exc:  # noqa: BLE001 - never crash the step: run eagerly
            self._spent(began)
            return self._capture_failed(key, label, exc, pool)
        self._spent(began)
        entry = GraphEntry(captured.graph, captured.outputs, data, label, pool, captured.eager_ms)
        measured = pool_bytes(pool.handle, self.lane.device_index)
        with owner._lock:
            self.captures += 1
            pool.bytes = measured
            self.tries.pop(key, None)
            over = owner.max_pool_bytes is not None and measured > owner.max_pool_bytes
            if over:
                self.dropped += 1
                message = (
                    f"expected the graph pool of {self.label} to stay within max_pool_bytes="
                    f"{owner.max_pool_bytes}, got {measured} bytes after capturing {label}"
                )
                if owner.on_full == "eager":
                    self._failed_locked(key, "memory cap", message)
                self._retire_empty_locked(pool)
            else:
                self.graphs[key] = entry
        if not over:
            return entry
        del entry, captured
        self._give_back_pools(reopen=False)  # the cause stays: giving its own pool back
        if owner.on_full == "raise":
            raise GraphMemoryError(message + "; raise max_pool_bytes or use fewer buckets")
        return self._eager_run(key)

    def _spent(self, began: float) -> None:
        with self.owner._lock:
            self.capture_seconds += time.perf_counter() - began

    def _failed_locked(self, key: Hashable, kind: str, detail: str) -> None:
        """Note [Capture failures]: records a failed attempt at `key`. Under the lock."""
        self.capture_failures += 1
        limit = RETRIED.get(kind)
        if limit is None:
            self.eager[key] = (kind, detail)
            return
        self.tries[key] = tries = self.tries.get(key, 0) + 1
        if tries >= limit or kind == "memory cap":
            self.eager[key] = (kind, detail)  # "memory cap": until a pool is given back

    def _capture_failed(self, key: Hashable, label: Any, exc: Exception, pool: _Pool) -> None:
        kind = getattr(exc, "kind", "capture failed")
        detail = (
            getattr(exc, "detail", None) or f"{type(exc).__name__}: {lane_graph.first_line(exc)}"
        )
        detail = f"{label} on {self.label}: {detail}"
        with self.owner._lock:
            self._failed_locked(key, kind, detail)
            if kind == "capture failed":
                # Note [A failed capture]: the next capture takes a fresh pool; the old one
                # stays while its graphs do.
                if self.pools.get(pool.name) is pool:
                    del self.pools[pool.name]  # its graphs, if any, keep it
                self._retire_empty_locked(pool)
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
        keep = graph_ms < owner.gpu_bound_ratio * entry.eager_ms
        with owner._lock:
            counts = self.measured.setdefault(entry.pool.name, [0, 0])
            counts[0] += 1
            counts[1] += not keep
        if keep:
            return True
        reason = (
            f"GPU-bound: its graph took {graph_ms:.3g} ms against {entry.eager_ms:.3g} ms eager "
            f"(gpu_bound_ratio={owner.gpu_bound_ratio:g})"
        )
        with owner._lock:
            if self.graphs.pop(key, None) is not None:
                self.dropped += 1
            self.eager[key] = ("gpu-bound", reason)
            self._retire_empty_locked(entry.pool)
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

    def _retire_empty_locked(self, pool: _Pool) -> None:
        """`pool` goes to `retiring` when no graph of it is left. Under the lock."""
        if any(e.pool is pool for e in self.graphs.values()):
            return
        if self.pools.get(pool.name) is pool:
            del self.pools[pool.name]
        if all(p is not pool for p in self.retiring):
            self.retiring.append(pool)

    def _give_back_pools(self, *, reopen: bool = True) -> None:
        """Note [Giving a pool back]: frees what the retiring pools still reserve, once no
        capture is open in the process; a pool still held elsewhere stays retiring.
        `reopen`: keys refused by the memory cap may try again once memory came back."""
        with self.owner._lock:
            retiring, self.retiring = self.retiring, []
        if not retiring:
            return
        device = self.lane.device_index
        before = [pool_bytes(p.handle, device) for p in retiring]
        lane_graph.release_cached_memory()
        after = [pool_bytes(p.handle, device) for p in retiring]
        with self.owner._lock:
            for pool, was, held in zip(retiring, before, after, strict=True):
                pool.bytes = held
                self.released_bytes += was - held
                if held:
                    self.retiring.append(pool)
                elif was:
                    self.pools_released += 1
            if reopen and sum(before) > sum(after):
                for key in [k for k, (kind, _) in self.eager.items() if kind == "memory cap"]:
                    if self.tries.get(key, 0) < MEMORY_RETRIES:
                        del self.eager[key]

    def _stats_locked(self) -> dict[str, Any]:
        return {
            "graphs": [entry.label for entry in self.graphs.values()],
            "captures": self.captures,
            "capture_attempts": self.capture_attempts,
            "capture_failures": self.capture_failures,
            "capture_seconds": self.capture_seconds,
            "replays": self.replays,
            "eager_runs": self.eager_runs,
            "evictions": self.evictions,
            "dropped": self.dropped,
            "pool_bytes": sum(p.bytes for p in self._pools_locked()),
            "pools_released": self.pools_released,
            "released_bytes": self.released_bytes,
            "policy_choices": _choices(self.eager),
        }

    def _pools_locked(self) -> list[_Pool]:
        """Every pool of the lane that may hold memory, once each."""
        pools = {id(p): p for p in (*self.pools.values(), *self.retiring)}
        pools.update((id(e.pool), e.pool) for e in self.graphs.values())
        return list(pools.values())


def _choices(eager: dict[Hashable, tuple[str, str]]) -> dict[str, int]:
    """How many keys run eagerly per kind of reason."""
    counts: dict[str, int] = {}
    for kind, _ in eager.values():
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected {name} to be a number, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"expected {name} > 0, got {value}")
    return float(value)


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
