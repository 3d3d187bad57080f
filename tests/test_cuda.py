"""GPU lanes: streams, events, cross-stream handoff and the caching allocator."""

import os
import threading
import time

import pytest

import pydflash

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SPIN_NS = 50_000_000  # 50 ms of GPU work from the busy-wait kernel


@pytest.fixture
def two_lanes():
    d = pydflash.Dispatcher([0, 0], guard=())
    for lane in d.lanes:
        lane.submit(load_kernels).result()
    yield d.lanes
    d.shutdown()


def load_kernels():
    # CUDA loads kernels lazily, and loading one can wait for the whole device: a first
    # fill queued behind a busy lane would block the host for the other lane's spin.
    pydflash._C.busy_wait(torch.cuda.current_stream().cuda_stream, 1000)
    x = torch.full((1 << 20,), 1.0, device="cuda")
    (x * 2).sum().item()


def test_default_is_one_lane_per_gpu():
    with pydflash.Dispatcher(guard=()) as d:
        assert [lane.device for lane in d.lanes] == [
            f"cuda:{i}" for i in range(torch.cuda.device_count())
        ]


def test_task_runs_on_the_lane_stream_and_device(two_lanes):
    for lane in two_lanes:
        stream, device = lane.submit(
            lambda: (torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())
        ).result()
        assert stream == lane.stream_ptr != 0
        assert device == lane.device_index
    assert two_lanes[0].stream_ptr != two_lanes[1].stream_ptr
    assert two_lanes[0].copy_stream_ptr not in (0, two_lanes[0].stream_ptr)


def test_task_that_switches_streams_does_not_leak_it(two_lanes):
    lane = two_lanes[0]
    lane.submit(lambda: torch.cuda.set_stream(torch.cuda.Stream())).result()
    assert lane.submit(lambda: torch.cuda.current_stream().cuda_stream).result() == lane.stream_ptr


def test_result_carries_an_event_that_completes_with_the_gpu_work(two_lanes):
    lane = two_lanes[0]

    def spin():
        pydflash._C.busy_wait(lane.stream_ptr, SPIN_NS)
        return "queued"

    f = lane.submit(spin)
    assert f.result() == "queued" and f.event != 0
    assert not pydflash._C.query_event(f.event)  # the host did not wait for the GPU
    torch.cuda.synchronize()
    assert pydflash._C.query_event(f.event)


def test_a_tensor_result_gets_its_event_when_the_task_ends(two_lanes):
    # Note [Deferred result events]: only results that cannot hold a tensor wait for
    # their event to be asked for. A tensor's event is recorded at the task's end, so
    # work the lane queues afterwards does not delay a consumer.
    lane = two_lanes[0]

    def produce():
        pydflash._C.busy_wait(lane.stream_ptr, SPIN_NS)
        return torch.ones(4, device="cuda")

    start = time.perf_counter()
    f = lane.submit(produce)
    later = lane.submit(pydflash._C.busy_wait, lane.stream_ptr, 4 * SPIN_NS)
    later.result()
    event = f.event  # read after the later spin is queued
    while not pydflash._C.query_event(event):
        time.sleep(0.001)
    waited = time.perf_counter() - start
    assert waited < 3 * SPIN_NS / 1e9, f"the event waited {waited:.3f} s: it covers later work"
    torch.cuda.synchronize()


def test_cross_stream_handoff_without_a_host_sync(two_lanes):
    producer, consumer = two_lanes

    def produce():
        pydflash._C.busy_wait(producer.stream_ptr, SPIN_NS)  # the fill waits behind this
        return torch.full((1 << 20,), 3.0, device="cuda")

    f = producer.submit(produce)
    start = time.perf_counter()
    out = consumer.submit(lambda: f.wait_stream() * 2).result()
    host_s = time.perf_counter() - start
    assert host_s < SPIN_NS / 1e9 / 2, "the handoff blocked the host on the GPU"
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((1 << 20,), 6.0, device="cuda"))


def test_handed_over_memory_is_not_reused_early(two_lanes):
    # The producer drops its reference at once and allocates more on its own stream;
    # without record_stream the consumer's (delayed) read could see the new data.
    producer, consumer = two_lanes
    n = 1 << 22
    for _ in range(5):
        handed = [producer.submit(lambda: torch.full((n,), 7.0, device="cuda"))]

        def consume(handed=handed):
            x = handed.pop().wait_stream()  # from here on only x holds the tensor
            pydflash._C.busy_wait(consumer.stream_ptr, 20_000_000)  # read happens later
            return x.sum()

        total = consumer.submit(consume)
        overwrite = producer.submit(lambda: [torch.zeros(n, device="cuda") for _ in range(4)])
        overwrite.result()
        assert total.wait_stream().item() == 7.0 * n  # ordered after the consumer's sum


def test_many_lanes_overlap_on_one_gpu():
    with pydflash.Dispatcher([0] * 4, guard=()) as d:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fs = [lane.submit(pydflash._C.busy_wait, lane.stream_ptr, SPIN_NS) for lane in d.lanes]
        for f in fs:
            f.result()
        for lane in d.lanes:
            pydflash._C.synchronize_stream(lane.stream_ptr)
        elapsed = time.perf_counter() - start
    assert elapsed < 4 * SPIN_NS / 1e9 * 0.75, f"4 lanes took {elapsed:.3f} s: no overlap"


def test_errors_from_cuda_name_the_lane(two_lanes):
    def bad():
        torch.empty(1 << 50, device="cuda")  # out of memory

    f = two_lanes[1].submit(bad)
    with pytest.raises(torch.OutOfMemoryError) as info:
        f.result()
    assert "raised in pydflash lane 1 (cuda:0)" in info.value.__notes__
    assert two_lanes[1].submit(lambda: torch.ones(1, device="cuda").item()).result() == 1.0


def _thread_cpu_s(tid: int) -> float:
    """CPU seconds thread `tid` of this process has run, from /proc (Linux)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")
def test_a_lane_whose_gpu_is_still_busy_sleeps_instead_of_polling():
    # Note [Adaptive polling]: tasks come every 0.2 ms, inside the poll window (1 ms),
    # so a polling worker would stay on a core the whole time. Each queues 1 ms of GPU
    # work, so the stream always has a backlog, and the worker sleeps at once instead;
    # a task that waits for another lane's future sleeps at once there too.
    with pydflash.Dispatcher([0, 0], guard=(), spin_us=1000) as d:
        lane, other = d.lanes
        for x in d.lanes:
            x.submit(load_kernels).result()
        worker = lane.submit(threading.get_native_id).result()
        pydflash._C.busy_wait(lane.stream_ptr, 1_000_000)  # the backlog from the start
        before, t0 = _thread_cpu_s(worker), time.perf_counter()
        for _ in range(200):
            lane.submit(pydflash._C.busy_wait, lane.stream_ptr, 1_000_000)
            time.sleep(0.0002)
        waited = lane.submit(lambda: other.submit(time.sleep, 0.05).result())
        waited.result()
        cpu, wall = _thread_cpu_s(worker) - before, time.perf_counter() - t0
        torch.cuda.synchronize()
    assert cpu < 0.3 * wall, f"the worker ran {cpu * 1e3:.1f} ms of {wall * 1e3:.1f} ms"
