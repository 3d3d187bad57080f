"""Section 3, launch-bound model: many small layers, where launching kernels from
Python costs more than running them.

A frozen target of DEPTH tiny Linear+GELU layers, one replica per lane on one GPU,
FORWARDS microbatches per replica. Every way of running them is timed in the same
run, per forward, against plain sequential eager code on one thread: eager through
the Dispatcher, eager through a ThreadPoolExecutor(1) per replica (each with its own
torch stream, as a lane has), eager through torch.nn.parallel.parallel_apply, and
captured graphs: launched natively by the lanes (`submit_graph`, no GIL), with a
copy-in of new inputs (`CapturedGraph.run`), replayed from the threads, and replayed
sequentially. A replica's work always goes to the same lane or thread: a graph's
executable must not be launched from two threads at once. Without a GPU the eager variants run
on CPU lanes with tiny sizes, so the code paths are exercised; graph rows need a GPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

from .common import Context, Row, compare, interleaved_medians, not_run

SECTION = "launch_bound"
DEPTH = 64
BATCH = 8
TARGET_LANES = 2
TARGET = "speedup >= 1.8"
BASELINE = "sequential eager (1 thread)"
GRAPH_ROWS = (
    ("lanes: graphs, submit_graph", "graph_lanes"),
    ("lanes: graphs + copy-in, CapturedGraph.run", "graph_run"),
    ("threads: graphs, replay() on a stream each", "graph_threads"),
)


def make_model(width: int, depth: int, device: Any) -> Any:
    import torch

    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device).requires_grad_(False).eval()


def run(ctx: Context) -> list[Row]:
    gpu = ctx.gpus > 0
    if gpu:
        counts = ctx.pick([2, 4, 8], [2, 4], [2, 8])
        config = {
            "width": 256,
            "forwards": ctx.reps(24, 8, default=8),
            "reps": ctx.reps(25, 5, default=6),
        }
    else:
        counts = [2]
        config = {
            "width": 32,
            "forwards": ctx.reps(16, 4, default=8),
            "reps": ctx.reps(20, 6, default=10),
        }
    from .harness import cpu_lanes

    rows: list[Row] = []
    with contextlib.nullcontext() if gpu else cpu_lanes():
        for n in counts:
            rows += measure(ctx, n, gpu, trace=n == counts[0], **config)
    return rows


def measure(
    ctx: Context, n: int, gpu: bool, *, width: int, forwards: int, reps: int, trace: bool
) -> list[Row]:
    import torch
    from torch.nn.parallel import parallel_apply

    import pydflash
    from pydflash.graphs import lane_graph as graphs
    from pydflash.trace import recording

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    models = [make_model(width, DEPTH, device) for _ in range(n)]
    inputs = [torch.randn(BATCH, width, device=device) for _ in range(n)]
    dispatcher = pydflash.Dispatcher([0 if gpu else "cpu"] * n)
    lanes = dispatcher.lanes
    pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(n)]
    streams = [torch.cuda.Stream(device=device) if gpu else None for _ in range(n)]
    sync: Callable[[], None] = torch.cuda.synchronize if gpu else (lambda: None)
    sync()  # the weights and inputs are written before any lane reads them
    jobs = [(i, m) for m in range(forwards) for i in range(n)]  # microbatch-major order

    def wait(futures: list[Any]) -> None:
        for future in futures:
            future.result()
        sync()

    def sequential() -> None:
        for i, _ in jobs:
            models[i](inputs[i])
        sync()

    def eager_lanes() -> None:
        wait([lanes[i].submit(models[i], inputs[i]) for i, _ in jobs])

    def eager_threads() -> None:
        wait([pools[i].submit(on_stream, streams[i], models[i], inputs[i]) for i, _ in jobs])

    def eager_parallel_apply() -> None:
        for _ in range(forwards):
            parallel_apply(models, inputs, devices=[device] * n)
        sync()

    variants: dict[str, Callable[[], None]] = {
        "sequential": sequential,
        "eager_lanes": eager_lanes,
        "eager_threads": eager_threads,
    }
    skipped: dict[str, str] = {}
    try:
        ctx.progress(f"{n} models: checking parallel_apply")
        eager_parallel_apply()
        variants["eager_parallel_apply"] = eager_parallel_apply
    except Exception as exc:  # noqa: BLE001 - e.g. torch's "No available accelerator found." on a CPU
        skipped["eager_parallel_apply"] = f"parallel_apply cannot run here: {exc}"
    try:
        if gpu:
            ctx.progress(f"{n} models: capturing a graph per lane")
            captured = [graphs.capture(models[i], (inputs[i],), lanes[i]) for i in range(n)]

            variants["graph_lanes"] = lambda: wait(
                [lanes[i].submit_graph(captured[i]) for i, _ in jobs]
            )
            variants["graph_run"] = lambda: wait([captured[i].run(inputs[i]) for i, _ in jobs])
            variants["graph_threads"] = lambda: wait(
                [pools[i].submit(on_stream, streams[i], captured[i].graph.replay) for i, _ in jobs]
            )

            def graph_sequential() -> None:
                for i, _ in jobs:
                    captured[i].graph.replay()
                sync()

            variants["graph_sequential"] = graph_sequential
        ctx.progress(
            f"{n} models: {len(variants)} variants, {reps} samples of {len(jobs)} forwards"
        )
        times = interleaved_medians(variants, reps)
        if trace:
            ctx.progress(f"{n} models: recording a trace")
            with recording(lanes) as events:
                eager_lanes()
                if gpu:
                    variants["graph_lanes"]()
            ctx.artifacts["trace"] = {
                "title": f"launch-bound model on {n} lanes: eager, then graphs"
                if gpu
                else f"launch-bound model on {n} CPU lanes: eager",
                "events": events,
            }
    finally:
        dispatcher.shutdown()
        for pool in pools:
            pool.shutdown()
    return rows_for(
        n, gpu, times, skipped, len(jobs), width=width, forwards_per_model=forwards, samples=reps
    )


def on_stream(stream: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs fn on `stream` in a pool thread (None: the CPU, no stream)."""
    import torch

    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return fn(*args)


def rows_for(
    n: int,
    gpu: bool,
    times: dict[str, float],
    skipped: dict[str, str],
    forwards: int,
    **extra: Any,
) -> list[Row]:
    per_forward = {k: v / forwards * 1e3 for k, v in times.items()}  # ms
    base = per_forward["sequential"]
    target = TARGET if n == TARGET_LANES else None

    def row(name: str, key: str, row_target: str | None = None, note: str = "") -> Row:
        if key in skipped:
            return not_run(SECTION, name, skipped[key], row_target)
        return compare(
            SECTION,
            name,
            per_forward[key],
            "ms",
            BASELINE,
            base,
            row_target,
            note,
            models=n,
            **extra,
        )

    rows = [
        compare(
            SECTION,
            f"{n} models: sequential eager (1 thread)",
            base,
            "ms",
            note="the baseline",
            models=n,
            **extra,
        ),
        row(f"{n} lanes: eager, Dispatcher", "eager_lanes"),
        row(f"{n} threads: eager, ThreadPoolExecutor + streams", "eager_threads"),
        row(
            f"{n} threads: eager, parallel_apply",
            "eager_parallel_apply",
            note="one stream: parallel_apply uses the device's current stream",
        ),
    ]
    if not gpu:
        rows += [
            not_run(
                SECTION,
                f"{n} {name}",
                "needs a GPU (CUDA graphs)",
                target if key == "graph_lanes" else None,
            )
            for name, key in GRAPH_ROWS
        ]
        rows.append(
            not_run(SECTION, f"{n} models: graphs, sequential replay() (1 thread)", "needs a GPU")
        )
        return rows
    rows += [
        row(f"{n} {name}", key, target if key == "graph_lanes" else None)
        for name, key in GRAPH_ROWS
    ]
    rows.append(row(f"{n} models: graphs, sequential replay() (1 thread)", "graph_sequential"))
    return rows
