"""Section 2, overlap: GPU work of known length on 1..N lanes of one GPU.

Each lane queues KERNELS busy-wait kernels (one thread block each, so N lanes can
share the GPU without competing for SMs). With perfect overlap, N lanes take as long as
one: the fraction of ideal is T(1 lane) / T(N lanes), 1.0 at best, 1/N when the
streams run one after another. The alternative is ThreadPoolExecutor(N) with one torch
stream per thread, launching the same kernels.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from .common import Context, Row, compare, interleaved_medians, not_run

SECTION = "overlap"
KERNELS = 4  # per lane per sample
TARGET_LANES = 4
TARGET = "value >= 0.95"
BASELINE = "ThreadPoolExecutor + torch streams"


def lane_counts(quick: bool) -> list[int]:
    return [1, 2, 4] if quick else [1, 2, 4, 8]


def run(ctx: Context) -> list[Row]:
    counts = lane_counts(ctx.quick)
    if not ctx.gpus:
        return [
            not_run(
                SECTION,
                f"busy-wait on {n} lanes of one GPU",
                "needs a GPU",
                TARGET if n == TARGET_LANES else None,
            )
            for n in counts
            if n > 1
        ]
    import torch

    import pydflash
    from pydflash import _C

    kernel_ns = 1_000_000 if ctx.quick else 2_000_000
    reps = ctx.reps(20, 6)

    def with_lanes(lanes: list[pydflash.Lane]) -> Callable[[], None]:
        def run_once() -> None:
            futures = [
                lane.submit(_C.busy_wait, lane.stream_ptr, kernel_ns)
                for _ in range(KERNELS)
                for lane in lanes
            ]
            for future in futures:
                future.result()
            for lane in lanes:
                _C.synchronize_stream(lane.stream_ptr)

        return run_once

    def with_threads(
        pool: concurrent.futures.Executor, streams: list[torch.cuda.Stream]
    ) -> Callable[[], None]:
        def run_once() -> None:
            futures = [
                pool.submit(_C.busy_wait, stream.cuda_stream, kernel_ns)
                for _ in range(KERNELS)
                for stream in streams
            ]
            for future in futures:
                future.result()
            torch.cuda.synchronize(0)

        return run_once

    times: dict[int, dict[str, float]] = {}
    for n in counts:
        ctx.progress(f"busy-wait on {n} lanes, {reps} samples of {KERNELS} kernels per lane")
        dispatcher = pydflash.Dispatcher([0] * n)
        pool = concurrent.futures.ThreadPoolExecutor(n)
        streams = [torch.cuda.Stream(device=0) for _ in range(n)]
        try:
            times[n] = interleaved_medians(
                {"lanes": with_lanes(dispatcher.lanes), "threads": with_threads(pool, streams)},
                reps,
            )
        finally:
            dispatcher.shutdown()
            pool.shutdown()
    ideal_ms = KERNELS * kernel_ns / 1e6
    rows = []
    for n in counts[1:]:
        lanes = times[1]["lanes"] / times[n]["lanes"]
        threads = times[1]["threads"] / times[n]["threads"]
        rows.append(
            compare(
                SECTION,
                f"busy-wait on {n} lanes of one GPU",
                lanes,
                "fraction",
                BASELINE,
                threads,
                TARGET if n == TARGET_LANES else None,
                "fraction of ideal overlap: T(1 lane) / T(n lanes)",
                lanes=n,
                kernel_ms=kernel_ns / 1e6,
                kernels_per_lane=KERNELS,
                ideal_ms=ideal_ms,
                one_lane_ms=times[1]["lanes"] * 1e3,
                n_lanes_ms=times[n]["lanes"] * 1e3,
                sequential_ms=ideal_ms * n,
                samples=reps,
            )
        )
    return rows
