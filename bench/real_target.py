"""Section 6: a real target. Hugging Face transformers' Qwen3-Next, built from a config
with random weights (examples/dflash/hf.py), at three sizes: small, launch-bound (8 layers,
hidden 1024, T=1024); medium, compute-bound (16 layers, hidden 2048, T=4096); and large,
the scale users train at (a 23 B Qwen3-Next-style hybrid: hidden 5120, 64 layers, full
attention with head_dim 256, built on the GPU; microbatches of 512-2048 tokens).
The default run measures small; --full all three and torch.compile.

- Target step: N microbatches of one forward each, on N = 1, 2, 4 lanes of one GPU:
  ThreadPoolExecutor threads with a stream each, eager pydflash lanes, and graph lanes
  (pydflash.TargetGraphs, captured before timing), each against the eager sequential
  loop sampled in the same rounds.
- Pipeline step (the DFlash example's drafter on its own lane) with an eager target and
  with a TargetGraphs target, against the sequential and ThreadPoolExecutor loops.
- Fidelity (small, dense and MoE): the graph output's relative error against eager on
  the same unpadded input, beside the noise floor of padding alone (bench/fidelity.py;
  `python -m bench.fidelity` is the diagnostic that says where the difference comes from).
- Large: the eager loop against graph lanes over microbatches of mixed lengths, and
  what TargetGraphs' policy chose (buckets, padding waste, buckets left eager).
- torch.compile(mode="reduce-overhead") of the same forward, in a subprocess with a
  wall-clock limit (--full only): its step time if it compiles in time, and whether
  calling it from several threads works.

Each row's note names the kernels the eager forward ran (bench/kernels.py): FLA or
PyTorch's reference for the gated delta rule, causal-conv1d or PyTorch's for the short
convolution, and the SDPA backend; PYDFLASH_BENCH_FALLBACK=causal_conv1d measures without
causal-conv1d.

Rows report samples/s and tokens/s, which drafter-training users compare. Without a GPU
the section runs the tiny config, eager rows only.

    python -m bench.real_target [--quick | --full] [--sizes small,medium,large]
        [--lanes 1,2,4] [--batch 1] [--seq-small 1024] [--seq-medium 4096] [--reps 20]
        [--no-fidelity] [--compile-timeout 180] [--compile-sizes small] [--compile-only]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import sys
from typing import Any

import torch

from bench import fidelity, fidelity_report, kernels
from bench.common import Context, Row, compare, counts_arg, interleaved_medians, not_run
from bench.harness import (
    Setup,
    cpu_lanes,
    executor_step,
    lanes_step,
    loop_baselines,
    n_lanes,
    sequential_step,
    step_time,
)
from bench.real_target_common import (
    GRAPH_STEP_GOAL,
    NEEDS_GPU,
    PIPELINE_GOAL,
    SECTION,
    SIZES,
    Bench,
    Options,
    make_bench,
)
from bench.real_target_compile import compile_main, compiled_rows
from bench.real_target_large import measure_large
from examples.dflash.loops import PipelineLoop, build_models, target_forward
from pydflash import Dispatcher, TargetGraphs
from pydflash.pipeline.stages import EagerTarget


def run(ctx: Context) -> list[Row]:
    """Without transformers, HFTargetConfig.load raises ModuleNotFoundError: bench.run
    reports the section as not run, naming the missing package."""
    options = (ctx.options.get(SECTION) or Options()).for_run(ctx)
    kernels.apply_fallbacks()
    if ctx.gpus:
        rows = []
        for size in options.sizes:
            rows += measure_size(ctx, options, size)
            if size == "small" and options.fidelity and not options.compile_only:
                rows += fidelity_rows(ctx)
        return rows
    with cpu_lanes():
        return measure_cpu(ctx, options)


# --- one size ------------------------------------------------------------------------------
def measure_size(ctx: Context, options: Options, size: str) -> list[Row]:
    options = options.for_run(ctx)
    if size == "large":
        return measure_large(ctx, options)
    bench = make_bench(ctx, options, size)
    rows = []
    if not options.compile_only:
        ctx.progress(f"{bench.name}: building the target")
        models = build_models(bench.job, bench.placement)
        rows += target_steps(ctx, options, bench, models.targets[0])
        rows += pipeline_steps(ctx, options, bench, models)
        del models
        torch.cuda.empty_cache()  # the compile child needs the memory more than this process
    limit = options.compile_timeout or 0
    if size in options.compile_sizes and limit > 0:
        rows += compiled_rows(ctx, options, bench, size, limit)
    elif size in options.compile_sizes:
        why = "skipped (--compile-timeout 0)" if ctx.full else "--full runs only (minutes)"
        rows.append(not_run(SECTION, f"{bench.name}: torch.compile reduce-overhead", why))
    return rows


def measure_cpu(ctx: Context, options: Options) -> list[Row]:
    bench = make_bench(ctx, options, "tiny")
    models = build_models(bench.job, bench.placement)
    lanes = tuple(n for n in options.lanes if n <= 2) or (1,)  # CI has two cores
    rows = target_steps(ctx, dataclasses.replace(options, lanes=lanes), bench, models.targets[0])
    rows += pipeline_steps(ctx, options, bench, models)
    rows.append(not_run(SECTION, f"{bench.name}: torch.compile reduce-overhead", NEEDS_GPU))
    if options.fidelity:
        rows += [
            not_run(SECTION, f"{label}: graph output vs eager, relative error", NEEDS_GPU)
            for label in fidelity_labels()
        ]
    return rows


# --- fidelity --------------------------------------------------------------------------------
def fidelity_labels() -> list[str]:
    size = SIZES["small"][0]
    return [
        f"{size}{', MoE' if moe else ''}, 1x{fidelity.SEQ} padded to "
        f"{fidelity.bucket_of(fidelity.SEQ)}"
        for moe in (False, True)
    ]


def fidelity_rows(ctx: Context) -> list[Row]:
    """Graph vs eager on the same unpadded input, beside padding's noise floor, for the
    small target dense and MoE (bench/fidelity.py)."""
    rows = []
    for moe in (False, True):
        ctx.progress(f"fidelity, {'MoE' if moe else 'dense'}: graph vs eager, padding's floor")
        target = fidelity.build(SIZES["small"][0], moe)
        rows.append(fidelity_report.row(SECTION, fidelity.measure(target)))
        del target
        torch.cuda.empty_cache()
    return rows


# --- target step ---------------------------------------------------------------------------
def target_steps(ctx: Context, options: Options, bench: Bench, model: torch.nn.Module) -> list[Row]:
    forward = target_forward(model)
    most = max(options.lanes)
    batches = bench.batches(most)
    ctx.progress(f"{bench.name}: warm-up (compiles and autotunes the target's kernels)")
    with torch.no_grad():
        forward(batches[0])
    bench.synchronize()
    bench.kernels = kernels.describe(model, forward, batches[0])
    ctx.progress(f"{bench.name}: {bench.kernels_note()}")
    reps = options.reps
    dispatcher = Dispatcher([bench.device] * most)
    lanes = dispatcher.lanes
    eager = EagerTarget(forward)
    graphs = TargetGraphs(forward) if bench.on_gpu else None
    rows = []
    try:
        if graphs is not None:
            ctx.progress(f"{bench.name}: capturing graphs on {most} lanes")
            graphs.warmup(lanes, batches[0], [(bench.job.batch, bench.job.seq)])
        for n in options.lanes:
            ctx.progress(f"{bench.name}: target step on {n_lanes(n)}")
            streams = [torch.cuda.Stream(bench.device) if bench.on_gpu else None for _ in range(n)]
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                fns = {
                    "sequential": lambda n=n: sequential_step(
                        forward, batches[:n], bench.synchronize
                    ),
                    "executor": lambda n=n, pool=pool, streams=streams: executor_step(
                        [forward] * n, batches[:n], pool, streams, bench.synchronize
                    ),
                    "lanes": lambda n=n: lanes_step(
                        [eager] * n, lanes[:n], batches[:n], bench.synchronize
                    ),
                }
                if graphs is not None:
                    fns["graphs"] = lambda n=n: lanes_step(
                        [graphs] * n, lanes[:n], batches[:n], bench.synchronize
                    )
                times = interleaved_medians(fns, reps)
            rows += target_rows(bench, n, times, graphs)
        if graphs is None:
            rows.append(
                not_run(
                    SECTION,
                    f"{bench.name}, {n_lanes(most)}: target step, graph lanes",
                    NEEDS_GPU,
                    target=GRAPH_STEP_GOAL,
                )
            )
    finally:
        dispatcher.shutdown()
    return rows


def target_rows(bench: Bench, n: int, times: dict[str, float], graphs: Any) -> list[Row]:
    seq, ex = times["sequential"], times["executor"]
    names = {
        "executor": "ThreadPoolExecutor + streams",
        "lanes": "eager lanes",
        "graphs": "graph lanes",
    }
    rows = []
    for key, label in names.items():
        if key not in times:
            continue
        t = times[key]
        note = f"{bench.rate(t, n)}; sequential: {bench.rate(seq, n)}"
        if key != "executor":
            note += f"; x{t / ex:.3f} vs ThreadPoolExecutor ({ex * 1e3:.3f} ms)"
        if bench.kernels:
            note += f"; eager {bench.kernels_note()}"
        extra = {
            "executor_ms": ex * 1e3,
            "ratio_vs_executor": t / ex,
            "samples_per_s": n * bench.job.batch / t,
            "tokens_per_s": n * bench.job.batch * bench.job.seq / t,
            "kernels": bench.kernels,
        }
        if key == "graphs":
            stats = graphs.stats()
            extra["graphs"] = stats
            if stats["fallbacks"]:
                note += f"; ran eagerly: {'; '.join(stats['fallbacks'])}"
        goal = GRAPH_STEP_GOAL if key == "graphs" and n == 4 and bench.size == "small" else None
        rows.append(
            compare(
                SECTION,
                f"{bench.name}, {n_lanes(n)}: target step, {label}",
                t * 1e3,
                "ms",
                "eager sequential",
                seq * 1e3,
                goal,
                note,
                **extra,
            )
        )
    return rows


# --- pipeline step -------------------------------------------------------------------------
def pipeline_steps(ctx: Context, options: Options, bench: Bench, models: Any) -> list[Row]:
    job, placement = bench.job, bench.placement
    setup = Setup.for_model(ctx, job, placement, steps=options.pipeline_steps, on_gpu=bench.on_gpu)
    warm = setup.batches(1)[0]
    graph_stats = None
    times = loop_baselines(setup, models, ctx.progress, f"{bench.name}: ")
    for graphs in (False, True) if bench.on_gpu else (False,):
        ctx.progress(f"{bench.name}: pipeline, {'graph' if graphs else 'eager'} target")
        loop = PipelineLoop(models, placement, job, depth=2, graphs=graphs)
        try:
            loop.warm_up(warm)
            times["graphs" if graphs else "eager"] = step_time(setup, loop.steps)
            if graphs:
                graph_stats = loop.graph_stats()
        finally:
            loop.close()
    where = (
        f"{len(placement.targets)} target lane(s), 1 drafter lane on {bench.device}; "
        f"{job.accumulate} microbatches per step"
    )
    if bench.kernels:
        where += f"; eager {bench.kernels_note()}"
    seq, ex = times["sequential"], times["executor"]
    rows = [
        compare(
            SECTION,
            f"{bench.name}: pipeline step, ThreadPoolExecutor loop",
            ex * 1e3,
            "ms",
            "sequential loop",
            seq * 1e3,
            note=f"{where}; {bench.rate(ex, job.accumulate)}",
        )
    ]
    for key, label in (("eager", "eager target"), ("graphs", "graph target")):
        name = f"{bench.name}: pipeline step, {label}"
        if key not in times:
            rows.append(not_run(SECTION, name, NEEDS_GPU, target=PIPELINE_GOAL))
            continue
        t = times[key]
        goal = PIPELINE_GOAL if key == "graphs" and bench.size == "small" else None
        note = (
            f"{where}; {bench.rate(t, job.accumulate)}; x{t / seq:.3f} vs the sequential "
            f"loop ({seq * 1e3:.3f} ms)"
        )
        extra = {"sequential_ms": seq * 1e3, "samples_per_s": job.accumulate * job.batch / t}
        if graph_stats is not None and key == "graphs":
            extra["graphs"] = graph_stats
        rows.append(
            compare(
                SECTION,
                name,
                t * 1e3,
                "ms",
                "ThreadPoolExecutor loop, eager target",
                ex * 1e3,
                goal,
                note,
                **extra,
            )
        )
    return rows


# --- command line ----------------------------------------------------------------------------
def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in SIZES for n in names):
        raise argparse.ArgumentTypeError(f"expected sizes from {', '.join(SIZES)}, got {text!r}")
    return names


_counts = counts_arg("lane", "1,2,4")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments go to bench.run (--quick, --full, --fallback, --json, --plot).",
    )
    p.add_argument(
        "--sizes",
        type=_names,
        help="small, medium, large (default small; --full all three, --quick small,medium)",
    )
    p.add_argument(
        "--lanes", type=_counts, help="lane counts, e.g. 1,2,4 (default 1,4; --full 1,2,4)"
    )
    p.add_argument("--batch", type=int, default=Options.batch, help="sequences per microbatch")
    for size, (_, full, short) in SIZES.items():
        if size == "large":  # microbatches of LARGE_LENGTHS
            continue
        p.add_argument(
            f"--seq-{size}",
            type=int,
            help=f"tokens per sequence (default {full}, {short} with --quick)",
        )
    p.add_argument(
        "--reps",
        type=int,
        help="target-step samples per alternative (default 8, 20 with --full, 5 quick)",
    )
    p.add_argument("--pipeline-steps", type=int, help="timed pipeline steps (default 8, 3 quick)")
    p.add_argument("--accumulate", type=int, default=Options.accumulate)
    p.add_argument("--ratio", default=Options.ratio, help="pipeline target:drafter lanes")
    p.add_argument("--moe", action="store_true", help="MoE blocks instead of a dense MLP")
    p.add_argument("--no-fidelity", action="store_true", help="skip the graph-vs-eager error rows")
    p.add_argument(
        "--compile-timeout",
        type=float,
        help="seconds for the torch.compile subprocess (default: 180 with --full, else "
        "skipped; 0 skips)",
    )
    p.add_argument(
        "--compile-sizes",
        type=_names,
        default=Options.compile_sizes,
        help="sizes whose forward torch.compile also runs (default: small)",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="only the torch.compile rows, for --compile-sizes",
    )
    p.add_argument("--compile-child", choices=list(SIZES), help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def options_of(args: argparse.Namespace) -> Options:
    return Options(
        sizes=args.sizes,
        lanes=args.lanes,
        batch=args.batch,
        seq={size: getattr(args, f"seq_{size}", None) for size in SIZES},
        reps=args.reps,
        pipeline_steps=args.pipeline_steps,
        accumulate=args.accumulate,
        ratio=args.ratio,
        moe=args.moe,
        fidelity=not args.no_fidelity,
        compile_timeout=args.compile_timeout,
        compile_sizes=args.compile_sizes,
        compile_only=args.compile_only,
    )


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(argv)
    options = options_of(args)
    if args.compile_child:
        compile_main(args.compile_child, options)
        return 0
    from bench import run as suite

    return suite.main(["--sections", SECTION, *rest], options={SECTION: options})


if __name__ == "__main__":
    sys.exit(main())
