"""dflash_scale's stages alone: the target's prefill of one microbatch and one optimizer
step of the drafter, each with its cost (bench/limits.py), FLOPs and allocator peak; and
where the drafter's GPU time goes by kind of kernel."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench import limits
from bench.dflash_scale_common import Scale, peak_bytes, reset_peak, synchronize
from examples.dflash.loops import Models, drafter_loss, target_forward

# Kernel names by kind, for where the drafter's GPU time goes (first match wins).
KINDS = (
    ("attention", re.compile(r"fmha|flash|attention|attn|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|matmul|sm90_|sm80_|cublas", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("loss (softmax, argmax, gather)", re.compile(r"softmax|argmax|arg_max|scatter|gather", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy|cat", re.I)),
)


# --- the stages alone -------------------------------------------------------------------------
@dataclasses.dataclass
class Stage:
    cost: limits.Cost  # per call
    flops: int  # per call
    peak: int | None  # allocator peak while measured


def device_inputs(scale: Scale, models: Models, batches: list[dict]) -> list[dict]:
    """The drafter's inputs as the pipeline hands them over: target outputs on its device."""
    device = scale.placement.targets[0]
    forward = target_forward(models.targets[0])
    with torch.no_grad():
        out = [forward({k: t.to(device) for k, t in b.items()}) for b in batches]
    synchronize(scale)
    return out


def target_alone(scale: Scale, models: Models, batch: dict) -> Stage:
    """One prefill of a microbatch, as the target lane runs it."""
    forward = target_forward(models.targets[0])
    batch = {k: t.to(scale.placement.targets[0]) for k, t in batch.items()}

    def prefill() -> None:
        with torch.no_grad():
            forward(batch)

    flops = limits.count_flops(prefill)
    reset_peak(scale)
    cost = limits.measure(prefill, reps=5 * scale.reps, warmup=2)
    return Stage(cost, flops, peak_bytes(scale))


def drafter_step(scale: Scale, models: Models, inputs: list[dict]) -> Callable[[], None]:
    """One optimizer step of the drafter stage alone: a forward and backward per input,
    then AdamW, as the pipeline's drafter lane runs them (no host sync inside)."""
    drafter, optimizer = models.drafters[0], models.optimizers[0]

    def step() -> None:
        for x in inputs:
            with torch.autograd.set_multithreading_enabled(False):  # as the pipeline
                (drafter_loss(drafter, x) / len(inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def drafter_alone(scale: Scale, models: Models, inputs: list[dict]) -> Stage:
    drafter = models.drafters[0]
    step = drafter_step(scale, models, inputs)

    def microbatch() -> None:
        drafter_loss(drafter, inputs[0]).backward()

    # FLOPs of the optimizer step are not counted (elementwise), as MFU conventions do.
    flops = limits.count_flops(microbatch) * len(inputs)
    models.optimizers[0].zero_grad(set_to_none=True)
    reset_peak(scale)
    cost = limits.measure(step, reps=scale.reps + 1, warmup=1)
    return Stage(cost, flops, peak_bytes(scale))


def kernel_breakdown(step: Callable[[], None], on_gpu: bool) -> dict[str, Any] | None:
    """GPU time of one call of step() by kind of kernel, and its top kernels."""
    if not on_gpu:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with limits.profile(activities) as prof:
        step()
        torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            by_name[event.name()] += event.duration_ns() / 1e6
    return summarize_kernels(by_name)


def summarize_kernels(by_name: dict[str, float], top: int = 8) -> dict[str, Any]:
    """{"total_ms", "by_kind_ms", "top": [(name, ms), ...]} of kernel times by name."""
    by_kind: dict[str, float] = defaultdict(float)
    for name, ms in by_name.items():
        kind = next((k for k, pattern in KINDS if pattern.search(name)), "other elementwise")
        by_kind[kind] += ms
    ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {
        "total_ms": sum(by_name.values()),
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        "top": [(name[:120], ms) for name, ms in ranked],
    }
