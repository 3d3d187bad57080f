"""The seed workload's memory against length: peak memory and samples/s at each length
and batch (an out-of-memory a point too), their rows with the largest length that fits,
the curves as JSON and a PNG; and the drafter stage alone at a long length."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench import limits
from bench.common import Context, Row, compare
from bench.harness import objective
from bench.seed_workload_common import SECTION, Budget, first_line, free, peak
from bench.seed_workload_lengths import Workload
from examples.dflash import loops
from examples.dflash.loops import Job
from examples.dflash.models import BlockDrafter, TargetShapes

if TYPE_CHECKING:
    from bench.seed_workload_loops import Bench


def memory(
    bench: Bench,
    lengths: tuple[int, ...],
    batches: tuple[int, ...],
    pipeline: bool = False,
    budget: Budget | None = None,
) -> list[dict]:
    """Peak memory and samples/s at each length and batch of the sequential loop (one
    microbatch a step, one warm-up step, one timed), or with `pipeline` of the eager
    pipeline (accumulation 2, depth 2: two microbatches' features in flight); an OOM is
    a point too (the message says which: cuBLAS and cuDNN failing to allocate raise
    RuntimeError). Past the `budget`, the points left are left out. `bench`: the built
    models of one target variant and drafter."""
    points = []
    for length in lengths:
        for batch in batches:
            if budget is not None and budget.over():
                bench.ctx.progress(f"{SECTION}: over the budget: no point at {batch} x {length:,}")
                continue
            loop = "pipeline" if pipeline else "sequential"
            bench.ctx.progress(f"{SECTION}: memory at {batch} x {length:,}, {loop} loop")
            point: dict[str, Any] = {"length": length, "batch": batch, "loop": loop}
            acc = 2 if pipeline else 1
            job = replace(bench.job, seq=length, batch=batch, accumulate=acc)
            data = job.data(job.seed).batches(0, 2 * acc)
            peak(bench.on_gpu, reset=True)
            pipe = loops.PipelineLoop(bench.models, bench.placement, job, 2) if pipeline else None
            steps = (
                pipe.steps(data, 2)
                if pipe is not None
                else loops.sequential_steps(bench.models, bench.placement, job, data, 2)
            )
            try:
                next(steps)()
                started = time.perf_counter()
                next(steps)()
                point["samples_per_s"] = acc * batch / (time.perf_counter() - started)
                point["peak_bytes"] = peak(bench.on_gpu)
            except Exception as exc:  # noqa: BLE001 (an OOM, or a pipeline's error about one)
                point["oom"] = first_line(exc, 160)
            finally:
                steps.close()
                if pipe is not None:
                    pipe.close()
                del steps, data, pipe
                free(bench.models)
            points.append(point)
            bench.ctx.progress(f"{SECTION}: {point}")  # for a run cut short
    return points


def memory_rows(points: list[dict], what: str, on_gpu: bool, goals: dict[int, str]) -> list[Row]:
    rows, lengths = [], sorted({p["length"] for p in points})
    for p in points:
        name = f"{what}: memory at {p['batch']} x {p['length']:,}"
        if "oom" in p:
            rows.append(Row(SECTION, name, None, "bytes", note=f"OOM: {p['oom']}", extra=p))
        elif on_gpu:
            how = (
                "pipeline, eager stages, accumulation 2, depth 2"
                if p.get("loop") == "pipeline"
                else "sequential loop, one microbatch a step"
            )
            note = f"{p['samples_per_s']:.2f} samples/s; {how}"
            rows.append(compare(SECTION, name, float(p["peak_bytes"]), "bytes", note=note, **p))
    for batch in sorted({p["batch"] for p in points}):
        fits = [p["length"] for p in points if p["batch"] == batch and "oom" not in p]
        name, goal = f"{what}: largest length that fits at batch {batch}", goals.get(batch)
        value, goal = float(max(fits, default=0)), goal if on_gpu else None
        rows.append(compare(SECTION, name, value, "tokens", target=goal, tried=lengths))
    return rows


def save(curves: dict[str, list[dict]], out: str | None) -> None:
    """seed_memory_vs_length.json and .png in the folder `out` (None: nothing)."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "seed_memory_vs_length.json").write_text(json.dumps(curves, indent=1))
        plot_memory(curves, Path(out) / "seed_memory_vs_length.png")


def plot_memory(curves: dict[str, list[dict]], path: Path) -> None:
    """Peak memory and samples/s against length, one line per (target, batch); OOM as x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for what, points in curves.items():
        for batch in sorted({p["batch"] for p in points}):
            ok = [p for p in points if p["batch"] == batch and "oom" not in p]
            label, xs = f"{what}, batch {batch}", [p["length"] for p in ok]
            mem.plot(xs, [(p.get("peak_bytes") or 0) / 2**30 for p in ok], "o-", label=label)
            rate.plot(xs, [p["samples_per_s"] for p in ok], "o-", label=label)
            oom = [p["length"] for p in points if p["batch"] == batch and "oom" in p]
            mem.plot(oom, [0] * len(oom), "rx")
    if torch.cuda.is_available():
        mem.axhline(torch.cuda.get_device_properties(0).total_memory / 2**30, color="k", ls=":")
    for ax, label in ((mem, "peak allocated (GiB); x: out of memory"), (rate, "samples/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per row")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("DFlash on the 23 B hybrid, one GPU: memory and speed against length")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def drafter_alone(ctx: Context, workload: Workload, device: str, length: int) -> Row:
    """The drafter stage alone (the first drafter, at the target's width) on one
    microbatch of `workload.batch` x `length` random features: the attention's memory."""
    ctx.progress(f"{SECTION}: drafter alone at {workload.batch} x {length:,}")
    cost, top = _drafter_alone(workload, device, length)
    free()
    name, note = f"drafter stage alone at {workload.batch} x {length:,}, ms per step", "CPU"
    note = note if top is None else f"peak {top / 2**30:.1f} GiB"
    note += f"; {objective(next(iter(workload.drafters.values())))}"
    return compare(SECTION, name, cost.wall_ms, "ms", note=note, peak_bytes=top)


def _drafter_alone(workload: Workload, device: str, length: int) -> tuple[limits.Cost, int | None]:
    cfg, target = next(iter(workload.drafters.values())), workload.target
    width, on_gpu = len(target.capture_layers) * target.dim, device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.device(device):
        drafter = BlockDrafter(TargetShapes(target.dim, width, target.vocab).to(dtype), cfg)
        features = torch.randn(workload.batch, length, width, dtype=dtype)
    job = Job(target, cfg, seq=length, batch=workload.batch, accumulate=1, lr=1e-4)
    inputs = {**{k: t.to(device) for k, t in job.data(0).batch(0).items()}, "features": features}
    trained = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, fused=on_gpu)

    def step() -> None:
        loops.drafter_loss(drafter, inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    peak(on_gpu, reset=True)
    return limits.measure(step, reps=2, warmup=0), peak(on_gpu)
