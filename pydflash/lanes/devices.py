"""Device specifications: what `Dispatcher(devices=...)` and `Dispatcher.on()` accept."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .._native import C

CPU = -1
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def visible_gpus() -> int:
    """Visible CUDA devices as the native runtime sees them (0 without CUDA)."""
    return C.device_count()


def describe(device: int) -> str:
    return "cpu" if device == CPU else f"cuda:{device}"


def _valid(count: int) -> str:
    gpus = f"a CUDA ordinal in [0, {count}), " if count else ""
    return f"{gpus}'cuda:N' or 'cpu'" if count else "'cpu' (no CUDA device is visible)"


def parse_device(spec: Any, gpu_count: int | None = None) -> int:
    """Returns a CUDA ordinal or CPU (-1). Accepts an int, 'cuda:N', 'cuda' (device 0),
    'cpu', or a torch.device."""
    count = visible_gpus() if gpu_count is None else gpu_count
    given = spec
    if type(spec).__name__ == "device" and type(spec).__module__ == "torch":
        spec = str(spec)
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise TypeError(
            "expected a device as an int, 'cuda:N', 'cpu' or torch.device, "
            f"got {type(spec).__name__}"
        )
    if isinstance(spec, str):
        if spec == "cpu":
            return CPU
        match = _CUDA_RE.match(spec)
        if match is None:
            raise ValueError(f"expected {_valid(count)}, got {spec!r}")
        spec = int(match.group(1) or 0)
    if not 0 <= spec < count:
        raise ValueError(f"expected {_valid(count)}, got {given!r}")
    return spec


def parse_devices(devices: Iterable[Any] | None) -> list[int]:
    """The lanes to create: default every visible GPU, else one CPU lane."""
    count = visible_gpus()
    if devices is None:
        return list(range(count)) if count else [CPU]
    if isinstance(devices, (bytes, bytearray, memoryview)):  # would iterate as ints
        raise TypeError(
            "expected a device or a list of devices (ints, 'cuda:N', 'cpu' or "
            f"torch.device), got {type(devices).__name__}"
        )
    if isinstance(devices, (str, int)) or type(devices).__name__ == "device":
        devices = [devices]
    parsed = [parse_device(d, count) for d in devices]
    if not parsed:
        raise ValueError(f"expected at least one device ({_valid(count)}), got an empty list")
    return parsed
