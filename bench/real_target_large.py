"""real_target's large size: a 23 B Qwen3-Next-style hybrid built on the GPU, its
microbatches of mixed lengths through the eager loop and through graph lanes, and what
TargetGraphs' policy chose for them (buckets, padding waste, buckets left eager)."""

from __future__ import annotations

from typing import Any

import torch

from bench import fidelity, kernels
from bench.common import Context, Row, compare, interleaved_medians, not_run
from bench.harness import n_lanes
from bench.real_target_common import LARGE, LARGE_LENGTHS, LARGE_MICROBATCHES, SECTION, Options
from examples.dflash.hf import HFTarget, default_layers
from examples.dflash.loops import target_forward
from pydflash import Dispatcher, TargetGraphs


def build_large(device: str) -> HFTarget:
    """LARGE with random weights, made on the GPU in bf16 (a CPU build of 23 B parameters
    would take minutes and 47 GB of host memory)."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(**LARGE)
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(dtype)
    layers = default_layers(config.num_hidden_layers)
    return HFTarget(model, layers).eval().requires_grad_(False)


def measure_large(ctx: Context, options: Options) -> list[Row]:
    """Microbatches of mixed lengths through the eager loop and through graph lanes on 1
    and 2 lanes of one GPU; and what TargetGraphs chose for them."""
    low, high = LARGE_LENGTHS
    name = f"large (23B hybrid, {LARGE_MICROBATCHES} microbatches of {low}-{high} tokens)"
    device = "cuda:0"
    ctx.progress(f"{name}: building on the GPU")
    model = build_large(device)
    forward = target_forward(model)
    generator = torch.Generator().manual_seed(7)
    lengths = [
        int(t) for t in torch.randint(low, high + 1, (LARGE_MICROBATCHES,), generator=generator)
    ]
    batches = [
        {"input_ids": torch.randint(LARGE["vocab_size"], (1, t), generator=generator).to(device)}
        for t in lengths
    ]
    ctx.progress(f"{name}: warm-up (compiles and autotunes the target's kernels)")
    with torch.no_grad():
        forward(batches[0])
    torch.cuda.synchronize(device)
    found = kernels.describe(model, forward, batches[0])
    lanes_of = (1, 2)
    dispatcher = Dispatcher([device] * max(lanes_of))
    lanes = dispatcher.lanes
    graphs = TargetGraphs(forward, policy="graphs")  # captures at this size, GPU-bound or not

    def eager_loop() -> None:
        with torch.no_grad():
            for batch in batches:
                forward(batch)
        torch.cuda.synchronize(device)

    def graph_step(n: int) -> None:
        futures = [graphs.submit(lanes[k % n], b) for k, b in enumerate(batches)]
        results = [future.result() for future in futures]
        torch.cuda.synchronize(device)
        for result in results:
            graphs.release(result)

    try:
        buckets = sorted({fidelity.bucket_of(t) for t in lengths})
        for lane in lanes:  # one lane at a time: a capture beside another lane's work can fail
            ctx.progress(f"{name}: capturing buckets {buckets} on {lane.label}")
            graphs.warmup([lane], batches[0], [(1, b) for b in buckets])
        reps = ctx.reps(4, 1, default=2)
        ctx.progress(f"{name}: eager loop and graph lanes, {reps} samples each")
        fns = {"eager": eager_loop}
        for n in lanes_of:
            fns[f"graphs{n}"] = lambda n=n: graph_step(n)
        times = interleaved_medians(fns, reps, warmup=1)
        stats = graphs.stats()
    finally:
        dispatcher.shutdown()
    tokens = sum(lengths)
    eager_s = times["eager"]
    note = f"eager {kernels.note(found)}"
    rows = [
        compare(
            SECTION,
            f"{name}: eager loop",
            eager_s * 1e3,
            "ms",
            note=f"{tokens / eager_s:,.0f} tokens/s; lengths {lengths}; {note}",
            kernels=found,
            lengths=lengths,
        )
    ]
    for n in lanes_of:
        t = times[f"graphs{n}"]
        rows.append(
            compare(
                SECTION,
                f"{name}, {n_lanes(n)}: graph lanes",
                t * 1e3,
                "ms",
                "eager loop",
                eager_s * 1e3,
                note=f"{tokens / t:,.0f} tokens/s; {note}",
                graphs=stats,
            )
        )
    rows.append(policy_row(name, stats))
    return rows


def policy_row(name: str, stats: dict[str, Any]) -> Row:
    """What TargetGraphs chose: its padding waste (the fraction of replayed tokens that
    were padding), the buckets it left eager and why, the buckets and pool per lane."""
    note = "; ".join(
        f"{label}: buckets {[b[1] for b in lane['buckets']]}, "
        f"pool {lane['pool_bytes'] / 2**30:.2f} GiB"
        for label, lane in stats["lanes"].items()
    )
    if "eager_buckets" in stats:
        note += f"; buckets run eagerly: {stats['eager_buckets'] or 'none'}"
    if stats["fallbacks"]:
        note += f"; fallbacks: {'; '.join(stats['fallbacks'])}"
    row_name = f"{name}: TargetGraphs' choice, padding waste"
    waste = stats.get("padding_waste")
    if waste is None:
        return not_run(SECTION, row_name, f"TargetGraphs.stats() has no padding_waste; {note}")
    return compare(SECTION, row_name, float(waste), "fraction", note=note, graphs=stats)
