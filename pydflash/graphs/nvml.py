"""How busy a GPU is, from NVML (the driver's libnvidia-ml, which nvidia-smi reads): the
share of its last sample period in which the device ran one or more kernels, any
process's, on any stream. Graph stages' Policy.AUTO reads it once per key it judges
(Note [A policy for the whole step] in pydflash/graphs/policy.py). Loaded with ctypes, so
no Python package is needed; where the library or the device is missing, None."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

LIBRARY = "libnvidia-ml.so.1"
_SUCCESS = 0

_lock = threading.Lock()
_library: Any = None  # the loaded library; False once it failed to load or initialize
_handles: dict[int, ctypes.c_void_p | None] = {}  # CUDA device index -> NVML handle


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


def busy_share(device: int) -> float | None:
    """The share (0 to 1) of NVML's last sample period, 1/6 s to 1 s by product, in which
    CUDA device `device` ran a kernel; None where NVML cannot say."""
    handle = _handle(device)
    if handle is None:
        return None
    utilization = _Utilization()
    if _library.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(utilization)) != _SUCCESS:
        return None
    return utilization.gpu / 100


def _handle(device: int) -> ctypes.c_void_p | None:
    """NVML's handle of CUDA device `device`, found by its UUID (NVML numbers devices in
    its own order, whatever CUDA_VISIBLE_DEVICES says); None where there is none."""
    global _library
    with _lock:
        if device in _handles:
            return _handles[device]
        if _library is None:
            try:
                library = ctypes.CDLL(LIBRARY)
                _library = library if library.nvmlInit_v2() == _SUCCESS else False
            except (OSError, AttributeError):
                _library = False
        handle = None
        if _library:
            import torch

            uuid = str(torch.cuda.get_device_properties(device).uuid)
            if not uuid.startswith(("GPU-", "MIG-")):
                uuid = f"GPU-{uuid}"
            found = ctypes.c_void_p()
            if _library.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(found)) == _SUCCESS:
                handle = found
        _handles[device] = handle
        return handle
