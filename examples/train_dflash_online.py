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
    python examples/train_dflash_online.py --target-model ./qwen3-8b --data chats.jsonl \
        --drafter-config dflash-b16 --seq 4096 --batch 2 --accumulate 8 \
        --checkpoint-every 500 --export out/drafter                        # a user's own data

The target is the built-in hybrid model unless --target-model (a local Hugging Face
causal LM, never downloaded) or --target-config (a Qwen3-Next with random weights, needs
transformers) picks another; --target-graphs replays its forward as CUDA graphs, and
--drafter-graphs the drafter's training step (pydflash.DrafterGraphs: each microbatch is
padded to a length bucket, and the loss counts only the real positions).
--drafter-config dflash-b16 is the published DFlash drafter for Qwen3-8B (5 layers,
block 16, 256 anchors per sequence drawn by the data, loss over the full vocabulary).

--data trains on a JSONL file of token ids with a loss mask, or of chat messages that
the target's (or --tokenizer's) chat template encodes, only assistant tokens supervised
(examples/README.md). The loss is DFlash's (dflash/objective.py). --checkpoint-every and
Ctrl-C write --out/checkpoint.pt, --resume continues from it; --export writes the drafter
as config.json + model.safetensors.

Prints the loss and tokens/s every --log-every steps, with a progress bar on a terminal,
and writes loss_curve.png, metrics.csv (and TensorBoard scalars with --tensorboard) and
summary.json to --out. Needs pydflash installed (`pip install
-e '.[examples]'`); from the repository root, `python -m examples.train_dflash_online`
runs it too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__:  # python -m examples.train_dflash_online
    from . import dflash
else:  # python examples/train_dflash_online.py: Python puts this folder first on sys.path
    import dflash


def build_parser() -> argparse.ArgumentParser:
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
    dflash.cli.add_arguments(p)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    dflash.cli.check(p, args)
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


def make_job(args: argparse.Namespace, on_gpu: bool) -> tuple[dflash.loops.Job, int]:
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
                "gamma": args.gamma,
                "loss_kernel": args.loss_kernel,
            }.items()
            if v is not None
        },
    )
    steps = args.steps or (12 if args.tiny else 50)
    seq = args.seq or (32 if args.tiny else 1024)
    job = dflash.loops.Job(
        target=target,
        drafter=drafter,
        seq=seq,
        batch=args.batch or (2 if args.tiny else 8),
        accumulate=args.accumulate or (2 if args.tiny else 4),
        lr=args.lr or (3e-3 if args.tiny else 3e-4),
        seed=args.seed,
        warmup=args.warmup,
        decay_steps=steps,
        samples=load_samples(args, target, drafter.block, seq),
        pad_multiple=args.pad_multiple or (64 if on_gpu else 8),
    )
    job.data(seed=args.seed)  # checks the data's sizes (enough samples, anchors that fit)
    return job, steps


def load_samples(args: argparse.Namespace, target: Any, block: int, seq: int) -> list | None:
    """--data's samples that have a supervised block, or None without --data."""
    if args.data is None:
        return None
    tokenizer = args.tokenizer or args.target_model
    samples = dflash.jsonl.read_jsonl(args.data, tokenizer, max_length=seq, vocab=target.vocab)
    kept = dflash.jsonl.trainable(samples, block)
    if not kept:
        raise dflash.jsonl.DataError(
            f"{args.data}: no sample has a supervised token and next with a block of "
            f"{block} after them (within --seq {seq})"
        )
    if len(kept) < len(samples):
        print(
            f"{args.data}: {len(samples) - len(kept)} samples without a supervised block left out"
        )
    return kept


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ["LOCAL_RANK"]) if world > 1 else None
    try:  # what a user's flags and files get wrong ends in the usage line, with the reason
        placement = default_placement(args, local_rank)
        job, steps = make_job(args, on_gpu=placement.on_gpu)
        run = make_run(args, job, steps, rank, world)
    except dflash.cli.USER_ERRORS as exc:
        build_parser().error(str(exc))
    if world == 1:
        return train_and_report(args, job, placement, run)
    if args.check:
        raise SystemExit("--check compares single-process runs; run it without torchrun")
    on_gpu = placement.drafters[0].startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(placement.drafters[0])
    with process_group("nccl" if on_gpu else "gloo"):
        return train_and_report(args, job, placement, run)


@contextlib.contextmanager
def process_group(backend: str) -> Iterator[None]:
    """The default process group, for a block that holds every DDP drafter it makes.

    The drafters must be gone before the group is destroyed. torch releases a group from
    Python with the GIL dropped, but a DDP reducer releases its reference with the GIL
    held; gloo's destructor then joins its worker threads, and a worker that is freeing
    the last all-reduce (whose saved thread state holds a Python object) waits for the
    GIL: a hang at exit (examples/README.md)."""
    dist.init_process_group(backend)
    try:
        yield
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # the failed frames' locals hold the models
        raise
    finally:
        gc.collect()  # and a reference cycle may
        dist.destroy_process_group()


def train_and_report(
    args: argparse.Namespace,
    job: dflash.loops.Job,
    placement: dflash.loops.Placement,
    run: dflash.training.Run,
) -> int:
    """Trains, checks (--check) and writes the results; the exit status. The models live
    only in this call (see process_group)."""
    if run.rank == 0 and job.samples is not None:
        dflash.training.log(
            f"{args.data}: {len(job.samples)} samples, {job.data(args.seed).per_epoch} "
            f"microbatches per epoch, padding {job.data(args.seed).padding_waste():.1%} of tokens"
        )
    outcome = dflash.training.train(args.mode, job, placement, run)
    curves = {outcome.mode: [sum(s) / len(s) for s in outcome.losses]}
    status = 130 if outcome.interrupted else 0
    check_line = None
    if args.check and not outcome.interrupted:
        other = outcome
        reference = dataclasses.replace(run, trace=None, scalars=None)
        outcome = dflash.training.train("sequential", job, placement, reference)
        curves = {"sequential": [sum(s) / len(s) for s in outcome.losses], **curves}
        # A padded drafter (--drafter-graphs) equals the loop up to rounding, not bitwise.
        exact = not placement.on_gpu and not args.drafter_graphs
        rtol = dflash.metrics.BF16_RTOL if placement.on_gpu else dflash.metrics.FP32_RTOL
        ok, check_line = dflash.metrics.compare(
            outcome.losses, other.losses, other.mode, exact, rtol
        )
        status = 0 if ok else 1
        print(("check passed: " if ok else "check FAILED: ") + check_line, flush=True)
        outcome = other
    if run.scalars is not None:
        run.scalars.close()
    if outcome.losses:
        write_results(args, job, placement, outcome, curves, run.rank, run.world, check_line)
    return status


def make_run(
    args: argparse.Namespace, job: dflash.loops.Job, steps: int, rank: int, world: int
) -> dflash.training.Run:
    identity = {
        "world": world,
        "seed": job.seed,
        "steps": steps,
        "batch": job.batch,
        "accumulate": job.accumulate,
        "seq": job.seq,
        "lr": job.lr,
        "warmup": job.warmup,
        "drafter": dataclasses.asdict(job.drafter),
        "target": target_name(job),
        "target_layers": list(job.target.capture_layers),
        "data": None if args.data is None else str(args.data.resolve()),
        "samples": None if job.samples is None else len(job.samples),
    }
    keep = args.checkpoint_every or args.stop_after or args.resume
    checkpoint = args.out / "checkpoint.pt" if keep else None
    resume = None
    if args.resume:
        path = args.out / "checkpoint.pt" if args.resume is True else Path(args.resume)
        resume = dflash.checkpoint.load(path, identity)
    scalars = None
    if rank == 0:
        scalars = dflash.metrics.Scalars(
            args.out, tensorboard=args.tensorboard, append=bool(resume)
        )
    return dflash.training.Run(
        steps=steps,
        depth=args.depth,
        rank=rank,
        world=world,
        log_every=args.log_every,
        trace=None if args.trace is None or rank else args.trace,
        graphs=args.target_graphs,
        drafter_graphs=args.drafter_graphs,
        checkpoint=checkpoint,
        every=args.checkpoint_every,
        stop_after=args.stop_after,
        resume=resume,
        identity=identity,
        scalars=scalars,
    )


def target_name(job: dflash.loops.Job) -> str:
    if isinstance(job.target, dflash.models.TargetConfig):
        return "built-in hybrid"
    return job.target.source


def write_results(
    args, job, placement, outcome: dflash.training.Outcome, curves, rank, world, check_line
) -> None:
    """summary.json (per rank), and on rank 0 the drafter, its export and the loss curve."""
    state = dflash.checkpoint.trainable_state(outcome.models.drafters[0])
    steps = len(outcome.losses)
    per_step = job.accumulate * world  # microbatches of all ranks
    first = (outcome.first_step - 1) * per_step
    data = job.data(args.seed)
    tokens = sum(data.tokens(i) for i in range(first, first + steps * per_step))
    tokens_per_s = tokens / outcome.wall_s
    summary = {
        "mode": outcome.mode,
        "rank": rank,
        "world": world,
        "targets": list(placement.targets),
        "drafters": list(placement.drafters),
        "target": target_name(job),
        "target_layers": list(job.target.capture_layers),
        "target_graphs": outcome.graph_stats,
        "drafter_graphs": outcome.drafter_graph_stats,
        "gamma": job.drafter.gamma_,
        "loss_kernel": job.drafter.loss_kernel,
        "data": None if args.data is None else str(args.data),
        "first_step": outcome.first_step,
        "steps": steps,
        "interrupted": outcome.interrupted,
        "step_time_s": outcome.wall_s / steps,
        "tokens_per_s": tokens_per_s,
        "loss_per_step": curves[outcome.mode],
        "losses": outcome.losses,
        "drafter_sha256": dflash.metrics.checksum(state),
        "pipeline": outcome.pipeline_stats,
        "check": check_line,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "summary.json" if rank == 0 else f"summary.rank{rank}.json"
    (args.out / name).write_text(json.dumps(summary, indent=1))
    if rank:
        return
    if args.save_drafter is not None:
        torch.save(state, args.save_drafter)
    if args.export is not None and not outcome.interrupted:
        dflash.export.export(outcome.models.drafters[0], args.export, job.target.capture_layers)
        print(f"exported the drafter to {args.export}")
    first, last = curves[outcome.mode][0], curves[outcome.mode][-1]
    print(
        f"{outcome.mode}: loss {first:.4f} -> {last:.4f} over steps {outcome.first_step}-"
        f"{outcome.first_step + steps - 1}, {outcome.wall_s / steps * 1e3:.1f} ms/step, "
        f"{tokens_per_s:,.0f} tokens/s",
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
    path = args.out / "loss_curve.png"
    if not args.no_plot and dflash.metrics.plot(curves, path, outcome.first_step):
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
