"""Section 7: scale-out. Can one Python process drive N GPUs at N times the speed of
one? The bench's real target (Hugging Face Qwen3-Next from a config, examples/dflash/
hf.py, qwen3-next-small by default), one lane per GPU, N = 1, 2, 4, 8 up to the GPUs
visible.

- Target samples/s with one forward per GPU at once, four ways: graph lanes
  (pydflash.TargetGraphs, captured before timing), eager lanes, ThreadPoolExecutor
  threads with a stream per GPU, and one process per GPU (bench/scale_out_worker.py in
  torchrun's environment, its forwards started on a barrier). The in-process ways are
  sampled in turn; each row's ratio is its speed-up over the same way on one GPU (on
  one GPU: its speed over the ThreadPoolExecutor). Goals: graph lanes reach a speed-up
  of 0.95 N, and at N GPUs keep at least their one-GPU margin over the
  ThreadPoolExecutor.
- Pipeline step with a graph target, target and drafter lanes on separate GPUs, 1:1 on
  2 GPUs and 3:1 on 4; the hidden states cross GPUs by peer copy. Goal: at most 1.05x
  the slower stage timed alone.

A row that needs more GPUs than are visible says so. Without a GPU the section runs the
tiny config on 1 and 2 CPU lanes (eager lanes, ThreadPoolExecutor, CPU processes), so
that CI runs the code paths; those figures mean nothing about scaling.

    python -m bench.scale_out [--quick] [--gpus 1,2,4,8] [--config qwen3-next-small]
        [--batch 1] [--seq 1024] [--reps 20] [--process-timeout 300] [--no-processes]
        [--pipelines 1:1,3:1] [--pipeline-steps 8] [--accumulate 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import gc
import sys
from collections.abc import Callable

import torch

from bench import kernels
from bench.common import Context, Row, compare, counts_arg, interleaved_medians, not_run
from bench.harness import cpu_lanes, executor_step, lanes_step, on_device
from bench.real_target_common import CPU_SIZE, NEEDS_GPU
from bench.scale_out_common import (
    SCALING,
    SECTION,
    WAYS,
    Options,
    Setting,
    make_setting,
)
from bench.scale_out_pipeline import parse_ratio, pipeline_row
from bench.scale_out_processes import process_times
from examples.dflash.hf import QWEN3_NEXT
from examples.dflash.loops import target_dtype, target_forward
from pydflash import Dispatcher, TargetGraphs
from pydflash.pipeline.stages import EagerTarget


def run(ctx: Context) -> list[Row]:
    """Without transformers, HFTargetConfig.load raises ModuleNotFoundError: bench.run
    reports the section as not run, naming the missing package."""
    options = ctx.options.get(SECTION) or Options()
    if ctx.gpus:
        return measure(ctx, options, make_setting(options, torch.cuda.device_count()))
    with cpu_lanes():
        return measure(ctx, options, make_setting(options, 0))


def measure(ctx: Context, options: Options, setting: Setting) -> list[Row]:
    counts = sorted(set(options.counts) | {1})
    runnable = [n for n in counts if n <= setting.available]
    times, graph_stats = in_process(ctx, options, setting, runnable, graphs=setting.on_gpu)
    gc.collect()  # the replicas and their graph pools, before the workers need the memory
    if setting.on_gpu:
        torch.cuda.empty_cache()
    failure = "off (--no-processes)"
    one_gpu_default = ctx.mode == "default" and setting.on_gpu and setting.available < 2
    if one_gpu_default:  # half a minute of worker start-up for one figure
        failure = "on one GPU, --full runs it"
    elif options.processes:
        limit = options.process_timeout or (180.0 if ctx.quick else 300.0)
        processes, failure = process_times(ctx, options, setting, runnable, limit)
        for n, seconds in processes.items():
            times[n]["processes"] = seconds
    rows = scaling_rows(setting, counts, times, graph_stats, failure)
    for ratio in options.pipelines:
        rows.append(pipeline_row(ctx, options, setting, ratio))
    return rows


# --- in one process ------------------------------------------------------------------------
def in_process(
    ctx: Context, options: Options, setting: Setting, counts: list[int], graphs: bool
) -> tuple[dict[int, dict[str, float]], list[dict]]:
    """Median seconds of a step (one forward per lane, then a synchronize of every
    device) for each count and in-process way, graph lanes only with `graphs`; and the
    graph targets' stats. (On CPU lanes TargetGraphs runs its padded eager path.)"""
    most = max(counts)
    ctx.progress(f"{setting.name}: building the target on {setting.where(most)}")
    torch.manual_seed(0)
    reference = setting.config.build(target_dtype(setting.devices(1)[0]))
    replicas = [copy.deepcopy(reference).to(d) for d in setting.devices(most)]
    del reference
    forwards = [target_forward(model) for model in replicas]
    batches = setting.batches(most)
    ctx.progress(f"{setting.name}: warm-up, one device at a time (compiles and autotunes)")
    with torch.no_grad():
        for forward, batch, device in zip(forwards, batches, setting.devices(most), strict=True):
            with on_device(device):
                forward(batch)
    setting.synchronize(most)
    with on_device(setting.devices(1)[0]):
        setting.kernels = kernels.describe(replicas[0], forwards[0], batches[0])
    ctx.progress(f"{setting.name}: eager {kernels.note(setting.kernels)}")
    reps = options.reps or ctx.reps(20, 5, default=10)
    streams = [torch.cuda.Stream(d) if setting.on_gpu else None for d in setting.devices(most)]
    dispatcher = Dispatcher(setting.devices(most))
    lanes = dispatcher.lanes
    stages: dict[str, list] = {"lanes": [EagerTarget(f) for f in forwards]}
    times = {}
    try:
        if graphs:
            stages["graphs"] = [TargetGraphs(f) for f in forwards]
            ctx.progress(f"{setting.name}: capturing graphs on {most} lanes")
            for stage, lane, batch in zip(stages["graphs"], lanes, batches, strict=True):
                stage.warmup(lane, batch, [(setting.batch, setting.seq)])
        for n in counts:
            ctx.progress(f"{setting.name}: target step on {setting.where(n)}, in this process")
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                fns: dict[str, Callable[[], None]] = {
                    "executor": lambda n=n, pool=pool: executor_step(
                        forwards[:n],
                        batches[:n],
                        pool,
                        streams[:n],
                        lambda n=n: setting.synchronize(n),
                        set_device=True,
                    ),
                }
                for key, stage in stages.items():
                    fns[key] = lambda n=n, stage=stage: lanes_step(
                        stage[:n], lanes[:n], batches[:n], lambda n=n: setting.synchronize(n)
                    )
                times[n] = interleaved_medians(fns, reps)
        graph_stats = [stage.stats() for stage in stages.get("graphs", [])]
    finally:
        dispatcher.shutdown()
    return times, graph_stats


# --- rows ----------------------------------------------------------------------------------
def scaling_goal(n: int) -> str | None:
    return f"ratio >= {SCALING * n:g}" if n > 1 else None


def scaling_rows(
    setting: Setting,
    counts: list[int],
    times: dict[int, dict[str, float]],
    graph_stats: list[dict],
    failure: str | None,
) -> list[Row]:
    def rate(n: int, key: str) -> float | None:
        t = times.get(n, {}).get(key)
        return None if t is None else n * setting.batch / t

    rows = []
    for n in counts:
        prefix = f"{setting.name}, {setting.where(n)}"
        for key, label in WAYS.items():
            name = f"{prefix}: {label}"
            goal = scaling_goal(n) if key == "graphs" else None
            if n not in times:
                rows.append(not_run(SECTION, name, f"needs {n} GPUs", target=goal))
            elif key not in times[n]:
                reason = NEEDS_GPU if key == "graphs" else f"no figure: {failure or 'no report'}"
                rows.append(not_run(SECTION, name, reason, target=goal))
            else:
                rows.append(way_row(setting, n, key, name, goal, times, rate))
        if n > 1:
            rows.append(margin_row(setting, n, prefix, rate))
    fallbacks = sorted({reason for stats in graph_stats for reason in stats["fallbacks"]})
    if fallbacks:
        for row in rows:
            if row.measured and row.name.endswith(WAYS["graphs"]):
                row.note += f"; ran eagerly: {'; '.join(fallbacks)}"
    return rows


def way_row(
    setting: Setting,
    n: int,
    key: str,
    name: str,
    goal: str | None,
    times: dict[int, dict[str, float]],
    rate: Callable[[int, str], float | None],
) -> Row:
    t, value = times[n][key], rate(n, key)
    # Above one device: the speed-up over the same way on one; on one: over the executor.
    base_key = key if n > 1 else ("executor" if key != "executor" else None)
    baseline = rate(1, base_key) if base_key else None
    base_name = f"{WAYS[base_key]}, {setting.where(1)}" if baseline is not None else None
    others = [
        f"x{value / other:.3f} vs {WAYS[k]}"
        for k in WAYS
        if k != key and (other := rate(n, k)) is not None
    ]
    note = "; ".join([f"{setting.rate(t, n)}; step {t * 1e3:.3f} ms", *others])
    extra = {
        "devices": n,
        "way": key,
        "step_ms": t * 1e3,
        "samples_per_s": value,
        "tokens_per_s": value * setting.seq,
    }
    if key == "processes":
        note += "; the slowest rank's median step"
    if setting.kernels:
        note += f"; eager {kernels.note(setting.kernels)}"
        extra["kernels"] = setting.kernels
    return compare(SECTION, name, value, "samples/s", base_name, baseline, goal, note, **extra)


def margin_row(
    setting: Setting, n: int, prefix: str, rate: Callable[[int, str], float | None]
) -> Row:
    """Graph lanes over the ThreadPoolExecutor at n devices, against the one-device margin."""
    name = f"{prefix}: graph lanes over ThreadPoolExecutor"
    graphs, executor = rate(n, "graphs"), rate(n, "executor")
    one_graphs, one_executor = rate(1, "graphs"), rate(1, "executor")
    if graphs is None or executor is None or one_graphs is None or one_executor is None:
        # No target without the one-device figures: the goal is their margin.
        reason = NEEDS_GPU if n <= setting.available else f"needs {n} GPUs"
        return not_run(SECTION, name, reason)
    margin = one_graphs / one_executor
    return compare(
        SECTION,
        name,
        graphs,
        "samples/s",
        f"{WAYS['executor']}, same devices",
        executor,
        f"ratio >= {margin:.3f}",
        f"the one-device margin is x{margin:.3f} (the goal: keep it at {n} devices)",
        devices=n,
        one_device_margin=margin,
    )


# --- command line ----------------------------------------------------------------------------
_counts = counts_arg("GPU", "1,2,4,8")


def _ratios(text: str) -> tuple[str, ...]:
    ratios = tuple(r.strip() for r in text.split(",") if r.strip())
    try:
        for ratio in ratios:
            parse_ratio(ratio)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return ratios


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments go to bench.run (--quick, --json, --plot).",
    )
    p.add_argument(
        "--gpus",
        type=_counts,
        default=Options.counts,
        help="GPU counts, e.g. 1,2,4,8 (1 is always measured; counts above the "
        "GPUs visible are reported as not run)",
    )
    p.add_argument(
        "--config",
        choices=[n for n in QWEN3_NEXT if n != CPU_SIZE[0]],
        default=Options.config,
        help="the target's size",
    )
    p.add_argument("--moe", action="store_true", help="MoE blocks instead of a dense MLP")
    p.add_argument("--batch", type=int, default=Options.batch, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=Options.seq, help="tokens per sequence")
    p.add_argument(
        "--reps", type=int, help="target-step samples per way (default 10, 20 --full, 5 quick)"
    )
    p.add_argument(
        "--process-timeout",
        type=float,
        help="seconds for the worker processes, start-up included (default 300, 180 quick)",
    )
    p.add_argument("--no-processes", action="store_true", help="skip the one-process-per-GPU rows")
    p.add_argument(
        "--pipelines",
        type=_ratios,
        default=Options.pipelines,
        help="target:drafter GPUs of the pipeline rows, e.g. 1:1,3:1 (empty: none)",
    )
    p.add_argument("--pipeline-steps", type=int, help="timed pipeline steps (default 8, 3 quick)")
    p.add_argument(
        "--accumulate", type=int, default=Options.accumulate, help="microbatches per pipeline step"
    )
    return p.parse_known_args(argv)


def options_of(args: argparse.Namespace) -> Options:
    return Options(
        counts=args.gpus,
        config=args.config,
        moe=args.moe,
        batch=args.batch,
        seq=args.seq,
        reps=args.reps,
        processes=not args.no_processes,
        process_timeout=args.process_timeout,
        pipelines=args.pipelines,
        pipeline_steps=args.pipeline_steps,
        accumulate=args.accumulate,
    )


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(argv)
    from bench import run as suite

    return suite.main(["--sections", SECTION, *rest], options={SECTION: options_of(args)})


if __name__ == "__main__":
    sys.exit(main())
