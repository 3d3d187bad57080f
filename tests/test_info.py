"""`python -m pydflash`: what it reports about the machine and about tasks."""

import ctypes
import os

import pytest

import pydflash


def report(run_child_module) -> dict[str, str]:
    out = run_child_module("pydflash")
    assert out.returncode == 0, out.stderr
    return dict(line.split(None, 1) for line in out.stdout.strip().splitlines())


def driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_the_torch_state_reader_a_task_uses(run_child_module):
    # Chosen once torch is imported: the report imports it, as a training script does.
    pytest.importorskip("torch")
    expected = "python" if os.environ.get("PYDFLASH_TORCH_STATE") == "python" else "native"
    assert report(run_child_module)["torch_state_reader"] == expected


def test_no_cuda_driver_is_named_as_such(run_child_module):
    if not pydflash._C.compiled_with_cuda() or driver_loads():
        pytest.skip("needs a CUDA build on a machine without a CUDA driver (CI)")
    reason = report(run_child_module)["devices_unavailable_because"]
    assert reason.startswith("no CUDA driver was found: libcuda.so.1"), reason
    # What the bench's header prints (bench.run.machine).
    assert pydflash.build_info()["devices_unavailable_because"] == reason


def test_build_info_names_the_native_version():
    import pydflash

    assert (
        pydflash.build_info()["native_version"] == pydflash._C.__version__ == pydflash.__version__
    )
