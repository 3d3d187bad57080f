"""Section 5: the target/drafter pipeline on the DFlash example's models.

- step time of the pipeline vs a sequential loop vs a ThreadPoolExecutor loop;
- the hidden-state bytes held at each prefetch depth;
- each stage's wall, GPU-busy and host time, and the pipeline's step against its limit
  (the stages' GPU-busy times), launch-bound and GPU-bound, with eager and graph
  drafters and targets (bench/pipeline_limits.py).

Placement: target on cuda:0 and drafter on cuda:1 with two GPUs, two lanes of cuda:0
with one, two CPU lanes without (tiny sizes; the timing rows then say they need a GPU).

    python -m bench.pipeline [--quick]        # this section alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import torch

import pydflash
from bench import pipeline_limits
from bench.common import Context, Row, check
from bench.harness import Setup, cpu_lanes, step_time, synchronize
from examples.dflash.loops import (
    Job,
    PipelineLoop,
    Placement,
    build_models,
    executor_steps,
    sequential_steps,
    target_forward,
)
from examples.dflash.models import TINY_DRAFTER, TINY_TARGET, DrafterConfig, TargetConfig

SECTION = "pipeline"
DEPTHS = (1, 2, 3, 4)  # --full; the default and --quick runs take the first two
CPU_NOTE = (
    "needs a GPU: on CPU lanes both stages compute on the host's shared cores, "
    "and tiny ops hold the GIL, so the stages cannot overlap"
)


def make_setup(ctx: Context) -> Setup:
    if ctx.gpus >= 2:
        placement = Placement(("cuda:0",), ("cuda:1",))
    elif ctx.gpus == 1:
        placement = Placement(("cuda:0",), ("cuda:0",))
    else:
        placement = Placement(("cpu",), ("cpu",))
    if ctx.gpus:
        # The default run takes the smaller target too: the ratios, not the sizes, answer it.
        small = not ctx.full
        target = TargetConfig(layers=8, capture_layers=(1, 4, 7)) if small else TargetConfig()
        batch = 4 if small else 8
        job = Job(target, DrafterConfig(), seq=1024, batch=batch, accumulate=4, lr=3e-4)
        return Setup(
            job,
            placement,
            steps=ctx.reps(8, 4, default=4),
            reps=ctx.reps(3, 2, default=2),
            warmup=ctx.reps(3, 3, default=2),
            on_gpu=True,
        )
    job = Job(TINY_TARGET, TINY_DRAFTER, seq=32, batch=2, accumulate=2, lr=3e-3)
    return Setup(job, placement, steps=ctx.reps(10, 3), reps=ctx.reps(3, 1), warmup=1, on_gpu=False)


def warm_targets(models, setup: Setup, batch: dict) -> None:
    with torch.no_grad():
        for target, device in zip(models.targets, setup.placement.targets, strict=True):
            target_forward(target)({k: t.to(device) for k, t in batch.items()})


def loop_times(setup: Setup, ctx: Context) -> dict[str, float]:
    job, placement = setup.job, setup.placement
    warm = setup.batches(1)[0]
    times = {}
    ctx.progress("pipeline: warming the target (compiles its kernels)")
    models = build_models(job, placement)
    # Under pydflash's guards a cold autotune key compiles its configs on several threads
    # (Note [Compiling configs in parallel]); the loops' timed steps come after.
    with pydflash.install_guards(missing_ok=True) or contextlib.nullcontext():
        warm_targets(models, setup, warm)
    ctx.progress("pipeline: sequential loop")
    times["sequential"] = step_time(
        setup, lambda b, n: sequential_steps(models, placement, job, b, n)
    )
    ctx.progress("pipeline: executor loop")
    models = build_models(job, placement)
    times["executor"] = step_time(
        setup, lambda b, n: executor_steps(models, placement, job, b, n, depth=2)
    )
    ctx.progress("pipeline: pydflash pipeline")
    loop = PipelineLoop(build_models(job, placement), placement, job, depth=2)
    try:
        loop.warm_up(warm)
        times["pipeline"] = step_time(setup, loop.steps)
    finally:
        loop.close()
    return times


def memory_by_depth(setup: Setup, ctx: Context) -> list[dict[str, Any]]:
    job, placement = setup.job, setup.placement
    steps = max(setup.steps, 2)
    batches = setup.batches(steps * job.accumulate)
    warm = setup.batches(1)[0]
    out = []
    for depth in ctx.pick(DEPTHS, DEPTHS[:2], DEPTHS[:2]):
        ctx.progress(f"pipeline: hidden states at depth {depth}")
        loop = PipelineLoop(build_models(job, placement), placement, job, depth=depth)
        try:
            loop.warm_up(warm)
            allocated = {}
            if setup.on_gpu:
                for device in set(placement.lanes):
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    allocated[device] = torch.cuda.memory_allocated(device)
            for _ in loop.steps(batches, steps):
                pass
            synchronize(setup)
            stats = loop.pipe.stats()
            allocator_peak = {
                device: torch.cuda.max_memory_allocated(device) - base
                for device, base in allocated.items()
            }
        finally:
            loop.close()
        out.append(
            {
                "depth": depth,
                "peak": stats["hidden_bytes_peak"],
                "per_microbatch": stats["hidden_bytes_per_microbatch"],
                "allocator_peak_over_start": allocator_peak,
            }
        )
    return out


def run(ctx: Context) -> list[Row]:
    setup = make_setup(ctx)
    if setup.on_gpu:
        return measure(setup, ctx)
    with cpu_lanes():
        return measure(setup, ctx)


def measure(setup: Setup, ctx: Context) -> list[Row]:
    where = (
        f"target {setup.placement.targets[0]}, drafter {setup.placement.drafters[0]}; "
        f"{setup.job.tokens_per_step} tokens/step"
    )
    times = loop_times(setup, ctx)
    rows = []
    ms = {name: t * 1e3 for name, t in times.items()}
    for baseline in ("sequential", "executor"):
        ratio = times["pipeline"] / times[baseline]
        rows.append(
            Row(
                SECTION,
                f"pipeline step vs {baseline} loop",
                ms["pipeline"],
                "ms",
                baseline_name=f"{baseline} loop step",
                baseline=ms[baseline],
                ratio=ratio,
                note=where if setup.on_gpu else f"{where}; {CPU_NOTE}",
            )
        )
    for m in memory_by_depth(setup, ctx):
        ratio = m["peak"] / m["per_microbatch"]
        rows.append(
            Row(
                SECTION,
                f"hidden-state bytes held, depth {m['depth']}",
                m["peak"],
                "bytes",
                baseline_name="one microbatch's hidden states",
                baseline=m["per_microbatch"],
                ratio=ratio,
                target=f"<= {m['depth']}",
                met=check(ratio, m["depth"]),
                note="peak of target results not yet consumed plus their drafter-side copies",
                extra={"allocator_peak_over_start_bytes": m["allocator_peak_over_start"]},
            )
        )
    return rows + pipeline_limits.rows(ctx)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pydflash benchmark section 5: the pipeline")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    ctx = Context(
        quick=args.quick,
        gpus=torch.cuda.device_count(),
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    rows = run(ctx)
    verdicts = {True: "met", False: "not met", None: "n/a (see note)"}
    for row in rows:
        ratio = ""
        if row.ratio is not None:
            ratio = f"  x{row.ratio:.3f} vs {row.baseline_name} ({row.baseline:,.3f})"
        goal = "" if row.target is None else f"  goal {row.target}: {verdicts[row.met]}"
        value = "not run" if row.value is None else f"{row.value:,.3f} {row.unit}"
        print(f"{row.name:42s} {value:>17s}{ratio}{goal}")
        if row.note:
            print(f"{'':42s} {row.note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row.as_dict() for row in rows], f, indent=1)


if __name__ == "__main__":
    main()
