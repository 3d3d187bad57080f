"""Section: the seed's workload. DFlash trained online against a 23 B Qwen3-Next-style
hybrid on one GPU with long microbatches of varied length, and the memory a length takes.

- Target: `qwen3-next-large` (transformers' Qwen3-Next, hidden 5120, 64 layers, every 4th
  full attention, dense MLP, ~23 B), random weights, bf16, built on the GPU; FP8 rows with
  examples/dflash/fp8.py where it exists. Drafter: DFlash at the target's width (5 layers)
  on layers 5/19/33/47/61, block 8 with 512 anchors (SpecForge's 27 B recipe) and 16/256.
- Lengths per microbatch, rounded up to 64: long, uniform on [1,024, 8,192] (mean ~4,640);
  chat, 320 + an exponential of mean 200 redrawn above 2,048 (mean ~550). Batch 2, acc. 4.
- Rows: the sequential, ThreadPoolExecutor, pipeline (eager) and pipeline (graph stages)
  loops: samples/s, tokens/s, MFU (Note [Counted FLOPs]), peak memory, beside SpecForge's
  27 B figures (another run); memory and samples/s against length (rows and a PNG) with the
  largest length that fits; the drafter stage alone at 2 x 32 k, the default run's only GPU
  row. `--full` or this command line measures the rest (minutes):

    python -m bench.seed_workload [--quick] [--json F] [--out DIR] [--no-fp8] [--chat]
        [--b16] [--lengths 4096,8192,16384,32768]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench import limits
from bench.common import Context, Row, compare, counts_arg, not_run
from bench.pipeline import Setup, step_time
from examples.dflash import loops
from examples.dflash.loops import Job, Models, Placement
from examples.dflash.models import (
    DFLASH_B16,
    BlockDrafter,
    DrafterConfig,
    TargetConfig,
    _Shapes,
    query_groups,
)

SECTION = "seed_workload"
# SpecForge's docs, recipe "qwen3.8-27b-dflash2-disaggregated" (Sept 2026), 8 x H200.
SPECFORGE = {"disaggregated_per_gpu": 10.65 / 8, "colocated_per_gpu": 8.61 / 8, "trainer_rank": 3.7}
CROSS_RUN = "SpecForge 27 B, disaggregated, per GPU (another run)"
SETUP_DIFFERENCES = (
    "SpecForge: 27 B FP8 target, ~1.9 B DFlash2 drafter, real data, 5 capture + 3 trainer GPUs "
    "(colocated 8.61/8 per GPU, a trainer rank 3.7); ours: one H200, 23 B random weights, bf16"
)
B8 = replace(DFLASH_B16, block=8, anchors=512)  # the 27 B recipe's drafter


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Uniform on [low, high], or low + Exp(mean - low) redrawn above high; rounded up."""

    name: str
    low: int
    high: int
    mean: int | None = None
    multiple: int = 64

    def draw(self, count: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while len(out) < count:
            u = torch.rand((), generator=g, dtype=torch.float64).item()
            if self.mean is None:
                x = self.low + u * (self.high - self.low)
            else:
                x = self.low - (self.mean - self.low) * math.log1p(-u)
            if x <= self.high:
                out.append(min(self.high, -(-math.ceil(x) // self.multiple) * self.multiple))
        return out


@dataclasses.dataclass(frozen=True)
class Workload:
    """Shapes for a GPU (the issue's) or a CPU (tiny, the same code paths)."""

    target: Any  # HFTargetConfig or TargetConfig
    drafters: dict[str, DrafterConfig]  # by name: "block 8, 512 anchors", ...
    lengths: dict[str, Lengths]  # "long", "chat"
    memory_lengths: tuple[int, ...]
    batch: int = 2
    accumulate: int = 4

    @classmethod
    def gpu(cls, layers: int = 64) -> Workload:
        drafters = {"block 8, 512 anchors": B8, "block 16, 256 anchors": DFLASH_B16}
        lengths = {"long": Lengths("long", 1024, 8192), "chat": Lengths("chat", 320, 2048, 520)}
        return cls(hybrid_target(layers), drafters, lengths, (4096, 8192, 16384, 32768))

    @classmethod
    def cpu(cls) -> Workload:
        target = TargetConfig(64, 32, 8, heads=2, head_dim=16, capture_layers=recipe_layers(8))
        tiny = DrafterConfig(layers=1, heads=2, kv_heads=1, head_dim=16, block=4, anchors=8)
        drafters = {"block 4, 8 anchors": tiny, "block 8, 4 anchors": replace(tiny, block=8)}
        lengths = {"long": Lengths("long", 40, 96, None, 8), "chat": Lengths("chat", 24, 64, 32, 8)}
        return cls(target, drafters, lengths, (32, 64, 128))


def recipe_layers(n: int) -> tuple[int, ...]:
    """The 27 B recipe's capture layers 5/19/33/47/61 of 64, scaled to n layers."""
    return tuple(sorted({min(n - 1, round((5 + 14 * i) * n / 64)) for i in range(5)}))


def hybrid_target(layers: int = 64) -> Any:
    """`qwen3-next-large` with `layers` decoder layers (64: the issue's 23 B target)."""
    from transformers import Qwen3NextConfig

    from examples.dflash.hf import QWEN3_NEXT, HFTargetConfig

    shape = {**QWEN3_NEXT["qwen3-next-large"], "num_hidden_layers": layers}
    config = Qwen3NextConfig(**shape, num_experts=0)
    return HFTargetConfig("qwen3-next-large", recipe_layers(layers), config)


def varied_batches(job: Job, lengths: Lengths, count: int, pin: bool = False) -> list[dict]:
    """`count` microbatches of the job's data, batch i at the i-th drawn length: a pure
    function of (job.seed, lengths, i)."""
    sources: dict[int, Any] = {}
    out = []
    for i, seq in enumerate(lengths.draw(count, job.seed)):
        if seq not in sources:
            sources[seq] = replace(job, seq=seq).data(job.seed)
        batch = sources[seq].batch(i)
        out.append({k: t.pin_memory() for k, t in batch.items()} if pin else batch)
    return out


class VariedSetup(Setup):
    """bench.pipeline's timing setup over varied-length microbatches."""

    lengths: Lengths

    def batches(self, count: int) -> list[dict]:
        if len(self._made) < count:
            self._made = varied_batches(self.job, self.lengths, count, pin=self.on_gpu)
        return self._made[:count]


# Note [Counted FLOPs]: MFU here is the FLOPs of both stages, counted from the shapes, over
# wall time, against the GPU's dense bf16 peak (the FP8 rows too). Per microbatch of B rows
# of length L:
# - target forward: 2 x L x B x (weights of the linear layers it runs); each softmax
#   attention layer 2 x heads x head_dim x L^2 x B (QK^T and PV, causal half); each
#   gated-delta-rule layer (FLA's chunked kernels, chunk 64) L x B x value heads x (4 x
#   key_dim x value_dim + 128 x (key_dim + value_dim)), an estimate (5 % of GPU time);
# - drafter forward and backward, Q = anchors x block queries per row: 3 x 2 x (rows x
#   weights) for its trainable linear layers (key/value projections on L + Q rows, the rest
#   on Q), 2 x 2 x L x weights for fc (the features take no gradient); attention 3.5 x 4
#   x heads x head_dim x Q x keys (the keys of each query group, masked ones included: the
#   fused kernel computes them); the frozen head 2 x 2 x anchors x (block - 1) x dim x
#   vocab (forward and input gradient). Not counted: the optimizer, norms, gates, rotary,
#   the short convolution (elementwise, a third of the target's GPU time in a profile).
def target_shape(target: nn.Module) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(linear weights a forward runs, (attention layers, heads, head_dim), (delta-rule
    layers, value heads, key_dim, value_dim)): what target_flops counts with."""
    base = getattr(getattr(target, "model", None), "base_model", None)
    if base is not None:  # examples.dflash.hf.HFTarget: every decoder layer runs
        cfg = base.config
        kinds = list(cfg.layer_types)
        attn = (kinds.count("full_attention"), cfg.num_attention_heads, cfg.head_dim)
        keys, values = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        delta = (kinds.count("linear_attention"), cfg.linear_num_value_heads, keys, values)
        linear = base.layers
    else:  # examples.dflash.models.HybridTarget: the layers up to the last capture
        cfg = target.cfg
        run = max(cfg.capture_layers) + 1
        attn = (run // cfg.attn_every, cfg.heads, cfg.head_dim)
        delta = (run - run // cfg.attn_every, cfg.heads, cfg.head_dim, cfg.head_dim)
        linear = target.layers[:run]
    weights = sum(m.weight.numel() for m in linear.modules() if isinstance(m, nn.Linear))
    return weights, attn, delta


def target_flops(shape: tuple, batch: int, length: int) -> float:
    weights, attn, delta = shape
    tokens = batch * length
    return (
        2 * tokens * weights
        + attn[0] * 2 * attn[1] * attn[2] * length * tokens
        + delta[0] * tokens * delta[1] * (4 * delta[2] * delta[3] + 128 * (delta[2] + delta[3]))
    )


def drafter_flops(drafter: BlockDrafter, batch: int, length: int) -> float:
    cfg, dim = drafter.cfg, drafter.fc.out_features
    n = cfg.anchors or length // cfg.block
    q = n * cfg.block
    inner, kv = cfg.heads * cfg.head_dim, cfg.kv_heads_ * cfg.head_dim
    mlp = sum(m.weight.numel() for m in drafter.layers[0].mlp.modules() if isinstance(m, nn.Linear))
    per_layer = q * (2 * dim * inner + mlp) + (length + q) * dim * 2 * kv
    keys = length + q // query_groups(cfg, n, length)
    attention = cfg.layers * 4 * inner * q * keys
    head = n * (cfg.block - 1) * drafter.lm_head.weight.numel()
    fc = length * drafter.fc.weight.numel()  # its input, the features, takes no gradient
    return batch * (6 * cfg.layers * per_layer + 4 * fc + 3.5 * attention + 4 * head)


def flop_counter(models: Models) -> Callable[[list[dict]], float]:
    """Both stages' FLOPs of a list of microbatches (Note [Counted FLOPs]), with the
    target's shape read now: an FP8 conversion later changes its modules, not its FLOPs."""
    shape, drafter = target_shape(models.targets[0]), models.drafters[0]
    return lambda batches: sum(
        target_flops(shape, *b["input_ids"].shape) + drafter_flops(drafter, *b["input_ids"].shape)
        for b in batches
    )


def peak(on_gpu: bool, reset: bool = False) -> int | None:
    if not on_gpu:
        return None
    torch.cuda.synchronize()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated()


def free(models: Models | None = None) -> None:
    for optimizer in models.optimizers if models is not None else ():
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA never started


SEQUENTIAL, EXECUTOR = "sequential loop", "ThreadPoolExecutor loop"
LOOPS = (SEQUENTIAL, EXECUTOR, "pipeline, eager stages", "pipeline, graph stages")


@dataclasses.dataclass
class Bench:
    """The built models of one drafter configuration and what measures them."""

    ctx: Context
    models: Models
    job: Job
    placement: Placement

    def __post_init__(self) -> None:
        self.on_gpu = self.placement.targets[0].startswith("cuda")
        self.flops = flop_counter(self.models)

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

    def loop_rows(self, lengths: Lengths, what: str, names=LOOPS) -> list[Row]:
        job = replace(self.job, seq=lengths.high)
        steps = self.ctx.reps(3, 1, default=2)
        setup = VariedSetup(job, self.placement, steps, reps=1, warmup=1, on_gpu=self.on_gpu)
        setup.lengths = lengths
        return [self.loop_row(name, setup, what) for name in names]

    def loop_row(self, name: str, setup: VariedSetup, what: str) -> Row:
        self.ctx.progress(f"{SECTION}: {what}, {name}")
        free(self.models)  # and what a failed loop before left
        resident, row_name = peak(self.on_gpu, reset=True), f"{what}: {name}, samples/s"
        try:
            seconds = self.step_time(name, setup)
        except Exception as exc:  # noqa: BLE001 (one loop failing, say an OOM, costs its row)
            why = f"failed: {type(exc).__name__}: {exc}"[:240]
            return Row(SECTION, row_name, None, "samples/s", note=why, extra={"status": "failed"})
        top, acc = peak(self.on_gpu), setup.job.accumulate  # the timed microbatches:
        timed = setup.batches((setup.warmup + setup.steps) * acc)[setup.warmup * acc :]
        free(self.models)
        rate = acc * setup.job.batch / seconds
        tokens = sum(b["input_ids"].numel() for b in timed) / setup.steps / seconds
        peak_flops = limits.peak_flops(0) if self.on_gpu else None
        mfu = peak_flops and self.flops(timed) / setup.steps / seconds / peak_flops
        mean = sum(b["input_ids"].shape[1] for b in timed) / len(timed)
        note = f"{tokens:,.0f} tokens/s" + (f", MFU {mfu:.0%}" if mfu else "")
        note += (f", peak {top / 2**30:.1f} GiB" if top else "") + f"; mean length {mean:,.0f}"
        goal, baseline = None, {}
        if self.on_gpu:  # SpecForge beside the GPU rows; the goals on the recipe's
            baseline = dict(baseline_name=CROSS_RUN, baseline=SPECFORGE["disaggregated_per_gpu"])
            if name == LOOPS[2] and what.startswith("long, block 8"):
                goal = "value >= 3.0" if "fp8" in what else "value >= 2.2"
                note += f"; {SETUP_DIFFERENCES}"
        extra = dict(tokens_per_s=tokens, mfu=mfu, peak_bytes=top, resident_bytes=resident)
        self.ctx.progress(f"{SECTION}: {row_name}: {rate:.3g} ({note.split('; ')[0]})")
        return compare(SECTION, row_name, rate, "samples/s", **baseline, target=goal, note=note,
                       step_s=seconds, specforge=SPECFORGE, **extra)  # fmt: skip

    def memory(self, lengths: tuple[int, ...], batches: tuple[int, ...]) -> list[dict]:
        """Peak memory and samples/s of the sequential loop (one microbatch a step, one
        warm-up step, one timed) at each length and batch; an OOM is a point too (the
        message says which: cuBLAS and cuDNN failing to allocate raise RuntimeError)."""
        points = []
        for length in lengths:
            for batch in batches:
                self.ctx.progress(f"{SECTION}: memory at {batch} x {length:,}")
                point: dict[str, Any] = {"length": length, "batch": batch}
                job = replace(self.job, seq=length, batch=batch, accumulate=1)
                data = job.data(job.seed).batches(0, 2)
                peak(self.on_gpu, reset=True)
                steps = loops.sequential_steps(self.models, self.placement, job, data, 2)
                try:
                    next(steps)()
                    started = time.perf_counter()
                    next(steps)()
                    point["samples_per_s"] = batch / (time.perf_counter() - started)
                    point["peak_bytes"] = peak(self.on_gpu)
                except (torch.OutOfMemoryError, RuntimeError) as exc:  # cuBLAS's: RuntimeError
                    message = str(exc).partition("\n")[0][:160]
                    point["oom"] = f"{type(exc).__name__}: {message}"
                finally:
                    steps.close()
                    del steps, data
                    free(self.models)
                points.append(point)
                self.ctx.progress(f"{SECTION}: {point}")  # for a run cut short
        return points


def memory_rows(points: list[dict], what: str, on_gpu: bool, goals: dict[int, str]) -> list[Row]:
    rows, lengths = [], sorted({p["length"] for p in points})
    for p in points:
        name = f"{what}: memory at {p['batch']} x {p['length']:,}"
        if "oom" in p:
            rows.append(Row(SECTION, name, None, "bytes", note=f"OOM: {p['oom']}", extra=p))
        elif on_gpu:
            note = f"{p['samples_per_s']:.2f} samples/s; sequential loop, one microbatch a step"
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
    return compare(SECTION, name, cost.wall_ms, "ms", note=note, peak_bytes=top)


def _drafter_alone(workload: Workload, device: str, length: int) -> tuple[limits.Cost, int | None]:
    cfg, target = next(iter(workload.drafters.values())), workload.target
    width, on_gpu = len(target.capture_layers) * target.dim, device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.device(device):
        drafter = BlockDrafter(_Shapes(target.dim, width, target.vocab).to(dtype), cfg)
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


@dataclasses.dataclass
class Options:
    everything: bool = False  # the module's command line: every row (as --full)
    fp8: bool = True  # the --target-fp8 rows, where examples/dflash/fp8.py exists
    lengths: tuple[int, ...] | None = None  # memory-vs-length points (default: the workload's)
    chat: bool | None = None  # the chat workload's rows (default: --full)
    b16: bool | None = None  # the long workload with block 16, 256 anchors (default: --full)
    out: str | None = None  # a folder for seed_memory_vs_length.png / .json


def run(ctx: Context) -> list[Row]:
    opts = ctx.options.get(SECTION) or Options()
    on_gpu = ctx.gpus > 0
    workload = Workload.gpu() if on_gpu else Workload.cpu()
    device = "cuda:0" if on_gpu else "cpu"
    rows = [drafter_alone(ctx, workload, device, 32768 if on_gpu else 256)]
    full = ctx.full or opts.everything
    if on_gpu and not full:
        why = "not run in the default run: --full, or python -m bench.seed_workload (minutes)"
        return rows + [not_run(SECTION, f"long, block 8: {n}, samples/s", why) for n in LOOPS]
    placement = Placement((device,), (device,))
    (first, drafter), (second, other) = workload.drafters.items()
    long, chat = workload.lengths["long"], workload.lengths["chat"]
    job = Job(workload.target, drafter, long.high, workload.batch, workload.accumulate, 1e-4)
    ctx.progress(f"{SECTION}: building the target and the drafter")
    bench = Bench(ctx, loops.build_models(job, placement), job, placement)
    rows += bench.loop_rows(long, f"long, {first}", LOOPS[:3])
    curves = {"bf16": bench.memory(lengths := opts.lengths or workload.memory_lengths, (1, 2))}
    rows += memory_rows(curves["bf16"], "bf16 target", on_gpu, {1: "value >= 32768"})
    rows += bench.loop_rows(long, f"long, {first}", LOOPS[3:])  # last: may lose, or take long
    save(curves, opts.out)  # now too: the FP8 rows may take the rest of a time limit
    if opts.b16 if opts.b16 is not None else full and on_gpu:
        ctx.progress(f"{SECTION}: a second drafter ({second})")
        j = replace(job, drafter=other)
        built = loops.build_models(j, placement, target=bench.models.targets[0])
        b16 = Bench(ctx, built, j, placement)
        rows += b16.loop_rows(long, f"long, {second}")
        if opts.chat if opts.chat is not None else full and on_gpu:
            rows += b16.loop_rows(chat, f"chat, {second}")
        del b16, built
        free()
    try:  # branch target's module, not merged everywhere yet
        from examples.dflash.fp8 import to_fp8
    except ImportError:
        to_fp8 = None
    if opts.fp8 and on_gpu and to_fp8 is None:
        why = "not available: no examples/dflash/fp8.py here"
        rows.append(not_run(SECTION, f"long, {first}, fp8 target", why, "value >= 3.0"))
    if opts.fp8 and on_gpu and to_fp8 is not None:
        ctx.progress(f"{SECTION}: the target's linear layers in FP8, row-wise scales")
        converted = to_fp8(bench.models.targets[0], granularity="row")
        if isinstance(converted, nn.Module):  # else converted in place
            bench.models = replace(bench.models, targets=[converted])
        rows += bench.loop_rows(long, f"long, {first}, fp8 target", LOOPS[2:3])
        curves["fp8"] = bench.memory([n for n in lengths if n >= 16384] or lengths, (2,))
        rows += memory_rows(curves["fp8"], "fp8 target", on_gpu, {2: "value >= 32768"})
    save(curves, opts.out)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.seed_workload")
    parser.add_argument("--out", help="folder for the memory-vs-length PNG and JSON")
    parser.add_argument("--no-fp8", action="store_true", help="leave out the FP8 target's rows")
    parser.add_argument("--lengths", type=counts_arg("length", "4096,32768"))
    parser.add_argument("--chat", action="store_true", help="the chat workload's rows too")
    parser.add_argument("--b16", action="store_true", help="block 16, 256 anchors too")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    b16, chat = args.b16 or args.chat or None, args.chat or None
    options = Options(True, not args.no_fp8, args.lengths, chat, b16, args.out)
    from bench import run as suite

    return suite.main(["--sections", SECTION, *rest], options={SECTION: options})


if __name__ == "__main__":
    sys.exit(main())
