"""pydflash.graphs: argument checks, errors and the choice between a native launch and
a replay() fallback on any machine; capture and native launches on a GPU."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

import pytest
import torch

import pydflash
from pydflash import GraphCaptureError
from pydflash.graphs import lane_graph as graphs
from pydflash.lanes import graph_exec

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or pydflash._C.device_count() == 0,
    reason="needs a CUDA device visible to both torch and pydflash (CUDA graphs run on GPUs)",
)


# --- stand-ins that let the graph logic run on CPU lanes ---------------------------------


class FakeGraph:
    """Behaves like a captured graph: replay() writes fn(static input) to the static
    output. `raw` is what raw_cuda_graph_exec returns (an int, or an exception)."""

    def __init__(self, fn=None, static_in=None, static_out=None, raw=1234):
        self.fn, self.static_in, self.static_out, self.raw = fn, static_in, static_out, raw
        self.replay_threads: list[int] = []

    def replay(self):
        self.replay_threads.append(threading.get_ident())
        self.static_out.copy_(self.fn(self.static_in))

    def raw_cuda_graph_exec(self):
        if isinstance(self.raw, Exception):
            raise self.raw
        return self.raw


class FakeGraphWithoutRawHandle(FakeGraph):
    raw_cuda_graph_exec = None  # what an older torch looks like


class FakeGpuLane:
    """A GPU lane as graphs.py sees it, running its tasks on a real CPU lane. A native
    launch is emulated by a replay() task, so ordering and futures are the lane's own."""

    def __init__(self, lane, device_index=0):
        self.lane, self.device_index = lane, device_index
        self.device = f"cuda:{device_index}"
        self.is_gpu = True
        self.native_launches = 0

    def submit(self, fn, /, *args, **kwargs):
        return self.lane.submit(fn, *args, **kwargs)

    def submit_graph(self, graph):
        handle, keepalive = graph_exec.graph_exec_handle(graph, self)
        assert handle == 1234 and keepalive is graph
        self.native_launches += 1
        torch_graph = graph.graph if isinstance(graph, graphs.CapturedGraph) else graph
        future = self.lane.submit(torch_graph.replay)
        # Done before it is returned: like a native launch's, the future's result is
        # then only what the submitter attaches.
        future.exception()
        return future

    def __repr__(self):
        return f"<FakeGpuLane on {self.device}>"


@pytest.fixture
def fake_graph_type(monkeypatch):
    monkeypatch.setattr(graph_exec, "_torch_graph_type", lambda: FakeGraph)


@pytest.fixture
def cpu_lane():
    dispatcher = pydflash.Dispatcher(["cpu"])
    yield dispatcher.lanes[0]
    dispatcher.shutdown()


def double_plus_one(x):
    return x * 2 + 1


def run_in_threads(count, body):
    """body(k) on `count` threads at once; returns when all have finished."""
    workers = [threading.Thread(target=body, args=(k,)) for k in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def make_captured(lane, native=True, shape=(4, 3)):
    static_in = torch.zeros(shape)
    static_out = torch.zeros(shape)
    kind = FakeGraph if native else FakeGraphWithoutRawHandle
    graph = kind(double_plus_one, static_in, static_out)
    return graphs.CapturedGraph(lane, graph, (static_in,), static_out)


# --- graph_exec_handle ------------------------------------------------------------------


@pytest.mark.parametrize("not_a_graph", [object(), None, "graph", 7])
def test_graph_exec_handle_rejects_what_is_not_a_graph(cpu_lane, not_a_graph):
    expected = r"expected a torch\.cuda\.CUDAGraph or a .*CapturedGraph, got"
    with pytest.raises(TypeError, match=expected):
        graph_exec.graph_exec_handle(not_a_graph, cpu_lane)


def test_submit_graph_on_a_cpu_lane_is_a_value_error(cpu_lane, fake_graph_type):
    with pytest.raises(ValueError, match=r"expected a GPU lane .* a CPU lane"):
        cpu_lane.submit_graph(FakeGraph())
    with pytest.raises(ValueError, match="a CPU lane"):
        graphs.submit(cpu_lane, FakeGraph())


def test_graph_of_another_device_is_refused(cpu_lane, fake_graph_type):
    captured = make_captured(FakeGpuLane(cpu_lane, device_index=0))
    other = FakeGpuLane(cpu_lane, device_index=1)
    for graph in (captured, captured.graph):  # the torch graph remembers its device too
        with pytest.raises(ValueError, match=r"expected a lane on cuda:0, .* on cuda:1"):
            graph_exec.graph_exec_handle(graph, other)
        with pytest.raises(ValueError, match="cuda:0"):
            graphs.submit(other, graph)


def test_graph_without_a_raw_handle_names_the_fallback(cpu_lane, monkeypatch):
    monkeypatch.setattr(graph_exec, "_torch_graph_type", lambda: FakeGraphWithoutRawHandle)
    with pytest.raises(GraphCaptureError, match=r"raw_cuda_graph_exec.*graph\.replay\(\)"):
        graph_exec.graph_exec_handle(FakeGraphWithoutRawHandle(), FakeGpuLane(cpu_lane))


@pytest.mark.parametrize("raw", [RuntimeError("instantiate() has not been called"), 0])
def test_graph_without_an_executable_is_a_capture_error(cpu_lane, fake_graph_type, raw):
    with pytest.raises(GraphCaptureError, match="expected a captured"):
        graph_exec.graph_exec_handle(FakeGraph(raw=raw), FakeGpuLane(cpu_lane))


def test_graph_exec_handle_keeps_the_object_submitted_alive(cpu_lane, fake_graph_type):
    lane = FakeGpuLane(cpu_lane)
    graph = FakeGraph()
    assert graph_exec.graph_exec_handle(graph, lane) == (1234, graph)
    captured = make_captured(lane)
    handle, keepalive = graph_exec.graph_exec_handle(captured, lane)
    assert handle == 1234 and keepalive is captured


def test_submit_launches_natively_when_it_can_and_replays_otherwise(cpu_lane, fake_graph_type):
    lane = FakeGpuLane(cpu_lane)
    worker = cpu_lane.submit(threading.get_ident).result()
    native = make_captured(lane, native=True)
    graphs.submit(lane, native).result()
    assert lane.native_launches == 1

    fallback = make_captured(lane, native=False)
    assert not fallback.native and native.native
    graphs.submit(lane, fallback.graph).result()
    assert lane.native_launches == 1
    assert fallback.graph.replay_threads == [worker]  # replay() ran as a task on the lane


# --- CapturedGraph.run ------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "replay"])
def test_run_copies_in_replays_and_returns_the_static_outputs(cpu_lane, fake_graph_type, native):
    captured = make_captured(FakeGpuLane(cpu_lane), native=native)
    x = torch.arange(12.0).reshape(4, 3)
    out = captured.run(x).result()
    assert out is captured.static_outputs
    assert torch.equal(out, x * 2 + 1)
    # No inputs: replays on what the static inputs hold.
    captured.static_inputs[0].fill_(5)
    assert torch.equal(captured.run().result(), torch.full((4, 3), 11.0))


@pytest.mark.parametrize("native", [True, False], ids=["native", "replay"])
def test_clone_outlives_the_next_run(cpu_lane, fake_graph_type, native):
    captured = make_captured(FakeGpuLane(cpu_lane), native=native)
    first = captured.run(torch.ones(4, 3), clone=True).result()
    captured.run(torch.zeros(4, 3)).result()
    assert first is not captured.static_outputs
    assert torch.equal(first, torch.full((4, 3), 3.0))
    assert torch.equal(captured.static_outputs, torch.ones(4, 3))


@pytest.mark.parametrize("native", [True, False], ids=["native", "replay"])
def test_concurrent_runs_each_see_their_own_inputs(cpu_lane, fake_graph_type, native):
    # Copy-in, launch and clone of one run must stay adjacent in the lane's queue.
    captured = make_captured(FakeGpuLane(cpu_lane), native=native)
    threads, iterations = 4, 150
    barrier = threading.Barrier(threads)
    wrong: list[tuple[int, int]] = []

    def caller(k):
        x = torch.full((4, 3), float(k))
        barrier.wait()
        for i in range(iterations):
            out = captured.run(x, clone=True).result()
            if not torch.equal(out, x * 2 + 1):
                wrong.append((k, i))

    run_in_threads(threads, caller)
    assert wrong == []


@pytest.mark.parametrize("clone", [False, True])
def test_a_failed_copy_in_fails_the_run(cpu_lane, fake_graph_type, clone):
    captured = make_captured(FakeGpuLane(cpu_lane), native=True)
    unreadable = torch.empty(4, 3, device="meta")  # right shape and dtype; copying fails
    future = captured.run(unreadable, clone=clone)
    with pytest.raises(NotImplementedError, match="meta"):
        future.result()
    # The lane goes on: the next run is right.
    assert torch.equal(captured.run(torch.ones(4, 3)).result(), torch.full((4, 3), 3.0))


def test_run_checks_inputs_against_the_capture(cpu_lane, fake_graph_type):
    captured = make_captured(FakeGpuLane(cpu_lane))
    with pytest.raises(
        ValueError,
        match=r"expected input 0 of shape \(4, 3\) and dtype "
        r"torch\.float32.*got shape \(5, 3\)",
    ):
        captured.run(torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"got shape \(4, 3\) and dtype torch\.float64"):
        captured.run(torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected 1 inputs .* got 2"):
        captured.run(torch.zeros(4, 3), torch.zeros(4, 3))
    with pytest.raises(TypeError, match="expected input 0 as a tensor, got list"):
        captured.run([[0.0] * 3] * 4)


# --- capture ----------------------------------------------------------------------------


def test_capture_on_a_cpu_lane_is_impossible(cpu_lane):
    with pytest.raises(GraphCaptureError, match=r"capture needs a GPU lane.* a CPU lane"):
        graphs.capture(double_plus_one, torch.zeros(2), cpu_lane)


@pytest.mark.parametrize(
    ("fn", "inputs", "warmup", "error", "match"),
    [
        (42, (torch.zeros(2),), 3, TypeError, "expected a callable to capture, got int"),
        (
            double_plus_one,
            {"x": 1},
            3,
            TypeError,
            "expected example_inputs as a tensor or a sequence of tensors, got dict",
        ),
        (
            double_plus_one,
            (torch.zeros(2), 3.0),
            3,
            TypeError,
            "expected example input 1 as a tensor, got float",
        ),
        (double_plus_one, (torch.zeros(2),), -1, ValueError, "expected warmup >= 0, got -1"),
        (double_plus_one, (torch.zeros(2),), True, TypeError, "expected warmup to be an int"),
    ],
)
def test_capture_argument_errors(cpu_lane, fn, inputs, warmup, error, match):
    with pytest.raises(error, match=match):
        graphs.capture(fn, inputs, cpu_lane, warmup=warmup)


def test_capture_from_a_task_on_the_same_lane_is_refused(cpu_lane):
    lane = FakeGpuLane(cpu_lane)
    graphs._worker_threads[lane] = cpu_lane.submit(threading.get_ident).result()
    future = cpu_lane.submit(graphs.capture, double_plus_one, torch.zeros(2), lane)
    with pytest.raises(GraphCaptureError, match="would wait for itself"):
        future.result(timeout=60)


# --- on a GPU ---------------------------------------------------------------------------


@pytest.fixture
def gpu_lane():
    dispatcher = pydflash.Dispatcher([0])
    yield dispatcher.lanes[0]
    dispatcher.shutdown()


def small_model(width=32, depth=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda().requires_grad_(False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("native", [True, False], ids=["native", "replay"])
def test_gpu_captured_forward_matches_eager(gpu_lane, monkeypatch, native):
    if not native:
        monkeypatch.setattr(graphs, "native_launch_supported", lambda graph: False)
    model = small_model()
    captured = graphs.capture(model, torch.randn(8, 32, device="cuda"), gpu_lane)
    assert captured.native is native
    for _ in range(20):
        x = torch.randn(8, 32, device="cuda")
        out = captured.run(x, clone=True).wait_stream()
        torch.testing.assert_close(out, model(x))


@pytest.mark.gpu
@needs_gpu
def test_gpu_future_completes_when_the_gpu_is_done(gpu_lane):
    from pydflash import _C

    def slow(x):
        _C.busy_wait(torch.cuda.current_stream().cuda_stream, 100_000_000)  # 100 ms
        return x + 1

    captured = graphs.capture(slow, torch.zeros(4, device="cuda"), gpu_lane, warmup=1)
    assert captured.native
    for future in (gpu_lane.submit_graph(captured), captured.run(torch.ones(4, device="cuda"))):
        future.result()
        # The event recorded after the launch has been reached: the GPU ran the graph.
        assert _C.query_event(future.event)
    assert future.result() is captured.static_outputs
    assert torch.equal(captured.static_outputs, torch.full((4,), 2.0, device="cuda"))


@pytest.mark.gpu
@needs_gpu
def test_gpu_copy_in_waits_for_the_stream_that_produces_the_input(gpu_lane):
    from pydflash import _C

    captured = graphs.capture(double_plus_one, torch.zeros(1024, device="cuda"), gpu_lane)
    producer = torch.cuda.Stream()
    for value in range(3):
        with torch.cuda.stream(producer):
            _C.busy_wait(producer.cuda_stream, 50_000_000)  # the input is late
            x = torch.full((1024,), float(value), device="cuda")
            out = captured.run(x, clone=True).wait_stream(producer)
        producer.synchronize()
        assert torch.equal(out, torch.full((1024,), 2.0 * value + 1, device="cuda"))


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_stays_alive_until_the_gpu_is_done(gpu_lane):
    from pydflash import _C

    def slow(x):
        # Long enough to outlast gc.collect() over torch's heap.
        _C.busy_wait(torch.cuda.current_stream().cuda_stream, 2_000_000_000)
        return x * 3

    captured = graphs.capture(slow, torch.ones(1024, device="cuda"), gpu_lane, warmup=0)
    alive = weakref.ref(captured)
    out = captured.static_outputs
    future = gpu_lane.submit_graph(captured)
    del captured
    gc.collect()
    assert not future.done(), "the graph finished before the check: spin longer"
    assert alive() is not None  # the lane holds it while the graph runs
    future.result()
    assert torch.equal(out, torch.full((1024,), 3.0, device="cuda"))
    del future
    deadline = time.monotonic() + 30  # the release is posted to the worker after completion
    while alive() is not None and time.monotonic() < deadline:
        gpu_lane.submit(gc.collect).result()
    assert alive() is None


@pytest.mark.gpu
@needs_gpu
def test_gpu_torch_graph_captured_in_a_task_launches_natively(gpu_lane):
    static = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()

    def capture_here():
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        static.add_(1)
        graph.capture_end()
        return graph

    graph = gpu_lane.submit(capture_here).result()
    for _ in range(5):
        gpu_lane.submit_graph(graph).result()
    assert torch.equal(static.cpu(), torch.full((16,), 5.0))


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_that_faults_fails_its_future_with_a_cuda_error(run_child_script):
    done = run_child_script("graph_that_faults.py", timeout=120)
    kind, _, message = done.stdout.strip().splitlines()[-1].partition("|")
    assert (kind, done.returncode) == ("CudaError", 0), done.stdout + done.stderr
    assert "lane 0 (cuda:0)" in message and "assert" in message, message


@pytest.mark.gpu
@needs_gpu
def test_gpu_uncaptured_graph_is_a_capture_error(gpu_lane):
    with pytest.raises(GraphCaptureError, match="expected a captured"):
        gpu_lane.submit_graph(torch.cuda.CUDAGraph())


@pytest.mark.gpu
@needs_gpu
def test_gpu_capture_failure_leaves_the_lane_usable(gpu_lane):
    def syncs(x):
        return x * float(x.sum().item())  # a host sync cannot be captured

    with pytest.raises(GraphCaptureError, match="capturing"):
        graphs.capture(syncs, torch.ones(4, device="cuda"), gpu_lane, warmup=0)
    y = gpu_lane.submit(torch.ones, 4, device="cuda").result()
    assert y.sum().item() == 4


@pytest.mark.gpu
@needs_gpu
def test_gpu_an_empty_graph_is_caught_by_the_gpu_tests(gpu_lane, no_empty_cuda_graph):
    """tests/conftest.py fails a GPU test on torch's "The CUDA Graph is empty" warning,
    also where a cleanup swallows it: here one is made on purpose, and taken back out."""

    def empty_capture():
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        with contextlib.suppress(Exception):  # as a cleanup would
            graph.capture_end()

    gpu_lane.submit(empty_capture).result()
    assert len(no_empty_cuda_graph) == 1
    no_empty_cuda_graph.clear()


@pytest.mark.gpu
@needs_gpu
def test_gpu_a_step_refused_before_its_first_kernel_leaves_no_empty_graph(gpu_lane):
    """Issue 31: torch's capture check refuses an optimizer step whose group says
    capturable=False before the step launches anything, and ending that capture warned
    "The CUDA Graph is empty" (Note [No empty graph]); the fixture fails on it."""
    weight = torch.nn.Parameter(torch.ones(4, device="cuda"))
    weight.grad = torch.ones(4, device="cuda")
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)  # capturable=False
    optimizer.step()

    def capture():
        pool = torch.cuda.graph_pool_handle()
        return graphs.capture_graph(optimizer.step, gpu_lane, pool=pool, warmup=0)

    with pytest.raises(graphs.CaptureFailed, match="capturable is False"):
        gpu_lane.submit(capture).result()
    assert gpu_lane.submit(torch.ones, 4, device="cuda").result().sum().item() == 4


@pytest.mark.gpu
@needs_gpu
def test_gpu_capture_from_its_own_lane_is_refused(gpu_lane):
    future = gpu_lane.submit(
        graphs.capture, small_model(), torch.zeros(8, 32, device="cuda"), gpu_lane
    )
    with pytest.raises(GraphCaptureError, match="would wait for itself"):
        future.result(timeout=60)


@pytest.mark.gpu
@needs_gpu
def test_gpu_concurrent_runs_with_clone(gpu_lane):
    model = small_model()
    captured = graphs.capture(model, torch.zeros(8, 32, device="cuda"), gpu_lane)
    threads, iterations = 4, 50
    barrier = threading.Barrier(threads)
    inputs = [torch.randn(8, 32, device="cuda") for _ in range(threads)]
    expected = [model(x) for x in inputs]
    torch.cuda.synchronize()
    wrong = []

    def caller(k):
        barrier.wait()
        for i in range(iterations):
            out = captured.run(inputs[k], clone=True).wait_stream()
            if not torch.allclose(out, expected[k]):
                wrong.append((k, i))

    run_in_threads(threads, caller)
    assert wrong == []


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (a graph on one, a lane on the other)",
)
def test_gpu_graph_on_another_devices_lane_is_refused():
    dispatcher = pydflash.Dispatcher([0, 1])
    try:
        captured = graphs.capture(
            small_model(), torch.zeros(8, 32, device="cuda:0"), dispatcher.on(0)
        )
        with pytest.raises(ValueError, match="expected a lane on cuda:0"):
            dispatcher.on(1).submit_graph(captured)
    finally:
        dispatcher.shutdown()
