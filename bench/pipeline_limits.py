"""The pipeline against its physical limit, with the example's Hugging Face Qwen3-Next
target (qwen3-next-small, random weights) and its drafter; part of section 5.

Two regimes of 6 microbatches per optimizer step: launch-bound (1 x 1024 tokens per
microbatch), where the stages' Python is the limit unless they replay graphs, and
GPU-bound (8 x 1024). In each, with --full, four variants: eager or graph drafter
(pydflash.DrafterGraphs), each with an eager or graph target (pydflash.TargetGraphs);
the default run takes both eager and both graphs.

- Each stage alone, as the pipeline runs it on its lane: wall time, GPU-busy time and
  host thread time per step (bench/limits.py). The drafter's steps run back to back, as
  in the pipeline (the window's last synchronizes); the target's synchronize each step.
  The drafter's row compares its wall time with its GPU-busy time: a ratio far above 1
  is a host-bound stage.
- Each pipeline variant's step against its limit: on one GPU the sum of its two stages'
  GPU-busy times (the GPU cannot do both at once), on separate GPUs the larger one.
- The host thread time of the whole pipeline per step, against the step.

Graph stages keep every graph here (policy "graphs"): the section measures the graph path
against its limits; bench/dflash_varlen.py measures what policy "auto" chooses.

Wall and host times come from a window without the profiler (whose per-launch callbacks
slow a launch-bound stage); GPU-busy time from a profiled window of the same steps.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.common import Context, Row, compare, not_run
from bench.limits import calling_thread_name, cpu_ms_by_name, measure, thread_cpu_by_name
from examples.dflash.data import MarkovTokens
from examples.dflash.loops import (
    Job,
    Models,
    PipelineLoop,
    Placement,
    build_models,
    drafter_loss,
    target_forward,
)
from examples.dflash.models import TINY_DRAFTER, DrafterConfig
from pydflash import Dispatcher, TargetGraphs
from pydflash.pipeline.stages import EagerDrafter, EagerTarget
from pydflash.pipeline.stages.drafter_graphs import DrafterGraphs

SECTION = "pipeline"
ACCUMULATE = 6
SEQ = 1024
REGIMES = {"launch-bound": 1, "GPU-bound": 8}  # sequences of SEQ tokens per microbatch
DRAFTER_GOAL = "<= 1.1"  # launch-bound drafter stage with graphs: wall vs GPU-busy
ONE_GPU_GOAL = {"launch-bound": "<= 1.05", "GPU-bound": "<= 1.0"}  # graph drafter and target
HOST_GOAL = "<= 0.25"  # host thread time of the pipeline per step, vs the step
KINDS = ("eager", "graphs")
GRAPHS = "graphs"  # the graph stages' policy: every graph kept
VARIANTS = [(d, t) for d in KINDS for t in KINDS]
# The default run: both stages eager against both replaying graphs; --full adds the mixed two.
DEFAULT_VARIANTS = [("eager", "eager"), ("graphs", "graphs")]
LABEL = {"eager": "eager", "graphs": "graph"}
NEEDS_GPU = "needs a GPU: the limit is GPU-busy time"
# Lanes made with spin_us=0: an idle worker sleeps at once instead of polling its queue.
SLEEPING = "one GPU, lanes that sleep when idle (spin_us=0)"


@dataclasses.dataclass
class Regime:
    name: str
    job: Job
    placement: Placement
    reps: int  # calls per window (profiled and unprofiled)
    warmup: int
    on_gpu: bool
    # Graph stages, whose rows hold the host-time goals, of a launch-bound regime (a step
    # of ~20 ms) run three times the steps after 6 of warm-up: under a second for the
    # steady state a training run spends its time in. Eager ones keep the short window.
    graph_window: bool = False
    _batches: list[dict] = dataclasses.field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        j = self.job
        return f"{self.name} ({j.target.source}, {j.batch}x{j.seq} x{j.accumulate})"

    def batches(self, count: int) -> list[dict]:
        if len(self._batches) < count:
            data = MarkovTokens(self.job.target.vocab, self.job.seq, self.job.batch, seed=3)
            self._batches = data.batches(0, count, pin=self.on_gpu)
        return self._batches[:count]

    def window(self, graphs: bool) -> tuple[int, int]:
        """(warm-up calls, timed calls) for a stage or pipeline, graphs or not."""
        if graphs and self.graph_window:
            return 6, 3 * self.reps
        return self.warmup, self.reps

    def synchronize(self) -> None:
        if self.on_gpu:
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)


def rows(ctx: Context) -> list[Row]:
    """Every regime's rows; not run where transformers is missing."""
    try:
        from examples.dflash.hf import HFTargetConfig

        config = "qwen3-next-small" if ctx.gpus else "qwen3-next-tiny"
        target = HFTargetConfig.load(config)
    except ModuleNotFoundError as exc:
        return [not_run(SECTION, "pipeline against its limit", f"needs {exc.name}")]
    out = []
    for name, batch in REGIMES.items():
        if not ctx.gpus and name != "launch-bound":  # on CPU the code path, once, suffices
            out.append(not_run(SECTION, f"pipeline against its limit, {name}", NEEDS_GPU))
            continue
        out += regime_rows(ctx, make_regime(ctx, name, batch, target))
        if ctx.gpus:
            torch.cuda.empty_cache()
    return out


def make_regime(ctx: Context, name: str, batch: int, target: Any) -> Regime:
    full = ctx.full and not ctx.quick
    if ctx.gpus:
        job = Job(target, DrafterConfig(), seq=SEQ, batch=batch, accumulate=ACCUMULATE, lr=3e-4)
        placement = Placement(("cuda:0",), ("cuda:0",))
        reps = 8 if full else (2 if ctx.quick else 4)
        return Regime(name, job, placement, reps, warmup=2, on_gpu=True, graph_window=batch == 1)
    job = Job(target, TINY_DRAFTER, seq=32, batch=min(batch, 2), accumulate=2, lr=3e-3)
    return Regime(name, job, Placement(("cpu",), ("cpu",)), 2, warmup=1, on_gpu=False)


# --- measuring ----------------------------------------------------------------------------
def cost(
    regime: Regime, step: Callable[[], None], *, graphs: bool, sync_each: bool = True
) -> dict[str, Any]:
    """Per call of step(): wall and host ms unprofiled, GPU-busy ms profiled (None on CPU).
    With sync_each False, only a window's last call synchronizes (a pipeline keeps its
    next step's work in flight). Host time leaves out the CPU time of those synchronizes:
    torch.cuda.synchronize() spins under CUDA's default scheduling (a host with more cores
    than contexts), and that wait is the bench's, not the stage's."""
    warmup, n = regime.window(graphs)
    synced_s = 0.0  # the main thread's CPU time inside the window's synchronizes

    def window(calls: int) -> Callable[[], None]:
        count = 0

        def call() -> None:
            nonlocal count, synced_s
            step()
            count += 1
            if sync_each or count == calls:
                before = time.thread_time()
                regime.synchronize()
                synced_s += time.thread_time() - before

        return call

    for _ in range(warmup):
        step()
    regime.synchronize()
    call = window(n)
    cpu0, process0, t0 = thread_cpu_by_name(), time.process_time(), time.perf_counter()
    for _ in range(n):
        call()
    wall, by_thread = time.perf_counter() - t0, cpu_ms_by_name(cpu0, thread_cpu_by_name(), n)
    sync_ms = synced_s * 1e3 / n
    if by_thread is not None:
        me = calling_thread_name()
        by_thread[me] = round(max(0.0, by_thread.get(me, 0.0) - sync_ms), 3)
        host_ms = sum(by_thread.values())
    else:  # not Linux: no per-thread times
        host_ms = (time.process_time() - process0) * 1e3 / n - sync_ms
    busy = None
    if regime.on_gpu:
        busy = measure(window(n), reps=n, warmup=0, sync=False).gpu_busy_ms
    return {
        "wall_ms": wall * 1e3 / n,
        "host_ms": host_ms,
        "host_ms_by_thread": by_thread,
        "sync_ms_left_out": round(sync_ms, 3),
        "gpu_busy_ms": busy,
    }


def pristine(job: Job, placement: Placement) -> tuple[Models, Any]:
    models = build_models(job, placement)
    return models, copy.deepcopy(models.drafters[0])


def fresh(models: Models, drafter: Any, job: Job) -> Models:
    """The regime's target with a fresh copy of the untrained drafter and its optimizer."""
    d = copy.deepcopy(drafter)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=job.lr)
    return Models(
        models.targets, [d], [opt], [torch.optim.lr_scheduler.LambdaLR(opt, job.lr_factor)]
    )


def target_stage_cost(regime: Regime, models: Models, kind: str) -> dict[str, Any]:
    with Dispatcher(regime.placement.targets[:1]) as d:
        lane = d.lanes[0]
        forward = target_forward(models.targets[0])
        stage = TargetGraphs(forward, policy=GRAPHS) if kind == "graphs" else EagerTarget(forward)
        batches = regime.batches(regime.job.accumulate)
        if kind == "graphs":
            stage.warmup(lane, batches[0], [tuple(batches[0]["input_ids"].shape)])

        def step() -> None:
            futures = [stage.submit(lane, b) for b in batches]
            for f in futures:
                result = f.wait_stream() if f.event else f.result()
                if kind == "graphs":  # its ring buffer back, for the next step's copy
                    stage.release(result)

        return cost(regime, step, graphs=kind == "graphs")


def drafter_inputs(regime: Regime, models: Models) -> list[dict]:
    device = regime.placement.drafters[0]
    with torch.no_grad():
        forward = target_forward(models.targets[0])
        out = [forward({k: t.to(device) for k, t in b.items()}) for b in regime.batches(6)]
    regime.synchronize()
    return out[: regime.job.accumulate]


def drafter_stage_cost(
    regime: Regime, models: Models, kind: str, inputs: list[dict]
) -> dict[str, Any]:
    with Dispatcher(regime.placement.drafters[:1]) as d:
        lane = d.lanes[0]
        graph_kind = {"policy": GRAPHS} if kind == "graphs" else {}
        make = DrafterGraphs if kind == "graphs" else EagerDrafter
        stage = make(
            [lane],
            **graph_kind,
            drafter=models.drafters[0],
            loss=drafter_loss,
            optimizer=models.optimizers[0],
            accumulate=regime.job.accumulate,
        )
        lane.submit(stage.zero_grad, 0).result()
        steps = iter(range(1 << 30))

        def step() -> None:
            s, last = next(steps), len(inputs) - 1
            for i, x in enumerate(inputs):
                lane.submit(stage.train, 0, x, all_reduce=i == last)
            lane.submit(stage.step, s, 0, None).result()

        # Steps back to back, as the pipeline runs them: a synchronize after each would
        # leave the GPU idle while the next step's first microbatch is launched.
        result = cost(regime, step, graphs=kind == "graphs", sync_each=False)
        if kind == "graphs":
            result["stats"] = stage.stats()
        return result


def pipeline_cost(
    regime: Regime, models: Models, drafter: str, target: str, spin_us: float | None = None
) -> dict[str, Any]:
    loop = PipelineLoop(
        models,
        regime.placement,
        regime.job,
        depth=2,
        graphs=target == "graphs",
        drafter_graphs=drafter == "graphs",
        spin_us=spin_us,
        policy=GRAPHS,
    )
    steps: Iterator[Any] | None = None
    try:
        warm = regime.batches(1)[0]
        loop.warm_up(warm)
        graphs = drafter == target == "graphs"
        warmup, reps = regime.window(graphs)
        total = warmup + 2 * reps + 1  # one step more: its work is cancelled
        steps = loop.steps(regime.batches(total * regime.job.accumulate), total)
        result = cost(regime, lambda: next(steps), graphs=graphs, sync_each=False)
        result["drafter_graphs"] = loop.drafter_graph_stats()
        result["native_microbatches"] = loop.pipe.stats()["native_microbatches"]
        return result
    finally:
        if steps is not None:
            steps.close()
        loop.close()


# --- rows ---------------------------------------------------------------------------------
def regime_rows(ctx: Context, regime: Regime) -> list[Row]:
    label = regime.label
    ctx.progress(f"pipeline limits, {label}: building the models")
    models, drafter = pristine(regime.job, regime.placement)
    # The default run takes the GPU-bound regime's graph stages only: its goal is theirs.
    kinds = ("graphs",) if regime.name == "GPU-bound" and ctx.mode == "default" else KINDS
    stages: dict[tuple[str, str], dict[str, Any]] = {}
    for kind in kinds:
        ctx.progress(f"pipeline limits, {label}: target stage alone, {kind}")
        stages["target", kind] = target_stage_cost(regime, models, kind)
    inputs = drafter_inputs(regime, models)
    for kind in kinds:
        ctx.progress(f"pipeline limits, {label}: drafter stage alone, {kind}")
        stages["drafter", kind] = drafter_stage_cost(
            regime, fresh(models, drafter, regime.job), kind, inputs
        )
    del inputs
    pipes = {}
    variants = VARIANTS if ctx.mode == "full" else DEFAULT_VARIANTS
    variants = [(d, t) for d, t in variants if d in kinds and t in kinds]
    for d, t in variants:
        ctx.progress(f"pipeline limits, {label}: pipeline, {d} drafter, {t} target")
        pipes[d, t] = pipeline_cost(regime, fresh(models, drafter, regime.job), d, t)
    ctx.progress(f"pipeline limits, {label}: pipeline, graphs, lanes that sleep when idle")
    asleep = pipeline_cost(regime, fresh(models, drafter, regime.job), "graphs", "graphs", 0)
    del models, drafter
    out = [stage_row(regime, which, kind, c) for (which, kind), c in stages.items()]
    for (d, t), c in pipes.items():
        out.append(pipeline_row(regime, d, t, c, stages, "one GPU", sum))
    out.append(pipeline_row(regime, "graphs", "graphs", asleep, stages, SLEEPING, sum))
    out.append(host_row(regime, pipes["graphs", "graphs"], "graph drafter and target"))
    out.append(host_row(regime, asleep, f"graph drafter and target, {SLEEPING}"))
    if ctx.gpus < 2:
        name = f"{label}: pipeline step, target and drafter on two GPUs"
        out.append(not_run(SECTION, name, "not run: one GPU lent (goal <= 1.05x the larger stage)"))
        return out
    # Target on cuda:0, drafter on cuda:1: the limit is the larger stage's GPU-busy time
    # (each stage's kernels are the same on either GPU, so the one-GPU stage figures hold).
    apart = dataclasses.replace(regime, placement=Placement(("cuda:0",), ("cuda:1",)))
    ctx.progress(f"pipeline limits, {label}: building the models on two GPUs")
    models, drafter = pristine(apart.job, apart.placement)
    for d, t in variants:
        ctx.progress(f"pipeline limits, {label}: two GPUs, {d} drafter, {t} target")
        c = pipeline_cost(apart, fresh(models, drafter, apart.job), d, t)
        out.append(pipeline_row(apart, d, t, c, stages, "two GPUs", max))
    return out


def host_row(regime: Regime, c: dict[str, Any], what: str) -> Row:
    return compare(
        SECTION,
        f"{regime.label}: pipeline host thread time per step, {what}",
        c["host_ms"],
        "ms",
        "the pipeline's step (wall)",
        c["wall_ms"],
        HOST_GOAL if regime.on_gpu else None,
        "CPU time of every thread of the process per step, lane workers' polling included, "
        f"the bench's own synchronize left out ({c['sync_ms_left_out']:.1f} ms)"
        + _by_thread(c["host_ms_by_thread"])
        + ("" if regime.on_gpu else f"; {NEEDS_GPU}"),
        host_ms_by_thread=c["host_ms_by_thread"],
    )


def _by_thread(by_thread: dict[str, float] | None, top: int = 4) -> str:
    if not by_thread:
        return ""
    return "; by thread, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in list(by_thread.items())[:top])


def stage_row(regime: Regime, which: str, kind: str, c: dict[str, Any]) -> Row:
    name = f"{regime.label}: {which} stage alone, {LABEL[kind]}"
    goal = (
        DRAFTER_GOAL
        if (which, kind, regime.name) == ("drafter", "graphs", "launch-bound")
        else None
    )
    extra = {k: v for k, v in c.items() if k != "wall_ms"}
    note = f"host thread time {c['host_ms']:.1f} ms per step"
    if c["gpu_busy_ms"] is None:
        return compare(SECTION, name, c["wall_ms"], "ms", note=f"{note}; {NEEDS_GPU}", **extra)
    return compare(
        SECTION,
        name,
        c["wall_ms"],
        "ms",
        "its GPU-busy time",
        c["gpu_busy_ms"],
        goal,
        note,
        **extra,
    )


def pipeline_row(
    regime: Regime,
    d: str,
    t: str,
    c: dict[str, Any],
    stages: dict[tuple[str, str], dict],
    where: str,
    limit: Callable[[list[float]], float],
) -> Row:
    """A pipeline variant's step against `limit` of its stages' GPU-busy times: their sum
    on one GPU, the larger on two."""
    name = f"{regime.label}: pipeline step, {LABEL[d]} drafter, {LABEL[t]} target, {where}"
    busy = [stages["target", t]["gpu_busy_ms"], stages["drafter", d]["gpu_busy_ms"]]
    extra = {k: v for k, v in c.items() if k != "wall_ms"}
    note = f"host thread time {c['host_ms']:.1f} ms per step"
    if None in busy:
        return compare(SECTION, name, c["wall_ms"], "ms", note=f"{note}; {NEEDS_GPU}", **extra)
    goal = None
    if (d, t) == ("graphs", "graphs"):
        goal = "<= 1.05" if where == "two GPUs" else ONE_GPU_GOAL[regime.name]
    what = (
        "sum of the two stages' GPU-busy times" if limit is sum else "larger stage's GPU-busy time"
    )
    return compare(
        SECTION,
        name,
        c["wall_ms"],
        "ms",
        what,
        limit(busy),
        goal,
        note,
        target_busy_ms=busy[0],
        drafter_busy_ms=busy[1],
        **extra,
    )
