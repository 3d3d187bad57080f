"""flash-linear-attention's chunk_gated_delta_rule from many lanes of one GPU, cold.

Every trial is a fresh process with an empty TRITON_CACHE_DIR and FLA_CONFIG_DIR, so it
compiles and autotunes from nothing. In each, every lane runs the forward and backward
of `chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)` on its own inputs
(backward on the lane's thread: autograd multithreading off), all lanes at once:

  guarded     the lanes of a pydflash Dispatcher on one GPU (Triton guard on)
  bare        the threads of a ThreadPoolExecutor, bare Triton
  sequential  one thread runs every lane's step in turn: a sequential warmup

A lane crashed when it raised; its result is wrong when it differs from the same step
recomputed on one thread afterwards. The sequential warmup and one guarded trial run
alone, for the cold-start times; the other trials run `--parallel` at a time.

    python tests/gpu/fla_race.py --procs 10 --lanes 8

Exits 1 when a guarded lane crashed or was wrong (or a guarded process died).
A CPU check of the plumbing, with a toy autotuned kernel instead of FLA:

    python tests/gpu/fla_race.py --workload toy --device cpu --procs 2 --lanes 4
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 900
RELATIVE_TOLERANCE = 2e-2  # bf16; a foreign or zeroed tensor is far off


# ======================================================================================
# The parent: trials, then the summary.
# ======================================================================================


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--procs", type=int, default=10, help="fresh processes per mode (guarded, bare)"
    )
    parser.add_argument(
        "--lanes", type=int, default=8, help="lanes (threads) per process, all on one GPU"
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 2) // 4)),
        help="trial processes at once after the timed ones",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--forward-only",
        action="store_true",
        help="forward only: flash-linear-attention 0.6.0 refuses its gated backward on "
        "Hopper with Triton >= 3.4, < 3.7.1 (its issue #640)",
    )
    parser.add_argument("--workload", choices=["fla", "toy"], default="fla")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, help="also write every trial's result here (JSON)")
    parser.add_argument(
        "--child", choices=["guarded", "bare", "sequential"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        os._exit(0)  # threads stuck after a bare-Triton crash must not hold the exit
    if args.procs < 1 or args.lanes < 1 or args.parallel < 1:
        parser.error("--procs, --lanes and --parallel must be >= 1")
    if args.device == "cpu" and args.workload == "fla":
        parser.error(
            "flash-linear-attention does not run in Triton's interpreter: "
            "use --workload toy on a CPU"
        )

    started = time.perf_counter()
    print(f"timed runs, alone: sequential warmup and guarded, {args.lanes} lanes, cold", flush=True)
    sequential = run_child(args, "sequential")
    report_progress("sequential", sequential)
    guarded_first = run_child(args, "guarded")
    report_progress("guarded", guarded_first)
    trials = ["bare", "guarded"] * args.procs
    trials.remove("guarded")  # one guarded trial ran above
    print(f"{len(trials)} more cold processes, {args.parallel} at a time", flush=True)
    results: dict[str, list[dict]] = {
        "guarded": [guarded_first],
        "bare": [],
        "sequential": [sequential],
    }
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        outcomes = pool.map(lambda mode: run_child(args, mode), trials)
        for mode, result in zip(trials, outcomes, strict=True):
            results[mode].append(result)
            report_progress(mode, result)
    print_summary(args, results, time.perf_counter() - started)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    guarded_failed = any(
        r["died"] or any(lane["error"] or lane["wrong"] for lane in r["lanes"])
        for r in results["guarded"]
    )
    return 1 if guarded_failed else 0


def run_child(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fla-race-") as scratch:
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": str(Path(scratch) / "triton"),
            "FLA_CONFIG_DIR": str(Path(scratch) / "fla"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        if args.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        command = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--lanes",
            str(args.lanes),
            "--seq-len",
            str(args.seq_len),
            "--workload",
            args.workload,
            "--device",
            args.device,
        ] + (["--forward-only"] if args.forward_only else [])
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
            )
            returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            returncode, stdout, stderr = (
                None,
                exc.stdout or "",
                f"timed out after {CHILD_TIMEOUT_S} s",
            )
    lines = [line for line in (stdout or "").splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        return {**json.loads(lines[-1]), "died": None}
    tail = (stderr if isinstance(stderr, str) else stderr.decode(errors="replace"))[-2000:]
    last_line = tail.strip().splitlines()[-1] if tail.strip() else ""
    return {
        "mode": mode,
        "died": f"exit status {returncode}: {last_line}",
        "stderr_tail": tail,
        "seconds": time.perf_counter() - start,
        "lanes": [
            {"error": "process died", "where": "", "wrong": False} for _ in range(args.lanes)
        ],
    }


def report_progress(mode: str, result: dict) -> None:
    crashed = sum(1 for lane in result["lanes"] if lane["error"])
    wrong = sum(1 for lane in result["lanes"] if lane["wrong"])
    died = f", died: {result['died']}" if result["died"] else ""
    first = next(
        (f"{lane['error']}  [{lane['where']}]" for lane in result["lanes"] if lane["error"]), ""
    )
    print(
        f"  {mode:10s} {result['seconds']:7.1f} s  crashed lanes {crashed}  wrong {wrong}{died}"
        + (f"\n             first error: {first}" if first else ""),
        flush=True,
    )


def print_summary(args: argparse.Namespace, results: dict[str, list[dict]], wall_s: float) -> None:
    print()
    work = (
        f"chunk_gated_delta_rule forward{'' if args.forward_only else '+backward'}"
        if args.workload == "fla"
        else "toy autotuned kernels"
    )
    print(f"{work}, {args.lanes} lanes on one {args.device} device, cold cache per process")
    header = (
        f"{'mode':11s} {'procs':>5s} {'lanes':>5s} {'crashed lanes':>13s} {'procs w/ crash':>14s} "
        f"{'wrong':>5s} {'died':>4s} {'cold s (median)':>15s}"
    )
    print(header)
    print("-" * len(header))
    for mode in ("guarded", "bare", "sequential"):
        runs = results[mode]
        crashed = sum(1 for r in runs for lane in r["lanes"] if lane["error"])
        procs_crashed = sum(1 for r in runs if any(lane["error"] for lane in r["lanes"]))
        wrong = sum(1 for r in runs for lane in r["lanes"] if lane["wrong"])
        died = sum(1 for r in runs if r["died"])
        cold = statistics.median(r["seconds"] for r in runs)
        print(
            f"{mode:11s} {len(runs):5d} {args.lanes:5d} {crashed:13d} {procs_crashed:14d} "
            f"{wrong:5d} {died:4d} {cold:15.1f}"
        )
    sequential, guarded = results["sequential"][0], results["guarded"][0]
    if not sequential["died"] and not guarded["died"]:
        ratio = guarded["seconds"] / sequential["seconds"]
        print(
            f"\ncold start, alone: {args.lanes} guarded lanes {guarded['seconds']:.1f} s "
            f"vs sequential warmup {sequential['seconds']:.1f} s = {ratio:.2f}x (goal <= 1.05)"
        )
        if "queue" in guarded:
            q = guarded["queue"]
            print(
                f"  compile queue: {q['autotune_keys']} autotune keys, {q['runs']} runs, "
                f"{q['waits']} waits, longest wait {q['max_wait_s']:.1f} s"
            )
    for mode in ("guarded", "bare"):
        errors = collections.Counter(
            f"{lane['error']}  [{lane['where']}]"
            for r in results[mode]
            for lane in r["lanes"]
            if lane["error"]
        )
        if errors:
            print(f"\n{mode} errors:")
            for text, count in errors.most_common(8):
                print(f"  {count:3d} x {text}")
    if not any(lane["error"] or lane["wrong"] for r in results["bare"] for lane in r["lanes"]):
        print("\nnote: no bare thread crashed or went wrong this run; the race did not show")
    print(f"\nall trials: {wall_s:.0f} s")


# ======================================================================================
# The child: one cold process.
# ======================================================================================


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
        torch.ones(1, device=device).sum().item()  # the CUDA context, outside the timing
    make_inputs, step = (fla_workload if args.workload == "fla" else toy_workload)(args, device)
    inputs = [make_inputs(lane) for lane in range(args.lanes)]
    outcomes: list[dict[str, Any]] = [{"error": None, "where": "", "wrong": False} for _ in inputs]
    results: list[Any] = [None] * len(inputs)

    def lane_body(lane: int) -> None:
        try:
            results[lane] = step(inputs[lane])
        except Exception as exc:  # noqa: BLE001 - the trial counts it
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            first_line = (str(exc).splitlines() or [""])[0][:160]
            outcomes[lane]["error"] = f"{type(exc).__name__}: {first_line}"
            outcomes[lane]["where"] = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"

    extra: dict[str, Any] = {}
    start = time.perf_counter()
    if args.child == "sequential":
        for lane in range(len(inputs)):
            lane_body(lane)
    elif args.child == "bare":
        with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
            list(pool.map(lane_body, range(len(inputs))))
    else:
        from pydflash import Dispatcher, compile_queue

        dispatcher = Dispatcher([str(device)] * len(inputs))  # every guard, by default
        futures = [lane.submit(lane_body, i) for i, lane in enumerate(dispatcher.lanes)]
        for f in futures:
            f.result()
        stats = compile_queue.stats()
        extra["queue"] = {
            "autotune_keys": sum(1 for k in stats["keys"] if k.startswith("autotune:")),
            "runs": stats["runs"],
            "waits": stats["waits"],
            "max_wait_s": stats["max_wait_s"],
        }
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if args.child == "guarded":
        dispatcher.shutdown()

    # The same steps again on this thread, now warm: what every lane should have got.
    for lane, result in enumerate(results):
        if result is None:
            continue
        try:
            expected = step(inputs[lane])
        except Exception as exc:  # noqa: BLE001 - a broken autotuner after a bare crash
            outcomes[lane]["wrong"] = f"recompute failed: {type(exc).__name__}: {exc}"[:200]
            continue
        error = max(relative_error(got, want) for got, want in zip(result, expected, strict=True))
        outcomes[lane]["wrong"] = error > RELATIVE_TOLERANCE
        outcomes[lane]["max_rel_error"] = error
    return {"mode": args.child, "seconds": seconds, "lanes": outcomes, **extra}


def relative_error(got: Any, want: Any) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


Workload = tuple[Callable[[int], Any], Callable[[Any], list]]


def fla_workload(args: argparse.Namespace, device: Any) -> Workload:
    import torch
    import torch.nn.functional as F

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise SystemExit(
            f"needs flash-linear-attention (pip install flash-linear-attention==0.6.0): {exc}"
        ) from exc
    batch, heads, dim = 2, 4, 128

    def make_inputs(lane: int) -> tuple:
        gen = torch.Generator().manual_seed(1000 + lane)

        def randn(*shape: int, dtype: Any = torch.bfloat16) -> Any:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        q, k, v = (randn(batch, args.seq_len, heads, dim).requires_grad_() for _ in range(3))
        g = F.logsigmoid(randn(batch, args.seq_len, heads, dtype=torch.float32)).requires_grad_()
        beta = randn(batch, args.seq_len, heads).sigmoid().requires_grad_()
        do = randn(batch, args.seq_len, heads, dim)
        return q, k, v, g, beta, do

    def step(inputs: tuple) -> list:
        q, k, v, g, beta, do = inputs
        if args.forward_only:
            with torch.no_grad():
                o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            return [o.clone()]
        for t in (q, k, v, g, beta):
            t.grad = None
        # Backward on this thread too, as lanes running whole steps do.
        with torch.autograd.set_multithreading_enabled(False):
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            o.backward(do)
        return [o.detach().clone()] + [t.grad.clone() for t in (q, k, v, g, beta)]

    return make_inputs, step


def toy_workload(args: argparse.Namespace, device: Any) -> Workload:
    """Two autotuned kernels with positional launches, reset_to_zero and restore_value:
    enough to race in bare Triton, and runnable in Triton's interpreter."""
    import torch
    import triton
    import triton.language as tl

    globals()["tl"] = tl
    options: dict[str, Any] = {}
    if os.environ.get("TRITON_INTERPRET") == "1":

        def cpu_do_bench(kernel_call: Callable[[], None], quantiles: Any) -> list[float]:
            start = time.perf_counter()
            kernel_call()
            ms = (time.perf_counter() - start) * 1e3
            return [ms, ms, ms]

        options["do_bench"] = cpu_do_bench
    configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64, 128)]
    accumulate = triton.autotune(
        configs, key=["n"], reset_to_zero=["out_ptr"], restore_value=["acc_ptr"], **options
    )(triton.jit(toy_accumulate))
    scale = triton.autotune(configs, key=["n"], **options)(triton.jit(toy_scale))
    n = max(64, args.seq_len // 16)

    def make_inputs(lane: int) -> tuple:
        gen = torch.Generator().manual_seed(lane)
        x = torch.randint(-50, 50, (n,), generator=gen).float().to(device)
        acc = torch.randint(-50, 50, (n,), generator=gen).float().to(device)
        return x, acc

    def step(inputs: tuple) -> list:
        x, acc0 = inputs
        acc, out, y = acc0.clone(), torch.zeros_like(x), torch.empty_like(x)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
        accumulate[grid](x, acc, out, n)
        scale[grid](out, y, n, 3.0)
        return [acc, out, y]

    return make_inputs, step


def toy_accumulate(x_ptr, acc_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: F821 - set in toy_workload
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # noqa: F821
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)  # noqa: F821
    tl.store(acc_ptr + offs, tl.load(acc_ptr + offs, mask=mask) + x, mask=mask)  # noqa: F821
    tl.atomic_add(out_ptr + offs, x * 2, mask=mask)  # noqa: F821


def toy_scale(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):  # noqa: F821
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # noqa: F821
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)  # noqa: F821


if __name__ == "__main__":
    sys.exit(main())
