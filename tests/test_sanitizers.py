"""Builds the native tests (tests/native) under ThreadSanitizer and AddressSanitizer and
runs them, stress test included, at a scale that fits CI (PYDFLASH_STRESS_SCALE
overrides it; 1 is the full million-task run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 240
RUN_TIMEOUT_S = 240

# CMakePresets.json names the sanitizer builds. The second target runs the core against
# a counting fake of the device seam (tests/native/fake_device).
TARGETS = ("pydflash_native_tests", "pydflash_fake_device_tests")
PRESETS = {"thread": "tsan", "address": "asan"}
# Scales that keep each run well under a minute on a shared 2-core machine.
CI_SCALE = {"thread": "0.1", "address": "0.25"}
REPORT_MARKERS = {
    "thread": "WARNING: ThreadSanitizer",
    "address": "ERROR: AddressSanitizer",
}
RUNTIME_OPTIONS = {
    "thread": ("TSAN_OPTIONS", "halt_on_error=1:second_deadlock_stack=1"),
    "address": ("ASAN_OPTIONS", "halt_on_error=1:detect_leaks=1:strict_init_order=1"),
}


def _require_build_tools() -> None:
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not on PATH (a test requirement: pip install {tool})")


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )


def build_native_tests(build_dir: Path, sanitizer: str) -> Path:
    """Configures and builds tests/native with `sanitizer`; returns the test binary."""
    _require_build_tools()
    configure = ["cmake", "--preset", PRESETS[sanitizer], "-B", str(build_dir)]
    build = ["cmake", "--build", str(build_dir), "--target", *TARGETS]
    for command in (configure, build):
        done = _run(command)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return build_dir / "pydflash_native_tests"


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_native_tests_clean_under_sanitizer(
    sanitizer: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    binary = build_native_tests(tmp_path_factory.mktemp(f"native-{sanitizer}"), sanitizer)
    env = dict(os.environ)
    env.setdefault("PYDFLASH_STRESS_SCALE", CI_SCALE[sanitizer])
    name, options = RUNTIME_OPTIONS[sanitizer]
    env[name] = options
    done = subprocess.run(
        [str(binary)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
    )
    output = done.stdout + done.stderr
    assert REPORT_MARKERS[sanitizer] not in output, output[-20000:]
    assert done.returncode == 0, output[-20000:]
    summary = re.search(r"^(\d+) passed, (\d+) failed$", done.stdout, re.MULTILINE)
    assert summary is not None and int(summary[1]) > 0 and summary[2] == "0", output[-20000:]
    stress = re.search(r"STRESS tasks=(\d+) finished=(\d+) cancelled=(\d+)", done.stdout)
    assert stress is not None, output[-20000:]
    tasks, finished, cancelled = map(int, stress.groups())
    assert tasks > 0 and finished + cancelled == tasks
    quiet = re.search(r"QUIET tasks=(\d+) .*quiets=(\d+) .*breaches=(\d+)", done.stdout)
    assert quiet is not None, output[-20000:]
    assert int(quiet[2]) > 0 and quiet[3] == "0", quiet[0]
    print(f"{sanitizer}: {stress[0]}; {quiet[0]}")
    fake = subprocess.run(
        [str(binary.parent / TARGETS[1])],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
    )
    output = fake.stdout + fake.stderr
    assert REPORT_MARKERS[sanitizer] not in output, output[-20000:]
    assert fake.returncode == 0, output[-20000:]


def test_sanitize_option_rejects_unknown_values(tmp_path: Path) -> None:
    _require_build_tools()
    done = _run(["cmake", "--preset", "tsan", "-B", str(tmp_path), "-DPYDFLASH_SANITIZE=memory"])
    assert done.returncode != 0
    assert "PYDFLASH_SANITIZE must be 'thread' or 'address', got 'memory'" in done.stderr
