"""pydflash: native per-device lanes for multi-model training from one Python process."""

from __future__ import annotations

from ._native import C as _C
from ._version import __version__
from .errors import (
    CompileQueueTimeout,
    CudaError,
    GraphCaptureError,
    GraphFallbackWarning,
    GraphMemoryError,
    InputFailedError,
    InternalError,
    NativeModuleError,
    PipelineError,
    PydflashError,
    UnsupportedTritonError,
)
from .guards import guard_triton, install_guards, remove_guards, unguard_triton
from .info import build_info
from .lanes._future import Future
from .lanes.dispatcher import Dispatcher
from .lanes.lane import Lane
from .lanes.waiting import wait_all


def __getattr__(name: str):
    # Pipeline, TargetGraphs and DrafterGraphs need torch; the core does not, so they are
    # imported on first use.
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    if name == "TargetGraphs":
        from .pipeline.stages.target_graphs import TargetGraphs

        return TargetGraphs
    if name == "DrafterGraphs":
        from .pipeline.stages.drafter_graphs import DrafterGraphs

        return DrafterGraphs
    if name == "Policy":
        from .graphs.cache import Policy

        return Policy
    raise AttributeError(f"module 'pydflash' has no attribute {name!r}")


if _C.__version__ != __version__:  # pragma: no cover - a stale build in the tree
    raise NativeModuleError(
        f"pydflash._C is version {_C.__version__} but the package is {__version__}; reinstall"
    )

__all__ = [
    "CompileQueueTimeout",
    "CudaError",
    "Dispatcher",
    "DrafterGraphs",
    "Future",
    "GraphCaptureError",
    "GraphFallbackWarning",
    "GraphMemoryError",
    "InputFailedError",
    "InternalError",
    "Lane",
    "NativeModuleError",
    "Pipeline",
    "PipelineError",
    "Policy",
    "PydflashError",
    "TargetGraphs",
    "UnsupportedTritonError",
    "__version__",
    "build_info",
    "guard_triton",
    "install_guards",
    "remove_guards",
    "unguard_triton",
    "wait_all",
]
