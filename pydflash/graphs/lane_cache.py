"""One lane's graphs: `LaneGraphCache`, made by `GraphCache.lane` (pydflash/graphs/cache.py,
whose contract it keeps), and `GraphEntry`, one captured graph."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..errors import GraphMemoryError
from . import _cuda_capture, lane_graph
from .policy import (
    CHOSEN,
    LAUNCH_BOUND_READINGS,
    PROBE_AT,
    TIMED_REPLAYS,
    NotWorthCapturing,
    Policy,
    TimedCall,
    choices,
    device_saturated,
    eager_cost,
    gpu_bound,
    gpu_bound_eagerly,
    not_worth_capturing,
    repaid,
    timed_call,
)
from .pools import DEFAULT_POOL, Pool, give_back, pool_bytes
from .pools import new_pool as _new_pool

if TYPE_CHECKING:
    from .cache import GraphCache

BUSY_RETRIES = 3
MEMORY_RETRIES = 2  # "memory cap" retries, each only after a pool of the lane was released

# Note [Capture failures]: a capture that failed is remembered per key, with its kind, and
# not tried again for the same reason: a failure of the function or of torch ("capture
# failed") fails the same way each time. Two causes can pass: the device's other lanes
# not pausing in time ("device busy": retried at the next call, BUSY_RETRIES times in
# all), and the pool's byte cap ("memory cap": retried only after a pool of the lane was
# given back, MEMORY_RETRIES times). `stats()` counts attempts and failures per lane.
RETRIED = {"device busy": BUSY_RETRIES, "memory cap": MEMORY_RETRIES}


@dataclass
class GraphEntry:
    """One captured graph: `graph` (a torch.cuda.CUDAGraph), `outputs` (what fn returned
    while captured), `data` (what make() gave besides fn), `label` (how stats name it)
    and `pool` (the lane's pool it is in)."""

    graph: Any
    outputs: Any
    data: Any
    label: Any
    pool: Any = None  # a Pool
    eager_ms: float | None = None
    host_ms: float | None = None  # the host's time to launch the eager call
    graph_ms: list[float] = field(default_factory=list)
    exec_handle: int | None = None  # its cudaGraphExec_t, once `LaneGraphCache.exec_handle` read it
    _events: list[tuple[Any, Any]] = field(default_factory=list)


class LaneGraphCache:
    """One lane's graphs (see the module's contract); made by `GraphCache.lane`."""

    def __init__(self, owner: GraphCache, lane: Any) -> None:
        self.owner = owner
        self.lane = lane
        self.label = lane.label
        self.pools: dict[str, Pool] = {}
        self.graphs: OrderedDict[Hashable, GraphEntry] = OrderedDict()  # LRU first
        self.eager: dict[Hashable, tuple[str, str]] = {}  # key -> (kind, detail)
        self.tries: dict[Hashable, int] = {}  # key -> failed attempts of a RETRIED kind
        self.seen: dict[Hashable, int] = {}  # key -> calls of get_or_capture
        # Policy.AUTO's eager timing of keys (Note [A policy for the whole step]): key ->
        # (pool, label) while its eager call is to be timed, the timed calls not read yet,
        # and per key the timed calls that found it launch-bound (LAUNCH_BOUND_READINGS).
        self.to_time: dict[Hashable, tuple[str, Any]] = {}
        self.probes: list[TimedCall] = []
        self.launch_bound: dict[Hashable, int] = {}
        self.retiring: list[Pool] = []  # pools whose graphs are all gone
        # pool name -> [keys judged (by an eager call or a graph), of which GPU-bound]
        self.measured: dict[str, list[int]] = {}
        self.savings: dict[str, list[float]] = {}  # pool name -> ms a replay saved, per key
        self.costs: dict[str, list[float]] = {}  # pool name -> seconds each capture took
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
        if self.probes:
            self._read_probes()
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
            skip = self._not_worth_it(key, seen, pool, ahead, label, timed is not False)
            if skip is not None:
                return self._eager_run(key, skip)
        return self._capture(key, make, key if label is None else label, warmup, timed, pool)

    def run_eagerly(self, key: Hashable, call: Callable[[], Any]) -> Any:
        """call(): `key`'s eager, unpadded call, where get_or_capture gave None. Under
        Policy.AUTO, a key still to be judged has its calls from the PROBE_AT-th on timed,
        one at a time (Note [A policy for the whole step])."""
        with self.owner._lock:
            where = self.to_time.get(key)
            due = where is not None and self.seen.get(key, 0) >= PROBE_AT
        if not due or any(p.key == key for p in self.probes):
            return call()
        out, timed = timed_call(call)
        self.probes.append(replace(timed, key=key, pool=where[0], label=where[1]))
        return out

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
        """Whether `key` is recorded to run eagerly; if so, this call's eager run is
        counted as get_or_capture counts it (a stage's path without graphs asks this)."""
        with self.owner._lock:
            if key not in self.eager:
                return False
        self._eager_run(key)
        return True

    # --- inside ------------------------------------------------------------------------
    def _eager_run(self, key: Hashable, chosen: tuple[str, str] | None = None) -> None:
        with self.owner._lock:
            kind, detail = chosen or self.eager.get(key, ("policy", ""))
            if kind in CHOSEN:
                self.eager_runs += 1  # the policy's choice, not a fallback
                return
        self.owner._fell_back(self, kind, detail)

    def _not_worth_it(
        self, key: Hashable, seen: int, pool: str, ahead: bool, label: Any, timed: bool
    ) -> tuple[str, str] | None:
        """Why policy AUTO runs `key` eagerly for now (Note [A policy for the whole
        step]), or None: capture it. `timed`: its calls may be timed."""
        owner = self.owner
        with owner._lock:
            why = not_worth_capturing(
                self.measured.get(pool, (0, 0)),
                self.capture_seconds,
                owner.capture_budget,
                f"pool {pool!r} of {self.label}",
            )
            if why is not None:
                self.eager[key] = why  # for good: neither comes back
                return why
            savings, costs = self.savings.get(pool, []), self.costs.get(pool, [])
            judged = self.launch_bound.get(key, 0) >= LAUNCH_BOUND_READINGS
            if PROBE_AT and not ahead and timed and not judged:
                self.to_time[key] = (pool, label)
                return (
                    "timed first",
                    f"its calls from {PROBE_AT} on run eagerly, timed, until judged",
                )
        if ahead:
            return None
        if seen < owner.capture_after:
            return ("rare", f"seen {seen} times, captured at {owner.capture_after}")
        return repaid(seen, savings, costs)

    def _pool_for(self, name: str) -> Any:
        """The handle of pool `name`, a fresh one where it has no graph (Note [A failed
        capture]: a pool with no graph is not captured into again). Under the lock."""
        pool = self.pools.get(name)
        if pool is not None:
            self._retire_empty_locked(pool)
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool(name, _new_pool())
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
            pool = self._pool_for(pool_name)  # a Pool
        if self.retiring:
            self._give_back_pools()
        if timed is None:
            timed = owner.policy is Policy.AUTO
        name = f"{owner.name} {label}"
        began = perf_counter()
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
                judge=partial(gpu_bound_eagerly, ratio=owner.gpu_bound_ratio)
                if owner.policy is Policy.AUTO
                else None,
            )
        except NotWorthCapturing as no:
            self._spent(began)
            self._judged(key, label, pool.name, no.reason, no.eager_ms, no.host_ms, graph_ms=None)
            return self._eager_run(key)
        except Exception as exc:  # noqa: BLE001 - never crash the step: run eagerly
            self._spent(began)
            return self._capture_failed(key, label, exc, pool)
        self._spent(began, pool.name)
        entry = GraphEntry(
            captured.graph, captured.outputs, data, label, pool, captured.eager_ms, captured.host_ms
        )
        measured = pool_bytes(pool.handle, self.lane.device_index)
        with owner._lock:
            self.capture_attempts += 1
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

    def _spent(self, began: float, pool: str | None = None) -> None:
        """Counts a capture's seconds; with `pool`, a capture that succeeded there."""
        took = perf_counter() - began
        with self.owner._lock:
            self.capture_seconds += took
            if pool is not None:
                self.costs.setdefault(pool, []).append(took)

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

    def _capture_failed(self, key: Hashable, label: Any, exc: Exception, pool: Pool) -> None:
        kind = getattr(exc, "kind", "capture failed")
        detail = (
            getattr(exc, "detail", None) or f"{type(exc).__name__}: {lane_graph.first_line(exc)}"
        )
        detail = f"{label} on {self.label}: {detail}"
        with self.owner._lock:
            self.capture_attempts += 1
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
        reason = gpu_bound(graph_ms, entry.eager_ms, entry.host_ms, self.owner.gpu_bound_ratio)
        if reason is not None:
            with self.owner._lock:
                if self.graphs.pop(key, None) is not None:
                    self.dropped += 1
                self._retire_empty_locked(entry.pool)
        self._judged(
            key, entry.label, entry.pool.name, reason or "", entry.eager_ms, entry.host_ms, graph_ms
        )
        return reason is None

    def _read_probes(self) -> None:
        """Judges the timed eager calls the GPU has passed, in the stream's order."""
        while self.probes and self.probes[0].passed():
            probe = self.probes.pop(0)
            eager_ms, host_ms = probe.read()
            bound = gpu_bound_eagerly(eager_ms, host_ms, self.owner.gpu_bound_ratio)
            reason = bound or device_saturated(_cuda_capture.device_busy(self.lane.device_index))
            with self.owner._lock:
                self.to_time.pop(probe.key, None)  # its next call, if still to judge: timed again
                if reason is None:
                    self.launch_bound[probe.key] = self.launch_bound.get(probe.key, 0) + 1
            if reason is not None:
                self._judged(probe.key, probe.label, probe.pool, reason, eager_ms, host_ms, None)

    def _judged(
        self,
        key: Hashable,
        label: Any,
        pool: str,
        reason: str,
        eager_ms: float,
        host_ms: float | None,
        graph_ms: float | None,
    ) -> None:
        """Records the policy's judgement of `key` in `pool` (Note [A policy for the whole
        step]): GPU-bound with `reason` (runs eagerly from now on, listed in
        eager_buckets), or kept where `reason` is empty; `graph_ms` None: judged by an
        eager call, never captured."""
        saved = 0.0 if graph_ms is None else max(0.0, eager_cost(eager_ms, host_ms) - graph_ms)
        with self.owner._lock:
            counts = self.measured.setdefault(pool, [0, 0])
            counts[0] += 1
            counts[1] += bool(reason)
            self.savings.setdefault(pool, []).append(saved)
            if not reason:
                return
            self.eager[key] = ("gpu-bound", reason)
            timings = {"eager_ms": eager_ms, "host_ms": host_ms, "graph_ms": graph_ms}
            record = {"lane": self.label, "bucket": label, "reason": reason, **timings}
            self.owner._eager_buckets.append(record)

    def _retire_empty_locked(self, pool: Pool) -> None:
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
        freed = give_back(retiring, self.lane.device_index, pool_bytes)
        with self.owner._lock:
            self.retiring.extend(p for p in retiring if p.bytes)
            self.pools_released += freed.pools
            self.released_bytes += freed.bytes
            if reopen and freed.bytes:
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
            "policy_choices": choices(self.eager),
        }

    def _pools_locked(self) -> list[Pool]:
        """Every pool of the lane that may hold memory, once each."""
        pools = {id(p): p for p in (*self.pools.values(), *self.retiring)}
        pools.update((id(e.pool), e.pool) for e in self.graphs.values())
        return list(pools.values())
