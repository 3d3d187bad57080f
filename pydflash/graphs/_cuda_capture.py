"""The CUDA calls a capture makes (pydflash.graphs.capture_graph), one function each: the
seam the CPU tests stand in for. No torch import until one is called."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..lanes.lane import Lane

QUIET_ENV = "PYDFLASH_CAPTURE_QUIET"  # "0": captures do not pause the device's other lanes


def new_graph() -> Any:
    import torch

    return torch.cuda.CUDAGraph()


def stream_idle() -> None:
    import torch

    torch.cuda.current_stream().synchronize()


def timing_events() -> tuple[Any, Any]:
    """Two CUDA events that time what runs between their records."""
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def device_busy(device: int) -> float | None:
    """The share of NVML's last sample period in which `device` ran a kernel, or None."""
    from .nvml import busy_share

    return busy_share(device)


def is_capturing() -> bool:
    import torch

    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return True  # unknown: try to end it


def launch_marker() -> None:
    """One small kernel on the current stream (Note [No empty graph]).

    Note [No empty graph]: torch's `capture_end` warns "The CUDA Graph is empty. This
    usually means that the graph was attempted to be captured on wrong device or stream"
    (a TORCH_WARN, which reaches Python as a UserWarning) when nothing was recorded. A
    capture whose fn raised before its first kernel is one: an optimizer step that
    torch's capture check refuses (`capturable=False`, as the example's fused AdamW was)
    raises before it launches anything, and the cleanup of a failed capture
    (`_leave_no_trace` in pydflash/graphs/lane_graph.py) ended that empty capture, once
    per lane and run. A capture still valid when its cleanup ends it first records this
    kernel, so the graph reset right after is never empty. The GPU tests fail on the
    warning wherever it comes from, the cleanup's `suppress` included (tests/conftest.py).
    """
    import torch

    torch.zeros(1, device=torch.cuda.current_device())


def empty_cache() -> None:
    import torch

    torch.cuda.empty_cache()


def end_allocate_to_pool(device: int, pool: Any) -> None:
    import torch

    torch._C._cuda_endAllocateToPool(device, pool)


def end_generator_capture() -> None:
    """Note [A failed capture]: takes the device's default CUDA generator out of capture
    mode, which a capture that failed after capture_begin leaves it in. A capture of one
    random draw runs the generator's capture prologue and epilogue once more (the draw
    makes sure the generator takes part, however torch registers it)."""
    import torch

    draw = torch.empty(1, device=torch.cuda.current_device())
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    draw.uniform_()
    graph.capture_end()
    graph.reset()


@contextlib.contextmanager
def device_quiet(lane: Lane, timeout: float) -> Iterator[bool]:
    """pydflash.lanes.quiesce.device_quiet, unless QUIET_ENV is "0" (then True at once)."""
    if os.environ.get(QUIET_ENV, "1") == "0":
        yield True
        return
    from ..lanes import quiesce

    with quiesce.device_quiet(lane, timeout=timeout) as quiet:
        yield quiet
