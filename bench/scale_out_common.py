"""What the scale_out section's parts share: its goals, its options, and `Setting`, the
target, its data and the devices the counts run on (bench/scale_out.py measures;
bench/scale_out_processes.py starts its worker processes and bench/scale_out_pipeline.py
times its pipeline across GPUs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bench import harness, kernels
from bench.real_target_common import CPU_SIZE
from examples.dflash.data import MarkovTokens
from examples.dflash.hf import HFTargetConfig
from examples.dflash.models import TINY_DRAFTER, DrafterConfig

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
        return harness.rate(seconds, n, self.batch, self.seq)


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
