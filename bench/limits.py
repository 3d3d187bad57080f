"""What a stage costs against its physical limits: GPU-busy time from the profiler, host
CPU time of the process's threads, and MFU from a FLOP count. Wall time alone hides a
host-bound stage: a step that takes 50 ms of wall time on 20 ms of kernels is bound by
its Python, not by the GPU.

    cost = measure(step, reps=5)           # runs step() 5 times (after one warm-up)
    cost.wall_ms, cost.gpu_busy_ms, cost.host_ms

GPU-busy time is the union of the intervals in which any kernel, copy or memset ran on
a device, per device, from the profiler's device activity (kineto/CUPTI): kernels that
overlap on two streams count once. Host time is the CPU time of every
thread of the process (Linux /proc), idle lane workers' polling included, so it is an
upper bound on what the stage's Python cost. Without a GPU, gpu_busy_ms is None. A
profiled window leaves no cost on later ones (Note [No profiler left behind]).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Note [No profiler left behind]: once a profiled window ends, Kineto keeps CUPTI's
# callbacks on every CUDA call of the process unless told to tear CUPTI down. Every
# unprofiled figure measured after the first profiled one then carries that cost: on the
# H200 (2026-12-01), the launch-bound pipeline's lane workers went from 0.6 and 1.0 ms to
# 2.2 ms of CPU per step after one profiled window, and not with teardown. Kineto reads
# TEARDOWN_CUPTI when each trace stops, and re-initializes CUPTI lazily for the next one.
# Every profile of the bench starts in profile(), which sets it first; a user's own
# setting wins.


def cupti_teardown_safe(cuda: str | None) -> bool:
    """Whether Kineto may tear CUPTI down after each profile of a process that replays
    CUDA graphs: from CUDA 12.6 on. Before it, re-initializing CUPTI after a teardown
    crashed with graphs, and torch's profiler turns teardown off there itself."""
    try:
        major, minor = (int(part) for part in (cuda or "").split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (12, 6)


def profile(activities: list[Any]) -> torch.profiler.profile:
    """torch.profiler.profile(activities=activities), leaving no cost behind on the
    process's later CUDA calls (Note [No profiler left behind])."""
    if cupti_teardown_safe(torch.version.cuda):
        os.environ.setdefault("TEARDOWN_CUPTI", "1")
    # One cycle per profile: acc_events=True keeps torch (2.11 on) from warning that a
    # profiler object prepared again "clears events at the end of each cycle".
    return torch.profiler.profile(activities=activities, acc_events=True)


# A device's dense bf16 matrix rate, FLOP/s, by the name torch reports; the MFU
# denominator. H100/H200 SXM: 989 TFLOP/s dense bf16 (NVIDIA's datasheet).
PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}
# Dense FP8 (e4m3) tensor-core peaks, NVIDIA's H100/H200 SXM datasheets: twice bf16's.
PEAK_FP8_FLOPS = {"NVIDIA H200": 1979e12, "NVIDIA H100 80GB HBM3": 1979e12}


@dataclass
class Cost:
    wall_ms: float  # per call
    gpu_busy_ms: float | None  # per call, summed over devices; None without a GPU
    host_ms: float  # per call: CPU time of all the process's threads
    busy_by_device: dict[int, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_ms": self.wall_ms,
            "gpu_busy_ms": self.gpu_busy_ms,
            "host_ms": self.host_ms,
            "busy_by_device_ms": self.busy_by_device,
        }


def thread_cpu_seconds() -> float:
    """User + system CPU seconds of every live thread of this process."""
    by_name = thread_cpu_by_name()
    return time.process_time() if by_name is None else sum(by_name.values())


def thread_cpu_by_name() -> dict[str, float] | None:
    """CPU seconds of the process's live threads, summed by thread name ("main" for the
    main thread; pydflash's lane workers are "pydflash-laneN"); None where /proc is
    missing (not Linux). Each thread's time on a CPU in ns from /proc/.../schedstat, or
    where the kernel keeps no schedstat, user + system time in clock ticks (10 ms)."""
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except FileNotFoundError:
        return None
    out: dict[str, float] = {}
    main = str(os.getpid())
    for tid in tids:
        task = f"/proc/self/task/{tid}"
        try:
            with open(f"{task}/stat") as f:
                head, fields = f.read().rsplit(")", 1)
            try:
                with open(f"{task}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                fields = fields.split()
                seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except OSError:  # the thread ended meanwhile
            continue
        name = "main" if tid == main else head.split("(", 1)[1]
        out[name] = out.get(name, 0.0) + seconds
    return out


def calling_thread_name() -> str:
    """The calling thread's name as thread_cpu_by_name() keys it."""
    tid = threading.get_native_id()
    if tid == os.getpid():
        return "main"
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def cpu_ms_by_name(before: dict[str, float] | None, after: dict[str, float] | None, calls: int):
    """Per call, ms of CPU time by thread name between two thread_cpu_by_name() readings
    (threads that did not run left out); None without /proc."""
    if before is None or after is None:
        return None
    spent = {k: (v - before.get(k, 0.0)) * 1e3 / calls for k, v in after.items()}
    return {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 0}


def measure(fn: Callable[[], Any], *, reps: int, warmup: int = 1, sync: bool = True) -> Cost:
    """Wall, GPU-busy and host CPU time per call of fn(), over `reps` calls after `warmup`.
    fn must leave no GPU work running past a synchronize (sync=True synchronizes every
    device after each call so the wall time covers the GPU work)."""
    gpu = torch.cuda.is_available()

    def call() -> None:
        fn()
        if gpu and sync:
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)

    for _ in range(warmup):
        call()
    if not gpu:
        cpu0, t0 = thread_cpu_seconds(), time.perf_counter()
        for _ in range(reps):
            call()
        wall, cpu = time.perf_counter() - t0, thread_cpu_seconds() - cpu0
        return Cost(wall * 1e3 / reps, None, cpu * 1e3 / reps, {})
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with profile(activities) as prof:
        cpu0, t0 = thread_cpu_seconds(), time.perf_counter()
        for _ in range(reps):
            call()
        wall, cpu = time.perf_counter() - t0, thread_cpu_seconds() - cpu0
    busy = {d: ns / 1e6 / reps for d, ns in device_busy_ns(prof).items()}
    return Cost(wall * 1e3 / reps, sum(busy.values()), cpu * 1e3 / reps, busy)


def device_busy_ns(prof: Any) -> dict[int, int]:
    """Per device, the length of the union of its activity intervals in a profile."""
    intervals: dict[int, list[tuple[int, int]]] = {}
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        start = event.start_ns()
        intervals.setdefault(event.device_index(), []).append((start, start + event.duration_ns()))
    return {device: union_length(spans) for device, spans in intervals.items()}


def union_length(spans: list[tuple[int, int]]) -> int:
    """Total length covered by a set of [start, end) intervals."""
    total, end = 0, None
    for lo, hi in sorted(spans):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def peak_flops(device: int = 0, dtype: str = "bf16") -> float | None:
    """The device's dense bf16 (or "fp8") peak in FLOP/s, or None for a device not in the
    table."""
    if not torch.cuda.is_available():
        return None
    table = {"bf16": PEAK_BF16_FLOPS, "fp8": PEAK_FP8_FLOPS}[dtype]
    return table.get(torch.cuda.get_device_name(device))


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call of fn(), counted by torch.utils.flop_counter (matmuls, convolutions
    and attention; elementwise work is not counted, as MFU conventions do). Attention with
    fewer key/value heads than query heads (grouped-query attention, as Qwen3's) counts as
    its query heads: torch 2.11's formulas refuse those shapes, and its CPU kernel has none."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_attention_formulas()) as counter:
        fn()
    return counter.get_total_flops()


def _attention_formulas() -> dict[Any, Callable[..., int]]:
    from torch.utils import flop_counter

    def as_query_heads(query: Any, shape: Any) -> tuple:
        return (shape[0], query[1], *shape[2:])  # each KV head serves its group of queries

    def forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        kv = as_query_heads(query, key), as_query_heads(query, value)
        return flop_counter.sdpa_flop_count(query, *kv)

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        kv = as_query_heads(query, key), as_query_heads(query, value)
        return flop_counter.sdpa_backward_flop_count(grad, query, *kv)

    aten = torch.ops.aten
    kernels = ("efficient_attention", "flash_attention", "cudnn_attention")
    kernels += ("flash_attention_for_cpu",)
    formulas = {}
    for kernel in kernels:
        for suffix, formula in (("", forward), ("_backward", backward)):
            op = getattr(aten, f"_scaled_dot_product_{kernel}{suffix}", None)
            if op is not None:
                formulas[op] = formula
    return formulas
