"""What the real_target section's parts share: its sizes and goals, its options, and
`Bench`, one size's target, data and what the rows say about it (bench/real_target.py
measures; bench/real_target_large.py and bench/real_target_compile.py are its large
target and its torch.compile subprocess)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bench import harness, kernels
from bench.common import Context
from examples.dflash.data import MarkovTokens
from examples.dflash.hf import QWEN3_NEXT, HFTargetConfig
from examples.dflash.loops import Job, Placement
from examples.dflash.models import TINY_DRAFTER, DrafterConfig

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
        return harness.rate(seconds, microbatches, self.job.batch, self.job.seq)

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
