"""scale_out's pipeline across GPUs: the pipeline step with graph targets, target and
drafter lanes on separate GPUs (1:1 on 2 GPUs, 3:1 on 4), against each stage timed
alone on the pipeline's own lanes."""

from __future__ import annotations

import re
from typing import Any

import torch

from bench import kernels
from bench.common import Context, Row, compare, not_run
from bench.harness import Setup, drafter_stage, step_time, synchronize, time_stages
from bench.scale_out_common import OVERLAP_GOAL, SECTION, Options, Setting
from examples.dflash.loops import Job, PipelineLoop, Placement, build_models


def pipeline_row(ctx: Context, options: Options, setting: Setting, ratio: str) -> Row:
    n_targets = parse_ratio(ratio)
    needed = n_targets + 1
    name = f"{setting.name}: pipeline step, graph target, {ratio} on {needed} GPUs"
    if not setting.on_gpu or needed > setting.available:
        return not_run(SECTION, name, f"needs {needed} GPUs", target=OVERLAP_GOAL)
    placement = Placement.parse([f"cuda:{i}" for i in range(needed)], ratio)
    return pipeline_figures(ctx, options, setting, placement, name)


def pipeline_figures(
    ctx: Context, options: Options, setting: Setting, placement: Placement, name: str
) -> Row:
    """The pipeline's step with graph targets on `placement` against each stage alone
    (on CPU lanes TargetGraphs runs its padded eager path: the code runs, the figure
    means nothing)."""
    job = Job(
        setting.config,
        setting.drafter,
        seq=setting.seq,
        batch=setting.batch,
        accumulate=options.accumulate,
        lr=3e-4,
    )
    setup = Setup.for_model(
        ctx, job, placement, steps=options.pipeline_steps, on_gpu=setting.on_gpu
    )
    depth = len(placement.targets) + 1  # every target lane one microbatch ahead of the drafter
    ctx.progress(f"{name}: building the models")
    models = build_models(job, placement)
    loop = PipelineLoop(models, placement, job, depth=depth, graphs=True)
    try:
        ctx.progress(f"{name}: capturing, then the pipeline")
        loop.warm_up(setup.batches(1)[0])
        step = step_time(setup, loop.steps, run_ahead=True)
        ctx.progress(f"{name}: each stage alone")
        stages = stages_alone(loop, models, setup)
        stats = loop.graph_stats()
    finally:
        loop.close()
    peer = peer_access(placement)
    slower = max(stages, key=stages.get)
    note = (
        f"targets on {', '.join(placement.targets)}, drafter on {placement.drafters[0]}; "
        f"{job.accumulate} microbatches per step, depth {depth}; "
        f"target alone {stages['target'] * 1e3:.3f} ms, drafter alone "
        f"{stages['drafter'] * 1e3:.3f} ms; {setting.rate(step, job.accumulate)}"
    )
    if peer is not None:
        note += f"; peer access {'on' if peer else 'off: torch stages the copies through the host'}"
    fallbacks = [reason for s in stats for reason in s["fallbacks"]]
    if fallbacks:
        note += f"; ran eagerly: {'; '.join(fallbacks)}"
    if setting.kernels:
        note += f"; {kernels.note(setting.kernels)}"
    return compare(
        SECTION,
        name,
        step * 1e3,
        "ms",
        f"{slower} stage alone",
        stages[slower] * 1e3,
        OVERLAP_GOAL,
        note,
        target_stage_ms=stages["target"] * 1e3,
        drafter_stage_ms=stages["drafter"] * 1e3,
        peer_access=peer,
        graphs=stats,
    )


def peer_access(placement: Placement) -> bool | None:
    """Whether every target GPU can copy to the drafter's GPU directly; None off GPUs."""
    drafter = torch.device(placement.drafters[0])
    targets = [torch.device(d) for d in placement.targets]
    if drafter.type != "cuda":
        return None
    return all(
        t.index == drafter.index or torch.cuda.can_device_access_peer(t.index, drafter.index)
        for t in targets
    )


def parse_ratio(ratio: str) -> int:
    """Target lanes of a "T:1" ratio (one drafter lane: the stage timed alone is one)."""
    match = re.fullmatch(r"(\d+):1", ratio)
    if match is None or int(match[1]) < 1:
        raise ValueError(
            f"expected a ratio like 3:1 (target GPUs : one drafter GPU), got {ratio!r}"
        )
    return int(match[1])


def stages_alone(loop: PipelineLoop, models: Any, setup: Setup) -> dict[str, float]:
    """Median seconds of each stage of a step alone, on the pipeline's own lanes: the
    step's target forwards, spread over the target lanes as the pipeline spreads them;
    the drafter's forward/backward passes (inputs already on its GPU) and its optimizer
    step."""
    job, placement = setup.job, setup.placement
    targets, lanes = loop.targets, loop.target_lanes
    drafter_lane = loop.dispatcher.lanes[len(lanes)]
    drafter, optimizer = models.drafters[0], models.optimizers[0]
    batches = setup.batches(job.accumulate)

    def forwards() -> list:
        futures = [
            targets[k % len(lanes)].submit(lanes[k % len(lanes)], b) for k, b in enumerate(batches)
        ]
        return [future.result() for future in futures]

    def release(results: list) -> None:
        for k, result in enumerate(results):
            targets[k % len(lanes)].release(result)

    results = forwards()
    synchronize(setup)
    inputs = [{k: t.to(placement.drafters[0]) for k, t in result.items()} for result in results]
    synchronize(setup)
    release(results)

    def target_step() -> None:
        results = forwards()
        synchronize(setup)
        release(results)

    drafter_step = drafter_stage(setup, drafter_lane, drafter, optimizer, inputs)
    return time_stages(setup, {"target": target_step, "drafter": drafter_step})
