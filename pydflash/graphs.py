"""CUDA graphs on lanes: captured work launched by the native worker without the GIL.

`lane.submit_graph(graph)` launches a torch.cuda.CUDAGraph (or a CapturedGraph) with
`cudaGraphLaunch` on the lane stream from the native worker (the executable's handle
comes from pydflash/graph_exec.py); its future completes when the GPU has run the
graph. `capture(fn, example_inputs, lane)` records an inference forward (a frozen target
model) on a lane, with static input and output buffers, and `CapturedGraph.run(*inputs)`
replays it per microbatch.

Note [Native graph launch]: the worker launches `raw_cuda_graph_exec()` directly, so
torch's `replay()` does not run. For inference graphs that changes nothing; a graph with
random ops (dropout) replays the same random numbers each launch, because only
`replay()` advances the generator offsets. Where the torch in use has no
`raw_cuda_graph_exec()`, `submit` and `CapturedGraph.run` fall back to calling
`replay()` in an ordinary lane task (the launch then holds the GIL).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from .errors import GraphCaptureError
from .graph_exec import GraphWrapper, check_lane, native_launch_supported, remember_device, unwrap

if TYPE_CHECKING:
    from ._future import Future
    from .lane import Lane

DEFAULT_WARMUP = 3

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
        self._native = native_launch_supported(graph)
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
        return self._native

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
            if not self._native:
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
        mode = "native" if self._native else "replay"
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
    (torch.cuda.graph_pool_handle()). Call it from the training thread, not from a
    task on the same lane. Only what runs on the GPU is replayed: Python control flow
    is fixed at capture, and fn must not synchronise with the host."""
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
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"expected warmup as an int >= 0, got {warmup!r}")
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
        for _ in range(warmup):
            fn(*static_inputs)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other lanes keep allocating and synchronising while this one
        # captures; "global" would make their calls fail and invalidate the capture.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = fn(*static_inputs)
        except BaseException as exc:
            # The capture was invalidated by the failure reported below; end it all the same, to
            # leave the lane stream out of capture mode.
            with contextlib.suppress(RuntimeError):
                graph.capture_end()
            raise GraphCaptureError(
                f"capturing {getattr(fn, '__qualname__', fn)!s} on {lane!r} failed: {exc} "
                "(a captured function must not synchronise with the host or change "
                "shapes between calls)"
            ) from exc
        try:
            graph.capture_end()
        except RuntimeError as exc:
            raise GraphCaptureError(f"ending the capture on {lane!r} failed: {exc}") from exc
    return CapturedGraph(lane, graph, static_inputs, outputs)


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

    from .handoff import map_tensors

    return map_tensors(torch.Tensor.clone, outputs)
