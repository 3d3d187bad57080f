"""The example's flags for a user's own run (data, objective, resume, export, logging),
and the checks that turn a bad flag into argparse's usage line with the reason."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from .checkpoint import ResumeError
from .jsonl import DataError

# What a user's input can get wrong: main reports these as usage errors, not tracebacks.
USER_ERRORS = (DataError, ResumeError, ValueError)


def add_arguments(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("a user's data (examples/README.md)")
    data.add_argument(
        "--data",
        type=Path,
        metavar="FILE.jsonl",
        help="train on this JSONL: token ids with a loss mask, or chat messages (default: "
        "synthetic Markov tokens); --seq is then the longest sample kept",
    )
    data.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="a local tokenizer whose chat template encodes --data's messages "
        "(default: --target-model's)",
    )
    data.add_argument(
        "--pad-multiple",
        type=int,
        help="pad each microbatch of --data to a multiple of this length (default 8, "
        "64 on a GPU: fewer distinct shapes)",
    )
    obj = p.add_argument_group("objective")
    obj.add_argument(
        "--gamma",
        type=float,
        help="loss decay: slot k weighs exp(-(k-1)/gamma) (default DFlash's: 7 at block "
        "16, 4 at block 8)",
    )
    obj.add_argument(
        "--loss-kernel",
        choices=["chunked", "liger"],
        default="chunked",
        help="the fused head + cross entropy: the example's chunked one, or "
        "liger-kernel's LigerFusedLinearCrossEntropyLoss (pip install liger-kernel)",
    )
    obj.add_argument("--warmup", type=int, default=0, help="LR warm-up steps (then cosine)")
    run = p.add_argument_group("checkpoints, export and logging")
    run.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="write --out/checkpoint.pt every N steps (and at Ctrl-C)",
    )
    run.add_argument(
        "--resume",
        nargs="?",
        const=True,
        metavar="PATH",
        help="continue from a checkpoint (default --out/checkpoint.pt)",
    )
    run.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="train N steps of the run, checkpoint and stop (a job with a time limit); "
        "--resume continues",
    )
    run.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="write the trained drafter as a Hugging Face-style directory "
        "(config.json, model.safetensors)",
    )
    run.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log the scalars to --out/tensorboard (needs tensorboard installed)",
    )


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of these flags and of --devices that need no model."""
    for name in ("pad_multiple", "checkpoint_every", "stop_after"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.gamma is not None and not args.gamma > 0:
        p.error(f"--gamma must be > 0, got {args.gamma}")
    if args.seq is not None and args.seq < 2:
        p.error(f"--seq must be >= 2 (a token and the next), got {args.seq}")
    if args.tokenizer is not None and args.data is None:
        p.error("--tokenizer encodes --data's chat messages: pass --data too")
    if args.stop_after is not None and args.check:
        p.error("--stop-after stops one run; --check compares two whole runs")
    for device in args.devices or ():
        reason = device_problem(device)
        if reason:
            p.error(f"--devices {device}: {reason}")
    if args.export is not None and importlib.util.find_spec("safetensors") is None:
        p.error("--export writes safetensors: pip install safetensors")
    if args.loss_kernel == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            p.error("--loss-kernel liger needs liger-kernel: pip install liger-kernel")
        if not torch.cuda.is_available() or any(d == "cpu" for d in args.devices or ()):
            p.error("--loss-kernel liger runs Triton kernels on a GPU: use the chunked kernel")


def device_problem(device: str) -> str | None:
    """Why `device` cannot carry a lane here, or None."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return "expected a device such as cpu, cuda or cuda:1"
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        return f"expected a cpu or cuda device, got {parsed.type}"
    count = torch.cuda.device_count()
    if count == 0:
        return "no GPU is visible here (torch.cuda.device_count() is 0)"
    if parsed.index is not None and parsed.index >= count:
        return f"expected a GPU index below {count}, got {parsed.index}"
    return None
