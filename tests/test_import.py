"""Importing pydflash: it refuses a native module built for another version, and it
touches no GPU (neither the CUDA driver nor torch is loaded)."""

from __future__ import annotations

import json
import sys

import pytest

import pydflash


def test_a_native_module_of_another_version_is_refused(run_child_script):
    other = "0.0.0.dev0"
    out = run_child_script("import_pydflash.py", "--native-version", other)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"pydflash.errors.NativeModuleError: pydflash._C is version {other} but the package "
        f"is {pydflash.__version__}; reinstall"
    )


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="reads /proc/self/maps and glibc's loader log (LD_DEBUG)",
)
def test_import_loads_no_cuda_driver_and_no_torch(run_child_script):
    def import_pydflash(*args: str) -> tuple[dict, list[str]]:
        # The loader's log names each library looked for, found or not: on a machine
        # without a driver it still shows an attempt to load one.
        out = run_child_script("import_pydflash.py", *args, env={"LD_DEBUG": "libs"})
        assert out.returncode == 0, out.stderr[-3000:]
        looked_for = [line for line in out.stderr.splitlines() if "libcuda.so" in line]
        return json.loads(out.stdout), looked_for

    report, looked_for = import_pydflash()
    assert report == {"torch": False, "driver": []}
    assert looked_for == []
    if pydflash._C.compiled_with_cuda():
        # The same checks see a device query, which looks for the driver.
        report, looked_for = import_pydflash("--count-devices")
        assert report["driver"] or looked_for
