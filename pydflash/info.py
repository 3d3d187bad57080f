"""build_info() and `python -m pydflash`: what was built and what it runs on."""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import sys
from typing import Any

from ._native import C
from ._version import __version__


def _version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_version(encoded: int) -> str | None:
    return f"{encoded // 1000}.{encoded % 1000 // 10}" if encoded else None


def build_info() -> dict[str, Any]:
    """Build flags, CUDA runtime/driver versions, visible devices, torch and triton
    versions. Touches the CUDA driver only to count devices."""
    count = C.device_count()
    info: dict[str, Any] = {
        "pydflash": __version__,
        "native_version": C.__version__,
        "built_with_cuda": C.BUILD["with_cuda"],
        "sanitizer": C.BUILD["sanitizer"] or None,
        "compiler": C.BUILD["compiler"],
        "cuda_runtime": _cuda_version(C.runtime_version()),
        "cuda_driver": _cuda_version(C.driver_version()),
        "visible_devices": count,
        "devices_unavailable_because": C.unavailable_reason() or None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": _version_of("torch"),
        "triton": _version_of("triton"),
        "flash_linear_attention": _version_of("flash-linear-attention"),
        # How a submit reads the caller's grad mode, inference mode and autocast; None
        # until torch is imported.
        "torch_state_reader": C.torch_state_reader(),
    }
    if count and "torch" in sys.modules:
        import torch

        info["device_names"] = [torch.cuda.get_device_name(i) for i in range(count)]
    return info


def main() -> None:
    # As a training script would, so that the report shows the torch state reader a task
    # uses (chosen once torch is imported) and names the GPUs.
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401
    for key, value in build_info().items():
        print(f"{key:30s} {value}")
