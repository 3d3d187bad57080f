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

The loss is DFlash's objective on synthetic tokens (no loss mask; the rows name gamma).
Modules: seed_workload_lengths (shapes, lengths), seed_workload_flops (Note [Counted
FLOPs]), seed_workload_loops (the loop rows), seed_workload_memory (memory against length,
the drafter alone); this one builds the target variants and runs them in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.common import Context, Row, counts_arg, not_run
from bench.seed_workload_common import SECTION, Budget, free
from bench.seed_workload_lengths import Workload
from bench.seed_workload_loops import LOOPS, Bench
from bench.seed_workload_memory import drafter_alone, memory, memory_rows, save
from examples.dflash import loops
from examples.dflash.loops import Job, Placement


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
            curves[variant] = memory(bench, longest, (2,), budget=budget)
            keep(memory_rows(curves[variant], f"{variant} target", on_gpu,
                             {2: "value >= 32768"}))  # fmt: skip
            if not budget.over():
                name = f"{variant}, pipeline"
                curves[name] = memory(bench, longest[-1:], (2,), pipeline=True)
                keep(memory_rows(curves[name], f"{variant} target, pipeline", on_gpu, {}))
            save(curves, opts.out)
        del bench
        free()
    if budget.over():
        skip(f"bf16 target: memory at 1 x {max(lengths):,}", "value >= 32768")
        skip(f"long, {first}: {LOOPS[3]}, samples/s")
    else:
        bench = build_bench(ctx, job, placement, "bf16")
        curves["bf16"] = memory(bench, lengths, (1, 2), budget=budget)
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
