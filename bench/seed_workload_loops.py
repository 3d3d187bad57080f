"""The seed workload's loop rows: one target variant and drafter built, each loop timed
over varied-length microbatches (samples/s, tokens/s, MFU, peak memory) beside
SpecForge's 27 B figures."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import torch

from bench import limits
from bench.common import Context, Row, compare
from bench.harness import Setup, objective, step_time
from bench.seed_workload_common import SECTION, failed_row, free, peak
from bench.seed_workload_flops import flop_counter, fp8_flop_counter
from bench.seed_workload_lengths import Lengths, VariedSetup
from examples.dflash import loops
from examples.dflash.loops import Job, Models, Placement

# SpecForge's docs, recipe "qwen3.8-27b-dflash2-disaggregated" (Sept 2026), 8 x H200.
SPECFORGE = {"disaggregated_per_gpu": 10.65 / 8, "colocated_per_gpu": 8.61 / 8, "trainer_rank": 3.7}
CROSS_RUN = "SpecForge 27 B, disaggregated, per GPU (another run)"
SETUP_DIFFERENCES = (
    "SpecForge: 27 B FP8 target, ~1.9 B DFlash2 drafter, real data, 5 capture + 3 trainer GPUs "
    "(colocated 8.61/8 per GPU, a trainer rank 3.7); ours: one H200, 23 B random weights, bf16"
)

SEQUENTIAL, EXECUTOR = "sequential loop", "ThreadPoolExecutor loop"
LOOPS = (SEQUENTIAL, EXECUTOR, "pipeline, eager stages", "pipeline, graph stages")


# Lengths (with the drafter's shape) already run in this process: Note [Warm lengths].
_WARM: set[tuple[int, Any]] = set()


@dataclasses.dataclass
class Bench:
    """The built models of one target variant and drafter configuration, and what
    measures them."""

    ctx: Context
    models: Models
    job: Job
    placement: Placement
    variant: str = "bf16"  # the target's: "bf16", "bf16+fla", "fp8", "fp8+fla"

    def __post_init__(self) -> None:
        self.on_gpu = self.placement.targets[0].startswith("cuda")
        self.flops = flop_counter(self.models)
        self.fp8_flops = fp8_flop_counter(self.models)
        self.warmed = False

    # Note [Warm lengths]: a loop's first call at a new length pays one-time costs (cuDNN's
    # attention plans, autotuning and compiles; the first measured row of one run read 0.48
    # samples/s against 1.86 for the same loop later). So before any timed window, warm()
    # runs a target forward and a drafter forward and backward (no optimizer step: the
    # weights stay as built) at every length the window will see that this process has not
    # run with this drafter shape, and, for a newly built target, at its shortest and
    # longest lengths at least (its own kernels' first calls).
    def warm(self, batches: list[dict]) -> None:
        by_length = {b["input_ids"].shape[1]: b for b in batches}
        shape = dataclasses.astuple(self.job.drafter)
        todo = [n for n in sorted(by_length) if (n, shape) not in _WARM]
        if not self.warmed:
            todo = sorted({min(by_length), max(by_length), *todo})
        if not todo:
            return
        self.ctx.progress(f"{SECTION}: warming the {self.variant} target at {len(todo)} lengths")
        target, drafter = self.models.targets[0], self.models.drafters[0]
        device = self.placement.targets[0]
        for n in todo:
            batch = {k: t.to(device) for k, t in by_length[n].items()}
            with torch.no_grad():
                features = loops.target_forward(target)(batch)
            loops.drafter_loss(drafter, features).backward()
            del features, batch
            _WARM.add((n, shape))
        free(self.models)
        self.warmed = True

    def step_time(self, name: str, setup: Setup) -> float:  # seconds per optimizer step
        given = self.models, self.placement, setup.job
        if name == SEQUENTIAL:
            return step_time(setup, lambda b, n: loops.sequential_steps(*given, b, n))
        if name == EXECUTOR:
            return step_time(setup, lambda b, n: loops.executor_steps(*given, b, n, 2))
        graphs = name == LOOPS[3]
        loop = loops.PipelineLoop(*given, 2, graphs=graphs, drafter_graphs=graphs)
        try:
            loop.warm_up(setup.batches(1)[0])
            return step_time(setup, loop.steps)
        finally:
            loop.close()

    def setup(self, lengths: Lengths) -> VariedSetup:
        job = replace(self.job, seq=lengths.high)
        steps = self.ctx.reps(3, 1, default=2)
        setup = VariedSetup(job, self.placement, steps, reps=1, warmup=1, on_gpu=self.on_gpu)
        setup.lengths = lengths
        return setup

    def loop_rows(
        self, lengths: Lengths, what: str, names=LOOPS, goal: str | None = None
    ) -> list[Row]:
        setup = self.setup(lengths)
        rows = []
        for name in names:
            self.ctx.progress(f"{SECTION}: {what}, {name}")
            try:
                self.warm(setup.batches((setup.warmup + setup.steps) * setup.job.accumulate))
            except Exception as exc:  # noqa: BLE001 (costs the row, as a failed loop does)
                rows.append(failed_row(f"{what}: {name}, samples/s", exc))
                continue
            rows.append(self.loop_row(name, setup, what, goal if name == LOOPS[2] else None))
        return rows

    def loop_row(self, name: str, setup: VariedSetup, what: str, goal: str | None) -> Row:
        free(self.models)  # and what a failed loop before left
        resident, row_name = peak(self.on_gpu, reset=True), f"{what}: {name}, samples/s"
        try:
            seconds = self.step_time(name, setup)
        except Exception as exc:  # noqa: BLE001 (one loop failing, say an OOM, costs its row)
            free(self.models)
            return failed_row(row_name, exc)
        top, timed = peak(self.on_gpu), setup.timed()
        free(self.models)
        rate = setup.job.accumulate * setup.job.batch / seconds
        tokens = sum(b["input_ids"].numel() for b in timed) / setup.steps / seconds
        bf16_peak = limits.peak_flops(0) if self.on_gpu else None
        mfu = bf16_peak and self.flops(timed) / setup.steps / seconds / bf16_peak
        fp8_peak = limits.peak_flops(0, "fp8") if self.on_gpu else None
        fp8_flops = self.fp8_flops(timed) / setup.steps / seconds
        fp8_mfu = fp8_peak and fp8_flops and fp8_flops / fp8_peak
        mean = sum(b["input_ids"].shape[1] for b in timed) / len(timed)
        note = f"{tokens:,.0f} tokens/s"
        note += f", MFU {mfu:.0%} (bf16-equivalent)" if mfu else ""
        note += f", FP8 GEMMs {fp8_mfu:.0%} of the FP8 peak" if fp8_mfu else ""
        note += f", peak {top / 2**30:.1f} GiB" if top else ""
        note += f"; mean length {mean:,.0f} (distribution {setup.lengths.expected():,.0f})"
        note += f"; {objective(setup.job.drafter)}"
        baseline = {}
        if self.on_gpu:  # SpecForge beside the GPU rows; the goals on the recipe's
            baseline = dict(baseline_name=CROSS_RUN, baseline=SPECFORGE["disaggregated_per_gpu"])
            if goal is not None:
                note += f"; {SETUP_DIFFERENCES}"
        goal = goal if self.on_gpu else None
        extra = dict(tokens_per_s=tokens, mfu=mfu, fp8_gemm_mfu=fp8_mfu, peak_bytes=top,
                     resident_bytes=resident, mean_length=mean, target_variant=self.variant,
                     lengths=[b["input_ids"].shape[1] for b in timed])  # fmt: skip
        self.ctx.progress(f"{SECTION}: {row_name}: {rate:.3g} ({note.split('; ')[0]})")
        return compare(SECTION, row_name, rate, "samples/s", **baseline, target=goal, note=note,
                       step_s=seconds, specforge=SPECFORGE, **extra)  # fmt: skip
