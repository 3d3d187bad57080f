"""real_target's torch.compile rows: torch.compile(mode="reduce-overhead") of the
target's forward in a subprocess with a wall-clock limit (inductor may take minutes, and
a hung compile must not hang the suite), its step time if it compiles in time, and
whether calling it from several threads works. The child is
`python -m bench.real_target --compile-child SIZE`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from bench import kernels
from bench.common import Context, Row, compare, interleaved_medians, not_run
from bench.harness import sequential_step
from bench.real_target_common import ROOT, SECTION, SIZES, Bench, Options
from examples.dflash.hf import HFTargetConfig
from examples.dflash.loops import Job, Placement, target_forward
from examples.dflash.models import DrafterConfig


def compiled_rows(
    ctx: Context, options: Options, bench: Bench, size: str, limit: float
) -> list[Row]:
    options = options.for_run(ctx)
    threads = max(options.lanes)
    name = f"{bench.name}: torch.compile reduce-overhead"
    threaded = f"{name}, from {threads} threads"
    ctx.progress(f"{name}: in a subprocess, at most {limit:.0f} s")
    args = [
        "--compile-child",
        size,
        "--batch",
        str(bench.job.batch),
        f"--seq-{size}",
        str(bench.job.seq),
        "--lanes",
        str(threads),
        "--reps",
        str(options.reps),
    ]
    if options.moe:
        args.append("--moe")
    report, failure = compile_child([sys.executable, "-m", "bench.real_target", *args], limit)
    rows = []
    step = report.get("step")
    if step is None:
        phase = report.get("phase", "start")
        why = failure or "it ended early"
        rows.append(not_run(SECTION, name, f"no step time: after '{phase}', {why}"))
    else:
        rows.append(
            compare(
                SECTION,
                name,
                step["compiled_ms"],
                "ms",
                "eager, same process",
                step["eager_ms"],
                note=f"first call (compile and capture) {report['first_call_s']:.1f} s; "
                f"{bench.rate(step['compiled_ms'] / 1e3, 1)}"
                + (f"; {report['cudagraphs_skipped']}" if "cudagraphs_skipped" in report else ""),
                first_call_s=report["first_call_s"],
            )
        )
    threads_report = report.get("threads")
    if threads_report is None:
        rows.append(not_run(SECTION, threaded, "not reached: " + (failure or "see the row above")))
    elif threads_report["error"]:
        rows.append(not_run(SECTION, threaded, f"fails: {threads_report['error']}"))
    else:
        rows.append(
            compare(
                SECTION,
                threaded,
                threads_report["compiled_ms"],
                "ms",
                f"eager sequential, {threads} forwards",
                threads_report["eager_ms"],
                note=f"{threads} threads at once, outputs equal to one thread's; "
                f"{bench.rate(threads_report['compiled_ms'] / 1e3, threads)}",
            )
        )
    return rows


def compile_child(command: list[str], limit: float) -> tuple[dict[str, Any], str | None]:
    """Runs the child; returns what it reported (its JSON lines, merged) and why it
    stopped early (None when it finished). At `limit` the child is killed with its
    process group: inductor starts compile workers of its own."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    failure = None
    try:
        out, err = proc.communicate(timeout=limit)
        if proc.returncode:
            lines = [line for line in err.strip().splitlines() if line.strip()]
            failure = f"exit {proc.returncode}: {lines[-1] if lines else 'no message'}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        failure = f"still running at the {limit:.0f} s limit"
    report: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            report.update(json.loads(line))
    # Inductor logs, and runs on without graphs, when it cannot use CUDA graphs.
    skipped = [line.strip() for line in err.splitlines() if "skipping cudagraphs" in line.lower()]
    if skipped:
        report["cudagraphs_skipped"] = skipped[0][:300]
    return report, failure


def compile_main(size: str, options: Options) -> None:
    """The child: builds the target, compiles its forward and reports each phase as a
    JSON line as soon as it is done, so a parent that kills it knows how far it got."""

    def say(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    kernels.apply_fallbacks()
    torch.manual_seed(0)
    config = HFTargetConfig.load(SIZES[size][0], moe=options.moe)
    model = config.build(torch.bfloat16).to("cuda:0")
    forward = target_forward(model)
    job = Job(
        config,
        DrafterConfig(),
        seq=options.seq_of(size, False),
        batch=options.batch,
        accumulate=1,
        lr=0.0,
    )
    bench = Bench(size, size, job, Placement(("cuda:0",), ("cuda:0",)), True)
    threads = max(options.lanes)
    batches = bench.batches(threads)
    compiled = torch.compile(forward, mode="reduce-overhead")
    say(phase="built")
    start = time.perf_counter()
    with torch.no_grad():
        compiled(batches[0])
    bench.synchronize()
    say(phase="first call", first_call_s=time.perf_counter() - start)
    reps = options.reps or 20
    times = interleaved_medians(
        {
            "compiled": lambda: sequential_step(compiled, batches[:1], bench.synchronize),
            "eager": lambda: sequential_step(forward, batches[:1], bench.synchronize),
        },
        reps,
    )
    say(
        phase="timed",
        step={"compiled_ms": times["compiled"] * 1e3, "eager_ms": times["eager"] * 1e3},
    )
    say(phase="threads", threads=threaded_calls(bench, compiled, forward, batches))


def threaded_calls(
    bench: Bench, compiled: Callable, forward: Callable, batches: list[dict]
) -> dict[str, Any]:
    """Calls `compiled` from len(batches) threads at once (a stream each on a GPU,
    started on a barrier); the outputs must equal those of one thread's calls."""
    with torch.no_grad():
        expected = [compiled(b)["features"].clone() for b in batches]
    n = len(batches)
    barrier = threading.Barrier(n)
    streams = [torch.cuda.Stream(bench.device) if bench.on_gpu else None for _ in range(n)]

    def call(i: int) -> torch.Tensor:
        barrier.wait()
        with torch.no_grad(), torch.cuda.stream(streams[i]) if bench.on_gpu else nullcontext():
            out = compiled(batches[i])["features"].clone()
        bench.synchronize()
        return out

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        try:
            outs = list(pool.map(call, range(n)))
        except Exception as exc:  # noqa: BLE001 - the failure is what this reports
            return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
        wrong = [
            i for i, (a, b) in enumerate(zip(outs, expected, strict=True)) if not torch.equal(a, b)
        ]
        if wrong:
            return {"error": f"wrong outputs in threads {wrong} (no exception)"}
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(call, range(n)))
            samples.append(time.perf_counter() - start)
    eager = statistics.median(
        _timed(lambda: sequential_step(forward, batches, bench.synchronize)) for _ in range(5)
    )
    return {"error": None, "compiled_ms": statistics.median(samples) * 1e3, "eager_ms": eager * 1e3}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
