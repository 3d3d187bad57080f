"""tests/gpu/capture_stress.py run as a test: lazy captures of three buckets per lane on
a large Qwen3-Next-style target while the other lanes of the GPU autotune, run eager
forwards and replay, in fresh processes. The script says what it runs; on the GPU host
2 and 4 lanes x 5 processes take about six minutes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "capture_stress.py")


def _run(args, env, timeout):
    done = subprocess.run(
        [sys.executable, SCRIPT, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(done.stdout)
    return done


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lazy_captures_beside_busy_lanes_never_fail_a_microbatch(python_subprocess_env):
    pytest.importorskip("transformers")
    done = _run(["--procs", "5", "--lanes", "2,4"], python_subprocess_env, timeout=880)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 died, 0 failed microbatches, fallbacks none" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_stress_script_runs_on_cpu_lanes(python_subprocess_env):
    pytest.importorskip("transformers")
    done = _run(["--tiny", "--procs", "1", "--lanes", "2"], python_subprocess_env, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "lanes=2 proc=0 failed=0/16" in done.stdout
