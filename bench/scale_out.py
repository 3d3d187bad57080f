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
import dataclasses
import gc
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from bench import kernels
from bench.common import Context, Row, compare, counts_arg, interleaved_medians, not_run
from bench.pipeline import Setup, drafter_stage, step_time, synchronize, time_stages
from bench.real_target import CPU_SIZE, NEEDS_GPU
from examples.dflash.data import MarkovTokens
from examples.dflash.hf import QWEN3_NEXT, HFTargetConfig
from examples.dflash.loops import (
    Job,
    PipelineLoop,
    Placement,
    build_models,
    target_dtype,
    target_forward,
)
from examples.dflash.models import TINY_DRAFTER, DrafterConfig
from pydflash import Dispatcher, TargetGraphs
from pydflash.pipeline.stages import EagerTarget

SECTION = "scale_out"
ROOT = Path(__file__).resolve().parents[1]
WORKER = "bench.scale_out_worker"
CPU_LANES = 2  # CI has two cores
SCALING = 0.95  # graph lanes' goal: a speed-up of at least SCALING * N
OVERLAP_GOAL = "<= 1.05"  # pipeline step / slower stage alone
# NVLink multicast stays off in every process this section starts: a program using it
# can take a shared host's GPUs out of service.
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
WAYS = {
    "graphs": "graph lanes",
    "lanes": "eager lanes",
    "executor": "ThreadPoolExecutor + streams",
    "processes": "one process per device",
}
DATA_SEED = 7  # as bench.real_target and the worker: device i's microbatch is batch i


@dataclasses.dataclass
class Options:
    """What to measure; None picks the default for the run (quick or full)."""

    counts: tuple[int, ...] = (1, 2, 4, 8)  # GPUs; 1 is always measured (speed-ups are over it)
    config: str = "qwen3-next-small"
    moe: bool = False
    batch: int = 1
    seq: int = 1024
    reps: int | None = None  # target-step samples per way and count (20 full, 10, 5 quick)
    processes: bool = True
    process_timeout: float | None = None  # seconds for all worker processes (300, 180 quick)
    pipelines: tuple[str, ...] = ("1:1", "3:1")  # target:drafter GPUs, one drafter
    pipeline_steps: int | None = None  # timed optimizer steps per repetition (8, 3 quick)
    # A multiple of 3, so the 3:1 pipeline's target lanes get equal shares of a step.
    accumulate: int = 6


@dataclasses.dataclass
class Setting:
    """The target, its data, and the devices the counts run on."""

    config: HFTargetConfig
    drafter: DrafterConfig
    name: str
    batch: int
    seq: int
    on_gpu: bool
    available: int  # devices for the lanes: GPUs, or CPU_LANES on the CPU
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)  # what eager runs

    def devices(self, n: int) -> list[str]:
        return [f"cuda:{i}" for i in range(n)] if self.on_gpu else ["cpu"] * n

    def where(self, n: int) -> str:
        """Where n lanes run, for row names; counts above `available` need GPUs."""
        unit = "GPU" if self.on_gpu or n > self.available else "CPU lane"
        return f"{n} {unit}{'' if n == 1 else 's'}"

    def batches(self, n: int) -> list[dict]:
        data = MarkovTokens(self.config.vocab, self.seq, self.batch, seed=DATA_SEED)
        return [
            {k: t.to(device) for k, t in b.items()}
            for b, device in zip(data.batches(0, n), self.devices(n), strict=True)
        ]

    def synchronize(self, n: int) -> None:
        if self.on_gpu:
            for i in range(n):
                torch.cuda.synchronize(i)

    def rate(self, seconds: float, n: int) -> str:
        samples = n * self.batch / seconds
        return f"{samples:,.1f} samples/s, {samples * self.seq:,.0f} tokens/s"


def run(ctx: Context) -> list[Row]:
    """Without transformers, HFTargetConfig.load raises ModuleNotFoundError: bench.run
    reports the section as not run, naming the missing package."""
    options = ctx.options.get(SECTION) or Options()
    if ctx.gpus:
        return measure(ctx, options, make_setting(options, torch.cuda.device_count()))
    # CPU lanes share the host's cores: one intra-op thread each (as bench/pipeline.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure(ctx, options, make_setting(options, 0))
    finally:
        torch.set_num_threads(threads)


def make_setting(options: Options, gpus: int) -> Setting:
    if gpus:
        name, batch, seq = options.config, options.batch, options.seq
    else:
        (name, seq), batch = CPU_SIZE, 2
    kernels.apply_fallbacks()  # PYDFLASH_BENCH_FALLBACK; the workers apply it too
    config = HFTargetConfig.load(name, moe=options.moe)
    label = f"{name}{', MoE' if options.moe else ''} {batch}x{seq}"
    drafter = DrafterConfig() if gpus else TINY_DRAFTER
    return Setting(config, drafter, label, batch, seq, gpus > 0, gpus or CPU_LANES)


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
                        setting, forwards[:n], batches[:n], pool, streams[:n]
                    ),
                }
                for key, stage in stages.items():
                    fns[key] = lambda n=n, stage=stage: lanes_step(
                        setting, stage[:n], lanes[:n], batches[:n]
                    )
                times[n] = interleaved_medians(fns, reps)
        graph_stats = [stage.stats() for stage in stages.get("graphs", [])]
    finally:
        dispatcher.shutdown()
    return times, graph_stats


def on_device(device: Any) -> Any:
    """The device current for kernels that launch on the current device."""
    return torch.cuda.device(device) if torch.device(device).type == "cuda" else nullcontext()


def executor_step(
    setting: Setting,
    forwards: list,
    batches: list[dict],
    pool: concurrent.futures.Executor,
    streams: list[Any],
) -> None:
    def one(i: int) -> None:
        with torch.no_grad():
            if streams[i] is None:
                forwards[i](batches[i])
                return
            # The inputs were made on the default stream, long before: no wait needed.
            with on_device(streams[i].device), torch.cuda.stream(streams[i]):
                forwards[i](batches[i])

    list(pool.map(one, range(len(batches))))
    setting.synchronize(len(batches))


def lanes_step(setting: Setting, stages: list, lanes: list, batches: list[dict]) -> None:
    futures = [
        stage.submit(lane, batch) for stage, lane, batch in zip(stages, lanes, batches, strict=True)
    ]
    results = [future.result() for future in futures]
    setting.synchronize(len(batches))
    for stage, result in zip(stages, results, strict=True):
        if isinstance(stage, TargetGraphs):
            stage.release(result)  # its output buffers serve the next replays


# --- one process per device ----------------------------------------------------------------
def process_times(
    ctx: Context, options: Options, setting: Setting, counts: list[int], limit: float
) -> tuple[dict[int, float], str | None]:
    """Per count, the slowest rank's median step (one forward, then a synchronize), in
    seconds; and why the workers stopped early (None when they finished)."""
    world = max(counts)
    ctx.progress(f"{setting.name}: {world} worker processes, at most {limit:.0f} s")
    args = [
        "--counts",
        ",".join(map(str, counts)),
        "--config",
        setting.config.source,
        "--batch",
        str(setting.batch),
        "--seq",
        str(setting.seq),
        "--reps",
        str(options.reps or ctx.reps(20, 5, default=10)),
    ]
    if options.moe:
        args.append("--moe")
    if not setting.on_gpu:
        args.append("--cpu")
    reports, failure = launch([sys.executable, "-m", WORKER, *args], world, limit)
    times = {}
    for n in counts:
        ranks = [r for r in reports if r["n"] == n]
        if len(ranks) == n:
            times[n] = max(statistics.median(r["step_s"]) for r in ranks)
    return times, failure


def launch(command: list[str], world: int, limit: float) -> tuple[list[dict], str | None]:
    """Starts `world` copies of `command` in torchrun's environment (ranks 0..world-1 on
    this host) and waits for all; returns their JSON lines and why they stopped early
    (None when every rank exited 0). When a rank fails or `limit` passes, the others
    are killed with their process groups."""
    env = {
        **os.environ,
        **CHILD_ENV,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
    }
    failure = None
    with tempfile.TemporaryDirectory(prefix="scale_out-") as folder:
        logs = [
            (Path(folder) / f"{rank}.out", Path(folder) / f"{rank}.err") for rank in range(world)
        ]
        procs: list[subprocess.Popen] = []
        try:
            for rank, (out, err) in enumerate(logs):
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    procs.append(
                        subprocess.Popen(
                            command,
                            cwd=ROOT,
                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdout=stdout,
                            stderr=stderr,
                            start_new_session=True,
                        )
                    )
            failure = wait_all(procs, logs, limit)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        reports = [
            json.loads(line)
            for out, _ in logs
            for line in out.read_text().splitlines()
            if line.startswith("{")
        ]
    return reports, failure


def wait_all(
    procs: list[subprocess.Popen], logs: list[tuple[Path, Path]], limit: float
) -> str | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code:  # the others would wait for it at the barrier
                lines = [line for line in logs[rank][1].read_text().splitlines() if line.strip()]
                return f"rank {rank} exit {code}: {lines[-1] if lines else 'no message'}"
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)
    return f"still running at the {limit:.0f} s limit"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# --- pipeline across GPUs ------------------------------------------------------------------
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
