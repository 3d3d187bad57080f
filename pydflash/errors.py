"""Every exception pydflash defines. All are picklable (they take one message)."""

from __future__ import annotations


class PydflashError(Exception):
    """Base of pydflash's own exceptions."""


class CudaError(PydflashError, RuntimeError):
    """A CUDA runtime call failed; the message names the call, file and line."""


class InternalError(PydflashError, RuntimeError):
    """A bug in pydflash itself; please report it with `python -m pydflash` output."""


class NativeModuleError(PydflashError, ImportError):
    """pydflash._C could not be loaded."""


class UnsupportedTritonError(PydflashError, RuntimeError):
    """The installed Triton lacks an internal that the guard relies on."""


class CompileQueueTimeout(PydflashError, TimeoutError):
    """A compile-queue wait ran past its timeout; the message names the key and holder."""


class GraphCaptureError(PydflashError, RuntimeError):
    """A CUDA graph could not be captured or launched on a lane."""


class GraphMemoryError(PydflashError, RuntimeError):
    """A graph capture would take a lane's graph pool past its byte cap."""


class InputFailedError(PydflashError, RuntimeError):
    """A stream program's input task (`Lane.submit_program(after=...)`) failed or was
    cancelled, so the program issued nothing."""


class GraphFallbackWarning(UserWarning):
    """A target forward that could not be served by a CUDA graph ran eagerly instead."""


class PipelineError(PydflashError, RuntimeError):
    """A pipeline stage failed; the message names the stage, microbatch and lane, and
    the original exception is the `__cause__`. `stage` is 'data', 'target', 'transfer',
    'drafter', 'reduce' or 'optimizer' (pydflash.pipeline._failures.STAGES); it, `microbatch` and
    `lane` (a lane label) are None where they do not apply."""

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        microbatch: int | None = None,
        lane: str | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.lane = lane
