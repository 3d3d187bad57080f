"""The graph cache (pydflash/graphs/cache.py) and the one capture routine under it
(pydflash.graphs.capture_graph), on CPU: the CUDA calls a capture makes are stood in for
by fakes that keep torch's bookkeeping (a pool's use count, the allocator's recordings),
so a failure can be injected at each point of a capture."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest

import pydflash
from pydflash import GraphFallbackWarning, GraphMemoryError
from pydflash.graphs import _cuda_capture, lane_cache, policy
from pydflash.graphs import cache as graph_cache
from pydflash.graphs import lane_graph as graphs
from pydflash.graphs.cache import BUSY_RETRIES, TIMED_REPLAYS, GraphCache

REAL_QUIET = _cuda_capture.device_quiet


class FakeAllocator:
    """torch's caching allocator as a capture sees it: capture_begin takes a reference to
    the pool and starts recording into it; capture_end stops recording; reset() of an
    ended graph gives the reference back."""

    def __init__(self):
        self.use_count: dict = {}
        self.reserved: dict = {}  # pool -> bytes it holds: 1000 per capture into it
        self.recording: list = []
        self.host_recording: list = []  # the pinned host allocator's: no Python call ends it

    def begin(self, pool):
        if pool in self.use_count:
            assert self.use_count[pool] > 0, "a pool with no graph is captured into again"
            self.use_count[pool] += 1
        else:
            self.use_count[pool] = 1
        if pool in self.recording or pool in self.host_recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.recording.append(pool)
        self.host_recording.append(pool)
        self.reserved[pool] = self.reserved.get(pool, 0) + 1000

    def end(self, device, pool):
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.remove(pool)

    def release(self, device, pool):
        self.use_count[pool] -= 1
        assert self.use_count[pool] >= 0

    def empty_cache(self):
        """Frees the pools no graph uses any more, as torch's free_cached_blocks does."""
        for pool, count in self.use_count.items():
            if count == 0:
                self.reserved[pool] = 0

    def pool_bytes(self, pool, device):
        return self.reserved.get(pool, 0)


class FakeCudaGraph:
    """torch.cuda.CUDAGraph's capture bookkeeping, with its order of failure as torch
    releases differ (aten/src/ATen/cuda/CUDAGraph.cpp), by `cuda.torch`:
    - "keeps": an invalidated capture raises at the stream's end of capture, before the
      allocator is told; reset() gives the pool reference back after a successful end only;
    - "releases": as "keeps", but reset() gives it back after a failed capture too (the
      torch on the H200);
    - "ends": capture_end tells the allocator before it raises; reset() gives the
      reference back after a failed capture too (later torch)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.holds = False  # the pool reference capture_begin took
        self.ended = False
        self.replays = 0

    def capture_begin(self, pool, capture_error_mode):
        assert capture_error_mode == "thread_local"
        self.cuda.generator_capturing = True  # torch's capture prologue comes first
        self.pool = pool
        self.cuda.allocator.begin(pool)
        self.cuda.nodes = 0
        self.holds = True
        if self.cuda.fail_at == "capture_begin":
            raise RuntimeError("CUDA error: operation not permitted (begin)")
        self.cuda.capturing = True

    def capture_end(self):
        self.cuda.capturing = False
        failed = self.cuda.invalidated or self.cuda.fail_at == "capture_end"
        if not failed or self.cuda.torch == "ends":
            self.cuda.allocator.end(0, self.pool)
            self.cuda.allocator.host_recording.remove(self.pool)
        if failed:
            self.cuda.invalidated = False
            raise RuntimeError(
                "CUDA error: operation failed due to a previous error during capture"
            )
        self.cuda.generator_capturing = False  # the epilogue, after a successful end only
        self.ended = True
        if self.cuda.nodes == 0:  # torch's TORCH_WARN "The CUDA Graph is empty"
            self.cuda.empty_graphs += 1

    def reset(self):
        if self.holds and (self.ended or self.cuda.torch != "keeps"):
            self.cuda.allocator.release(0, self.pool)
            self.holds = self.ended = False

    def replay(self):
        self.replays += 1

    def __del__(self):
        self.reset()  # as torch's destructor does


class FakeCuda:
    def __init__(self, torch="releases"):
        self.torch = torch  # which torch release's CUDAGraph (FakeCudaGraph)
        self.allocator = FakeAllocator()
        self.capturing = False
        self.invalidated = False
        self.fail_at = None
        self.quiet = True
        self.host_ms = 1e6  # each timed warm-up call's launch: host-bound unless a test says
        self.device_busy = None  # NVML's busy share of the device: unknown unless a test says
        self.clock = 0.0
        self.made = 0
        self.generator_capturing = False
        self.nodes = 0  # kernels recorded by the capture underway
        self.empty_graphs = 0  # captures ended with no kernel in them

    def launch(self):
        """A kernel launch: recorded while a capture is underway."""
        if self.capturing:
            self.nodes += 1

    def end_generator_capture(self):
        self.generator_capturing = False  # a capture's prologue, then its epilogue

    def new_graph(self):
        self.made += 1
        return FakeCudaGraph(self)

    def stream_idle(self):
        if self.fail_at == "stream_idle":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def host_sync(self):
        """What `.item()` does inside a capture: the capture is invalidated, and it raises."""
        if self.capturing:
            self.invalidated = True
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    @contextlib.contextmanager
    def device_quiet(self, lane, timeout):
        yield self.quiet

    def tick(self):
        """The host clock of a timed warm-up call: `host_ms` passes in each call."""
        self.clock += self.host_ms / 1000
        return self.clock


class FakeEvent:
    """A CUDA timing event that has passed, at `at` ms."""

    def __init__(self, at):
        self.at = at

    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(_cuda_capture, "new_graph", fake.new_graph)
    monkeypatch.setattr(_cuda_capture, "stream_idle", fake.stream_idle)
    monkeypatch.setattr(_cuda_capture, "is_capturing", lambda: fake.capturing)
    monkeypatch.setattr(_cuda_capture, "end_allocate_to_pool", fake.allocator.end)
    monkeypatch.setattr(_cuda_capture, "device_quiet", fake.device_quiet)
    monkeypatch.setattr(_cuda_capture, "end_generator_capture", fake.end_generator_capture)
    monkeypatch.setattr(_cuda_capture, "launch_marker", fake.launch)
    monkeypatch.setattr(_cuda_capture, "empty_cache", fake.allocator.empty_cache)
    monkeypatch.setattr(_cuda_capture, "device_busy", lambda device: fake.device_busy)
    monkeypatch.setattr(policy, "perf_counter", fake.tick)
    # The capture's mechanics first: no eager call timed before (the tests of that set it).
    monkeypatch.setattr(lane_cache, "PROBE_AT", 0)
    pools = iter(range(1, 1000))
    monkeypatch.setattr(lane_cache, "_new_pool", lambda: (0, next(pools)))
    monkeypatch.setattr(lane_cache, "pool_bytes", fake.allocator.pool_bytes)
    return fake


class FakeLane:
    label = "cuda:0/0"
    device_index = 0


LANE = FakeLane()


def forward(cuda, fail=False):
    def fn():
        cuda.launch()
        if fail:
            cuda.host_sync()
        return "out"

    return fn


# --- the capture routine: a failure at each point leaves no trace --------------------------
POINTS = ["stream_idle", "capture_begin", "forward", "forward_python", "capture_end"]


def _inject(cuda, point):
    if point in ("stream_idle", "capture_begin", "capture_end"):
        cuda.fail_at = point
        return forward(cuda)
    if point == "forward":
        return forward(cuda, fail=True)

    def raises_without_invalidating():
        raise ValueError("a Python error inside the forward")

    return raises_without_invalidating


@pytest.mark.parametrize("torch_release", ["keeps", "releases", "ends"])
@pytest.mark.parametrize("point", POINTS)
def test_a_failed_capture_leaves_no_trace(cuda, point, torch_release):
    cuda.torch = torch_release
    pool = (0, 7)
    kept = graphs.capture_graph(forward(cuda), LANE, pool=pool, warmup=0)  # holds the pool
    with pytest.raises(graphs.CaptureFailed) as failed:
        graphs.capture_graph(_inject(cuda, point), LANE, pool=pool, warmup=0)
    assert failed.value.kind == "capture failed"
    assert not cuda.capturing and cuda.allocator.recording == []
    assert not cuda.generator_capturing  # random ops outside a capture work again
    assert cuda.empty_graphs == 0  # Note [No empty graph]: a cleanup never ends one
    # The kept graph's reference, and where torch keeps it, the failed capture's.
    began = point not in ("stream_idle", "forward_python")
    assert cuda.allocator.use_count[pool] == 1 + (torch_release == "keeps" and began)
    cuda.fail_at = None
    kept_replays = kept.graph.replays
    kept.graph.replay()  # the graph already in the pool still replays from it
    assert kept.graph.replays == kept_replays + 1
    fresh = (0, 8)  # the next capture takes a fresh pool (Note [A failed capture])
    again = graphs.capture_graph(forward(cuda), LANE, pool=fresh, warmup=0)
    assert again.outputs == "out" and cuda.allocator.use_count[fresh] == 1
    del kept


def test_the_warm_up_runs_outside_the_capture_and_errors_from_it_propagate(cuda):
    calls = []

    def fn():
        calls.append(cuda.capturing)
        if len(calls) == 1:
            raise KeyError("warm-up")
        return "out"

    with pytest.raises(KeyError):
        graphs.capture_graph(fn, LANE, pool=(0, 1), warmup=2)
    assert cuda.made == 0  # nothing began
    graphs.capture_graph(fn, LANE, pool=(0, 1), warmup=2)
    assert calls == [False, False, False, True]


def test_a_device_that_does_not_quiet_is_busy_and_nothing_is_captured(cuda):
    cuda.quiet = False
    with pytest.raises(graphs.CaptureFailed) as failed:
        graphs.capture_graph(forward(cuda), LANE, pool=(0, 1), warmup=1, quiet_timeout=0.5)
    assert failed.value.kind == "device busy" and "0.5 s" in str(failed.value)
    assert cuda.made == 0 and cuda.allocator.recording == []


def test_quiet_env_switch_skips_the_pause(monkeypatch):
    monkeypatch.setenv(graphs.QUIET_ENV, "0")
    with _cuda_capture.device_quiet(LANE, 0.0) as quiet:
        assert quiet is True


def test_the_capture_runs_while_the_other_lanes_of_the_device_are_paused(cuda, monkeypatch):
    """Lanes of one device (here the CPU's) keep running tasks during the warm-up, and
    none runs while the capture is open."""
    monkeypatch.setattr(_cuda_capture, "device_quiet", REAL_QUIET)
    ran, window = [], []

    def tick():
        ran.append(time.monotonic())
        time.sleep(0.001)

    def fn():
        if cuda.capturing:
            window.append(time.monotonic())
            time.sleep(0.2)
            window.append(time.monotonic())
        return "out"

    with pydflash.Dispatcher(["cpu", "cpu"]) as d:
        capturer, other = d.lanes
        ticks = [other.submit(tick) for _ in range(1000)]
        while not ran:
            time.sleep(0.001)
        capture = capturer.submit(graphs.capture_graph, fn, capturer, pool=(0, 1), warmup=1)
        assert capture.result(timeout=60).outputs == "out"
        for future in ticks:
            future.result(timeout=60)
    start, end = window
    assert [t for t in ran if t < start] and [t for t in ran if t > end]
    assert [t for t in ran if start < t < end] == []


# --- the cache: fallbacks, retries, eviction, cap ------------------------------------------
def test_a_failed_capture_runs_eagerly_and_later_keys_still_capture(cuda):
    cache = GraphCache("stage", warmup=0)
    lane = cache.lane(LANE)
    assert lane.get_or_capture("a", lambda: (forward(cuda), "data")).data == "data"
    pool = lane.pool
    with pytest.warns(GraphFallbackWarning, match=r"\(capture failed\).*not permitted"):
        assert lane.get_or_capture("b", lambda: (forward(cuda, fail=True), None)) is None
    assert lane.get_or_capture("c", lambda: (forward(cuda), None)) is not None
    assert lane.pool not in (None, pool)  # Note [A failed capture]: a fresh pool after a failure
    assert (
        lane.get_or_capture("b", lambda: pytest.fail("the failed key is not captured again"))
        is None
    )
    stats = cache.stats()
    assert stats["fallbacks"]["capture failed"]["count"] == 2
    assert stats["lanes"][LANE.label]["graphs"] == ["a", "c"]
    assert stats["lanes"][LANE.label]["eager_runs"] == 2
    assert cuda.allocator.recording == []


@pytest.mark.parametrize("error", [MemoryError("out of memory"), ZeroDivisionError("x")])
def test_any_error_while_capturing_is_a_fallback_not_a_crash(cuda, error):
    def make():
        raise error

    cache = GraphCache("stage", warmup=0)
    with pytest.warns(GraphFallbackWarning, match=type(error).__name__):
        assert cache.lane(LANE).get_or_capture("k", make) is None


def test_a_busy_device_is_retried_then_given_up(cuda):
    cuda.quiet = False
    cache = GraphCache("stage", warmup=0)
    lane = cache.lane(LANE)
    with pytest.warns(GraphFallbackWarning, match="did not pause"):
        assert lane.get_or_capture("k", lambda: (forward(cuda), None)) is None
    cuda.quiet = True
    assert lane.get_or_capture("k", lambda: (forward(cuda), None)) is not None  # retried
    cuda.quiet = False
    for _ in range(BUSY_RETRIES):
        assert lane.get_or_capture("j", lambda: (forward(cuda), None)) is None
    cuda.quiet = True
    assert lane.get_or_capture("j", lambda: pytest.fail("given up")) is None
    assert cache.stats()["fallbacks"]["device busy"]["count"] == BUSY_RETRIES + 2


def test_least_recently_used_graphs_are_evicted(cuda):
    cache = GraphCache("stage", warmup=0, max_graphs=2)
    lane = cache.lane(LANE)
    for key in ("a", "b", "a", "c"):  # b is the least recently used when c comes
        lane.get_or_capture(key, lambda: (forward(cuda), None))
    stats = cache.stats()["lanes"][LANE.label]
    assert stats["graphs"] == ["a", "c"] and stats["evictions"] == 1 and stats["captures"] == 3


@pytest.mark.parametrize("on_full", ["eager", "raise"])
def test_the_pool_cap_runs_eagerly_or_raises(cuda, monkeypatch, on_full):
    monkeypatch.setattr(lane_cache, "pool_bytes", lambda pool, device: 100)
    cache = GraphCache("stage", warmup=0, max_pool_bytes=10, on_full=on_full)
    lane = cache.lane(LANE)
    if on_full == "raise":
        with pytest.raises(GraphMemoryError, match="max_pool_bytes=10, got 100"):
            lane.get_or_capture("k", lambda: (forward(cuda), None))
    else:
        with pytest.warns(GraphFallbackWarning, match="max_pool_bytes=10"):
            assert lane.get_or_capture("k", lambda: (forward(cuda), None)) is None
    stats = cache.stats()["lanes"][LANE.label]
    assert stats["graphs"] == [] and stats["dropped"] == 1


@pytest.mark.filterwarnings("ignore::pydflash.GraphFallbackWarning")
def test_a_lane_with_no_graph_left_takes_a_fresh_pool(cuda):
    """torch asserts a pool's use count is positive when a capture shares it: a pool
    whose graphs are all gone (a failed first capture, evictions) is never captured into
    again (FakeAllocator asserts it)."""
    cache = GraphCache("stage", warmup=0, max_graphs=1)
    lane = cache.lane(LANE)
    assert lane.get_or_capture("a", lambda: (forward(cuda, fail=True), None)) is None
    assert lane.get_or_capture("b", lambda: (forward(cuda), None)) is not None
    assert lane.get_or_capture("c", lambda: (forward(cuda), None)) is not None  # evicts b
    assert cache.stats()["lanes"][LANE.label]["graphs"] == ["c"]


# --- the policy -----------------------------------------------------------------------------
@pytest.mark.parametrize(("graph_ms", "kept"), [(9.5, False), (4.0, True)])
def test_auto_policy_drops_a_graph_no_faster_than_eager(cuda, monkeypatch, graph_ms, kept):
    spent = iter([10.0, graph_ms, graph_ms])  # the warm-up call, then two replays

    def events():
        return FakeEvent(0.0), FakeEvent(next(spent))

    monkeypatch.setattr(_cuda_capture, "timing_events", events)
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    for _ in range(3):
        entry = lane.get_or_capture("k", lambda: (forward(cuda), None), label=(2, 512))
        if entry is None:
            break
        lane.replay(entry)
    again = lane.get_or_capture("k", lambda: pytest.fail("not captured again"), label=(2, 512))
    stats = cache.stats()
    assert (again is not None) == kept
    if kept:
        assert stats["eager_buckets"] == []
    else:
        (dropped,) = stats["eager_buckets"]
        assert dropped["bucket"] == (2, 512) and dropped["eager_ms"] == 10.0
        assert dropped["graph_ms"] == 9.5 and "GPU-bound" in dropped["reason"]
        assert stats["fallbacks"] == {}  # the policy's choice is no fallback
        assert stats["lanes"][LANE.label]["dropped"] == 1


def test_a_call_its_host_launches_faster_than_the_gpu_runs_it_is_never_captured(cuda, monkeypatch):
    """Note [A policy for the whole step]: the timed warm-up call ran 10 ms on the GPU and
    took the host 5 ms to launch: the GPU limits it, a graph would only add padding. Nothing
    is captured, the key runs eagerly (unpadded, no warning), and once PREDICT_AFTER keys
    were judged so, a new key is not even warmed up."""
    _timed(monkeypatch, eager_ms=10.0, graph_ms=10.0)  # every warm-up call: 10 ms
    cuda.host_ms = 5.0
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    for key in range(policy.PREDICT_AFTER):
        assert lane.get_or_capture(key, lambda: (forward(cuda), None), label=(2, key)) is None
        assert lane.get_or_capture(key, lambda: pytest.fail("warmed up again")) is None
    assert lane.get_or_capture("new", lambda: pytest.fail("warmed up")) is None
    stats = cache.stats()
    s = stats["lanes"][LANE.label]
    assert (s["capture_attempts"], s["captures"], s["pool_bytes"]) == (0, 0, 0)
    assert cuda.allocator.use_count == {}  # no capture began
    assert s["policy_choices"] == {"gpu-bound": 2, "predicted GPU-bound": 1}
    assert stats["fallbacks"] == {} and s["eager_runs"] == 5
    first = stats["eager_buckets"][0]
    assert (first["eager_ms"], first["host_ms"], first["graph_ms"]) == (10.0, 5.0, None)
    assert "launching it eagerly took the host 5 ms, running it the GPU 10 ms" in first["reason"]


def _calls(lane, key, cuda, n, counted):
    """`n` calls of `key` as a stage makes them: its graph, or its eager call."""
    entries = []
    for _ in range(n):
        entry = lane.get_or_capture(key, lambda: (forward(cuda), None), label=key)
        if entry is None:
            lane.run_eagerly(key, lambda: counted.append(key))
        entries.append(entry)
    return entries


def test_a_key_whose_eager_call_is_gpu_bound_is_never_warmed_up_nor_captured(cuda, monkeypatch):
    """Note [A policy for the whole step]: each key's second eager call, unpadded, ran 10 ms
    on the GPU and took the host 5 ms to launch: the GPU limits it. No warm-up, no capture,
    no warning; once PREDICT_AFTER keys were judged so, a new key is not even timed."""
    monkeypatch.setattr(lane_cache, "PROBE_AT", 2)
    timed = []

    def events():
        timed.append(1)
        return FakeEvent(0.0), FakeEvent(10.0)

    monkeypatch.setattr(_cuda_capture, "timing_events", events)
    cuda.host_ms = 5.0
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    counted = []
    for key in range(policy.PREDICT_AFTER):
        assert _calls(lane, key, cuda, 3, counted) == [None] * 3
    assert _calls(lane, "new", cuda, 3, counted) == [None] * 3
    assert len(counted) == 3 * (policy.PREDICT_AFTER + 1)  # every call ran, eagerly
    assert len(timed) == policy.PREDICT_AFTER  # one call per key judged, none of "new"
    stats = cache.stats()
    s = stats["lanes"][LANE.label]
    assert (s["capture_attempts"], s["captures"], s["pool_bytes"]) == (0, 0, 0)
    assert s["policy_choices"] == {"gpu-bound": 2, "predicted GPU-bound": 1}
    assert stats["fallbacks"] == {} and s["eager_runs"] == 9
    first = stats["eager_buckets"][0]
    assert (first["bucket"], first["eager_ms"], first["host_ms"], first["graph_ms"]) == (
        0,
        10.0,
        5.0,
        None,
    )


def test_a_key_whose_eager_calls_are_launch_bound_is_captured_after_them(cuda, monkeypatch):
    """Calls 2 and 3 of "k" are timed (LAUNCH_BOUND_READINGS=2), both launch-bound: call 4
    captures it."""
    monkeypatch.setattr(lane_cache, "PROBE_AT", 2)
    _timed(monkeypatch, eager_ms=10.0, graph_ms=1.0)  # the host launches for 1000 s
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    counted = []
    got = _calls(lane, "k", cuda, 5, counted)
    assert [g is not None for g in got] == [False, False, False, True, True]
    assert counted == ["k"] * 3
    s = cache.stats()["lanes"][LANE.label]
    assert (s["capture_attempts"], s["eager_runs"], s["policy_choices"]) == (1, 3, {})


@pytest.mark.parametrize("readings", [(0.5, 0.99), (0.99, 0.5)])
def test_one_gpu_bound_reading_of_a_key_keeps_it_eager_for_good(cuda, monkeypatch, readings):
    """The host launches "k" for 1000 s against 10 ms of GPU time, and NVML reads its
    device busy `readings` at its two timed calls: one reading at or past DEVICE_BUSY
    suffices (a pipeline starting up reads once as launch-bound), and "k" is never warmed
    up nor captured."""
    monkeypatch.setattr(lane_cache, "PROBE_AT", 2)
    _timed(monkeypatch, eager_ms=10.0, graph_ms=10.0)
    busy = iter(readings)
    monkeypatch.setattr(_cuda_capture, "device_busy", lambda device: next(busy))
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    counted = []
    assert _calls(lane, "k", cuda, 6, counted) == [None] * 6
    assert counted == ["k"] * 6
    stats = cache.stats()
    assert stats["lanes"][LANE.label]["capture_attempts"] == 0
    (judged,) = stats["eager_buckets"]
    assert "its device ran kernels 99% of NVML's last sample period" in judged["reason"]


@pytest.mark.parametrize(("busy", "captured"), [(0.99, False), (0.95, False), (0.94, True)])
def test_a_launch_bound_call_on_a_device_busy_all_the_time_is_gpu_bound(
    cuda, monkeypatch, busy, captured
):
    """Note [A policy for the whole step]: the host launches "k" for 1000 s against 10 ms
    of GPU time, but its device ran kernels `busy` of NVML's last sample period: from
    DEVICE_BUSY (0.95) on, saved launches cannot shorten a step, and it is never captured."""
    monkeypatch.setattr(lane_cache, "PROBE_AT", 2)
    _timed(monkeypatch, eager_ms=10.0, graph_ms=1.0)
    cuda.device_busy = busy
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    got = _calls(lane, "k", cuda, 5, [])
    assert [g is not None for g in got] == [False, False, False, captured, captured]
    stats = cache.stats()
    assert stats["lanes"][LANE.label]["capture_attempts"] == int(captured)
    if not captured:
        (judged,) = stats["eager_buckets"]
        assert f"its device ran kernels {busy:.0%} of NVML's last sample period" in judged["reason"]
        assert (judged["eager_ms"], judged["graph_ms"]) == (10.0, None)


@pytest.mark.parametrize(("host_ms", "kept"), [(1e6, True), (9.5, False)])
def test_a_graph_must_beat_the_eager_calls_launch_as_well_as_its_gpu_time(
    cuda, monkeypatch, host_ms, kept
):
    """A replay of 8.8 ms beats a 10 ms eager call by more than gpu_bound_ratio=0.9, but
    not an eager call whose launch, 9.5 ms, is what it costs a pipeline."""
    _timed(monkeypatch, eager_ms=10.0, graph_ms=8.8)
    cuda.host_ms = host_ms
    cache = GraphCache("stage", warmup=1)
    assert _replayed_until_judged(cache.lane(LANE), "k", cuda) == kept
    s = cache.stats()["lanes"][LANE.label]
    assert (s["capture_attempts"], s["dropped"]) == (1, 0 if kept else 1)


def test_eager_policy_captures_nothing(cuda):
    cache = GraphCache("stage", policy="eager")
    lane = cache.lane(LANE)
    assert lane.get_or_capture("k", lambda: pytest.fail("captured")) is None
    assert cache.stats()["lanes"][LANE.label]["eager_runs"] == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"on_full": "drop"}, ValueError, "on_full in"),
        ({"policy": "sometimes"}, ValueError, "policy in"),
        ({"gpu_bound_ratio": 0}, ValueError, "gpu_bound_ratio > 0"),
        ({"gpu_bound_ratio": "1"}, TypeError, "gpu_bound_ratio to be a number"),
        ({"max_graphs": 0}, ValueError, "max_graphs >= 1"),
        ({"warmup": -1}, ValueError, "warmup >= 0"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        GraphCache("stage", **kwargs)


# --- stats from any thread while the lane's worker changes the cache ------------------------
def test_stats_is_consistent_while_another_thread_captures_evicts_and_replays(cuda):
    """The lane's worker captures, evicts and replays while another thread reads stats();
    every snapshot must be whole: no "mutated during iteration", and captures equal
    evictions plus graphs held."""
    cache = GraphCache("stage", warmup=0, max_graphs=3)
    lane = cache.lane(LANE)
    start = threading.Barrier(2)
    done = threading.Event()
    errors = []

    def worker():
        start.wait()
        try:
            for i in range(20_000):
                entry = lane.get_or_capture(i % 7, lambda: (forward(cuda), None))
                lane.replay(entry)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    def reader():
        start.wait()
        try:
            while not done.is_set():
                s = cache.stats()["lanes"][LANE.label]
                assert s["captures"] == s["evictions"] + len(s["graphs"]), s
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker), threading.Thread(target=reader)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


# --- failures remembered, attempts counted (Note [Capture failures]) --------------------------
def test_a_deterministic_failure_is_attempted_once_per_key(cuda, monkeypatch):
    attempts = []
    real = graphs.capture_graph

    def counting(fn, lane, **kwargs):
        attempts.append(kwargs["turn"])
        return real(fn, lane, **kwargs)

    monkeypatch.setattr(graphs, "capture_graph", counting)
    cache = GraphCache("stage", warmup=0)
    lane = cache.lane(LANE)
    with pytest.warns(GraphFallbackWarning, match="capture failed"):
        for _ in range(5):
            for key in ("bucket", "step"):
                assert lane.get_or_capture(key, lambda: (forward(cuda, fail=True), None)) is None
    assert attempts == ["stage bucket", "stage step"]
    stats = cache.stats()
    s = stats["lanes"][LANE.label]
    assert (s["capture_attempts"], s["capture_failures"], s["captures"]) == (2, 2, 0)
    assert s["eager_runs"] == 10 and stats["fallbacks"]["capture failed"]["count"] == 10


def test_a_key_over_the_cap_is_tried_again_after_a_pool_was_given_back(cuda):
    cache = GraphCache("stage", warmup=0, max_pool_bytes=1500)
    lane = cache.lane(LANE)
    a = lane.get_or_capture("a", lambda: (forward(cuda), None))
    assert a is not None
    with pytest.warns(GraphFallbackWarning, match="memory cap"):
        assert lane.get_or_capture("b", lambda: (forward(cuda), None)) is None  # 2000 > 1500
    assert lane.get_or_capture("b", lambda: pytest.fail("tried again too soon")) is None
    # The policy drops a: its pool, with no graph left, is given back.
    lane.graphs.pop("a")
    lane._retire_empty_locked(a.pool)
    del a
    lane._give_back_pools()
    assert lane.get_or_capture("b", lambda: (forward(cuda), None)) is not None  # fresh pool
    s = cache.stats()["lanes"][LANE.label]
    assert (s["capture_attempts"], s["capture_failures"], s["pools_released"]) == (3, 1, 1)


# --- a dropped graph gives its memory back (Note [Giving a pool back]) ----------------------
def _timed(monkeypatch, eager_ms, graph_ms):
    spent = iter([eager_ms, *([graph_ms] * 100)])

    def events():
        return FakeEvent(0.0), FakeEvent(next(spent))

    monkeypatch.setattr(_cuda_capture, "timing_events", events)


def _replayed_until_judged(lane, key, cuda, pool="graphs"):
    """Calls for `key` until the policy has judged its graph: True when kept. Holds no
    reference to the entry between calls, as a stage's task does not."""
    for _ in range(TIMED_REPLAYS + 2):
        entry = lane.get_or_capture(key, lambda: (forward(cuda), None), pool=pool)
        if entry is None:
            return False
        if not entry._events and len(entry.graph_ms) >= TIMED_REPLAYS:
            return True
        lane.replay(entry)
        del entry
    raise AssertionError("not judged")


def test_a_dropped_only_graph_gives_its_pool_back(cuda, monkeypatch):
    _timed(monkeypatch, eager_ms=10.0, graph_ms=9.8)  # GPU-bound
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    assert not _replayed_until_judged(lane, "k", cuda)
    s = cache.stats()["lanes"][LANE.label]
    assert s["dropped"] == 1 and s["graphs"] == []
    assert (s["pool_bytes"], s["pools_released"], s["released_bytes"]) == (0, 1, 1000)


def test_a_pool_that_keeps_a_graph_is_not_given_back(cuda, monkeypatch):
    spent = iter([10.0, 2.0, 2.0, 2.0, 10.0, 9.9, 9.9, 9.9])  # "a" pays, "b" does not

    def events():
        return FakeEvent(0.0), FakeEvent(next(spent))

    monkeypatch.setattr(_cuda_capture, "timing_events", events)
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    assert _replayed_until_judged(lane, "a", cuda)
    assert not _replayed_until_judged(lane, "b", cuda)
    s = cache.stats()["lanes"][LANE.label]
    assert s["graphs"] == ["a"] and s["pools_released"] == 0 and s["pool_bytes"] == 2000


def test_graphs_in_another_pool_do_not_hold_a_dropped_pool(cuda, monkeypatch):
    """The step graph lives in a pool of its own: dropping every bucket frees theirs."""
    _timed(monkeypatch, eager_ms=10.0, graph_ms=9.8)
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    step = lane.get_or_capture("step", lambda: (forward(cuda), None), pool="step", timed=False)
    assert step is not None
    assert not _replayed_until_judged(lane, "bucket", cuda)
    s = cache.stats()["lanes"][LANE.label]
    assert s["graphs"] == ["step"] and s["pools_released"] == 1 and s["pool_bytes"] == 1000


# --- policy AUTO judges the whole step (Note [A policy for the whole step]) ------------------
def test_a_key_is_captured_only_once_seen_capture_after_times(cuda):
    cache = GraphCache("stage", warmup=0, capture_after=3)
    lane = cache.lane(LANE)
    got = [lane.get_or_capture("k", lambda: (forward(cuda), None)) for _ in range(4)]
    assert [g is not None for g in got] == [False, False, True, True]
    assert lane.get_or_capture("j", lambda: (forward(cuda), None), ahead=True) is not None
    stats = cache.stats()
    assert stats["fallbacks"] == {} and stats["lanes"][LANE.label]["eager_runs"] == 2


def test_keys_are_predicted_gpu_bound_once_every_measured_graph_was(cuda, monkeypatch):
    _timed(monkeypatch, eager_ms=10.0, graph_ms=9.8)
    monkeypatch.setattr(lane_cache, "perf_counter", lambda: 0.0)  # captures repay at once
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    for key in range(policy.PREDICT_AFTER):
        assert not _replayed_until_judged(lane, key, cuda)
    assert lane.get_or_capture("new", lambda: pytest.fail("captured")) is None
    s = cache.stats()["lanes"][LANE.label]
    assert s["capture_attempts"] == policy.PREDICT_AFTER
    assert s["policy_choices"] == {"gpu-bound": 2, "predicted GPU-bound": 1}
    assert cache.stats()["fallbacks"] == {}


def test_the_capture_budget_stops_new_captures(cuda, monkeypatch):
    clock = iter(range(0, 1000, 5))  # every capture takes 5 s
    monkeypatch.setattr(lane_cache, "perf_counter", lambda: next(clock))
    cache = GraphCache("stage", warmup=0, capture_budget=9)
    lane = cache.lane(LANE)
    got = [lane.get_or_capture(key, lambda: (forward(cuda), None)) for key in "abc"]
    assert [g is not None for g in got] == [True, True, False]
    assert cache.stats()["lanes"][LANE.label]["policy_choices"] == {"capture budget": 1}


def test_the_policy_is_an_enum_and_its_strings_are_accepted():
    for value in ("auto", graph_cache.Policy.GRAPHS, "eager"):
        policy = GraphCache("stage", policy=value).policy
        assert isinstance(policy, graph_cache.Policy) and policy == value


def test_a_pool_held_elsewhere_is_given_back_once_let_go(cuda, monkeypatch):
    _timed(monkeypatch, eager_ms=10.0, graph_ms=9.8)
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    held = lane.get_or_capture("k", lambda: (forward(cuda), None))  # a program keeps it
    assert not _replayed_until_judged(lane, "k", cuda)
    s = cache.stats()["lanes"][LANE.label]
    assert (s["pool_bytes"], s["pools_released"]) == (1000, 0)
    del held
    s = cache.stats()["lanes"][LANE.label]
    assert (s["pool_bytes"], s["pools_released"]) == (0, 1)


def test_a_pool_is_given_back_only_while_no_capture_is_open(cuda, monkeypatch):
    """torch's allocator asserts that no capture is underway when it frees cached blocks:
    give_back waits for a capture open on another thread, and a capture that begins while
    a release runs waits for it (Note [Giving a pool back])."""
    from pydflash.graphs import pools

    events = []
    capturing, release_started, let_capture_end = (threading.Event() for _ in range(3))

    def fn():
        cuda.launch()
        if cuda.capturing:
            events.append("capture open")
            capturing.set()
            let_capture_end.wait(10)
            events.append("capture ends")
        return "out"

    def empty_cache():
        events.append("empty_cache")
        cuda.allocator.empty_cache()

    monkeypatch.setattr(_cuda_capture, "empty_cache", empty_cache)
    capture = threading.Thread(
        target=graphs.capture_graph, args=(fn, LANE), kwargs={"pool": (0, 1), "warmup": 0}
    )
    capture.start()
    assert capturing.wait(10)

    def release():
        release_started.set()
        pools.give_back([pools.Pool("p", (0, 2))], 0, cuda.allocator.pool_bytes)

    releaser = threading.Thread(target=release)
    releaser.start()
    assert release_started.wait(10)
    time.sleep(0.05)  # the release is waiting now, if it waits
    assert events == ["capture open"]
    let_capture_end.set()
    capture.join(10)
    releaser.join(10)
    assert events == ["capture open", "capture ends", "empty_cache"]


def test_a_key_is_captured_once_its_uses_would_repay_a_capture(cuda, monkeypatch):
    """Note [A policy for the whole step]: "a" is measured saving 6 ms a replay and its
    capture took 0.05 s, so "b" is captured at its 9th use (9 x 6 ms >= 50 ms), and runs
    eagerly, unpadded and without a warning, until then."""
    _timed(monkeypatch, eager_ms=10.0, graph_ms=4.0)
    clock = iter(x * 0.05 for x in range(1000))  # each capture takes 0.05 s
    monkeypatch.setattr(lane_cache, "perf_counter", lambda: next(clock))
    cache = GraphCache("stage", warmup=1)
    lane = cache.lane(LANE)
    assert _replayed_until_judged(lane, "a", cuda)
    got = [lane.get_or_capture("b", lambda: (forward(cuda), None)) for _ in range(9)]
    assert [g is not None for g in got] == [False] * 8 + [True]
    stats = cache.stats()
    assert stats["fallbacks"] == {} and stats["lanes"][LANE.label]["eager_runs"] == 8
    assert "repays a 0.05 s capture only after 9 uses" in repr(
        lane._not_worth_it("c", 1, "graphs", False, "c", True)
    )
