"""One process per device for bench/scale_out.py: the same target forward loop as the
section's lanes, on this process's own device, started on a barrier.

Started by the section in torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), or by torchrun itself:

    torchrun --nproc-per-node 4 -m bench.scale_out_worker --counts 1,2,4 \\
        --config qwen3-next-small --seq 1024

Each rank builds the target from the section's seed on cuda:LOCAL_RANK (the CPU with
--cpu), makes its microbatch (the one the section's lane of the same index gets) and
warms the forward up. Then, for each count N in --counts, every rank meets the others
at a barrier (gloo) and ranks below N time --reps forwards, each followed by a
synchronize, while the others wait at the next barrier: one start-up serves every N.
Each timing rank prints one JSON line, {"n", "rank", "device", "step_s"}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

if not __package__:
    # Run as a script (`python bench/scale_out_worker.py`): the checkout importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from bench import kernels
from bench.common import counts_arg
from examples.dflash.data import MarkovTokens
from examples.dflash.hf import QWEN3_NEXT, HFTargetConfig
from examples.dflash.loops import target_dtype, target_forward

DATA_SEED = 7  # bench.real_target's batches: lane i's microbatch is batch i
MODEL_SEED = 0  # build_models' seed for the target
WARMUP = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--counts",
        type=_counts,
        required=True,
        help="process counts to time, e.g. 1,2,4; each at most WORLD_SIZE",
    )
    p.add_argument("--config", choices=list(QWEN3_NEXT), default="qwen3-next-small")
    p.add_argument("--moe", action="store_true", help="MoE blocks instead of a dense MLP")
    p.add_argument("--batch", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--reps", type=int, default=20, help="timed forwards per count")
    p.add_argument("--cpu", action="store_true", help="run on the CPU, one intra-op thread")
    return p.parse_args(argv)


_counts = counts_arg("process", "1,2,4")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if max(args.counts) > world:
        raise SystemExit(f"expected counts of at most WORLD_SIZE={world}, got {args.counts}")
    if args.cpu:
        torch.set_num_threads(1)  # as the section's CPU lanes
        device = "cpu"
    else:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(device)
    # The barrier only orders the ranks' starts: gloo, so no NCCL communicator is made.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    try:
        forward, batch = build(args, rank, device)
        for n in args.counts:
            dist.barrier()
            if rank < n:
                step_s = timed(forward, batch, device, args.reps)
                print(
                    json.dumps({"n": n, "rank": rank, "device": device, "step_s": step_s}),
                    flush=True,
                )
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def build(args: argparse.Namespace, rank: int, device: str) -> tuple[Any, dict]:
    kernels.apply_fallbacks()  # PYDFLASH_BENCH_FALLBACK, inherited from the parent
    config = HFTargetConfig.load(args.config, moe=args.moe)
    torch.manual_seed(MODEL_SEED)
    model = config.build(target_dtype(device)).to(device)
    forward = target_forward(model)
    data = MarkovTokens(config.vocab, args.seq, args.batch, seed=DATA_SEED)
    batch = {k: t.to(device) for k, t in data.batch(rank).items()}
    with torch.no_grad():
        for _ in range(WARMUP):
            forward(batch)
    synchronize(device)
    return forward, batch


def timed(forward: Any, batch: dict, device: str, reps: int) -> list[float]:
    """Seconds of each of `reps` forwards, each to its synchronize."""
    out = []
    with torch.no_grad():
        for _ in range(reps):
            start = time.perf_counter()
            forward(batch)
            synchronize(device)
            out.append(time.perf_counter() - start)
    return out


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
