"""Section: DFlash training on variable-length microbatches, eager and graph stages side by
side (issue 31).

Real data varies in length; dflash_scale's rows use exactly 768 tokens. Here each
microbatch's length is drawn from ten lengths, 320 to 1024 tokens (mean 573), with the
example's blocks: a Qwen3-8B-shaped target (transformers' Qwen3 from a config, random
weights, bf16), the published DFlash drafter (`dflash-b16`: 5 layers, block 16, 256
anchors), batch 2, accumulation 8, fused AdamW, target and drafter lanes both on cuda:0.
In one run, on the same target, the same microbatches and each time a fresh drafter of the
same weights:

- the pipeline with eager stages (`EagerTarget`, `EagerDrafter`);
- the pipeline with `TargetGraphs` + `DrafterGraphs` (policy "auto": graphs where they
  pay, Note [A policy for the whole step] in pydflash/graphs/policy.py);
- the eager stages again: the two eager runs' difference is the run's own noise, and
  their mean, before and after the graph stages, is the graph stages' baseline (a drift
  over the run weighs on both sides alike).

Two untimed eager steps come first, so that neither kind pays the process's cold start.
Each: samples/s over the whole run (50 optimizer steps on a GPU, captures included: what a
user's run sees), over its timed steps (the first 3 left out), the seconds of the first
steps; on a GPU the share of 2 more steps' wall time in which the GPU ran anything (the
profiler's device activity: near 1.0, no stage can make a step faster); and per graph
stage the seconds spent capturing, its pools' bytes, the pools given back and the
policy's choices (which buckets kept a graph, which run eagerly and why), and whether the
optimizer step replays as a graph. The samples/s rows name the objective trained: DFlash's
loss with the drafter's gamma, no loss mask (synthetic tokens). With --full also the 23 B
Qwen3-Next-style target (`qwen3-next-large`). Without a GPU the same rows run at tiny
sizes on CPU lanes, where graph stages take their padded eager path (the code runs; the
figures answer nothing).

It runs with --full (it would take the default run past three minutes), or alone:

    python -m bench.dflash_varlen [--quick | --full] [--steps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bench import limits
from bench.common import Context, Row, compare, not_run
from bench.harness import objective
from examples.dflash.data import MarkovTokens
from examples.dflash.hf import HFTargetConfig, dflash_layers
from examples.dflash.loops import Job, Models, PipelineLoop, Placement, build_models
from examples.dflash.models import DFLASH_B16, DrafterConfig

SECTION = "dflash_varlen"
LENGTHS = (320, 384, 416, 448, 512, 544, 608, 672, 800, 1024)  # mean 572.8
BATCH, ACCUMULATE = 2, 8
TARGETS = {"qwen3-8b": 36, "qwen3-next-large": 64}  # config: layers (for DFlash's layers)
TINY_LENGTHS = (12, 16, 20, 24)
TINY_DRAFTER = DrafterConfig(layers=1, heads=2, head_dim=16, block=4, anchors=4)
# The eager stages run before and after the graph stages: their difference is the run's
# own noise (a drift from run to run included), and the graph stages, in between, are set
# against the mean of the two.
KINDS = ("eager stages", "graph stages", "eager stages again")
RUN_STEPS = 50  # optimizer steps of a run on a GPU, the first ones included
WARM_START_STEPS = 2  # eager steps before anything is timed: 16 microbatches, most lengths
PROFILED_STEPS = 2  # on a GPU, after the timed steps: the share of the wall time it was busy


@dataclass
class Options:
    """The section's own settings (`python -m bench.dflash_varlen`); None: by the mode."""

    steps: int | None = None  # timed optimizer steps per kind of stage
    warmup: int | None = None  # untimed steps first (the graph stages capture in them)
    targets: tuple[str, ...] | None = None
    alone: bool = False  # run as its own command: measure without --full


@dataclass
class Plan:
    name: str  # the target's config name
    job: Job
    placement: Placement
    lengths: tuple[int, ...]
    steps: int
    warmup: int
    on_gpu: bool

    @property
    def profiled(self) -> int:
        """Steps run after the timed ones under the profiler: PROFILED_STEPS on a GPU."""
        return PROFILED_STEPS if self.on_gpu else 0


def plans(ctx: Context, options: Options) -> list[Plan]:
    """What to run: the 8 B target, and with --full the 23 B one too; tiny on CPU."""
    if not ctx.gpus:
        target = HFTargetConfig.load("qwen3-tiny", dflash_layers(6, TINY_DRAFTER.layers))
        job = Job(target, TINY_DRAFTER, max(TINY_LENGTHS), BATCH, 2, lr=1e-3)
        steps, warmup = options.steps or 2, options.warmup or 1
        return [Plan("qwen3-tiny", job, _placement("cpu"), TINY_LENGTHS, steps, warmup, False)]
    names = options.targets or (tuple(TARGETS) if ctx.full else ("qwen3-8b",))
    warmup = options.warmup or ctx.pick(full=3, quick=2, default=3)
    steps = options.steps or ctx.pick(full=RUN_STEPS, quick=6, default=RUN_STEPS) - warmup
    out = []
    for name in names:
        target = HFTargetConfig.load(name, dflash_layers(TARGETS[name], DFLASH_B16.layers))
        job = Job(target, DFLASH_B16, max(LENGTHS), BATCH, ACCUMULATE, lr=1e-4)
        out.append(Plan(name, job, _placement("cuda:0"), LENGTHS, steps, warmup, True))
    return out


def _placement(device: str) -> Placement:
    return Placement((device,), (device,))


def microbatches(plan: Plan, count: int, seed: int = 0) -> list[dict]:
    """`count` microbatches, each of a length drawn uniformly from plan.lengths (one
    generator per length, so every length's tokens and anchors are the example's)."""
    job, rng = plan.job, random.Random(seed)
    data = {
        n: MarkovTokens(
            job.target.vocab,
            n,
            job.batch,
            seed=seed,
            anchors=job.drafter.anchors,
            block=job.drafter.block,
        )
        for n in plan.lengths
    }
    out = []
    for i in range(count):
        batch = data[rng.choice(plan.lengths)].batch(i)
        out.append({k: t.pin_memory() for k, t in batch.items()} if plan.on_gpu else batch)
    return out


def _synchronize(plan: Plan) -> None:
    if plan.on_gpu:
        torch.cuda.synchronize(0)


def timed(plan: Plan, loop: PipelineLoop, batches: list[dict]) -> dict[str, float]:
    """`loop` over `batches`: the seconds of its warm-up steps ("warm_s"), per timed step
    ("step_s"), and on a GPU the share of PROFILED_STEPS more steps' wall time in which
    the GPU ran anything ("gpu_busy")."""
    steps: Iterator[Any] = loop.steps(batches, plan.warmup + plan.steps + plan.profiled)
    try:
        start = time.perf_counter()
        for _ in range(plan.warmup):
            next(steps)
        _synchronize(plan)
        warm = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(plan.steps):
            next(steps)
        _synchronize(plan)
        out = {"warm_s": warm, "step_s": (time.perf_counter() - start) / plan.steps}
        if plan.profiled:
            out["gpu_busy"] = gpu_busy_share(steps, plan.profiled)
        return out
    finally:
        steps.close()


def gpu_busy_share(steps: Iterator[Any], count: int) -> float:
    """The share of `count` steps' wall time in which cuda:0 ran a kernel, copy or memset
    (the profiler's device activity): 1.0 is a GPU that no stage can make faster."""
    with limits.profile([torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(count):
            next(steps)
        torch.cuda.synchronize(0)
        wall = time.perf_counter() - start
    return limits.device_busy_ns(prof).get(0, 0) / 1e9 / wall


def stage_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """What a graph stage's stats() says about the run, summed over its lanes."""
    lanes = stats["lanes"].values()
    summary: dict[str, Any] = {
        "capture_s": round(sum(s["capture_seconds"] for s in lanes), 3),
        "pool_gb": round(sum(s["pool_bytes"] for s in lanes) / 1e9, 3),
        "released_gb": round(sum(s["released_bytes"] for s in lanes) / 1e9, 3),
        "pools_released": sum(s["pools_released"] for s in lanes),
        "capture_attempts": sum(s["capture_attempts"] for s in lanes),
        "capture_failures": sum(s["capture_failures"] for s in lanes),
        "graph_buckets": sorted({tuple(b) for s in lanes for b in s["buckets"]}),
        "policy_choices": _summed(s["policy_choices"] for s in lanes),
        "eager_buckets": [
            {k: e[k] for k in ("bucket", "eager_ms", "host_ms", "graph_ms")}
            for e in stats["eager_buckets"]
        ],
        "fallbacks": {k: v["count"] for k, v in stats["fallbacks"].items()},
        "padding_waste": round(stats["padding_waste"], 4),
        "replays": sum(s["replays"] for s in lanes),
        "eager_runs": sum(s["eager_runs"] for s in lanes),
    }
    if any("step" in s for s in lanes):
        summary["step"] = [s["step"] for s in lanes]
        summary["step_replays"] = sum(s["step_replays"] for s in lanes)
    return summary


def _summed(dicts: Iterator[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def run_kind(
    plan: Plan, models: Models, batches: list[dict], *, graphs: bool, steps: int = 0
) -> dict[str, Any]:
    """A pipeline of eager or graph stages training `models` over `batches`: `timed`'s
    figures and, for graph stages, each stage's summary. `steps`: only that many untimed
    steps."""
    loop = PipelineLoop(
        models, plan.placement, plan.job, depth=2, graphs=graphs, drafter_graphs=graphs
    )
    try:
        if steps:
            for _ in loop.steps(batches, steps):
                pass
            _synchronize(plan)
            return {}
        out = timed(plan, loop, batches)
        if graphs:
            (target_stats,) = loop.graph_stats()
            out["target"] = stage_summary(target_stats)
            out["drafter"] = stage_summary(loop.drafter_graph_stats())
        return out
    finally:
        loop.close()


def measure(ctx: Context, plan: Plan) -> list[Row]:
    """Every kind of stage against one target and one list of microbatches."""
    label = f"{plan.name}, {len(plan.lengths)} lengths {plan.lengths[0]}-{plan.lengths[-1]}"
    ctx.progress(f"{SECTION}: building {plan.name}")
    models = build_models(plan.job, plan.placement)
    batches = microbatches(plan, (plan.warmup + plan.steps + plan.profiled) * plan.job.accumulate)
    samples = plan.job.accumulate * plan.job.batch
    # Every kind starts warm: the process's first steps (kernels autotuned and cuBLAS plans
    # made per length, the allocator grown) would otherwise count against the first kind.
    ctx.progress(f"{SECTION}: {plan.name}, warming the process up (untimed)")
    run_kind(plan, models, batches, graphs=False, steps=WARM_START_STEPS)
    target = models.targets[0]
    del models  # its drafter: every kind trains a fresh one
    results: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        ctx.progress(f"{SECTION}: {plan.name}, {kind}")
        # The same weights each time: DrafterGraphs makes its optimizer capturable and
        # installs static gradients, which a later kind must not inherit.
        fresh = build_models(plan.job, plan.placement, target=target)
        results[kind] = run_kind(plan, fresh, batches, graphs=kind == "graph stages")
        del fresh  # before the next kind's is built
    eager, graph, again = (results[k] for k in KINDS)
    how = f"{plan.steps} timed steps after {plan.warmup} warm-up steps"
    how += f"; {objective(plan.job.drafter)}"
    total = plan.warmup + plan.steps
    rate = {k: samples / r["step_s"] for k, r in results.items()}
    run_rate = {
        k: samples * total / (r["warm_s"] + r["step_s"] * plan.steps) for k, r in results.items()
    }
    both = "eager stages, mean of 2 runs"

    def eager_mean(rates: dict[str, float]) -> float:
        return (rates["eager stages"] + rates["eager stages again"]) / 2

    whole = f"all {total} steps, the first {plan.warmup} (the captures) included"
    rows = [
        compare(SECTION, f"{label}: graph stages, samples/s over the run",
                run_rate["graph stages"], "samples/s", both, eager_mean(run_rate),
                target="ratio >= 1.0", note=whole),
        compare(SECTION, f"{label}: eager stages, samples/s", rate["eager stages"],
                "samples/s", note=how, step_s=eager["step_s"]),
        compare(SECTION, f"{label}: eager stages again, samples/s", rate["eager stages again"],
                "samples/s", "eager stages", rate["eager stages"], step_s=again["step_s"],
                note="the same stages run again, after the graph stages: the ratio is the "
                "run's own noise"),
        compare(SECTION, f"{label}: graph stages, samples/s", rate["graph stages"],
                "samples/s", both, eager_mean(rate), target="ratio >= 1.0", note=how,
                step_s=graph["step_s"]),
        compare(SECTION, f"{label}: graph stages, first {plan.warmup} steps", graph["warm_s"],
                "s", "eager stages", eager["warm_s"], note="the graph stages capture here"),
    ]  # fmt: skip
    if "gpu_busy" in graph:
        rows.append(
            compare(SECTION, f"{label}: graph stages, GPU busy", graph["gpu_busy"], "share",
                    both, eager_mean(
                        {k: r["gpu_busy"] for k, r in results.items()}),
                    note=f"the share of {PROFILED_STEPS} profiled steps' wall time in which "
                    "the GPU ran anything; near 1.0, no stage can make a step faster")
        )  # fmt: skip
    for stage in ("target", "drafter"):
        s = graph[stage]
        note = (
            f"captured {s['capture_attempts']} ({s['capture_failures']} failed), "
            f"graphs kept for {s['graph_buckets'] or 'no bucket'}, eager by choice "
            f"{s['policy_choices'] or '{}'}, pool {s['pool_gb']} GB, given back "
            f"{s['released_gb']} GB in {s['pools_released']} pools"
            + (f", optimizer step {s['step']} ({s['step_replays']} replays)" if "step" in s else "")
        )
        rows.append(
            compare(SECTION, f"{label}: {stage} graph stage, capture seconds", s["capture_s"],
                    "s", note=note, **s)
        )  # fmt: skip
    return rows


def run(ctx: Context) -> list[Row]:
    options = ctx.options.get(SECTION) or Options()
    if ctx.gpus and not (ctx.full or options.alone):
        return [
            not_run(
                SECTION,
                "qwen3-8b: graph stages, samples/s",
                "runs with --full, or alone: python -m bench.dflash_varlen",
                "ratio >= 1.0",
            )
        ]
    rows = []
    for plan in plans(ctx, options):
        rows += measure(ctx, plan)
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.dflash_varlen [--steps N] [--warmup N] [--targets a,b]` and the
    suite's flags (--quick, --full, --json FILE): this section alone, through bench.run."""
    parser = argparse.ArgumentParser(prog="python -m bench.dflash_varlen", add_help=False)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--targets", type=lambda s: tuple(s.split(",")))
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    unknown = [t for t in args.targets or () if t not in TARGETS]
    if unknown:
        parser.error(f"expected targets from {', '.join(TARGETS)}, got {', '.join(unknown)}")
    options = Options(args.steps, args.warmup, args.targets, alone=True)
    from bench import run as suite

    return suite.main(["--sections", SECTION, *rest], options={SECTION: options})


if __name__ == "__main__":
    sys.exit(main())
