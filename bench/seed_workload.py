"""Section: the seed's workload. DFlash trained online against a 23 B Qwen3-Next-style
hybrid on one GPU with long microbatches of varied length, and the memory a length takes.

- Target: `qwen3-next-large` (transformers' Qwen3-Next, hidden 5120, 64 layers, every 4th
  full attention, dense MLP, ~23 B), random weights, built on the GPU, in four variants:
  bf16, bf16 with FLA's fused norms, swiglu and causal conv (examples/dflash/fused.py,
  `--target-fused fla`), FP8 linear layers (examples/dflash/fp8.py, `--target-fp8`), and
  both. Drafter: DFlash at the target's width (5 layers) on layers 5/19/33/47/61, block 8
  with 512 anchors (SpecForge's 27 B recipe) and block 16 with 256.
- Lengths per microbatch (Note [Stratified lengths]), multiples of 64: long, uniform on
  [768, 8,192] (mean 4,512); chat, 320 + an exponential of mean 200 cut at 2,048 (mean
  553). Batch 2, accumulation 4.
- Rows: the sequential, ThreadPoolExecutor, pipeline (eager) and pipeline (graph stages)
  loops: samples/s, tokens/s, MFU (Note [Counted FLOPs]), peak memory, beside SpecForge's
  27 B figures (another run); memory and samples/s against length (rows and a PNG) with the
  largest length that fits; the drafter stage alone at 2 x 32 k, the default run's only GPU
  row. This command line measures the rest (about 6 minutes; stops starting rows after
  --budget seconds); --full adds block 16 and the chat workload:

    python -m bench.seed_workload [--quick] [--full] [--json F] [--out DIR] [--no-fp8]
        [--chat] [--b16] [--lengths 4096,8192,16384,32768] [--budget 330]
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
    TargetShapes,
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


# Note [Stratified lengths]: a handful of microbatches drawn at random has a mean far from
# the distribution's (4,168 against ~4,640 in one run of 8). So `count` lengths are the
# distribution's `count` equal-probability strata, each the mean of its rounded lengths
# (rounded to the multiple), in an order shuffled by the seed: their mean is the
# distribution's (`expected`) within half a multiple, whatever the count.
@dataclasses.dataclass(frozen=True)
class Lengths:
    """Uniform on [low, high], or low + Exp(mean - low) cut at high; each length rounded up
    to a multiple of `multiple`."""

    name: str
    low: int
    high: int
    mean: int | None = None  # the exponential's mean before the cut; None: uniform
    multiple: int = 64

    def quantile(self, u: float) -> float:
        """The length below which a fraction u of the distribution lies (before rounding)."""
        if self.mean is None:
            return self.low + u * (self.high - self.low)
        scale = self.mean - self.low
        kept = -math.expm1(-(self.high - self.low) / scale)  # the mass below the cut
        return self.low - scale * math.log1p(-u * kept)

    def rounded(self, x: float) -> int:
        return min(self.high, -(-math.ceil(x) // self.multiple) * self.multiple)

    def _stratum(self, i: int, count: int, fine: int = 256) -> float:
        """The mean rounded length of the i-th of `count` equal-probability strata."""
        return (
            sum(self.rounded(self.quantile((i + (j + 0.5) / fine) / count)) for j in range(fine))
            / fine
        )

    def expected(self) -> float:
        """The distribution's mean length, rounding included."""
        return self._stratum(0, 1, fine=1 << 14)

    def draw(self, count: int, seed: int) -> list[int]:
        """`count` lengths, one per stratum, shuffled by `seed` (Note [Stratified lengths])."""
        lowest = self.rounded(self.low)
        strata = [self._stratum(i, count) for i in range(count)]
        lengths = [
            min(self.high, max(lowest, round(x / self.multiple) * self.multiple)) for x in strata
        ]
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        return [lengths[i] for i in order.tolist()]


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
        lengths = {"long": Lengths("long", 768, 8192), "chat": Lengths("chat", 320, 2048, 520)}
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


def varied_batches(
    job: Job, lengths: Lengths, count: int, pin: bool = False, windows: tuple[int, ...] = ()
) -> list[dict]:
    """`count` microbatches of the job's data, batch i at the i-th length: a pure function of
    (job.seed, lengths, count, windows). The lengths are drawn window by window (`windows`:
    their sizes, repeated; default one window of `count`), each window stratified (Note
    [Stratified lengths]): a timed window's mean length is the distribution's."""
    drawn = window_lengths(lengths, count, windows or (count,), job.seed)
    sources: dict[int, Any] = {}
    out = []
    for i, seq in enumerate(drawn):
        if seq not in sources:
            sources[seq] = replace(job, seq=seq).data(job.seed)
        batch = sources[seq].batch(i)
        out.append({k: t.pin_memory() for k, t in batch.items()} if pin else batch)
    return out


def window_lengths(lengths: Lengths, count: int, sizes: tuple[int, ...], seed: int) -> list[int]:
    """`count` lengths drawn window after window of `sizes` (cycled), each window stratified
    and shuffled with a seed of its own."""
    drawn: list[int] = []
    window = 0
    while len(drawn) < count:
        size = sizes[window % len(sizes)]
        drawn += lengths.draw(size, seed * 1000 + window)
        window += 1
    return drawn[:count]


class VariedSetup(Setup):
    """bench.pipeline's timing setup over varied-length microbatches: the warm-up steps'
    microbatches and the timed steps' are each a stratified window."""

    lengths: Lengths

    def batches(self, count: int) -> list[dict]:
        if len(self._made) < count:
            acc = self.job.accumulate
            windows = tuple(n * acc for n in (self.warmup, self.steps) if n)
            self._made = varied_batches(self.job, self.lengths, count, self.on_gpu, windows)
        return self._made[:count]

    def timed(self) -> list[dict]:
        """The microbatches of the first repetition's timed steps."""
        acc = self.job.accumulate
        return self.batches((self.warmup + self.steps) * acc)[self.warmup * acc :]


# Note [Counted FLOPs]: MFU here is the FLOPs of both stages, counted from the shapes, over
# wall time, against the GPU's dense bf16 peak: for the FP8 rows too, where it reads as
# "bf16-equivalent" (an FP8 GEMM's peak is twice bf16's, so it can pass 100 %). FP8 rows
# also give the FP8 GEMMs' own FLOPs over wall time against the dense FP8 peak
# (limits.PEAK_FP8_FLOPS). Per microbatch of B rows of length L:
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
    if base is not None:  # examples.dflash.hf.HFTarget: the layers up to the last capture
        cfg, run = base.config, max(target.layers) + 1  # (Note [Capture layers only])
        kinds = list(cfg.layer_types)[:run]
        attn = (kinds.count("full_attention"), cfg.num_attention_heads, cfg.head_dim)
        keys, values = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        delta = (kinds.count("linear_attention"), cfg.linear_num_value_heads, keys, values)
        linear = base.layers[:run]
    else:  # examples.dflash.models.HybridTarget: the layers up to the last capture
        cfg = target.cfg
        run = max(cfg.capture_layers) + 1
        attn = (run // cfg.attn_every, cfg.heads, cfg.head_dim)
        delta = (run - run // cfg.attn_every, cfg.heads, cfg.head_dim, cfg.head_dim)
        linear = target.layers[:run]
    return linear_weights(linear), attn, delta


def linear_weights(module: nn.Module, fp8_only: bool = False) -> int:
    """The weights of the linear layers in `module`: nn.Linear and FP8Linear (examples/
    dflash/fp8.py, named here: that module may be absent), or FP8Linear's only."""
    total = 0
    for m in module.modules():
        fp8 = type(m).__name__ == "FP8Linear"
        if fp8 or (isinstance(m, nn.Linear) and not fp8_only):
            total += m.in_features * m.out_features
    return total


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
    """Both stages' FLOPs of a list of microbatches (Note [Counted FLOPs])."""
    shape, drafter = target_shape(models.targets[0]), models.drafters[0]
    return lambda batches: sum(
        target_flops(shape, *b["input_ids"].shape) + drafter_flops(drafter, *b["input_ids"].shape)
        for b in batches
    )


def fp8_flop_counter(models: Models) -> Callable[[list[dict]], float]:
    """The FLOPs of the target's FP8 GEMMs over a list of microbatches (0 for bf16)."""
    target = models.targets[0]
    base = getattr(getattr(target, "model", None), "base_model", None)
    run = base.layers[: max(target.layers) + 1] if base is not None else target
    weights = linear_weights(run, fp8_only=True)
    return lambda batches: sum(2 * b["input_ids"].numel() * weights for b in batches)


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

    def memory(
        self,
        lengths: tuple[int, ...],
        batches: tuple[int, ...],
        pipeline: bool = False,
        budget: Budget | None = None,
    ) -> list[dict]:
        """Peak memory and samples/s at each length and batch of the sequential loop (one
        microbatch a step, one warm-up step, one timed), or with `pipeline` of the eager
        pipeline (accumulation 2, depth 2: two microbatches' features in flight); an OOM is
        a point too (the message says which: cuBLAS and cuDNN failing to allocate raise
        RuntimeError). Past the `budget`, the points left are left out."""
        points = []
        for length in lengths:
            for batch in batches:
                if budget is not None and budget.over():
                    self.ctx.progress(
                        f"{SECTION}: over the budget: no point at {batch} x {length:,}"
                    )
                    continue
                loop = "pipeline" if pipeline else "sequential"
                self.ctx.progress(f"{SECTION}: memory at {batch} x {length:,}, {loop} loop")
                point: dict[str, Any] = {"length": length, "batch": batch, "loop": loop}
                acc = 2 if pipeline else 1
                job = replace(self.job, seq=length, batch=batch, accumulate=acc)
                data = job.data(job.seed).batches(0, 2 * acc)
                peak(self.on_gpu, reset=True)
                pipe = loops.PipelineLoop(self.models, self.placement, job, 2) if pipeline else None
                steps = (
                    pipe.steps(data, 2)
                    if pipe is not None
                    else loops.sequential_steps(self.models, self.placement, job, data, 2)
                )
                try:
                    next(steps)()
                    started = time.perf_counter()
                    next(steps)()
                    point["samples_per_s"] = acc * batch / (time.perf_counter() - started)
                    point["peak_bytes"] = peak(self.on_gpu)
                except Exception as exc:  # noqa: BLE001 (an OOM, or a pipeline's error about one)
                    point["oom"] = first_line(exc, 160)
                finally:
                    steps.close()
                    if pipe is not None:
                        pipe.close()
                    del steps, data, pipe
                    free(self.models)
                points.append(point)
                self.ctx.progress(f"{SECTION}: {point}")  # for a run cut short
        return points


def first_line(exc: BaseException, limit: int = 200) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().partition(chr(10))[0]}"[:limit]


def failed_row(name: str, exc: BaseException) -> Row:
    """A loop that failed (an OOM, a capture error): its row, with the error's first line."""
    why = f"failed: {first_line(exc)}"
    return Row(SECTION, name, None, "samples/s", note=why, extra={"status": "failed"})


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


@dataclasses.dataclass
class Options:
    everything: bool = False  # the loop rows (the module's command line); else as --full
    fp8: bool = True  # the FP8 target's rows, where examples/dflash/fp8.py exists
    lengths: tuple[int, ...] | None = None  # memory-vs-length points (default: the workload's)
    chat: bool | None = None  # the chat workload's rows (default: --full)
    b16: bool | None = None  # the long workload with block 16, 256 anchors (default: --full)
    out: str | None = None  # a folder for seed_memory_vs_length.png / .json and partial rows
    budget: float | None = None  # seconds after which no further item starts (None: no limit)
    fused: bool = True  # the targets with FLA's fused elementwise kernels, where FLA imports


# The target variants: (FP8 linear layers, fused elementwise kernels), as the example's
# --target-fp8 and --target-fused fla.
FLA_FUSIONS = ("norms", "swiglu", "conv")
TARGETS = {
    "bf16": (False, ()),
    "bf16+fla": (False, FLA_FUSIONS),
    "fp8": (True, ()),
    "fp8+fla": (True, FLA_FUSIONS),
}


def target_variants(opts: Options, job: Job) -> list[str]:
    """The variants this machine can build: FP8 where fp8.py imports (a GPU's needs
    compute capability 9.0, which to_fp8 checks), the fused ones with an HF target and FLA."""
    try:
        from examples.dflash import fp8  # noqa: F401 (the FP8 rows need it)
    except ImportError:
        has_fp8 = False
    else:
        has_fp8 = opts.fp8
    try:
        from examples.dflash.fused import fla_available
    except ImportError:
        has_fla = False
    else:
        has_fla = opts.fused and hasattr(job.target, "fused") and fla_available()
    return [
        name
        for name, (fp8, fused) in TARGETS.items()
        if (has_fp8 or not fp8) and (has_fla or not fused)
    ]


def build_bench(ctx: Context, job: Job, placement: Placement, variant: str) -> Bench:
    """The models of `job` with its target in `variant` (TARGETS): the same random weights
    and the same initial drafter for every variant (build_models seeds both)."""
    fp8, fused = TARGETS[variant]
    ctx.progress(f"{SECTION}: building the {variant} target and the drafter")
    if hasattr(job.target, "fused"):  # examples.dflash.hf.HFTargetConfig: built in variant
        job = replace(job, target=replace(job.target, fp8=fp8, fused=fused))
        return Bench(ctx, loops.build_models(job, placement), job, placement, variant)
    models = loops.build_models(job, placement)  # the built-in hybrid (CPU): FP8 in place
    if fp8:
        from examples.dflash.fp8 import to_fp8

        to_fp8(models.targets[0])
    return Bench(ctx, models, job, placement, variant)


class Budget:
    """Seconds left for the section's optional items (None: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.perf_counter() + seconds

    def over(self) -> bool:
        return self.end is not None and time.perf_counter() > self.end


def run(ctx: Context) -> list[Row]:
    opts = ctx.options.get(SECTION) or Options()
    budget = Budget(opts.budget)
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
    lengths = opts.lengths or workload.memory_lengths
    variants = target_variants(opts, job)
    fastest_fp8 = ([v for v in variants if v.startswith("fp8")] or [None])[-1]
    curves: dict[str, list[dict]] = {}

    def keep(new: list[Row]) -> None:
        rows.extend(new)
        save_rows(rows, opts.out)

    def skip(name: str, goal: str | None = None) -> None:
        why = f"not run: over the --budget of {opts.budget:.0f} s"
        keep([not_run(SECTION, name, why, goal if on_gpu else None)])

    # The bf16 target's three loops first, then each cheaper target's pipeline: the rows
    # the goals name come before the long memory sweep and the graph stages.
    bench = build_bench(ctx, job, placement, "bf16")
    keep(bench.loop_rows(long, f"long, {first}", LOOPS[:3], goal="value >= 2.2"))
    del bench
    free()
    for variant in variants[1:]:
        what, goal = f"long, {first}, {variant} target", None
        goal = "value >= 3.0" if variant == fastest_fp8 else None
        if budget.over():
            skip(f"{what}: {LOOPS[2]}, samples/s", goal)
            continue
        bench = build_bench(ctx, job, placement, variant)
        keep(bench.loop_rows(long, what, LOOPS[2:3], goal=goal))
        if variant == fastest_fp8 and not budget.over():
            longest = [n for n in lengths if n >= 16384] or list(lengths[-1:])
            curves[variant] = bench.memory(longest, (2,), budget=budget)
            keep(memory_rows(curves[variant], f"{variant} target", on_gpu,
                             {2: "value >= 32768"}))  # fmt: skip
            if not budget.over():
                name = f"{variant}, pipeline"
                curves[name] = bench.memory(longest[-1:], (2,), pipeline=True)
                keep(memory_rows(curves[name], f"{variant} target, pipeline", on_gpu, {}))
            save(curves, opts.out)
        del bench
        free()
    if budget.over():
        skip(f"bf16 target: memory at 1 x {max(lengths):,}", "value >= 32768")
        skip(f"long, {first}: {LOOPS[3]}, samples/s")
    else:
        bench = build_bench(ctx, job, placement, "bf16")
        curves["bf16"] = bench.memory(lengths, (1, 2), budget=budget)
        keep(memory_rows(curves["bf16"], "bf16 target", on_gpu, {1: "value >= 32768"}))
        save(curves, opts.out)
        # Last of the bf16 target's: the graph stages may fail or take long.
        if budget.over():
            skip(f"long, {first}: {LOOPS[3]}, samples/s")
        else:
            keep(bench.loop_rows(long, f"long, {first}", LOOPS[3:]))
        if opts.b16 if opts.b16 is not None else ctx.full and on_gpu:
            ctx.progress(f"{SECTION}: a second drafter ({second})")
            j = replace(job, drafter=other)
            built = loops.build_models(j, placement, target=bench.models.targets[0])
            b16 = Bench(ctx, built, j, placement)
            keep(b16.loop_rows(long, f"long, {second}"))
            if opts.chat if opts.chat is not None else ctx.full and on_gpu:
                keep(b16.loop_rows(chat, f"chat, {second}"))
            del b16, built
        del bench
        free()
    save(curves, opts.out)
    return rows


def save_rows(rows: list[Row], out: str | None) -> None:
    """seed_workload.partial.json in `out`: the rows so far, for a run cut short (the
    suite writes the section's JSON only when the section ends)."""
    if out:
        path = Path(out) / "seed_workload.partial.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.as_dict() for r in rows], indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.seed_workload")
    parser.add_argument("--out", help="folder for the memory-vs-length PNG and JSON")
    parser.add_argument("--no-fp8", action="store_true", help="leave out the FP8 target's rows")
    parser.add_argument("--lengths", type=counts_arg("length", "4096,32768"))
    parser.add_argument("--chat", action="store_true", help="the chat workload's rows too")
    parser.add_argument("--b16", action="store_true", help="block 16, 256 anchors too")
    parser.add_argument("--no-fused", action="store_true", help="leave out the FLA-fused targets")
    parser.add_argument(
        "--budget", type=float, default=330.0, help="seconds after which no further item starts"
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    b16, chat = args.b16 or args.chat or None, args.chat or None
    options = Options(
        True, not args.no_fp8, args.lengths, chat, b16, args.out, args.budget, not args.no_fused
    )
    from bench import run as suite

    return suite.main(["--sections", SECTION, *rest], options={SECTION: options})


if __name__ == "__main__":
    sys.exit(main())
