"""Section 1, dispatch: what a task costs to hand to a lane and get back.

An empty callable, per task: submit then result (one round trip at a time), and 64
submitted then waited (pipelined): by a result() loop, by concurrent.futures.wait and by
concurrent.futures.as_completed, the stdlib's own functions. pydflash's Dispatcher with
one lane against ThreadPoolExecutor(1), on a CPU lane and, when there is a GPU, on a GPU
lane. Tracing on is measured against tracing off.

Under load: the same round trip while K busy processes (0, one per core, two per core)
compete for the cores, as data workers and tokenizers do on a training node. Each figure
is the median over fresh processes of each process's median, pydflash and
ThreadPoolExecutor(1) interleaved in the same process. `python -m bench.dispatch
--under-load` runs these rows alone.

On a GPU lane an empty task's result (None) holds no GPU memory, so its CUDA event is
recorded only when asked for (Note [Deferred result events]); what the lane adds over a
CPU lane is the check that torch's current stream is still the lane's and the deferred
event's bookkeeping. The breakdown rows measure that on the same host, in the same
samples: the GPU lane against a CPU lane and ThreadPoolExecutor(1), and a task whose
result can hold a tensor (so a CUDA event is recorded per task). The GPU lane's ratio
is the CPU lane's plus (its extra per task) / ThreadPoolExecutor's per task: a target
below the CPU lane's ratio plus that extra cannot be met by the GPU lane.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import Context, Row, compare, interleaved_medians, not_run

SECTION = "dispatch"
ROUND_TRIPS_PER_SAMPLE = 20  # round trips per timed sample: a few µs each is below timer noise
PIPELINED = 64
TARGET_ROUND_TRIP = "ratio <= 0.25"
TARGET_PIPELINED = "ratio <= 0.10"
# The GPU lane's pipelined ratio is the CPU lane's plus what a GPU lane adds per task
# (0.18 µs on the H200 host, 0.015 of the pool's 12.4 µs there). What is left is the CPU
# lane's own path, and a profile of it (perf, 2-core VM, CPU lane) finds the work outside
# polling 60 % in CPython (the Future object, the call, the result), 22 % in pydflash's
# native submit, queue and publish, 10 % in libc (mutexes, the future's condition
# variable): so the GPU lane is held to the CPU lane's target plus that extra, rounded up.
TARGET_PIPELINED_GPU = "ratio <= 0.12"
TARGET_STDLIB_WAIT = "ratio <= 0.25"
TARGET_UNDER_LOAD = "ratio <= 1.0"  # issue 35: never slower than the stdlib, at any load
BASELINE = "ThreadPoolExecutor(1)"
ROOT = Path(__file__).resolve().parents[1]
BUSY_PROCESS_S = 120  # a busy process ends by itself after this, whatever happens to the run


def noop() -> None:
    pass


def empty_tuple() -> tuple:
    # A result that could hold a tensor: a GPU lane records its CUDA event at once.
    return ()


def round_trips(executor: concurrent.futures.Executor) -> Callable[[], None]:
    def run() -> None:
        for _ in range(ROUND_TRIPS_PER_SAMPLE):
            executor.submit(noop).result()

    return run


def pipelined(
    executor: concurrent.futures.Executor, fn: Callable[[], Any] = noop
) -> Callable[[], None]:
    def run() -> None:
        futures = [executor.submit(fn) for _ in range(PIPELINED)]
        [f.result() for f in futures]

    return run


def stdlib_wait(executor: concurrent.futures.Executor) -> Callable[[], None]:
    def run() -> None:
        concurrent.futures.wait([executor.submit(noop) for _ in range(PIPELINED)])

    return run


def stdlib_as_completed(executor: concurrent.futures.Executor) -> Callable[[], None]:
    def run() -> None:
        for _ in concurrent.futures.as_completed([executor.submit(noop) for _ in range(PIPELINED)]):
            pass

    return run


def measure(ctx: Context, kind: str, device: Any) -> list[Row]:
    import pydflash

    reps = ctx.reps(1000, 100, default=500)
    us = 1e6
    lane = pydflash.Dispatcher([device])
    traced = pydflash.Dispatcher([device], trace=True)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        ctx.progress(f"{kind} lane: submit→result, {reps} samples of {ROUND_TRIPS_PER_SAMPLE}")
        single = interleaved_medians(
            {
                "pydflash": round_trips(lane),
                "pool": round_trips(pool),
                "traced": round_trips(traced),
                "direct": round_trips_direct,
            },
            reps,
        )
        # Tracing keeps every span until taken: do not let the record grow unbounded.
        traced.set_tracing(False)
        for each in traced.lanes:
            each._core.take_trace()
        ctx.progress(f"{kind} lane: {PIPELINED} submitted then waited, {reps} samples")
        batch = interleaved_medians({"pydflash": pipelined(lane), "pool": pipelined(pool)}, reps)
        ctx.progress(f"{kind} lane: {PIPELINED} submitted, stdlib wait, {reps} samples")
        stdlib = interleaved_medians(
            {
                "wait": stdlib_wait(lane),
                "pool wait": stdlib_wait(pool),
                "as_completed": stdlib_as_completed(lane),
                "pool as_completed": stdlib_as_completed(pool),
            },
            reps,
        )
    finally:
        lane.shutdown()
        traced.shutdown()
        pool.shutdown()
    per_trip = {k: v / ROUND_TRIPS_PER_SAMPLE * us for k, v in single.items()}
    per_task = {k: v / PIPELINED * us for k, v in batch.items()}
    per_waited = {k: v / PIPELINED * us for k, v in stdlib.items()}
    note = "the empty task's CUDA event is deferred (its result is None)" if kind == "gpu" else ""
    return [
        compare(
            SECTION,
            f"{kind} lane: submit→result",
            per_trip["pydflash"],
            "us",
            BASELINE,
            per_trip["pool"],
            TARGET_ROUND_TRIP,
            note,
            direct_call_us=per_trip["direct"],
            samples=reps,
        ),
        compare(
            SECTION,
            f"{kind} lane: {PIPELINED} submitted, then waited",
            per_task["pydflash"],
            "us",
            BASELINE,
            per_task["pool"],
            TARGET_PIPELINED_GPU if kind == "gpu" else TARGET_PIPELINED,
            note,
            samples=reps,
        ),
        compare(
            SECTION,
            f"{kind} lane: {PIPELINED} submitted, concurrent.futures.wait",
            per_waited["wait"],
            "us",
            BASELINE,
            per_waited["pool wait"],
            TARGET_STDLIB_WAIT,
            note,
            samples=reps,
        ),
        compare(
            SECTION,
            f"{kind} lane: {PIPELINED} submitted, concurrent.futures.as_completed",
            per_waited["as_completed"],
            "us",
            BASELINE,
            per_waited["pool as_completed"],
            TARGET_STDLIB_WAIT,
            note,
            samples=reps,
        ),
        compare(
            SECTION,
            f"{kind} lane: submit→result, tracing on",
            per_trip["traced"],
            "us",
            "tracing off",
            per_trip["pydflash"],
            None,
            "what recording a trace costs",
            samples=reps,
        ),
    ]


def round_trips_direct() -> None:
    # The floor: calling the function where the caller is.
    for _ in range(ROUND_TRIPS_PER_SAMPLE):
        noop()


def breakdown(ctx: Context) -> list[Row]:
    """The pipelined GPU-lane row taken apart, on the same host and in the same samples:
    a CPU lane (the floor a GPU lane cannot beat), the GPU lane, the GPU lane with a CUDA
    event recorded per task, and ThreadPoolExecutor(1)."""
    import pydflash

    reps = ctx.reps(1000, 100, default=500)
    us = 1e6 / PIPELINED
    cpu = pydflash.Dispatcher(["cpu"])
    gpu = pydflash.Dispatcher([0])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        ctx.progress(f"breakdown of the GPU lane's {PIPELINED} pipelined tasks, {reps} samples")
        t = interleaved_medians(
            {
                "cpu": pipelined(cpu),
                "gpu": pipelined(gpu),
                "gpu event": pipelined(gpu, empty_tuple),
                "pool": pipelined(pool),
            },
            reps,
        )
    finally:
        cpu.shutdown()
        gpu.shutdown()
        pool.shutdown()
    per = {k: v * us for k, v in t.items()}
    extra = per["gpu"] - per["cpu"]
    floor = per["cpu"] / per["pool"]
    name = f"gpu lane: {PIPELINED} submitted, then waited"
    return [
        compare(
            SECTION,
            f"{name}: what the GPU lane adds over a CPU lane",
            extra,
            "us",
            "cpu lane, same samples",
            per["cpu"],
            note=f"same samples: gpu lane {per['gpu']:.3f} µs, cpu lane {per['cpu']:.3f} µs, "
            f"{BASELINE} {per['pool']:.3f} µs per task: the GPU lane's ratio "
            f"{per['gpu'] / per['pool']:.3f} = the CPU lane's {floor:.3f} + "
            f"{extra / per['pool']:.3f} for the stream check and deferred event",
            gpu_us=per["gpu"],
            pool_us=per["pool"],
            cpu_lane_ratio=floor,
            gpu_lane_ratio=per["gpu"] / per["pool"],
            samples=reps,
        ),
        compare(
            SECTION,
            f"{name}: a CUDA event recorded per task",
            per["gpu event"],
            "us",
            "gpu lane, event deferred (result None)",
            per["gpu"],
            note="the task returns () instead of None, so the lane records its CUDA event "
            f"at once: {per['gpu event'] - per['gpu']:.3f} µs per task; ratio to "
            f"{BASELINE} {per['gpu event'] / per['pool']:.3f}",
            pool_us=per["pool"],
            samples=reps,
        ),
    ]


def load_child(samples: int) -> None:
    """In a fresh process: `samples` interleaved samples of ROUND_TRIPS_PER_SAMPLE round
    trips each, pydflash and the pool; prints each one's median µs per round trip."""
    import pydflash

    lane = pydflash.Dispatcher(["cpu"], guard=())
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        medians = interleaved_medians(
            {"pydflash": round_trips(lane), "pool": round_trips(pool)}, samples
        )
    finally:
        lane.shutdown()
        pool.shutdown()
    print(json.dumps({k: v / ROUND_TRIPS_PER_SAMPLE * 1e6 for k, v in medians.items()}))


def busy_processes(count: int) -> list[subprocess.Popen]:
    """`count` processes that keep a core busy each, ending by themselves after
    BUSY_PROCESS_S seconds; stop() ends them sooner."""
    spin = (
        f"import time\nend = time.monotonic() + {BUSY_PROCESS_S}\n"
        "while time.monotonic() < end: pass"
    )
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        proc.kill()
    for proc in processes:
        proc.wait()


def under_load(ctx: Context) -> list[Row]:
    """submit→result on a CPU lane against ThreadPoolExecutor(1) while K busy processes
    spin, K = 0, one per core and two per core; fresh processes per K."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    fresh = ctx.reps(9, 2, default=5)
    samples = ctx.reps(100, 10, default=40)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    rows = []
    for busy in (0, cores, 2 * cores):
        ctx.progress(
            f"cpu lane: submit→result under {busy} busy processes, {fresh} fresh processes"
        )
        spinning = busy_processes(busy)
        try:
            time.sleep(0.2 if busy else 0)  # let them take the cores
            runs = []
            for _ in range(fresh):
                out = subprocess.run(
                    [sys.executable, "-m", "bench.dispatch", "--load-child", str(samples)],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            stop(spinning)
        ours = [r["pydflash"] for r in runs]
        theirs = [r["pool"] for r in runs]
        rows.append(
            compare(
                SECTION,
                f"cpu lane: submit→result, {busy} busy processes ({cores} cores)",
                statistics.median(ours),
                "us",
                BASELINE,
                statistics.median(theirs),
                TARGET_UNDER_LOAD,
                f"median over {fresh} fresh processes of each one's median of {samples} "
                f"samples; worst process: pydflash {max(ours):.1f} us, {BASELINE} "
                f"{max(theirs):.1f} us",
                busy_processes=busy,
                cores=cores,
                pydflash_us=ours,
                pool_us=theirs,
                samples=samples,
            )
        )
    return rows


def run(ctx: Context) -> list[Row]:
    if (ctx.options.get(SECTION) or {}).get("under_load_only"):
        return under_load(ctx)
    rows = measure(ctx, "cpu", "cpu") + under_load(ctx)
    if ctx.gpus:
        rows += measure(ctx, "gpu", 0)
        rows += breakdown(ctx)
    else:
        reason = "needs a GPU"
        rows += [
            not_run(SECTION, "gpu lane: submit→result", reason, TARGET_ROUND_TRIP),
            not_run(
                SECTION,
                f"gpu lane: {PIPELINED} submitted, then waited",
                reason,
                TARGET_PIPELINED_GPU,
            ),
            not_run(
                SECTION,
                f"gpu lane: {PIPELINED} submitted, concurrent.futures.wait",
                reason,
                TARGET_STDLIB_WAIT,
            ),
            not_run(
                SECTION,
                f"gpu lane: {PIPELINED} submitted, concurrent.futures.as_completed",
                reason,
                TARGET_STDLIB_WAIT,
            ),
            not_run(
                SECTION,
                f"gpu lane: {PIPELINED} submitted, then waited: what the GPU lane adds over a "
                "CPU lane",
                reason,
            ),
            not_run(
                SECTION,
                f"gpu lane: {PIPELINED} submitted, then waited: a CUDA event recorded per task",
                reason,
            ),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.dispatch [--under-load] [--quick | --full] [--json FILE]`: this
    section alone, through bench.run (its table, JSON and progress); --under-load runs
    only the rows under load."""
    parser = argparse.ArgumentParser(prog="python -m bench.dispatch", add_help=True)
    parser.add_argument("--under-load", action="store_true", help="only the rows under load")
    parser.add_argument("--load-child", type=int, metavar="SAMPLES", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.load_child is not None:
        load_child(args.load_child)
        return 0
    from bench import run as suite

    options = {SECTION: {"under_load_only": args.under_load}}
    return suite.main(["--sections", SECTION, *rest], options=options)


if __name__ == "__main__":
    sys.exit(main())
