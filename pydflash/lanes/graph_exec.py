"""What a lane needs to launch a captured CUDA graph natively: its executable handle.

`Lane.submit_graph` launches the cudaGraphExec_t found here; capturing graphs and
replaying them per microbatch is pydflash.graphs, on top of this (Note [Native graph
launch] there). No torch import until a graph is looked at.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..errors import GraphCaptureError

# The device each torch graph pydflash captured belongs to. A torch.cuda.CUDAGraph does
# not say which device it was captured on, so one captured elsewhere is not checked.
_graph_devices: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class GraphWrapper:
    """A torch graph (`graph`) with the device it was captured on, launched like the graph
    itself: pydflash.graphs.CapturedGraph."""

    graph: Any

    @property
    def device_index(self) -> int | None:
        raise NotImplementedError


def remember_device(graph: Any, device_index: int) -> None:
    """Records that torch graph `graph` was captured on `device_index`."""
    _graph_devices[graph] = device_index


def _torch_graph_type() -> type:
    import torch

    return torch.cuda.CUDAGraph


def native_launch_supported(graph: Any) -> bool:
    """Whether `graph` (a torch.cuda.CUDAGraph) exposes the cudaGraphExec_t that the
    native worker launches; False on a torch without `raw_cuda_graph_exec()`."""
    return callable(getattr(graph, "raw_cuda_graph_exec", None))


def unwrap(graph: Any) -> tuple[Any, int | None]:
    """(torch graph, device or None when unknown) of a CapturedGraph or torch graph."""
    if isinstance(graph, GraphWrapper):
        return graph.graph, graph.device_index
    if isinstance(graph, _torch_graph_type()):
        return graph, _graph_devices.get(graph)
    raise TypeError(
        f"expected a torch.cuda.CUDAGraph or a pydflash.graphs.CapturedGraph, "
        f"got {type(graph).__name__}"
    )


def check_lane(lane: Any, device: int | None) -> None:
    """Raises ValueError unless `lane` is a GPU lane on `device` (when known)."""
    if not lane.is_gpu:
        raise ValueError(f"expected a GPU lane for a CUDA graph, got {lane!r}, a CPU lane")
    if device is not None and device != lane.device_index:
        raise ValueError(
            f"expected a lane on cuda:{device}, where the graph was captured, "
            f"got {lane!r} on {lane.device}"
        )


def graph_exec_handle(graph: Any, lane: Any) -> tuple[int, Any]:
    """(cudaGraphExec_t as an int, the object to keep alive until the GPU has run it),
    for `lane.submit_graph`. Raises TypeError for anything but a torch.cuda.CUDAGraph
    or CapturedGraph, ValueError for a CPU lane or a graph of another device, and
    GraphCaptureError when the graph has no executable or torch has no raw handle
    (`pydflash.graphs.submit` then falls back to `replay()`). See Note [Native graph
    launch] in pydflash/graphs/lane_graph.py."""
    torch_graph, device = unwrap(graph)
    check_lane(lane, device)
    if not native_launch_supported(torch_graph):
        import torch

        raise GraphCaptureError(
            f"torch {torch.__version__} has no CUDAGraph.raw_cuda_graph_exec(), so the "
            "graph cannot be launched natively; pydflash.graphs.submit(lane, graph) "
            "replays it with graph.replay() instead"
        )
    try:
        handle = int(torch_graph.raw_cuda_graph_exec())
    except RuntimeError as exc:
        raise GraphCaptureError(
            f"expected a captured and instantiated CUDA graph, got one without an "
            f"executable ({exc})"
        ) from exc
    if handle == 0:
        raise GraphCaptureError("expected a captured CUDA graph, got a null executable")
    return handle, graph
