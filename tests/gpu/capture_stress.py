"""Lazy CUDA-graph captures beside busy lanes, on a large Qwen3-Next-style target.

The target is the hybrid of the project's facts at full width: hidden 5120, gated-delta-
rule layers through flash-linear-attention, full-attention layers with head_dim 256 (24
heads, 4 KV heads: SDPA takes cuDNN's attention there), dense MLP 17408, vocabulary
151,936, bf16, random weights built on the GPU. By default all 64 layers of the facts'
25 B model (2 and 4 lanes x 5 processes took 172 s and 182 s on one H200, 2026-12-01);
`--layers 16` keeps the per-layer kernels at a quarter of the GPU time.

Each process is fresh: Triton's compiled kernels are shared between processes through
one TRITON_CACHE_DIR (compiling is not what is tested), but autotuning starts cold in
every process (a fresh FLA_CONFIG_DIR), and the caches are warmed by one eager forward
at a single length before the lanes start. Then every lane's own thread runs its
microbatches at once (started on a barrier): through one `pydflash.TargetGraphs` shared by
the lanes (policy "graphs", buckets 1024, 1536, 2048, so each lane captures three buckets
lazily, at different times on different lanes) interleaved with plain eager forwards. So
captures happen while the other lanes autotune, run eager forwards and replay.

A microbatch failed when its future raised or its output is not finite. Each process
prints one line (failed microbatches, fallbacks by kind, captures, wall time); the parent
prints a summary and exits 1 on any failed microbatch or dead process, and 2 when none
failed but captures did (the step survives a failed capture by running that microbatch
eagerly, so without the quiesce the failures show up as "capture failed" fallbacks).

    python tests/gpu/capture_stress.py                      # 2 and 4 lanes x 5 processes
    PYDFLASH_CAPTURE_QUIET=0 python tests/gpu/capture_stress.py   # captures not quiesced
    python tests/gpu/capture_stress.py --no-quiet --lanes 4 --procs 3

The plumbing, on CPU lanes with a tiny config (no graphs there: the padded eager path):

    python tests/gpu/capture_stress.py --tiny --procs 1 --lanes 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 600
QUIET_ENV = "PYDFLASH_CAPTURE_QUIET"  # pydflash.graphs.QUIET_ENV
BUCKETS = (1024, 1536, 2048)
WARM_LENGTH = 2048
# Per lane: which bucket each graph microbatch falls in (rotated per lane, so lanes
# capture different buckets at different times), and "eager" for a plain forward.
SCHEDULE = (0, "eager", 1, 0, "eager", 2, 1, 2)


# ======================================================================================
# The parent: fresh processes, one line each, then the summary.
# ======================================================================================


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=5, help="fresh processes per lane count")
    parser.add_argument("--lanes", default="2,4", help="lane counts on one GPU, e.g. 2,4")
    parser.add_argument("--layers", type=int, default=64, help="decoder layers (facts: 64)")
    parser.add_argument("--no-quiet", action="store_true", help=f"sets {QUIET_ENV}=0")
    parser.add_argument("--tiny", action="store_true", help="a tiny config on CPU lanes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    env = dict(os.environ)
    if args.no_quiet:
        env[QUIET_ENV] = "0"
    lane_counts = [int(n) for n in args.lanes.split(",")]
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="capture-stress-") as scratch:
        env.setdefault("TRITON_CACHE_DIR", str(Path(scratch) / "triton"))
        for lanes in lane_counts:
            for proc in range(args.procs):
                rows.append(run_child(args, env, scratch, lanes, proc))
                print(format_row(rows[-1]), flush=True)
    failed = sum(row["failed"] for row in rows)
    dead = sum(1 for row in rows if row.get("error"))
    kinds: Counter[str] = Counter()
    for row in rows:
        kinds.update(row.get("fallbacks", {}))
    quiesce = "off" if env.get(QUIET_ENV) == "0" else "on"
    print(
        f"summary: {len(rows)} processes, {dead} died, {failed} failed microbatches, "
        f"fallbacks {dict(kinds) or 'none'}, quiesce {quiesce}, "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    if failed or dead:
        return 1
    return 2 if kinds.get("capture failed") else 0


def run_child(
    args: argparse.Namespace, env: dict[str, str], scratch: str, lanes: int, proc: int
) -> dict[str, Any]:
    child_env = dict(env)
    child_env["FLA_CONFIG_DIR"] = tempfile.mkdtemp(prefix=f"fla-{lanes}-{proc}-", dir=scratch)
    command = [
        sys.executable,
        __file__,
        "--child",
        "--lanes",
        str(lanes),
        "--layers",
        str(args.layers),
        "--seed",
        str(proc),
    ] + (["--tiny"] if args.tiny else [])
    base = {"lanes": lanes, "proc": proc, "failed": 0}
    try:
        done = subprocess.run(
            command,
            env=child_env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {**base, "error": f"no result within {CHILD_TIMEOUT_S} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return {**base, **json.loads(line[len("RESULT ") :])}
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {**base, "error": f"exit {done.returncode}: " + " | ".join(tail)}


def format_row(row: dict[str, Any]) -> str:
    head = f"lanes={row['lanes']} proc={row['proc']}"
    if row.get("error"):
        return f"{head} DIED {row['error']}"
    fallbacks = ", ".join(f"{k}: {n}" for k, n in row["fallbacks"].items()) or "none"
    line = (
        f"{head} failed={row['failed']}/{row['microbatches']} fallbacks={{{fallbacks}}} "
        f"captures={row['captures']} replays={row['replays']} wall={row['wall_s']:.1f}s"
    )
    if row["errors"]:
        line += f" first error: {row['errors'][0]}"
    return line


# ======================================================================================
# One fresh process.
# ======================================================================================


def child(args: argparse.Namespace) -> int:
    import torch

    import pydflash

    started = time.perf_counter()
    count = int(args.lanes)
    torch.manual_seed(args.seed)
    device = "cpu" if args.tiny else "cuda"
    forward, vocab = build_target(args.layers, args.tiny)
    buckets = (16, 24, 32) if args.tiny else BUCKETS
    warm = buckets[-1]
    dispatcher = pydflash.Dispatcher(["cpu"] * count if args.tiny else [0] * count)
    try:
        lanes = dispatcher.lanes
        # Caches warm for one length only: one eager forward, alone.
        ids = torch.randint(0, vocab, (1, warm), device=device)
        lanes[0].submit(eager, forward, {"input_ids": ids}).result()
        if device == "cuda":
            torch.cuda.synchronize()
        target = pydflash.TargetGraphs(forward, lengths=buckets, policy="graphs")
        results = run_lanes(lanes, target, forward, vocab, buckets, device, args.seed)
        stats = target.stats()
    finally:
        dispatcher.shutdown()
    failed = [r for r in results if r is not None]
    lane_stats = stats["lanes"].values()
    print(
        "RESULT "
        + json.dumps(
            {
                "microbatches": len(results),
                "failed": len(failed),
                "errors": failed[:3],
                "fallbacks": {k: v["count"] for k, v in stats["fallbacks"].items()},
                "captures": sum(s["captures"] for s in lane_stats),
                "replays": sum(s["replays"] for s in lane_stats),
                "wall_s": time.perf_counter() - started,
            }
        ),
        flush=True,
    )
    return 0


def build_target(layers: int, tiny: bool) -> tuple[Any, int]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    sys.path.insert(0, str(ROOT))  # examples/ is not installed with pydflash
    from examples.dflash.hf import QWEN3_NEXT

    if tiny:
        config = Qwen3NextConfig(**QWEN3_NEXT["qwen3-next-tiny"], num_experts=0)
        model = AutoModelForCausalLM.from_config(config)
    else:
        large = dict(QWEN3_NEXT["qwen3-next-large"], num_hidden_layers=layers, num_experts=0)
        config = Qwen3NextConfig(**large)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.eval().requires_grad_(False)
    n = config.num_hidden_layers
    chosen = sorted({1, n // 2 - 1, n - 2})

    def forward(batch: dict[str, Any]) -> Any:
        out = model.base_model(
            input_ids=batch["input_ids"], use_cache=False, output_hidden_states=True
        )
        return torch.cat([out.hidden_states[i + 1] for i in chosen], dim=-1)

    return forward, config.vocab_size


def eager(forward: Any, batch: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return forward(batch)


def run_lanes(
    lanes: list[Any],
    target: Any,
    forward: Any,
    vocab: int,
    buckets: tuple[int, ...],
    device: str,
    seed: int,
) -> list[str | None]:
    """Every lane's microbatches from its own thread, all started at once; per microbatch
    None, or what went wrong."""
    import torch

    start = threading.Barrier(len(lanes))
    results: list[list[str | None]] = [[] for _ in lanes]

    def drive(k: int) -> None:
        lane = lanes[k]
        g = torch.Generator().manual_seed(1000 * seed + k)
        start.wait()
        for step, slot in enumerate(SCHEDULE):
            if slot == "eager":
                length = int(torch.randint(buckets[0] // 2, buckets[-1] + 1, (1,), generator=g))
            else:
                i = (slot + k) % len(buckets)
                low = buckets[i - 1] + 1 if i else buckets[0] // 2
                length = int(torch.randint(low, buckets[i] + 1, (1,), generator=g))
            ids = torch.randint(0, vocab, (1, length), generator=g).to(device)
            batch = {"input_ids": ids}
            try:
                if slot == "eager":
                    out = lane.submit(eager, forward, batch).result()
                else:
                    out = target.submit(lane, batch).result()
                finite = bool(lane.submit(_all_finite, out).result())
                target.release(out)
                results[k].append(None if finite else f"lane {k} step {step}: not finite")
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                first = (str(exc).strip().splitlines() or [""])[0]
                results[k].append(f"lane {k} step {step}: {type(exc).__name__}: {first}")
                traceback.print_exc()

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(len(lanes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for lane_results in results for r in lane_results]


def _all_finite(out: Any) -> bool:
    import torch

    return bool(torch.isfinite(out).all())


if __name__ == "__main__":
    sys.exit(main())
