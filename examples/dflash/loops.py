"""Three ways to run the same online drafter training, for the example and the
benchmark: a plain sequential loop, a ThreadPoolExecutor loop (what a script would do
by hand), and the pydflash pipeline. Each is a generator yielding, once per optimizer
step, a callable that returns that step's microbatch losses (calling it syncs)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pydflash import Dispatcher, TargetGraphs
from pydflash.pipeline import Pipeline
from pydflash.pipeline.stages import EagerTarget, TargetStage
from pydflash.pipeline.stages.drafter_graphs import DrafterGraphs

from .data import MarkovTokens
from .jsonl import LengthBuckets, Sample
from .models import BlockDrafter, DrafterConfig, TargetConfig

if TYPE_CHECKING:
    from .hf import HFTargetConfig

StepLosses = Callable[[], list[float]]


@dataclass(frozen=True)
class Placement:
    """Devices of the target lanes and of the drafter lanes (one lane per entry)."""

    targets: tuple[str, ...]
    drafters: tuple[str, ...]

    @classmethod
    def parse(cls, devices: list[str], ratio: str) -> Placement:
        """`ratio` "T:D" lanes over `devices`: T + D devices in order (targets first), or
        one device carrying every lane."""
        match = re.fullmatch(r"(\d+):(\d+)", ratio)
        if match is None or min(int(match[1]), int(match[2])) < 1:
            raise ValueError(f"expected a ratio like 2:1 (targets:drafters), got {ratio!r}")
        n_targets, n_drafters = int(match[1]), int(match[2])
        if len(devices) == 1:
            devices = devices * (n_targets + n_drafters)
        if len(devices) != n_targets + n_drafters:
            raise ValueError(
                f"expected 1 or {n_targets + n_drafters} devices for ratio {ratio}, "
                f"got {len(devices)}"
            )
        return cls(tuple(devices[:n_targets]), tuple(devices[n_targets:]))

    @property
    def lanes(self) -> list[str]:
        return list(self.targets + self.drafters)

    @property
    def on_gpu(self) -> bool:
        """Whether any lane is a GPU's (batches pinned, the target in bf16)."""
        return any(d.startswith("cuda") for d in self.lanes)


@dataclass(frozen=True)
class Job:
    target: TargetConfig | HFTargetConfig  # the built-in hybrid target or a Hugging Face one
    drafter: DrafterConfig
    seq: int
    batch: int
    accumulate: int
    lr: float
    seed: int = 0
    warmup: int = 0  # optimizer steps of linear LR warm-up
    decay_steps: int | None = None  # cosine decay to LR_FLOOR x lr over this many steps
    # A data file's samples (dflash.jsonl); None: synthetic Markov tokens of length seq.
    samples: Sequence[Sample] | None = field(default=None, repr=False, compare=False)
    pad_multiple: int = 8  # a data file's microbatches are padded to a multiple of this

    @property
    def tokens_per_step(self) -> int:
        """Tokens per step with synthetic data (a data file's vary: `data().tokens`)."""
        return self.accumulate * self.batch * self.seq

    def lr_factor(self, step: int) -> float:
        """The LR at optimizer step `step` (0-based) over `lr`: warm-up, then cosine."""
        factor = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.decay_steps:
            progress = min(1.0, step / self.decay_steps)
            factor *= LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))
        return factor

    def data(self, seed: int) -> MarkovTokens | LengthBuckets:
        """The job's data: a data file's samples batched by length, or synthetic tokens;
        with anchors when the drafter takes a fixed number of them."""
        if self.samples is not None:
            return LengthBuckets(
                list(self.samples),
                self.batch,
                seed=seed,
                multiple=self.pad_multiple,
                anchors=self.drafter.anchors,
                block=self.drafter.block,
            )
        return MarkovTokens(
            self.target.vocab,
            self.seq,
            self.batch,
            seed=seed,
            anchors=self.drafter.anchors,
            block=self.drafter.block,
        )


LR_FLOOR = 0.1  # the cosine schedule ends at this fraction of the peak LR


@dataclass
class Models:
    targets: list[torch.nn.Module]  # one per target lane (shared by lanes on one device)
    drafters: list[torch.nn.Module]  # one per drafter lane, identical replicas
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]  # one per optimizer


def target_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def build_models(
    job: Job, placement: Placement, *, ddp: bool = False, target: torch.nn.Module | None = None
) -> Models:
    """Fresh models from job.seed: the same weights on every call (for one placement:
    random weights are drawn on the device the models are built on). `target`: one
    already built for this job, on the first target lane's device, taken as it is (a
    second drafter against one large target).

    The target is built on the first target lane's device, in its dtype: a checkpoint
    loads once, at the size it runs at, and an 8 B target from a config is initialised
    on the GPU, without a pass on the host. The drafter is built on the first drafter
    lane's device; the other lanes get copies. Its trainable weights stay fp32 (the
    master weights; the GPU forward runs under bf16 autocast) and train with AdamW,
    fused on a GPU; its frozen embedding and head match the target's precision."""
    first = placement.targets[0]
    torch.manual_seed(job.seed)
    if target is None:
        target = job.target.build(target_dtype(first), device=first)
    reference = target.eval().requires_grad_(False)
    torch.manual_seed(job.seed + 1)
    with torch.device(placement.drafters[0]):
        drafter = BlockDrafter(reference, job.drafter)
    by_device: dict[str, torch.nn.Module] = {}
    for device in placement.targets:
        if device not in by_device:
            same = torch.device(device) == next(reference.parameters()).device
            model = reference if same else copy.deepcopy(reference)
            by_device[device] = model.to(device, target_dtype(device))
    drafters: list[torch.nn.Module] = []
    for device in placement.drafters:
        replica = drafter if not drafters else copy.deepcopy(drafter)
        replica = replica.to(device)
        replica.embed.to(target_dtype(device))
        replica.lm_head.to(target_dtype(device))
        drafters.append(replica)
    optimizers = [
        torch.optim.AdamW(
            [p for p in d.parameters() if p.requires_grad],
            lr=job.lr,
            weight_decay=0.0,
            fused=torch.device(device).type == "cuda",
        )
        for d, device in zip(drafters, placement.drafters, strict=True)
    ]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, job.lr_factor) for o in optimizers]
    if ddp:
        if len(drafters) != 1:
            raise ValueError(f"expected one drafter lane per process with DDP, got {len(drafters)}")
        device = torch.device(placement.drafters[0])
        drafters = [
            torch.nn.parallel.DistributedDataParallel(
                drafters[0], device_ids=[device.index] if device.type == "cuda" else None
            )
        ]
    return Models([by_device[d] for d in placement.targets], drafters, optimizers, schedulers)


# --- the two stages ---------------------------------------------------------------------------
def target_forward(target: torch.nn.Module) -> Callable[[dict], dict]:
    """The target stage: the features, with the tokens (and the data's anchors, when it
    has them) passed on to the drafter."""

    def forward(batch: dict) -> dict:
        ids = batch["input_ids"]
        return {**batch, "features": target(ids)}

    return forward


def drafter_loss(
    drafter: torch.nn.Module, inputs: dict, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """The drafter's loss on the target's outputs; `lengths` marks the real positions of
    a padded microbatch (pydflash.DrafterGraphs passes it). A batch from a data file has
    a `loss_mask` and, with data-drawn anchors, an `anchor_mask` (dflash.jsonl)."""
    features, ids = inputs["features"], inputs["input_ids"]
    autocast = (
        torch.autocast("cuda", torch.bfloat16) if features.is_cuda else contextlib.nullcontext()
    )
    with autocast:
        return drafter(
            features,
            ids,
            inputs.get("anchors"),
            lengths,
            loss_mask=inputs.get("loss_mask"),
            anchor_mask=inputs.get("anchor_mask"),
        )


def _to(obj: dict, device: str) -> dict:
    return {key: t.to(device, non_blocking=True) for key, t in obj.items()}


# --- the loops --------------------------------------------------------------------------------
def sequential_steps(
    models: Models, placement: Placement, job: Job, batches: Iterable[dict], steps: int
) -> Iterator[StepLosses]:
    """Target, copy, drafter, one microbatch after another on the calling thread."""
    drafter, optimizer, scheduler = models.drafters[0], models.optimizers[0], models.schedulers[0]
    forwards = [target_forward(t) for t in models.targets]
    it = iter(batches)
    k = 0
    for _ in range(steps):
        losses = []
        for _ in range(job.accumulate):
            lane = k % len(forwards)
            with torch.no_grad():
                out = forwards[lane](_to(next(it), placement.targets[lane]))
            loss = drafter_loss(drafter, _to(out, placement.drafters[0]))
            (loss / job.accumulate).backward()
            losses.append(loss.detach())
            del out, loss  # the features go before the next forward allocates
            k += 1
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        yield _floats(losses)


def executor_steps(
    models: Models, placement: Placement, job: Job, batches: Iterable[dict], steps: int, depth: int
) -> Iterator[StepLosses]:
    """Target forwards on ThreadPoolExecutor threads (one per target lane, each on its
    own CUDA stream), up to `depth` microbatches ahead; the drafter on this thread."""
    drafter, optimizer, scheduler = models.drafters[0], models.optimizers[0], models.schedulers[0]
    drafter_device = placement.drafters[0]
    forwards = [target_forward(t) for t in models.targets]
    streams = [torch.cuda.Stream(d) if d.startswith("cuda") else None for d in placement.targets]

    def forward(k: int, batch: dict) -> tuple[dict, Any]:
        lane = k % len(forwards)
        stream = streams[lane]
        with torch.no_grad():
            if stream is None:
                return forwards[lane](batch), None
            torch.cuda.set_device(stream.device)
            with torch.cuda.stream(stream):
                out = forwards[lane](_to(batch, placement.targets[lane]))
                done = torch.cuda.Event()
                done.record(stream)
            return out, done

    def receive(out: dict, done: Any) -> dict:
        if done is not None:
            # This thread's stream on the target's device reads the outputs (and copies
            # them when the drafter is elsewhere): order it after the forward.
            stream = torch.cuda.current_stream(out["features"].device)
            stream.wait_event(done)
            for t in out.values():
                t.record_stream(stream)
        return _to(out, drafter_device)

    it = iter(batches)
    queue: collections.deque = collections.deque()
    submitted = 0
    total = steps * job.accumulate
    with concurrent.futures.ThreadPoolExecutor(len(forwards), thread_name_prefix="target") as pool:

        def top_up() -> None:
            nonlocal submitted
            while len(queue) < depth and submitted < total:
                queue.append(pool.submit(forward, submitted, next(it)))
                submitted += 1

        for _ in range(steps):
            losses = []
            for _ in range(job.accumulate):
                top_up()
                out, done = queue.popleft().result()
                top_up()
                loss = drafter_loss(drafter, receive(out, done))
                (loss / job.accumulate).backward()
                losses.append(loss.detach())
                del out, done, loss  # the features go before the next forward allocates
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            yield _floats(losses)


class PipelineLoop:
    """The pydflash pipeline over a Dispatcher with one lane per placement entry. With
    `graphs`, each target model's forward is one TargetGraphs for the lanes that share
    the model (one device): it replays CUDA graphs per shape bucket on GPU lanes. With
    `drafter_graphs`, the drafter trains through a DrafterGraphs stage: its microbatches
    and optimizer step replay CUDA graphs on GPU lanes (padded to buckets, on CPU too).
    `policy` is both graph stages' (`pydflash.Policy`: "auto", where graphs pay)."""

    def __init__(
        self,
        models: Models,
        placement: Placement,
        job: Job,
        depth: int,
        *,
        trace: bool = False,
        graphs: bool = False,
        drafter_graphs: bool = False,
        spin_us: float | None = None,
        policy: str = "auto",
    ) -> None:
        spin = {} if spin_us is None else {"spin_us": spin_us}  # None: the Dispatcher's default
        self.dispatcher = Dispatcher(placement.lanes, trace=trace, **spin)
        lanes = self.dispatcher.lanes
        n_targets = len(placement.targets)
        self.target_lanes = lanes[:n_targets]
        by_model: dict[int, TargetStage] = {}
        for t in models.targets:
            if id(t) not in by_model:
                forward = target_forward(t)
                by_model[id(t)] = (
                    TargetGraphs(forward, policy=policy) if graphs else EagerTarget(forward)
                )
        self.targets = [by_model[id(t)] for t in models.targets]
        training: dict[str, Any] = dict(
            drafter=models.drafters,
            loss=drafter_loss,
            optimizer=models.optimizers,
            scheduler=models.schedulers,
        )
        self.drafter = None
        if drafter_graphs:
            self.drafter = DrafterGraphs(
                lanes[n_targets:], **training, accumulate=job.accumulate, policy=policy
            )
            training = dict(drafter=self.drafter)
        self.pipe = Pipeline(
            self.target_lanes,
            lanes[n_targets:],
            target=self.targets,
            accumulate=job.accumulate,
            depth=depth,
            **training,
        )

    def warm_up(self, batch: dict) -> None:
        """One target forward per target lane, one lane at a time: Triton compiles and
        autotunes before any two lanes could do it at once. Graph targets capture the
        batch's bucket on each lane here, outside the timed steps."""
        for lane, stage in zip(self.target_lanes, self.targets, strict=True):
            if isinstance(stage, TargetGraphs):
                stage.warmup(lane, batch, [tuple(batch["input_ids"].shape)])
            else:
                stage.submit(lane, batch).result()

    def graph_stats(self) -> list[dict]:
        """TargetGraphs.stats() of each graph target (one per target model)."""
        unique = {id(s): s for s in self.targets if isinstance(s, TargetGraphs)}
        return [s.stats() for s in unique.values()]

    def drafter_graph_stats(self) -> dict | None:
        """DrafterGraphs.stats() with drafter_graphs, else None."""
        return None if self.drafter is None else self.drafter.stats()

    def steps(self, batches: Iterable[dict], steps: int) -> Iterator[StepLosses]:
        for result in self.pipe.run(batches, steps=steps):
            yield result.losses

    def close(self) -> None:
        self.dispatcher.shutdown()


def _floats(losses: list[torch.Tensor]) -> StepLosses:
    return lambda: [loss.item() for loss in losses]
