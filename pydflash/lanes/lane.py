"""A lane: one native worker thread bound to one device, as a concurrent.futures.Executor."""

from __future__ import annotations

import concurrent.futures
import numbers
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._native import C
from ._future import Future
from .devices import CPU, describe
from .graph_exec import graph_exec_handle

DEFAULT_SPIN_US = 50.0


def check_spin_us(spin_us: Any) -> float:
    """spin_us as a float: a TypeError for what is not a number, a ValueError outside
    [0, C.MAX_SPIN_US] (a second)."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, numbers.Real):
        raise TypeError(f"expected spin_us in microseconds, got {type(spin_us).__name__}")
    if not 0 <= spin_us <= C.MAX_SPIN_US:  # NaN fails this too
        raise ValueError(
            f"expected spin_us in [0, {C.MAX_SPIN_US:g}] (microseconds), got {spin_us!r}"
        )
    return float(spin_us)


def check_cancel_futures(cancel_futures: Any) -> bool:
    if not isinstance(cancel_futures, bool):
        raise TypeError(
            f"expected cancel_futures=True or False, got {type(cancel_futures).__name__}"
        )
    return cancel_futures


def refuse_copy(what: str, instead: str) -> NoReturn:
    """The TypeError for pickling or copying a Lane or a Dispatcher."""
    raise TypeError(
        f"a pydflash.{what} cannot be pickled or copied: its lanes are native worker threads "
        f"(and CUDA streams) of the process that made it. {instead}"
    )


class LanesHold:
    """Note [Lanes open while held]: lanes close (what is queued still runs) once nothing
    that can submit to them is left: their Dispatcher, its submit, any of its Lanes and
    their submit, and each task queued and not yet run. Each of those holds the lanes'
    one LanesHold, which refers to nothing of theirs (its finalizer has the native lanes),
    so no reference cycle keeps it, and it goes with the last holder, closing the lanes.
    A future refers to its lane weakly: as a stdlib future does not keep its executor
    running, a future does not keep its lanes open once its task has run. So a temporary
    dispatcher works, `Dispatcher(devices=["cpu"]).submit(pow, 2, 5).result()` is 32, where
    closing the lanes with the Dispatcher object closed them before the submit
    (issue 35)."""

    __slots__ = ("__weakref__", "_natives")

    def __init__(self) -> None:
        self._natives: list[Any] = []
        weakref.finalize(self, _close_natives, self._natives)

    def add(self, native: Any) -> None:
        self._natives.append(native)


def _close_natives(natives: list[Any]) -> None:
    for native in natives:
        if not native.forked:  # a forked child's lanes are the parent's
            native.shutdown(False)


class Lane(concurrent.futures.Executor):
    """Runs tasks in order on its own native thread. On a GPU lane the lane's device is
    current and its own CUDA stream is torch's current stream inside every task, and
    the caller's grad mode, inference mode and autocast state at submit apply.

    Lanes are made by `Dispatcher`; `dispatcher.on(device)` returns one.

    Args:
        index: the lane's number in its dispatcher, as labels and traces show it.
        device: a CUDA ordinal, or -1 (pydflash.lanes.devices.CPU) for a CPU lane.
        spin_us: how long the idle worker polls its queue before it sleeps (0: never).
        hold: the LanesHold the lane shares with the other lanes of its dispatcher; a lane
            made alone has its own. The lane closes once nothing holds it.
    """

    # The lane's native half (a C.Lane), set by __init__. Named here, at class level, because
    # csrc/python/bind_lane.cpp reads it by name (Note [Python entry points]).
    _core: Any = None

    def __init__(
        self,
        index: int,
        device: int,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        hold: LanesHold | None = None,
    ) -> None:
        for name, value, what in (
            ("index", index, "an int"),
            ("device", device, f"a CUDA ordinal (int) or {CPU} for the CPU"),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"expected {name} as {what}, got {type(value).__name__}")
        spin_us = check_spin_us(spin_us)
        self._core = C.Lane(index, device, f"lane {index} ({describe(device)})", Future, spin_us)
        # Which dispatcher the lane is part of, as exit messages name it when several
        # dispatchers have lanes (set by Dispatcher).
        self.owner = ""
        self._torch_streams: tuple[Any, Any] | None = None
        self._hold = LanesHold() if hold is None else hold  # Note [Lanes open while held]
        self._hold.add(self._core)
        # The hot path: a native callable, no Python frame (csrc/python/bind_lane.cpp).
        # Built once; it shadows the method below.
        self.submit = self._submitter = C.Submitter((self,), repr(self), self._hold)

    # --- identity -------------------------------------------------------------------
    @property
    def index(self) -> int:
        return self._core.index

    @property
    def label(self) -> str:
        """'lane N (device)', as task failures and stats name the lane."""
        return self._core.label

    @property
    def device(self) -> str:
        """'cuda:N' or 'cpu'."""
        return describe(self._core.device)

    @property
    def device_index(self) -> int | None:
        """CUDA ordinal, or None on a CPU lane."""
        device = self._core.device
        return None if device == CPU else device

    @property
    def is_gpu(self) -> bool:
        return self._core.device != CPU

    @property
    def stream_ptr(self) -> int:
        """The lane's compute stream as a cudaStream_t int (0 on CPU lanes)."""
        return self._core.stream

    @property
    def copy_stream_ptr(self) -> int:
        return self._core.copy_stream

    def _streams(self) -> tuple[Any, Any]:
        if self._torch_streams is None:
            import torch

            device = torch.device("cuda", self._core.device)
            self._torch_streams = (
                torch.cuda.ExternalStream(self.stream_ptr, device=device),
                torch.cuda.ExternalStream(self.copy_stream_ptr, device=device),
            )
        return self._torch_streams

    @property
    def stream(self) -> Any:
        """The compute stream as a torch.cuda.ExternalStream (None on CPU lanes)."""
        return self._streams()[0] if self.is_gpu else None

    @property
    def copy_stream(self) -> Any:
        """A second stream for copies, so transfers overlap compute (None on CPU lanes)."""
        return self._streams()[1] if self.is_gpu else None

    # --- Executor -------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queues fn(*args, **kwargs) on this lane. Each instance's native submitter
        shadows this method; it is reached only as Lane.submit(lane, ...)."""
        return self._submitter(fn, *args, **kwargs)

    def submit_graph(self, graph: Any) -> Future:
        """Launches a captured CUDA graph from the native worker without the GIL. The
        future completes when the GPU has run the graph; the graph (and its memory pool)
        is kept alive until then. `graph` is a torch.cuda.CUDAGraph or a
        pydflash.graphs.CapturedGraph."""
        handle, keepalive = graph_exec_handle(graph, self)
        return self._core.submit_graph(handle, keepalive, self)

    def submit_program(
        self, ops: Sequence[Any], keepalive: Any = None, after: Future | None = None
    ) -> Future:
        """Issues a stream program, `ops` as `_C.StreamOp`s (copies, fills, graph launches,
        as pydflash/pipeline/native_microbatch.py builds them), on this GPU lane's stream
        from the native worker, without the GIL. With `after`, it first waits for that
        future and fails with InputFailedError, issuing nothing, when that one was
        cancelled or failed. The future completes once the ops are issued and carries an
        event after them, as a Python task's does; `keepalive` lives until the GPU has
        passed them. With no keepalive the caller keeps what the ops read until then, and
        the worker never takes the GIL for the program. Note [Program tasks] in
        csrc/python/tasks.cpp."""
        return self._core.submit_program(ops, keepalive, after, self)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops accepting work. wait: return once the worker has finished what it had.
        cancel_futures: cancel what is still queued. In a forked child this does nothing:
        the lane and its worker are the parent's."""
        if self.forked:
            return
        self.close(cancel_futures=cancel_futures)
        if wait:
            self.join()

    # --- life -------------------------------------------------------------------------
    def close(self, *, cancel_futures: bool = False) -> int:
        """Stops accepting work without waiting; with cancel_futures, cancels what is
        queued and returns how many tasks that was (0 without)."""
        return self._core.shutdown(check_cancel_futures(cancel_futures))

    def join(self, timeout: float | None = None) -> bool:
        """Waits until the worker has run everything queued and exited (None: forever);
        False on timeout. The GIL is released meanwhile."""
        return self._core.join(timeout)

    @property
    def closed(self) -> bool:
        """Whether the lane has stopped accepting work."""
        return self._core.closed

    @property
    def exited(self) -> bool:
        """Whether the worker has run its last task and left."""
        return self._core.exited

    @property
    def forked(self) -> bool:
        """Whether this process is a forked child of the one the lane was made in."""
        return self._core.forked

    # --- traces -----------------------------------------------------------------------
    def set_tracing(self, on: bool) -> None:
        """Starts (dropping what was recorded) or stops recording a span per task."""
        if not isinstance(on, bool):
            raise TypeError(f"expected on=True or False, got {type(on).__name__}")
        self._core.set_tracing(on)

    def take_trace(self) -> list[tuple]:
        """Takes the spans recorded so far: (task id, label, submit ns, start ns, end ns,
        gpu) per task, where gpu is (begin ns, end ns) on the host clock, or None."""
        return self._core.take_trace()

    # --- quiet device (pydflash/lanes/quiesce.py) --------------------------------------------
    def hold_device_quiet(self, timeout: float | None) -> bool:
        """From a task on this lane: pauses every other lane of its device before its next
        task; True once all are paused, False if not within `timeout` seconds (then none
        stays paused). Use pydflash.lanes.quiesce.device_quiet, which ends it."""
        return self._core.quiesce(timeout)

    def release_device_quiet(self) -> None:
        """Lets the lanes paused by hold_device_quiet go on."""
        self._core.resume()

    # --- introspection ----------------------------------------------------------------
    def load(self) -> int:
        """Tasks queued, running or still on the GPU."""
        return self._core.load()

    def stats(self) -> dict[str, Any]:
        return {"lane": self.index, "device": self.device, **self._core.stats()}

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            "Lane",
            "Make a Dispatcher in the process that uses it (in a child, once it has started).",
        )

    def __repr__(self) -> str:
        return f"<pydflash.Lane {self.index} on {self.device}>"


def lanes_of(lanes: Any, name: str) -> list[Lane]:
    """`lanes` (one pydflash Lane or an iterable of them, at least one) as a list."""
    if isinstance(lanes, Lane):
        lanes = [lanes]
    try:
        lanes = list(lanes)
    except TypeError:
        raise TypeError(
            f"expected {name} to be pydflash lanes, got {type(lanes).__name__}"
        ) from None
    if not lanes:
        raise ValueError(f"expected at least one lane in {name}, got none")
    for lane in lanes:
        if not isinstance(lane, Lane):
            raise TypeError(f"expected {name} to be pydflash lanes, got a {type(lane).__name__}")
    return lanes
