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
from pathlib import Path
from typing import Any

import torch

from bench import fidelity, kernels
from bench.common import Context, Row, compare, counts_arg, interleaved_medians, not_run
from bench.pipeline import Setup, step_time
from examples.dflash.data import MarkovTokens
from examples.dflash.hf import QWEN3_NEXT, HFTarget, HFTargetConfig, default_layers
from examples.dflash.loops import (
    Job,
    PipelineLoop,
    Placement,
    build_models,
    executor_steps,
    sequential_steps,
    target_forward,
)
from examples.dflash.models import TINY_DRAFTER, DrafterConfig
from pydflash import Dispatcher, TargetGraphs
from pydflash.pipeline.stages import EagerTarget

SECTION = "real_target"
ROOT = Path(__file__).resolve().parents[1]
# size -> (config name in examples/dflash/hf.py, tokens per sequence, quick tokens)
SIZES = {
    "small": ("qwen3-next-small", 1024, 1024),
    "medium": ("qwen3-next-medium", 4096, 2048),
    "large": ("qwen3-next-large", 2048, 2048),  # the longest microbatch; see LARGE
}
# The scale users train at (examples/dflash/hf.py), dense.
LARGE = dict(QWEN3_NEXT["qwen3-next-large"], num_experts=0)
LARGE_LENGTHS = (512, 2048)  # microbatch lengths drawn between these
LARGE_MICROBATCHES = 8
CPU_SIZE = ("qwen3-next-tiny", 32)
GRAPH_STEP_GOAL = "<= 0.2"  # small, 4 lanes: graph lanes vs eager sequential
PIPELINE_GOAL = "<= 0.5"  # small: pipeline with graph target vs executor loop, eager target
NEEDS_GPU = "needs a GPU: CUDA graphs replay on a GPU stream"


@dataclasses.dataclass
class Options:
    """What to measure; None picks the default for the run (quick or full)."""

    sizes: tuple[str, ...] | None = None  # default: small; --full all; --quick small, medium
    lanes: tuple[int, ...] | None = None  # default: 1, 4; --full and --quick 1, 2, 4
    batch: int = 1
    seq: dict[str, int | None] = dataclasses.field(default_factory=dict)
    reps: int | None = None  # target-step samples per alternative (20 full, 8, 5 quick)
    pipeline_steps: int | None = None  # timed optimizer steps per repetition
    accumulate: int = 4
    ratio: str = "1:1"  # pipeline target:drafter lanes, all on cuda:0
    moe: bool = False
    fidelity: bool = True  # graph vs eager error rows, dense and MoE (GPU)
    # torch.compile's first call may take minutes: --full only, the small size, with a
    # limit that keeps the section within 8 minutes on one H200.
    compile_timeout: float | None = None  # seconds (180 with --full, else skipped); 0 skips
    compile_sizes: tuple[str, ...] = ("small",)
    compile_only: bool = False  # only the torch.compile rows: the whole time limit for them

    def seq_of(self, size: str, quick: bool) -> int:
        _, full, short = SIZES[size]
        return self.seq.get(size) or (short if quick else full)

    def for_run(self, ctx: Context) -> Options:
        """These options with what was left to the run's mode filled in."""
        return dataclasses.replace(
            self,
            sizes=self.sizes
            or ctx.pick(("small", "medium", "large"), ("small", "medium"), ("small",)),
            lanes=self.lanes or ctx.pick((1, 2, 4), (1, 2, 4), (1, 4)),
            reps=self.reps or ctx.reps(20, 5, default=8),
            compile_timeout=(
                self.compile_timeout if self.compile_timeout is not None else ctx.reps(180, 0, 0)
            ),
        )


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
    # CPU lanes share the host's cores: one intra-op thread each (as bench/pipeline.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_cpu(ctx, options)
    finally:
        torch.set_num_threads(threads)


# --- one size ------------------------------------------------------------------------------
@dataclasses.dataclass
class Bench:
    """One size's target, data and what the rows say about it."""

    size: str
    name: str
    job: Job
    placement: Placement
    on_gpu: bool
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)  # what eager runs

    @property
    def device(self) -> str:
        return self.placement.targets[0]

    def batches(self, count: int, seed: int = 7) -> list[dict]:
        data = MarkovTokens(self.job.target.vocab, self.job.seq, self.job.batch, seed=seed)
        return [{k: t.to(self.device) for k, t in b.items()} for b in data.batches(0, count)]

    def rate(self, seconds: float, microbatches: int) -> str:
        samples = microbatches * self.job.batch / seconds
        return f"{samples:,.1f} samples/s, {samples * self.job.seq:,.0f} tokens/s"

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def kernels_note(self) -> str:
        return kernels.note(self.kernels) if self.kernels else ""


def make_bench(ctx: Context, options: Options, size: str) -> Bench:
    if ctx.gpus:
        config, seq, batch = SIZES[size][0], options.seq_of(size, ctx.quick), options.batch
        drafter, device = DrafterConfig(), "cuda:0"
    else:
        (config, seq), batch, drafter, device = CPU_SIZE, 2, TINY_DRAFTER, "cpu"
    target = HFTargetConfig.load(config, moe=options.moe)
    job = Job(target, drafter, seq=seq, batch=batch, accumulate=options.accumulate, lr=3e-4)
    label = f"{size} ({config}{', MoE' if options.moe else ''}, {batch}x{seq})"
    return Bench(size, label, job, Placement.parse([device], options.ratio), device != "cpu")


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


# --- large ---------------------------------------------------------------------------------
def build_large(device: str) -> HFTarget:
    """LARGE with random weights, made on the GPU in bf16 (a CPU build of 23 B parameters
    would take minutes and 47 GB of host memory)."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(**LARGE)
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(dtype)
    layers = default_layers(config.num_hidden_layers)
    return HFTarget(model, layers).eval().requires_grad_(False)


def measure_large(ctx: Context, options: Options) -> list[Row]:
    """Microbatches of mixed lengths through the eager loop and through graph lanes on 1
    and 2 lanes of one GPU; and what TargetGraphs chose for them."""
    low, high = LARGE_LENGTHS
    name = f"large (23B hybrid, {LARGE_MICROBATCHES} microbatches of {low}-{high} tokens)"
    device = "cuda:0"
    ctx.progress(f"{name}: building on the GPU")
    model = build_large(device)
    forward = target_forward(model)
    generator = torch.Generator().manual_seed(7)
    lengths = [
        int(t) for t in torch.randint(low, high + 1, (LARGE_MICROBATCHES,), generator=generator)
    ]
    batches = [
        {"input_ids": torch.randint(LARGE["vocab_size"], (1, t), generator=generator).to(device)}
        for t in lengths
    ]
    ctx.progress(f"{name}: warm-up (compiles and autotunes the target's kernels)")
    with torch.no_grad():
        forward(batches[0])
    torch.cuda.synchronize(device)
    found = kernels.describe(model, forward, batches[0])
    lanes_of = (1, 2)
    dispatcher = Dispatcher([device] * max(lanes_of))
    lanes = dispatcher.lanes
    graphs = TargetGraphs(forward)

    def eager_loop() -> None:
        with torch.no_grad():
            for batch in batches:
                forward(batch)
        torch.cuda.synchronize(device)

    def graph_step(n: int) -> None:
        futures = [graphs.submit(lanes[k % n], b) for k, b in enumerate(batches)]
        results = [future.result() for future in futures]
        torch.cuda.synchronize(device)
        for result in results:
            graphs.release(result)

    try:
        buckets = sorted({fidelity.bucket_of(t) for t in lengths})
        for lane in lanes:  # one lane at a time: a capture beside another lane's work can fail
            ctx.progress(f"{name}: capturing buckets {buckets} on {lane.label}")
            graphs.warmup([lane], batches[0], [(1, b) for b in buckets])
        reps = ctx.reps(4, 1, default=2)
        ctx.progress(f"{name}: eager loop and graph lanes, {reps} samples each")
        fns = {"eager": eager_loop}
        for n in lanes_of:
            fns[f"graphs{n}"] = lambda n=n: graph_step(n)
        times = interleaved_medians(fns, reps, warmup=1)
        stats = graphs.stats()
    finally:
        dispatcher.shutdown()
    tokens = sum(lengths)
    eager_s = times["eager"]
    note = f"eager {kernels.note(found)}"
    rows = [
        compare(
            SECTION,
            f"{name}: eager loop",
            eager_s * 1e3,
            "ms",
            note=f"{tokens / eager_s:,.0f} tokens/s; lengths {lengths}; {note}",
            kernels=found,
            lengths=lengths,
        )
    ]
    for n in lanes_of:
        t = times[f"graphs{n}"]
        rows.append(
            compare(
                SECTION,
                f"{name}, {n_lanes(n)}: graph lanes",
                t * 1e3,
                "ms",
                "eager loop",
                eager_s * 1e3,
                note=f"{tokens / t:,.0f} tokens/s; {note}",
                graphs=stats,
            )
        )
    rows.append(policy_row(name, stats))
    return rows


def policy_row(name: str, stats: dict[str, Any]) -> Row:
    """What TargetGraphs chose: its padding waste (the fraction of replayed tokens that
    were padding), the buckets it left eager and why, the buckets and pool per lane."""
    note = "; ".join(
        f"{label}: buckets {[b[1] for b in lane['buckets']]}, "
        f"pool {lane['pool_bytes'] / 2**30:.2f} GiB"
        for label, lane in stats["lanes"].items()
    )
    if "eager_buckets" in stats:
        note += f"; buckets run eagerly: {stats['eager_buckets'] or 'none'}"
    if stats["fallbacks"]:
        note += f"; fallbacks: {'; '.join(stats['fallbacks'])}"
    row_name = f"{name}: TargetGraphs' choice, padding waste"
    waste = stats.get("padding_waste")
    if waste is None:
        return not_run(SECTION, row_name, f"TargetGraphs.stats() has no padding_waste; {note}")
    return compare(SECTION, row_name, float(waste), "fraction", note=note, graphs=stats)


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
        rows.append(fidelity.row(SECTION, fidelity.measure(target)))
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
                    "sequential": lambda n=n: sequential_step(bench, forward, batches[:n]),
                    "executor": lambda n=n, pool=pool, streams=streams: executor_step(
                        bench, forward, batches[:n], pool, streams
                    ),
                    "lanes": lambda n=n: lanes_step(bench, eager, lanes[:n], batches[:n]),
                }
                if graphs is not None:
                    fns["graphs"] = lambda n=n: lanes_step(bench, graphs, lanes[:n], batches[:n])
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


def n_lanes(n: int) -> str:
    return f"{n} lane" if n == 1 else f"{n} lanes"


def sequential_step(bench: Bench, forward: Callable, batches: list[dict]) -> None:
    with torch.no_grad():
        for batch in batches:
            forward(batch)
    bench.synchronize()


def executor_step(
    bench: Bench,
    forward: Callable,
    batches: list[dict],
    pool: concurrent.futures.Executor,
    streams: list[Any],
) -> None:
    def one(i: int) -> None:
        with torch.no_grad():
            if streams[i] is None:
                forward(batches[i])
                return
            # The inputs were made on the default stream, long before: no wait needed.
            with torch.cuda.stream(streams[i]):
                forward(batches[i])

    list(pool.map(one, range(len(batches))))
    bench.synchronize()


def lanes_step(bench: Bench, stage: Any, lanes: list, batches: list[dict]) -> None:
    futures = [stage.submit(lane, batch) for lane, batch in zip(lanes, batches, strict=True)]
    results = [future.result() for future in futures]
    bench.synchronize()
    if isinstance(stage, TargetGraphs):
        for result in results:
            stage.release(result)  # its output buffers serve the next replays


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
    times, graph_stats = {}, None
    ctx.progress(f"{bench.name}: sequential loop")
    times["sequential"] = step_time(
        setup, lambda b, n: sequential_steps(models, placement, job, b, n)
    )
    ctx.progress(f"{bench.name}: ThreadPoolExecutor loop")
    times["executor"] = step_time(
        setup, lambda b, n: executor_steps(models, placement, job, b, n, depth=2)
    )
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


# --- torch.compile ---------------------------------------------------------------------------
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
            "compiled": lambda: sequential_step(bench, compiled, batches[:1]),
            "eager": lambda: sequential_step(bench, forward, batches[:1]),
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
        _timed(lambda: sequential_step(bench, forward, batches)) for _ in range(5)
    )
    return {"error": None, "compiled_ms": statistics.median(samples) * 1e3, "eager_ms": eager * 1e3}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
