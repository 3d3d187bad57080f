"""Dispatcher: native lanes, one per device entry, behind one Executor."""

from __future__ import annotations

import concurrent.futures
import itertools
import operator
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from .. import guards
from .._native import C
from . import _exit
from ._future import Future
from .devices import describe, parse_device, parse_devices
from .lane import (
    DEFAULT_SPIN_US,
    Lane,
    LanesHold,
    check_cancel_futures,
    check_spin_us,
    refuse_copy,
)

_numbers = itertools.count(1)  # dispatchers made in this process, as exit messages name them


class Dispatcher(concurrent.futures.Executor):
    """Runs Python callables on native per-device workers; a drop-in replacement for
    ThreadPoolExecutor in multi-GPU training scripts.

    Args:
        devices: CUDA ordinals, 'cuda:N', torch.device or 'cpu', one lane per entry
            (repeat an entry for several lanes on one device). Default: every visible
            GPU, else one CPU lane.
        trace: record per-lane spans (see `export_trace`).
        guard: the guards that make compiling safe under threads while the dispatcher
            lives, by name: 'triton' (Triton's autotuner and compiles), 'fla'
            (flash-linear-attention's tensor_cache), 'torch_compile' (a compiled
            module's first calls). None: all of them (pydflash/guards/); (): none.
        guard_triton: deprecated; guard_triton=False is guard=().
        spin_us: how long an idle worker polls its queue before it sleeps; the window
            grows (to 1 ms) while tasks come in frequent bursts and shrinks back after a
            pause (0: never poll).
        max_workers: ThreadPoolExecutor's, refused with the `devices` call to use instead.
    """

    def __init__(
        self,
        devices: Iterable[Any] | None = None,
        *,
        trace: bool = False,
        guard: str | Iterable[str] | None = None,
        guard_triton: bool | None = None,
        spin_us: float = DEFAULT_SPIN_US,
        max_workers: None = None,
    ) -> None:
        if max_workers is not None:
            n = max_workers if type(max_workers) is int and max_workers > 0 else 4
            raise TypeError(
                f"expected devices, one lane per entry, got max_workers={max_workers!r}: lanes "
                f"are per device, not a pool of workers. For {n} lanes on the CPU use "
                f"Dispatcher(devices=['cpu'] * {n}); for one lane on each of GPUs 0 and 1, "
                "Dispatcher(devices=[0, 1])"
            )
        parsed = parse_devices(devices)
        spin_us = check_spin_us(spin_us)
        names = guards.select(guard)
        if guard_triton is not None:
            if not guard_triton and guard is not None and names:
                raise ValueError(
                    f"expected guard=None or () with guard_triton=False, got guard={guard!r}"
                )
            warnings.warn(
                "Dispatcher(guard_triton=...) is deprecated: it switches every guard; "
                "pass guard=() for none, or guard=None (the default) for all",
                DeprecationWarning,
                stacklevel=2,
            )
            if not guard_triton:
                names = ()
        # Before any lane exists: an unsupported Triton raises with nothing to clean up.
        self._guard = guards.guard(names, missing_ok=True) if names else None
        # Note [Lanes open while held]: they close once nothing holds self._hold.
        self._hold = LanesHold()
        self._lanes = [Lane(i, d, spin_us=spin_us, hold=self._hold) for i, d in enumerate(parsed)]
        caller = sys._getframe(1)
        self.name = (
            f"dispatcher {next(_numbers)} (made at "
            f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"
        )
        for lane in self._lanes:
            lane.owner = self.name
        if trace:
            self.set_tracing(True)
        # The hot path: a native callable picks the least-busy lane
        # (csrc/python/bind_lane.cpp). Built once; it shadows the method below.
        self.submit = self._submitter = C.Submitter(tuple(self._lanes), repr(self), self._hold)
        _exit.track(self._lanes)  # queued work runs before the interpreter exits

    # --- lanes ------------------------------------------------------------------------
    @property
    def lanes(self) -> list[Lane]:
        return list(self._lanes)

    def on(self, device: Any, index: int = 0) -> Lane:
        """The `index`-th lane on `device` (an ordinal, 'cuda:N', torch.device or 'cpu')."""
        wanted = parse_device(device)
        try:
            index = operator.index(index)
        except TypeError:
            got = type(index).__name__
            raise TypeError(f"expected a lane index as an int, got {got}") from None
        matching = [lane for lane in self._lanes if lane.device == describe(wanted)]
        if not matching:
            have = sorted({lane.device for lane in self._lanes})
            raise ValueError(f"expected a device with a lane ({', '.join(have)}), got {device!r}")
        if not 0 <= index < len(matching):
            raise ValueError(
                f"expected a lane index in [0, {len(matching)}) for {device!r}, got {index}"
            )
        return matching[index]

    # --- Executor ---------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Runs fn(*args, **kwargs) on the least-busy lane (fewest tasks queued, running
        or on the GPU). Each instance's native submitter shadows this method; it is
        reached only as Dispatcher.submit(dispatcher, ...)."""
        return self._submitter(fn, *args, **kwargs)

    def warmup(self, fn: Callable[..., Any], inputs_per_lane: Iterable[tuple | None]) -> list[Any]:
        """Runs fn(*inputs) on every lane at once, with every guard on, so that the
        kernels of a step are tuned and compiled in one pass: each autotune key is
        benchmarked once (one benchmark per GPU at a time, GPUs in parallel), each kernel
        compiled once, and lanes needing the same key wait for it instead of repeating it.

        inputs_per_lane: one tuple of positional arguments per lane, in lane order; None
        skips a lane. Returns fn's results in lane order (None for skipped lanes); raises
        the first lane's exception after every lane has finished.
        """
        if not callable(fn):
            raise TypeError(f"expected a callable, got {type(fn).__name__}")
        if isinstance(inputs_per_lane, (str, bytes)) or not isinstance(inputs_per_lane, Iterable):
            raise TypeError(
                "expected inputs_per_lane as a sequence of argument tuples, "
                f"got {type(inputs_per_lane).__name__}"
            )
        inputs = list(inputs_per_lane)
        if len(inputs) != len(self._lanes):
            raise ValueError(
                f"expected one entry of inputs_per_lane per lane ({len(self._lanes)}), "
                f"got {len(inputs)}"
            )
        for i, args in enumerate(inputs):
            if args is not None and not isinstance(args, (tuple, list)):
                raise TypeError(
                    f"expected inputs_per_lane[{i}] as a tuple of arguments or None, "
                    f"got {type(args).__name__}"
                )
        guard = guards.install_guards(missing_ok=True)
        try:
            futures = [
                None if args is None else lane.submit(fn, *args)
                for lane, args in zip(self._lanes, inputs, strict=True)
            ]
            concurrent.futures.wait([f for f in futures if f is not None])
            return [None if f is None else f.result() for f in futures]
        finally:
            if guard is not None:
                guard.uninstall()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops accepting work. wait: return once every lane has finished what it had
        (and give back this dispatcher's hold on its guards); without it, queued work
        still runs before the interpreter exits. cancel_futures: cancel what is still
        queued."""
        _shutdown_lanes(self._lanes, wait, check_cancel_futures(cancel_futures))
        if wait and self._guard is not None:
            # Lanes still running (wait=False) may still launch Triton kernels: keep it.
            self._guard.uninstall()
            self._guard = None

    # --- stats and traces -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"lanes": [lane.stats() for lane in self._lanes]}
        from .. import compile_queue

        stats["compile_queue"] = compile_queue.stats()
        return stats

    def set_tracing(self, on: bool) -> None:
        for lane in self._lanes:
            lane.set_tracing(on)

    def export_trace(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Writes a Chrome/Perfetto trace JSON of the spans recorded so far to the file at
        `path` (a str or os.PathLike; an int file descriptor is refused) and returns it."""
        from ..trace import export

        return export(self._lanes, path)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            "Dispatcher",
            "Make one in the process that uses it (in a child, once it has started), from "
            "the same devices.",
        )

    def __repr__(self) -> str:
        devices = ", ".join(lane.device for lane in self._lanes)
        return f"<pydflash.Dispatcher lanes=[{devices}]>"


def _shutdown_lanes(lanes: list[Lane], wait: bool, cancel_futures: bool) -> None:
    # Every lane stops taking work before the first wait, so they finish side by side.
    for lane in lanes:
        lane.shutdown(False, cancel_futures=cancel_futures)
    if wait:
        for lane in lanes:
            lane.shutdown(True)
