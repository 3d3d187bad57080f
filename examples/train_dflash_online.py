"""Online training of a DFlash-style block drafter on a frozen hybrid target, with the
target forward and the drafter's training overlapped on pydflash lanes.

    python examples/train_dflash_online.py --tiny                          # CPU, seconds
    python examples/train_dflash_online.py --devices cuda:0 --ratio 1:1    # one GPU, two lanes
    python examples/train_dflash_online.py --devices cuda:0 cuda:1 cuda:2 --ratio 2:1
    torchrun --nproc-per-node 2 examples/train_dflash_online.py --tiny     # a DDP drafter
    python examples/train_dflash_online.py --tiny --check                  # == a sequential loop
    python examples/train_dflash_online.py --target-config qwen3-next-small --target-graphs
    python examples/train_dflash_online.py --target-config qwen3-next-small --target-graphs \
        --drafter-graphs                                                    # both stages as graphs
    python examples/train_dflash_online.py --target-model ./my-checkpoint --target-layers 2,12,20
    python examples/train_dflash_online.py --devices cuda:0 --target-config qwen3-next-large \
        --target-fp8 --target-fused fla                                     # a cheaper target
    python examples/train_dflash_online.py --devices cuda:0 --target-config qwen3-8b \
        --target-layers 1,9,17,25,33 --drafter-config dflash-b16 --seq 768 --batch 2 --accumulate 8

The target is the built-in hybrid model unless --target-model (a local Hugging Face
causal LM, never downloaded) or --target-config (a Qwen3-Next with random weights, needs
transformers) picks another; --target-graphs replays its forward as CUDA graphs, and
--drafter-graphs the drafter's training step (pydflash.DrafterGraphs: each microbatch is
padded to a length bucket, and the loss counts only the real positions).
--drafter-config dflash-b16 is the published DFlash drafter for Qwen3-8B (5 layers,
block 16, 256 anchors per sequence drawn by the data, loss over the full vocabulary).

Prints the loss and tokens/s every --log-every steps, with a progress bar on a terminal,
and writes loss_curve.png and summary.json to --out. Needs pydflash installed (`pip install
-e '.[examples]'`); from the repository root, `python -m examples.train_dflash_online`
runs it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

if __package__:  # python -m examples.train_dflash_online
    from . import dflash
else:  # python examples/train_dflash_online.py: Python puts this folder first on sys.path
    import dflash

BF16_RTOL = 2e-2  # losses of two bf16 runs: a few bf16 ulps (2^-8) of drift over the steps
FP32_RTOL = 1e-4  # float32 on CPU, padded against unpadded: rounding over the steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU run in seconds")
    p.add_argument("--mode", choices=["pipeline", "sequential", "executor"], default="pipeline")
    p.add_argument(
        "--check",
        action="store_true",
        help="run the sequential loop, then --mode, and compare their losses",
    )
    p.add_argument("--devices", nargs="+", help="lane devices: T + D entries, or one for all")
    p.add_argument(
        "--ratio", help="target:drafter lanes, e.g. 2:1 (default 1:1, or (n-1):1 on n GPUs)"
    )
    p.add_argument("--steps", type=int)
    p.add_argument("--accumulate", type=int, help="microbatches per optimizer step")
    p.add_argument("--depth", type=int, default=2, help="microbatches in flight (prefetch depth)")
    p.add_argument("--batch", type=int, help="sequences per microbatch")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--vocab", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--layers", type=int, help="target layers")
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--target-model",
        type=Path,
        metavar="PATH",
        help="a local Hugging Face causal LM as the target (from_pretrained, no download)",
    )
    source.add_argument(
        "--target-config",
        choices=list(dflash.hf.CONFIGS),
        help="a Qwen3-Next or dense Qwen3 target built from this config, with random weights",
    )
    p.add_argument(
        "--moe", action="store_true", help="--target-config with MoE blocks, not a dense MLP"
    )
    p.add_argument(
        "--target-layers",
        type=layer_list,
        metavar="I,J,...",
        help="target layers whose outputs are the drafter's features (0-based)",
    )
    p.add_argument(
        "--target-fp8",
        action="store_true",
        help="a Hugging Face target's decoder linear layers in FP8 e4m3 with row-wise scales "
        "(examples/dflash/fp8.py; a GPU of compute capability 9.0 or later, emulated on a CPU)",
    )
    p.add_argument(
        "--target-fused",
        type=fusion_list,
        default=(),
        metavar="F,G,...",
        help="fused elementwise work in a Hugging Face Qwen3-Next target "
        f"(examples/dflash/fused.py): {', '.join(dflash.fused.FUSIONS)}, fla (the first "
        "three, flash-linear-attention's kernels) or all",
    )
    p.add_argument(
        "--target-graphs",
        action="store_true",
        help="replay the target forward as CUDA graphs (pydflash.TargetGraphs)",
    )
    p.add_argument(
        "--drafter-config",
        choices=list(dflash.models.DRAFTERS),
        help="the drafter's shapes (default: tiny with --tiny, else default); dflash-b16 is "
        "the published DFlash recipe for Qwen3-8B: 5 layers, block 16, 256 anchors",
    )
    p.add_argument(
        "--drafter-graphs",
        action="store_true",
        help="replay the drafter's training steps as CUDA graphs (pydflash.DrafterGraphs)",
    )
    p.add_argument("--drafter-layers", type=int)
    p.add_argument("--block", type=int, help="drafter block size (anchor + predictions)")
    p.add_argument(
        "--anchors",
        type=int,
        help="anchors per sequence, sampled by the data (default: every block-th position)",
    )
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("out/dflash"))
    p.add_argument("--save-drafter", type=Path, help="save the trained drafter's state dict here")
    p.add_argument(
        "--trace", type=Path, help="write a Perfetto/Chrome trace of the pipeline's lanes here"
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    for name in ("steps", "accumulate", "depth", "batch", "seq", "log_every", "anchors"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.target_model or args.target_config:
        for name in ("vocab", "dim", "layers"):
            if getattr(args, name) is not None:
                p.error(f"--{name} sizes the built-in target; a Hugging Face target has its own")
    if args.moe and not args.target_config:
        p.error("--moe applies to --target-config")
    for flag in ("target_fp8", "target_fused"):
        if getattr(args, flag) and not (args.target_model or args.target_config):
            p.error(
                f"--{flag.replace('_', '-')} applies to a Hugging Face target: "
                "--target-config or --target-model"
            )
    for flag in ("target_graphs", "drafter_graphs"):
        if getattr(args, flag) and args.mode != "pipeline":
            p.error(
                f"--{flag.replace('_', '-')} runs on pipeline lanes: "
                f"use --mode pipeline, not {args.mode}"
            )
    return args


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return dflash.hf.parse_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fusion_list(text: str) -> tuple[str, ...]:
    try:
        return dflash.fused.parse_fusions(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def make_target(args: argparse.Namespace) -> dflash.models.TargetConfig | dflash.hf.HFTargetConfig:
    if args.target_model or args.target_config:
        try:
            config = dflash.hf.HFTargetConfig.load(
                args.target_model or args.target_config, args.target_layers, moe=args.moe
            )
            return dataclasses.replace(config, fp8=args.target_fp8, fused=args.target_fused)
        except ModuleNotFoundError as exc:
            raise SystemExit(
                f"a Hugging Face target needs {exc.name}: pip install 'pydflash[hf]'"
            ) from exc
        except (OSError, ValueError) as exc:
            raise SystemExit(f"cannot use that target: {exc}") from exc
    target = dflash.models.TINY_TARGET if args.tiny else dflash.models.TargetConfig()
    target = dataclasses.replace(
        target,
        **{
            k: v
            for k, v in {
                "vocab": args.vocab,
                "dim": args.dim,
                "layers": args.layers,
                "heads": args.heads,
                "head_dim": args.head_dim,
            }.items()
            if v is not None
        },
    )
    if args.target_layers is not None:
        capture = args.target_layers
    elif args.layers is not None:
        capture = sorted({min(i, target.layers - 1) for i in target.capture_layers})
    else:
        return target
    try:
        return dataclasses.replace(target, capture_layers=tuple(capture))
    except ValueError as exc:
        raise SystemExit(f"--target-layers: {exc}") from exc


def make_job(args: argparse.Namespace) -> tuple[dflash.loops.Job, int]:
    target = make_target(args)
    name = args.drafter_config or ("tiny" if args.tiny else "default")
    drafter = dataclasses.replace(
        dflash.models.DRAFTERS[name],
        **{
            k: v
            for k, v in {
                "layers": args.drafter_layers,
                "block": args.block,
                "heads": args.heads,
                "head_dim": args.head_dim,
                "anchors": args.anchors,
            }.items()
            if v is not None
        },
    )
    job = dflash.loops.Job(
        target=target,
        drafter=drafter,
        seq=args.seq or (32 if args.tiny else 1024),
        batch=args.batch or (2 if args.tiny else 8),
        accumulate=args.accumulate or (2 if args.tiny else 4),
        lr=args.lr or (3e-3 if args.tiny else 3e-4),
        seed=args.seed,
    )
    steps = args.steps or (12 if args.tiny else 50)
    return job, steps


def default_placement(args: argparse.Namespace, local_rank: int | None) -> dflash.loops.Placement:
    gpus = torch.cuda.device_count()
    devices = args.devices
    if devices is None:
        if local_rank is not None:
            if gpus and local_rank >= gpus:
                raise SystemExit(
                    f"local rank {local_rank} has no GPU of its own ({gpus} "
                    "visible): start fewer processes per node, or pass --devices"
                )
            devices = [f"cuda:{local_rank}" if gpus else "cpu"]
        else:
            devices = [f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu"]
    ratio = args.ratio or (f"{len(devices) - 1}:1" if len(devices) > 1 else "1:1")
    return dflash.loops.Placement.parse(devices, ratio)


def log(line: str) -> None:
    """Prints a line on stdout, above the progress bar when there is one."""
    with tqdm.external_write_mode():
        print(line, flush=True)


@dataclasses.dataclass
class Outcome:
    mode: str
    losses: list[list[float]]  # per step, per microbatch
    wall_s: float
    models: dflash.loops.Models
    pipeline_stats: dict | None = None
    graph_stats: list[dict] | None = None  # per TargetGraphs, with --target-graphs
    drafter_graph_stats: dict | None = None  # DrafterGraphs.stats(), with --drafter-graphs


def synchronize(placement: dflash.loops.Placement) -> None:
    for device in set(placement.lanes):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def train(
    mode: str,
    job: dflash.loops.Job,
    placement: dflash.loops.Placement,
    batches: list[dict],
    steps: int,
    depth: int,
    *,
    ddp: bool,
    log_every: int,
    verbose: bool,
    trace: Path | None = None,
    graphs: bool = False,
    drafter_graphs: bool = False,
) -> Outcome:
    """Trains with `mode`'s loop; rank 0 (`verbose`) logs and shows a progress bar."""
    models = dflash.loops.build_models(job, placement, ddp=ddp)
    warm = job.data(seed=job.seed + 1).batch(0)
    loop = None
    if mode == "pipeline":
        loop = dflash.loops.PipelineLoop(
            models,
            placement,
            job,
            depth,
            trace=trace is not None,
            graphs=graphs,
            drafter_graphs=drafter_graphs,
        )
        loop.warm_up(warm)
        step_iter = loop.steps(batches, steps)
    else:
        with torch.no_grad():  # the same Triton warm-up as the pipeline's
            for target, device in zip(models.targets, placement.targets, strict=True):
                dflash.loops.target_forward(target)({k: t.to(device) for k, t in warm.items()})
        if mode == "sequential":
            step_iter = dflash.loops.sequential_steps(models, placement, job, batches, steps)
        else:
            step_iter = dflash.loops.executor_steps(models, placement, job, batches, steps, depth)
    synchronize(placement)
    if verbose:
        params = [p for p in models.drafters[0].parameters()]
        trainable = sum(p.numel() for p in params if p.requires_grad)
        log(
            f"{mode}: target lanes {list(placement.targets)}, drafter lanes "
            f"{list(placement.drafters)}, {job.tokens_per_step} tokens per step; drafter "
            f"{trainable:,} trainable parameters, "
            f"{sum(p.numel() for p in params) - trainable:,} frozen"
        )
    collected = []
    # disable=None: a bar only where stderr is a terminal; elsewhere the log lines alone.
    bar = tqdm(total=steps, desc=mode, unit="step", disable=None if verbose else True)
    start = window_start = time.perf_counter()
    try:
        for step, step_losses in enumerate(step_iter, 1):
            collected.append(step_losses)
            bar.update()
            if step % log_every == 0 or step == steps:
                losses = step_losses()  # syncs: only every log_every steps
                now = time.perf_counter()
                window = step - (step - 1) // log_every * log_every
                rate = window * job.tokens_per_step / (now - window_start)
                if verbose:
                    log(
                        f"{mode} step {step}/{steps}  loss {sum(losses) / len(losses):.4f}  "
                        f"tokens/s {rate:,.0f}"
                    )
                window_start = now
        synchronize(placement)
        wall = time.perf_counter() - start
    finally:
        stats = loop.pipe.stats() if loop is not None else None
        graph_stats = loop.graph_stats() if loop is not None and graphs else None
        drafter_stats = loop.drafter_graph_stats() if loop is not None else None
        if loop is not None:
            if trace is not None:
                loop.dispatcher.export_trace(trace)
            loop.close()
        bar.close()
    losses = [f() for f in collected]
    return Outcome(mode, losses, wall, models, stats, graph_stats, drafter_stats)


def drafter_state(models: dflash.loops.Models) -> dict[str, torch.Tensor]:
    module = models.drafters[0]
    module = getattr(module, "module", module)  # DistributedDataParallel
    return {name: p.detach().cpu() for name, p in module.named_parameters() if p.requires_grad}


def checksum(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()


def plot(curves: dict[str, list[float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no loss curve (pip install matplotlib)", file=sys.stderr
        )
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("drafter loss")
    ax.set_title("DFlash-style drafter, online training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def compare(
    reference: Outcome, other: Outcome, exact: bool, rtol: float = BF16_RTOL
) -> tuple[bool, str]:
    a = [x for step in reference.losses for x in step]
    b = [x for step in other.losses for x in step]
    if exact:
        ok = a == b
        verb = "equal" if ok else "differ from"
        return ok, f"{other.mode} losses {verb} the sequential loop's exactly"
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b, strict=False))
    ok = len(a) == len(b) and worst <= rtol
    kind = "bf16" if rtol == BF16_RTOL else "float32"
    return ok, (
        f"{other.mode} losses vs the sequential loop: max relative difference {worst:.2e} "
        f"({'within' if ok else 'beyond'} the {kind} tolerance {rtol:.0e})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ["LOCAL_RANK"]) if world > 1 else None
    placement = default_placement(args, local_rank)
    ddp = world > 1
    if ddp:
        if args.check:
            raise SystemExit("--check compares single-process runs; run it without torchrun")
        on_gpu = placement.drafters[0].startswith("cuda")
        if on_gpu:
            torch.cuda.set_device(placement.drafters[0])
        dist.init_process_group("nccl" if on_gpu else "gloo")
    job, steps = make_job(args)
    data = job.data(seed=args.seed)
    pin = any(d.startswith("cuda") for d in placement.lanes)
    # Rank r trains on microbatches r, r + world, ...: one stream of data split by rank.
    batches = data.batches(rank, steps * job.accumulate, stride=world, pin=pin)
    kwargs = dict(ddp=ddp, log_every=args.log_every, verbose=rank == 0)
    trace = None if args.trace is None or rank else args.trace
    outcome = train(
        args.mode,
        job,
        placement,
        batches,
        steps,
        args.depth,
        trace=trace,
        graphs=args.target_graphs,
        drafter_graphs=args.drafter_graphs,
        **kwargs,
    )
    curves = {outcome.mode: [sum(s) / len(s) for s in outcome.losses]}
    status = 0
    check_line = None
    if args.check:
        other = outcome
        outcome = train("sequential", job, placement, batches, steps, args.depth, **kwargs)
        curves = {"sequential": [sum(s) / len(s) for s in outcome.losses], **curves}
        # A padded drafter (--drafter-graphs) equals the loop up to rounding, not bitwise.
        exact = not pin and not args.drafter_graphs
        ok, check_line = compare(outcome, other, exact, FP32_RTOL if not pin else BF16_RTOL)
        status = 0 if ok else 1
        print(("check passed: " if ok else "check FAILED: ") + check_line, flush=True)
        outcome = other

    state = drafter_state(outcome.models)
    tokens_per_s = steps * job.tokens_per_step / outcome.wall_s
    summary = {
        "mode": outcome.mode,
        "rank": rank,
        "world": world,
        "targets": list(placement.targets),
        "drafters": list(placement.drafters),
        "target": (
            "built-in hybrid"
            if isinstance(job.target, dflash.models.TargetConfig)
            else job.target.source
        ),
        "target_layers": list(job.target.capture_layers),
        "target_graphs": outcome.graph_stats,
        "drafter_graphs": outcome.drafter_graph_stats,
        "steps": steps,
        "tokens_per_step": job.tokens_per_step,
        "step_time_s": outcome.wall_s / steps,
        "tokens_per_s": tokens_per_s,
        "loss_per_step": curves[outcome.mode],
        "losses": outcome.losses,
        "drafter_sha256": checksum(state),
        "pipeline": outcome.pipeline_stats,
        "check": check_line,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "summary.json" if rank == 0 else f"summary.rank{rank}.json"
    (args.out / name).write_text(json.dumps(summary, indent=1))
    if args.save_drafter is not None and rank == 0:
        torch.save(state, args.save_drafter)
    if rank == 0:
        first, last = curves[outcome.mode][0], curves[outcome.mode][-1]
        print(
            f"{outcome.mode}: loss {first:.4f} -> {last:.4f} over {steps} steps, "
            f"{outcome.wall_s / steps * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s",
            flush=True,
        )
        if outcome.pipeline_stats is not None:
            stats = outcome.pipeline_stats
            print(
                f"hidden states held: peak {stats['hidden_bytes_peak']:,} bytes at depth "
                f"{stats['depth']} ({stats['hidden_bytes_per_microbatch']:,} per microbatch)"
            )
        for graph_stats in outcome.graph_stats or ():
            print(f"target graphs: {json.dumps(graph_stats)}")
        if outcome.drafter_graph_stats is not None:
            print(f"drafter graphs: {json.dumps(outcome.drafter_graph_stats)}")
        if not args.no_plot and plot(curves, args.out / "loss_curve.png"):
            print(f"wrote {args.out / 'loss_curve.png'}")
    if ddp:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
