"""Per-thread setup of a lane worker, run on the worker the first time torch is present.

Torch keeps the current device and stream per thread, and Triton its allocator: a
native worker starts with none of them. Other parts of pydflash (the Triton guard)
register hooks here to run on each worker thread. Step 1 of Note [Lane stream
selection] in csrc/python/torch_abi.cpp; the worker keeps the stream current after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_hooks: list[Callable[[int], None]] = []
_hooks_lock = threading.Lock()


def register_thread_hook(hook: Callable[[int], None]) -> None:
    """Runs hook(device) on every lane worker thread before its first torch task
    (device is -1 on CPU lanes). Idempotent per hook."""
    with _hooks_lock:
        if hook not in _hooks:
            _hooks.append(hook)


def init_thread(device: int, stream: int) -> tuple | None:
    """Returns (set_stream, args) that re-select the lane stream before each task,
    or None on CPU lanes."""
    import torch

    result = None
    if device >= 0:
        torch.cuda.set_device(device)
        lane_stream = torch.cuda.ExternalStream(stream, device=torch.device("cuda", device))
        torch.cuda.set_stream(lane_stream)
        result = (
            torch._C._cuda_setStream,
            (lane_stream.stream_id, lane_stream.device_index, lane_stream.device_type),
        )
    with _hooks_lock:
        hooks = list(_hooks)
    for hook in hooks:
        hook(device)
    return result
