"""Section 4: the compile queue and the Triton guard.

- Guarded autotune cache hit vs bare Triton, per launch: the autotuner alone (a launch
  stub, any machine) and, with a GPU, real launches of a tuned kernel. Goal: < 1 us added.
- compile_queue.run with no contention (the cost a miss adds before its work).
- Cold start: N lanes start cold at once with the guard, against a sequential warmup
  of the same work by one thread with bare Triton; each in a fresh process with an
  empty TRITON_CACHE_DIR. Goal: at most 1.05x. On a CPU the kernels are interpreted
  (TRITON_INTERPRET=1), which runs launches one at a time: that ratio shows the
  guard's own overhead only.

Run alone: python -m bench.compile_queue [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from .common import Context, Row, meets

SECTION = "compile_queue"
ROOT = Path(__file__).resolve().parents[1]
ADDED_US_GOAL = 1.0
COLD_START_GOAL = 1.05


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    try:
        import triton  # noqa: F401
    except ImportError:
        return [
            Row(
                SECTION, "triton guard", float("nan"), "us", note="Triton is not installed: skipped"
            )
        ]
    ctx.progress("autotune hit path, launch stub")
    rows.append(_hit_path_stub(ctx))
    if ctx.gpus:
        ctx.progress("autotune hit path, GPU launches")
        rows.append(_hit_path_gpu(ctx))
    ctx.progress("compile queue, uncontended")
    rows.append(_queue_uncontended(ctx))
    ctx.progress("cold start")
    rows.extend(_cold_start(ctx))
    return rows


# --- hit path ---------------------------------------------------------------------------


def _interleaved(
    bare: Callable[[], None], guarded: Callable[[], None], rounds: int, inner: int
) -> tuple:
    """Median seconds per call of each, measured in alternating batches so drift hits both."""
    from pydflash import guards

    samples: dict[str, list[float]] = {"bare": [], "guarded": []}
    for _ in range(rounds):
        for name, fn in (("bare", bare), ("guarded", guarded)):
            if name == "bare":
                guards.remove_guards()
            else:
                guards.install_guards()
            fn()  # warm
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return statistics.median(samples["bare"]), statistics.median(samples["guarded"])


def _with_guard_state_restored(measure: Callable[[], Row]) -> Row:
    from pydflash import guards

    was = guards.is_guarded()
    try:
        return measure()
    finally:
        guards.remove_guards()
        if was:
            guards.install_guards(missing_ok=True)


def _hit_row(name: str, bare_s: float, guarded_s: float, note: str) -> Row:
    row = Row(
        SECTION,
        name,
        guarded_s * 1e6,
        "us",
        baseline_name="bare Triton",
        baseline=bare_s * 1e6,
        ratio=guarded_s / bare_s,
        target=f"added < {ADDED_US_GOAL}",
        note=note,
    )
    row.met = meets(row)
    return row


def _hit_path_stub(ctx: Context) -> Row:
    """Autotuner.run on a tuned key with a launch that does nothing: all of the
    difference is the autotuner's own dispatch."""
    import torch
    from triton.runtime.autotuner import Autotuner, Config

    def kernel(q, k, v, o, T, H, BT):
        pass

    class Launch:  # what Autotuner.fn would be, minus the GPU
        arg_names: ClassVar[list[str]] = ["q", "k", "v", "o", "T", "H"]
        fn = staticmethod(kernel)

        def run(self, *args, grid, warmup, **kwargs):
            return None

    tuner = Autotuner(
        Launch(),
        Launch.arg_names,
        [Config({"BT": b}) for b in (16, 32, 64)],
        ["T", "H"],
        None,
        None,
        do_bench=lambda call, quantiles: (call(), [1.0, 1.0, 1.0])[1],
    )
    tensors = [torch.empty(1) for _ in range(4)]
    launch = tuner[(1,)]

    def call() -> None:
        launch(*tensors, 1024, 8)  # positional, as FLA calls its kernels

    def measure() -> Row:
        bare, guarded = _interleaved(call, call, ctx.reps(15, 5, 9), ctx.reps(20000, 3000, 5000))
        return _hit_row(
            "autotune hit, launch stub",
            bare,
            guarded,
            "Autotuner.run dispatch only (4 tensors, 2 ints)",
        )

    return _with_guard_state_restored(measure)


def _hit_path_gpu(ctx: Context) -> Row:
    import torch
    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (256, 512, 1024)], key=["n"])
    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(
            out_ptr + offs,
            tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
            mask=mask,
        )

    n = 4096
    x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
    grid = (triton.cdiv(n, 256),)
    launch = add[grid]
    launch(x, y, out, n)  # tune
    torch.cuda.synchronize()

    def call() -> None:
        launch(x, y, out, n)

    def measure() -> Row:
        bare, guarded = _interleaved(call, call, ctx.reps(15, 5, 9), ctx.reps(5000, 500, 2000))
        torch.cuda.synchronize()
        return _hit_row(
            "autotune hit, GPU launch", bare, guarded, "host time per launch of a tuned kernel"
        )

    return _with_guard_state_restored(measure)


def _queue_uncontended(ctx: Context) -> Row:
    from pydflash import compile_queue

    inner = ctx.reps(20000, 2000, 5000)
    samples = []
    for _ in range(ctx.reps(15, 5, 9)):
        start = time.perf_counter()
        for _ in range(inner):
            compile_queue.run("bench:uncontended", _nothing)
        samples.append((time.perf_counter() - start) / inner)
    return Row(
        SECTION,
        "compile_queue.run, uncontended",
        statistics.median(samples) * 1e6,
        "us",
        note="what a miss pays before its work; hits never enter the queue",
    )


def _nothing() -> None:
    return None


# --- cold start ---------------------------------------------------------------------------


def _cold_start(ctx: Context) -> list[Row]:
    lanes = max(2, 2 * ctx.gpus) if ctx.gpus else 4
    kernels, configs = ctx.pick(full=(6, 4), quick=(3, 3), default=(3, 4))
    common = ["--lanes", str(lanes), "--kernels", str(kernels), "--configs", str(configs)]
    runs = {
        mode: _child(["cold", "--mode", mode, *common], interpret=not ctx.gpus)
        for mode in ("sequential", "lanes")
    }
    if ctx.gpus and ctx.full:
        runs["lanes, no precompile"] = _child(
            ["cold", "--mode", "lanes", *common],
            interpret=False,
            env={"PYDFLASH_PRECOMPILE_THREADS": "0"},
        )
    sequential = runs["sequential"]["seconds"]
    rows = []
    for mode, result in runs.items():
        if mode == "sequential":
            continue
        ratio = result["seconds"] / sequential
        rows.append(
            Row(
                SECTION,
                f"cold start, {lanes} lanes ({mode})",
                result["seconds"] * 1e3,
                "ms",
                baseline_name="sequential warmup, one thread, bare Triton",
                baseline=sequential * 1e3,
                ratio=ratio,
                # Interpreted, launches run one at a time: no goal to meet there.
                target=f"<= {COLD_START_GOAL}" if ctx.gpus else None,
                met=ratio <= COLD_START_GOAL if ctx.gpus else None,
                note=f"{kernels} autotuned kernels x {configs} configs"
                + ("; interpreted on the CPU (launches serialized)" if not ctx.gpus else ""),
                extra={
                    "benchmarks": result["benchmarks"],
                    "sequential_benchmarks": runs["sequential"]["benchmarks"],
                },
            )
        )
    return rows


def _child(args: list[str], interpret: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pydflash-bench-cache-") as cache:
        child_env = {
            **os.environ,
            "TRITON_CACHE_DIR": cache,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
            **(env or {}),
        }
        if interpret:
            child_env["TRITON_INTERPRET"] = "1"
        else:
            child_env.pop("TRITON_INTERPRET", None)
        proc = subprocess.run(
            [sys.executable, "-m", "bench.compile_queue", *args],
            cwd=ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"cold-start child {args} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cold_child(mode: str, lanes: int, kernels: int, configs: int) -> dict[str, Any]:
    """One process: `lanes` steps of the same work, cold. Timed from the first call."""
    import torch
    import triton

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpret else "cuda"
    benchmarks = []

    def counted_bench(kernel_call, quantiles):
        benchmarks.append(1)
        if not interpret:
            from triton.runtime.driver import driver

            return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles)
        start = time.perf_counter()
        kernel_call()
        ms = (time.perf_counter() - start) * 1e3
        return [ms, ms, ms]

    # Distinct source per kernel, so each compiles on its own; in a file, since the JIT
    # and the interpreter read kernels' source.
    source_dir = Path(tempfile.mkdtemp(prefix="pydflash-bench-kernels-"))
    (source_dir / "bench_kernels.py").write_text(
        "import triton.language as tl\n"
        + "".join(
            f"\n\ndef scale_{i}(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
            f"    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
            f"    mask = offs < n\n"
            f"    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * {i + 2}.0, mask=mask)\n"
            for i in range(kernels)
        )
    )
    sys.path.insert(0, str(source_dir))
    import bench_kernels

    def make_kernel(index: int):
        return triton.autotune(
            configs=[
                triton.Config({"BLOCK": 64 * 2**c}, num_warps=2 ** (c % 3 + 1))
                for c in range(configs)
            ],
            key=["n"],
            do_bench=counted_bench,
        )(triton.jit(getattr(bench_kernels, f"scale_{index}")))

    kernels_ = [make_kernel(i) for i in range(kernels)]
    n = 1 << 12 if interpret else 1 << 20

    def step(x: Any) -> Any:
        y = x
        for kernel in kernels_:
            out = torch.empty_like(y)
            kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, out, n)
            y = out
        return y

    devices = list(range(torch.cuda.device_count())) if not interpret else []
    if mode == "sequential":
        inputs = [
            torch.ones(n, device=device if not devices else f"cuda:{i % len(devices)}")
            for i in range(lanes)
        ]
        start = time.perf_counter()
        for x in inputs:  # first tunes, the rest hit
            if devices:
                torch.cuda.set_device(x.device)
            step(x)
        if devices:
            for d in devices:
                torch.cuda.synchronize(d)
        seconds = time.perf_counter() - start
    else:
        from pydflash import Dispatcher

        lane_devices = (
            [f"cuda:{i % len(devices)}" for i in range(lanes)] if devices else ["cpu"] * lanes
        )
        dispatcher = Dispatcher(lane_devices)
        try:
            inputs = [(torch.ones(n, device="cpu" if not devices else d),) for d in lane_devices]
            start = time.perf_counter()
            dispatcher.warmup(step, inputs)
            if devices:
                for d in devices:
                    torch.cuda.synchronize(d)
            seconds = time.perf_counter() - start
        finally:
            dispatcher.shutdown()
    return {"seconds": seconds, "benchmarks": len(benchmarks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    cold = sub.add_parser("cold")
    cold.add_argument("--mode", choices=["sequential", "lanes"], required=True)
    cold.add_argument("--lanes", type=int, required=True)
    cold.add_argument("--kernels", type=int, required=True)
    cold.add_argument("--configs", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.command == "cold":
        print(json.dumps(_cold_child(args.mode, args.lanes, args.kernels, args.configs)))
        return
    from pydflash.lanes.devices import visible_gpus

    ctx = Context(
        quick=args.quick, gpus=visible_gpus(), progress=lambda s: print(f"... {s}", file=sys.stderr)
    )
    for row in run(ctx):
        print(json.dumps(row.as_dict()))


if __name__ == "__main__":
    main()
