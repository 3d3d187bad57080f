"""scale_out's one process per device: bench/scale_out_worker.py started `world` times
in torchrun's environment on this host, with a wall-clock limit, and the slowest rank's
median step for each count."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Context
from bench.scale_out_common import CHILD_ENV, ROOT, WORKER, Options, Setting


def process_times(
    ctx: Context, options: Options, setting: Setting, counts: list[int], limit: float
) -> tuple[dict[int, float], str | None]:
    """Per count, the slowest rank's median step (one forward, then a synchronize), in
    seconds; and why the workers stopped early (None when they finished)."""
    world = max(counts)
    ctx.progress(f"{setting.name}: {world} worker processes, at most {limit:.0f} s")
    args = [
        "--counts",
        ",".join(map(str, counts)),
        "--config",
        setting.config.source,
        "--batch",
        str(setting.batch),
        "--seq",
        str(setting.seq),
        "--reps",
        str(options.reps or ctx.reps(20, 5, default=10)),
    ]
    if options.moe:
        args.append("--moe")
    if not setting.on_gpu:
        args.append("--cpu")
    reports, failure = launch([sys.executable, "-m", WORKER, *args], world, limit)
    times = {}
    for n in counts:
        ranks = [r for r in reports if r["n"] == n]
        if len(ranks) == n:
            times[n] = max(statistics.median(r["step_s"]) for r in ranks)
    return times, failure


def launch(command: list[str], world: int, limit: float) -> tuple[list[dict], str | None]:
    """Starts `world` copies of `command` in torchrun's environment (ranks 0..world-1 on
    this host) and waits for all; returns their JSON lines and why they stopped early
    (None when every rank exited 0). When a rank fails or `limit` passes, the others
    are killed with their process groups."""
    env = {
        **os.environ,
        **CHILD_ENV,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
    }
    failure = None
    with tempfile.TemporaryDirectory(prefix="scale_out-") as folder:
        logs = [
            (Path(folder) / f"{rank}.out", Path(folder) / f"{rank}.err") for rank in range(world)
        ]
        procs: list[subprocess.Popen] = []
        try:
            for rank, (out, err) in enumerate(logs):
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    procs.append(
                        subprocess.Popen(
                            command,
                            cwd=ROOT,
                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdout=stdout,
                            stderr=stderr,
                            start_new_session=True,
                        )
                    )
            failure = wait_all(procs, logs, limit)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        reports = [
            json.loads(line)
            for out, _ in logs
            for line in out.read_text().splitlines()
            if line.startswith("{")
        ]
    return reports, failure


def wait_all(
    procs: list[subprocess.Popen], logs: list[tuple[Path, Path]], limit: float
) -> str | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code:  # the others would wait for it at the barrier
                lines = [line for line in logs[rank][1].read_text().splitlines() if line.strip()]
                return f"rank {rank} exit {code}: {lines[-1] if lines else 'no message'}"
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)
    return f"still running at the {limit:.0f} s limit"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
