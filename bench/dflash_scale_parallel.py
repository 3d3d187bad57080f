"""dflash_scale's data-parallel drafters: one process driving a target and a drafter
replica on every GPU through the pipeline, and the example under torchrun with one
process per GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.dflash_scale_common import Scale, timing_setup
from bench.harness import step_time
from examples.dflash.loops import PipelineLoop, Placement, build_models
from examples.dflash.models import DRAFTERS


def data_parallel_rate(scale: Scale, devices: list[str]) -> tuple[float, float]:
    """(samples/s, seconds per optimizer step) with a target and a drafter replica on
    each device, one process driving all of them through the pipeline: microbatch k runs
    on device k % n, and the replicas' gradients are summed before each step. The
    accumulation is rounded up to a multiple of n."""
    n = len(devices)
    accumulate = -(-scale.job.accumulate // n) * n
    job = dataclasses.replace(scale.job, accumulate=accumulate)
    placement = Placement(tuple(devices), tuple(devices))
    sub = dataclasses.replace(scale, job=job, placement=placement)
    loop = PipelineLoop(build_models(job, placement), placement, job, depth=2 * n)
    try:
        setup = timing_setup(sub, placement)
        loop.warm_up(setup.batches(1)[0])
        step = step_time(setup, loop.steps)
    finally:
        loop.close()
    return accumulate * job.batch / step, step


def torchrun_command(scale: Scale, n: int, out: Path, steps: int) -> list[str]:
    """The example under torchrun, one process per GPU (each: target and DDP drafter on
    its own GPU), at the scale's shapes."""
    job = scale.job
    layers = ",".join(str(i) for i in job.target.capture_layers)
    named = [name for name, cfg in DRAFTERS.items() if cfg == job.drafter]
    if not named:
        raise ValueError(f"expected a drafter named in DRAFTERS, got {job.drafter}")
    drafter = named[0]
    script = Path(__file__).resolve().parents[1] / "examples" / "train_dflash_online.py"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(script),
        f"--target-config={job.target.source}",
        f"--target-layers={layers}",
        f"--drafter-config={drafter}",
        f"--seq={job.seq}",
        f"--batch={job.batch}",
        f"--accumulate={job.accumulate}",
        f"--steps={steps}",
        f"--log-every={steps}",
        f"--out={out}",
        "--no-plot",
    ]


def torchrun_time(scale: Scale, n: int, steps: int, timeout: float = 300) -> float:
    """Seconds per optimizer step of rank 0 under torchrun with n processes."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = torchrun_command(scale, n, Path(tmp), steps)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, timeout=timeout, env=env, capture_output=True)
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    return summary["step_time_s"]
