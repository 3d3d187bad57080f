"""The seed workload's shapes: the target and drafters, the lengths per microbatch drawn
stratified from their distribution (Note [Stratified lengths]), and the timing setup over
them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import Any

import torch

from bench.harness import Setup
from examples.dflash.loops import Job
from examples.dflash.models import DFLASH_B16, DrafterConfig, TargetConfig

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
