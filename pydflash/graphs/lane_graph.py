"""CUDA graphs on lanes: captured work launched by the native worker without the GIL.

`lane.submit_graph(graph)` launches a torch.cuda.CUDAGraph (or a CapturedGraph) with
`cudaGraphLaunch` on the lane stream from the native worker (the executable's handle
comes from pydflash/lanes/graph_exec.py); its future completes when the GPU has run the
graph. `capture(fn, example_inputs, lane)` records an inference forward (a frozen target
model) on a lane, with static input and output buffers, and `CapturedGraph.run(*inputs)`
replays it per microbatch. `capture_graph` is the one capture routine under it and under
the graph caches (pydflash/graphs/cache.py).

Note [Native graph launch]: the worker launches `raw_cuda_graph_exec()` directly, so
torch's `replay()` does not run. For inference graphs that changes nothing; a graph with
random ops (dropout) replays the same random numbers each launch, because only
`replay()` advances the generator offsets. Where the torch in use has no
`raw_cuda_graph_exec()`, `submit` and `CapturedGraph.run` fall back to calling
`replay()` in an ordinary lane task (the launch then holds the GIL).

Note [Where a replay runs]: `CapturedGraph.run` launches natively, as nothing but the
launch sits between its copy-in and clone. `pydflash.TargetGraphs` calls `replay()` inside
its one Python task: padding into the static inputs, a first capture, the copy into a ring
buffer all need Python, and splitting the task in three queue entries around a native
launch costs more than the microseconds `replay()` holds the GIL (which also keeps the
generator offsets right, should a target draw random numbers).

Note [Capturing beside other lanes]: `capture_graph` is the one capture routine (`capture`
and pydflash/graphs/cache.py call it from a task on the capturing lane).
- Warm-up runs eagerly beside the other lanes, compiling and autotuning under the Triton
  guard; with `turn`, one lane at a time per bucket in the compile queue (no turn is held
  afterwards).
- capture_begin..capture_end runs while every other lane of the device is paused between
  tasks (pydflash/lanes/quiesce.py; what that asks of the rest of the process: Note [Quiet
  device for capture] in csrc/core/device_quiet.h). "thread_local" capture mode does not
  make cuDNN's attention plans, cuBLAS workspaces or an autotuner's synchronize in another
  thread safe beside a capture (at head_dim 256, cuDNN's `mha_graph.execute` failed).
- The capturing lane's stream is made idle first; other lanes' queued GPU work may go on.
- No quiet within `quiet_timeout`: nothing is captured (CaptureFailed, kind "device busy");
  a later call may try again. PYDFLASH_CAPTURE_QUIET=0 skips the pause (to show its use).

Note [A failed capture]: when a capture was invalidated (a host sync in the forward, say),
torch's `capture_end` raises at `cudaStreamEndCapture`. Up to torch 2.11 it raises before
it tells the caching allocators the capture ended: the device allocator and the pinned
host allocator both keep recording into the pool, and the next capture into it raised
"beginAllocateToPool: already recording to mempool_id". So after any failure,
`capture_graph` ends the stream's capture if it is still on, ends the device allocator's
recording (`_cuda_endAllocateToPool`; it raises where torch ended it already) and resets
the graph. The host allocator's recording has no Python call to end it (on the H200 the
next capture into the pool still raised), so a caller never captures into a pool a
capture failed in again: the graph cache takes a fresh pool for its next capture, and
the graphs already in the old pool keep replaying from it. The cleanup never gives back
the pool reference capture_begin took: torch's `reset()` gives it back after a failed
capture in the releases that fixed that leak (2.11.x on the H200), and one more release
dropped the count of a pool that still held a graph to 0. Where `reset()` keeps it, the
pool keeps one reference too many and is freed only at exit, as plain torch does.
capture_begin also put the device's default CUDA generator in capture mode, and only a
successful end takes it out: left so, every later random op outside a capture raises
"Offset increment outside graph capture encountered unexpectedly" (seen on the H200, in
the tests after a failed capture). A capture of one random draw takes it out
(`_cuda_capture.end_generator_capture`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import compile_queue
from .._checks import counted
from ..errors import GraphCaptureError
from ..lanes.graph_exec import (
    GraphWrapper,
    check_lane,
    native_launch_supported,
    remember_device,
    unwrap,
)
from . import _cuda_capture as _cuda
from .policy import NotWorthCapturing, timed_call
from .pools import OPEN_CAPTURES

if TYPE_CHECKING:
    from ..lanes._future import Future
    from ..lanes.lane import Lane

#: Eager calls before a capture: the first compiles and autotunes, the second runs warm
#: (and is the one timed for a policy that compares graph and eager).
DEFAULT_WARMUP = 2
DEFAULT_QUIET_TIMEOUT = 30.0
QUIET_ENV = _cuda.QUIET_ENV

# Each lane's worker thread, once known, to refuse a capture that would wait for itself.
_worker_threads: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def submit(lane: Lane, graph: Any) -> Future:
    """Launches `graph` on `lane`: natively without the GIL when torch exposes the raw
    executable, else `graph.replay()` as an ordinary task (whose future completes when
    the launch returns rather than when the GPU is done; `wait_stream` works for both)."""
    torch_graph, device = unwrap(graph)
    check_lane(lane, device)
    if native_launch_supported(torch_graph):
        return lane.submit_graph(graph)
    return lane.submit(torch_graph.replay)


@dataclass(frozen=True)
class TensorSpec:
    """What a static input buffer accepts: the shape and dtype it was captured with."""

    shape: tuple[int, ...]
    dtype: Any

    @classmethod
    def of(cls, tensor: Any) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def check(self, position: int, tensor: Any) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected input {position} as a tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"expected input {position} of shape {self.shape} and dtype {self.dtype}, "
                f"as captured, got shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
                "(a graph replays fixed shapes: capture one graph per shape)"
            )


class CapturedGraph(GraphWrapper):
    """An inference forward captured on one lane, replayed per microbatch.

    Made by `capture`. `static_inputs` are the buffers the graph reads and
    `static_outputs` what `fn` returned during capture: the buffers every replay
    writes. The same tensors are returned by every `run`, so each replay overwrites
    the previous replay's outputs; pass `clone=True` to get copies that stay valid.
    """

    def __init__(
        self, lane: Lane, graph: Any, static_inputs: Sequence[Any], static_outputs: Any
    ) -> None:
        self._lane = lane
        self.graph = graph
        self.static_inputs = tuple(static_inputs)
        self.static_outputs = static_outputs
        self._specs = tuple(TensorSpec.of(t) for t in self.static_inputs)
        self._launches_natively = native_launch_supported(graph)
        # Keeps one run's copy-in, launch and clone adjacent in the lane queue.
        self._order = threading.Lock()
        if lane.device_index is not None:
            remember_device(graph, lane.device_index)

    @property
    def lane(self) -> Lane:
        return self._lane

    @property
    def device_index(self) -> int | None:
        return self._lane.device_index

    @property
    def native(self) -> bool:
        """True when runs launch without the GIL; False when they fall back to replay()."""
        return self._launches_natively

    def run(self, *inputs: Any, clone: bool = False) -> Future:
        """Copies `inputs` into the static inputs on the lane stream, once the work
        queued on the caller's current stream (which may be producing them) is done,
        then replays the graph. No inputs: replays on what the static inputs hold. The
        future's result is `static_outputs` (overwritten by the next run), or a copy with
        clone=True. Natively launched, the future completes when the GPU has run it."""
        self._check_inputs(inputs)
        ready = _inputs_ready(inputs)
        lane = self._lane
        with self._order:
            if not self._launches_natively:
                return lane.submit(
                    _replay,
                    self.graph,
                    self.static_inputs,
                    inputs,
                    ready,
                    self.static_outputs,
                    clone,
                )
            copied = lane.submit(_copy_in, self.static_inputs, inputs, ready) if inputs else None
            launched = lane.submit_graph(self)
            launched.replace_result(self.static_outputs)
            if copied is not None:
                # Runs before the launch completes (the lane is FIFO), or at once here.
                copied.add_done_callback(partial(_forward_failure, launched))
            if not clone:
                return launched
            return lane.submit(_clone_after, copied, launched, self.static_outputs)

    def _check_inputs(self, inputs: tuple[Any, ...]) -> None:
        if inputs and len(inputs) != len(self._specs):
            raise ValueError(
                f"expected {len(self._specs)} inputs (or none, to replay the static "
                f"inputs), got {len(inputs)}"
            )
        for position, (spec, tensor) in enumerate(zip(self._specs, inputs, strict=False)):
            spec.check(position, tensor)

    def __repr__(self) -> str:
        mode = "native" if self._launches_natively else "replay"
        return f"<pydflash.graphs.CapturedGraph on {self._lane!r} ({mode})>"


def capture(
    fn: Callable[..., Any],
    example_inputs: Any,
    lane: Lane,
    *,
    warmup: int = DEFAULT_WARMUP,
    pool: Any = None,
) -> CapturedGraph:
    """Captures `fn(*inputs)` without grad on `lane`'s worker and stream, as a graph
    with static input buffers (copies of `example_inputs` on the lane's device) and
    the outputs `fn` returned as static outputs. `fn` runs `warmup` times first (lazy
    initialisation, autotuning). `pool` shares a memory pool with other graphs
    (torch.cuda.graph_pool_handle()); after a GraphCaptureError, capture into another
    pool (Note [A failed capture]). Call it from the training thread, not from a
    task on the same lane. The capture pauses the other lanes of the device and leaves
    no trace when it fails (`capture_graph`, Note [Capturing beside other lanes]). Only
    what runs on the GPU is replayed: Python control flow is fixed at capture, and fn
    must not synchronise with the host."""
    import torch

    if not callable(fn):
        raise TypeError(f"expected a callable to capture, got {type(fn).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            f"expected example_inputs as a tensor or a sequence of tensors, "
            f"got {type(example_inputs).__name__}"
        )
    for position, tensor in enumerate(example_inputs):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"expected example input {position} as a tensor, got {type(tensor).__name__}"
            )
    counted(warmup, "warmup", minimum=0)
    if not lane.is_gpu:
        raise GraphCaptureError(
            f"capture needs a GPU lane: a CUDA graph records GPU work, and {lane!r} is a CPU lane"
        )
    if _on_worker_of(lane):
        raise GraphCaptureError(
            f"capture was called from a task on {lane!r}, which would wait for itself; "
            "call it from another thread"
        )
    return lane.submit(_capture_on_lane, fn, tuple(example_inputs), lane, warmup, pool).result()


def _on_worker_of(lane: Lane) -> bool:
    ident = _worker_threads.get(lane)
    if ident is not None:
        return ident == threading.get_ident()
    # Before the lane's first capture its thread is unknown, but inside a lane task
    # the lane stream is always the current stream.
    import torch

    return torch.cuda.current_stream(lane.device_index).cuda_stream == lane.stream_ptr


# --- what runs on the lane worker ------------------------------------------------------


def _capture_on_lane(
    fn: Callable[..., Any], examples: tuple[Any, ...], lane: Lane, warmup: int, pool: Any
) -> CapturedGraph:
    import torch

    _worker_threads[lane] = threading.get_ident()
    device = torch.device("cuda", lane.device_index)
    static_inputs = tuple(x.detach().to(device).clone() for x in examples)
    with torch.no_grad():
        try:
            captured = capture_graph(
                partial(fn, *static_inputs),
                lane,
                pool=torch.cuda.graph_pool_handle() if pool is None else pool,
                warmup=warmup,
            )
        except CaptureFailed as exc:
            raise GraphCaptureError(
                f"capturing {getattr(fn, '__qualname__', fn)!s} on {lane!r} failed: {exc} "
                "(a captured function must not synchronise with the host or change "
                "shapes between calls)"
            ) from exc.__cause__
    return CapturedGraph(lane, captured.graph, static_inputs, captured.outputs)


# --- the one capture routine -----------------------------------------------------------


class CaptureFailed(GraphCaptureError):
    """A capture that left no trace (Note [A failed capture]); `kind` says why in a word:
    "capture failed" (the forward or torch raised: the cause is `__cause__`) or "device
    busy" (the other lanes of the device did not pause in time)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail

    def __reduce__(self) -> tuple:
        return (type(self), (self.kind, self.detail))


@dataclass
class Captured:
    """What `capture_graph` made: the torch graph, what fn returned while it was captured
    (the buffers every replay writes), and with timed=True, of the last warm-up call, the
    GPU time and the host's time to launch it, in milliseconds (None otherwise)."""

    graph: Any
    outputs: Any
    eager_ms: float | None = None
    host_ms: float | None = None


def capture_graph(
    fn: Callable[[], Any],
    lane: Lane,
    *,
    pool: Any,
    warmup: int = DEFAULT_WARMUP,
    timed: bool = False,
    turn: str | None = None,
    quiet_timeout: float = DEFAULT_QUIET_TIMEOUT,
    judge: Callable[[float, float], str | None] | None = None,
) -> Captured:
    """Captures fn() as a CUDA graph into memory pool `pool`, from a task on `lane`'s
    worker (the lane stream current). fn runs `warmup` times eagerly first; with `turn`
    (a bucket's name) the warm-up takes turns with other lanes' warm-ups of that name in
    the compile queue; with `timed` the last warm-up call is timed, on the GPU and on the
    host, and `judge(eager_ms, host_ms)`, if given, may refuse the capture with a reason
    (NotWorthCapturing). The capture itself runs while the device's other lanes are paused
    (Note [Capturing beside other lanes]). Raises CaptureFailed, having left no trace (Note
    [A failed capture]); errors of the warm-up propagate as they are."""
    counted(warmup, "warmup", minimum=0)
    timing = _warm_up(fn, lane, warmup, timed, turn)
    eager_ms = host_ms = None
    if timing is not None:
        _cuda.stream_idle()  # the timed call has run: its events can be read
        eager_ms, host_ms = timing()
        reason = judge(eager_ms, host_ms) if judge is not None else None
        if reason is not None:
            raise NotWorthCapturing(reason, eager_ms, host_ms)
    with _cuda.device_quiet(lane, quiet_timeout) as quiet:
        if not quiet:
            raise CaptureFailed(
                "device busy",
                f"the other lanes of {lane.label}'s device did not pause within "
                f"{quiet_timeout:g} s for a capture",
            )
        graph = None
        with OPEN_CAPTURES.capturing():
            try:
                _cuda.stream_idle()
                graph = _cuda.new_graph()
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                outputs = fn()
                graph.capture_end()
            except Exception as exc:
                _leave_no_trace(graph, lane.device_index, pool)
                detail = f"{type(exc).__name__}: {first_line(exc)}"
                raise CaptureFailed("capture failed", detail) from exc
    return Captured(graph, outputs, eager_ms, host_ms)


def _warm_up(
    fn: Callable[[], Any], lane: Lane, warmup: int, timed: bool, turn: str | None
) -> Callable[[], tuple[float, float]] | None:
    """Runs the warm-up; returns how to read the last call's (GPU ms, host ms) once the
    stream has passed it (policy.timed_call), or None."""
    if warmup == 0:
        return None
    timing: list[Callable[[], tuple[float, float]]] = []

    def warm() -> None:
        for call in range(warmup):
            if timed and call == warmup - 1:
                # From an idle stream: queued behind other work, an eager call would show
                # none of the launch gaps a graph saves.
                _cuda.stream_idle()
                timing.append(timed_call(fn)[1].read)
            else:
                fn()

    if turn is None:
        warm()
    else:
        compile_queue.run(f"{turn} on {lane.label}", warm, slot=turn)
    return timing[0] if timing else None


def _leave_no_trace(graph: Any | None, device: int, pool: Any) -> None:
    """Note [A failed capture]: ends what a failed capture left on, in the stream and the
    allocator, and resets the graph."""
    if graph is not None and _cuda.is_capturing():
        with contextlib.suppress(Exception):  # an invalidated capture refuses any launch
            _cuda.launch_marker()  # Note [No empty graph] in _cuda_capture.py
        # Invalidated or not, the capture ends here; ending an invalidated capture raises.
        with contextlib.suppress(Exception):
            graph.capture_end()
    with contextlib.suppress(RuntimeError):  # raises where capture_end ended it already
        _cuda.end_allocate_to_pool(device, pool)
    if graph is not None:
        with contextlib.suppress(Exception):  # a cleanup that fails must not fail the step
            graph.reset()
        with contextlib.suppress(Exception):
            _cuda.end_generator_capture()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _inputs_ready(inputs: tuple[Any, ...]) -> list[Any]:
    """Events on the caller's current streams, after the work that may produce the
    CUDA inputs; the copy-in waits for them."""
    devices = {t.device for t in inputs if t.is_cuda}
    if not devices:
        return []
    import torch

    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def _copy_in(static_inputs: tuple[Any, ...], inputs: tuple[Any, ...], ready: list[Any]) -> None:
    import torch

    for event in ready:
        torch.cuda.current_stream().wait_event(event)
    for static, source in zip(static_inputs, inputs, strict=True):
        static.copy_(source, non_blocking=True)
        if source.is_cuda and source.device == static.device:
            # The caller may drop `source` once this task returns; keep its memory
            # from being reused before the copy on the lane stream has read it.
            source.record_stream(torch.cuda.current_stream())


def _failure_of(future: Future) -> BaseException | None:
    return None if future.cancelled() else future.exception()


def _forward_failure(launched: Future, copied: Future) -> None:
    failure = _failure_of(copied)
    if failure is not None:
        launched.forward_failure(failure)


def _clone_after(copied: Future | None, launched: Future, outputs: Any) -> Any:
    # The copy-in ran before this task (the lane is FIFO); the launch may still be on the GPU.
    failure = None if copied is None else _failure_of(copied)
    if failure is None and launched.done():
        failure = launched.exception()
    if failure is not None:
        raise failure
    return _clone(outputs)


def _replay(
    graph: Any,
    static_inputs: tuple[Any, ...],
    inputs: tuple[Any, ...],
    ready: list[Any],
    outputs: Any,
    clone: bool,
) -> Any:
    if inputs:
        _copy_in(static_inputs, inputs, ready)
    graph.replay()
    return _clone(outputs) if clone else outputs


def _clone(outputs: Any) -> Any:
    import torch

    from ..lanes.handoff import map_tensors

    return map_tensors(torch.Tensor.clone, outputs)
