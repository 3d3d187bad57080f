"""A pipeline microbatch as two stream programs, issued by the lane workers without the GIL.

Note [Native microbatch]: once both stages hold a graph for a microbatch's bucket
(`TargetGraphs` for the target, `DrafterGraphs` for the drafter, both captured and kept,
and replayed once in Python), the pipeline's per-microbatch Python is bookkeeping, and the
stages' tasks would spend more host time than the GPU spends on the graphs. Then
`Pipeline` submits two stream programs (`Lane.submit_program`, Note [Program tasks] in
csrc/python/tasks.cpp) instead of two Python tasks. What to launch comes from each stage
through one method, `native_launch(lane, b, t, spec, signature)` (TargetStage,
DrafterStage), as a `pydflash.graphs.bucketed.NativeLaunch`; a stage that says
`launches_natively` may give one, any other never does:

- on the target lane: the batch copied into the target graph's static inputs, padding
  filled; the target graph; a wait for the replica's previous drafter work; the outputs'
  real rows copied straight into the drafter graph's static inputs, padding filled;
- on the drafter lane, after the target program: the real lengths written into the
  drafter's `lengths` (Note [Padding contract] in pydflash/pipeline/stages/drafter_graphs.py); the
  drafter graph (forward, loss, backward into the static gradients); the loss copied out;
  the flight's event recorded.

The same math as the Python path (the same graphs, fed the same padded buffers), minus the
output ring: the target writes the drafter's static inputs itself, so it first waits for
the drafter work that last read them (the replica's previous microbatch, whatever path it
took). Each worker only issues on its own stream, so captures and quiets order programs
like any other task. What it takes, else the microbatch runs in Python as before: both
lanes on one GPU; batch tensors contiguous, on that GPU or in pinned host memory (a copy
from pageable memory may synchronize); pad values of 0 in both stages (a byte fill); and
every output of the target cut in batch and length, or in batch alone for [B] ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._native import C
from .._tree import flatten
from ..errors import GraphCaptureError
from ..graphs.bucketed import NativeLaunch
from ..graphs.buckets import CUT_BATCH, CUT_BOTH, batch_shape, signature
from ..lanes._future import Future
from ..lanes.lane import Lane

Op, Kind = C.StreamOp, C.StreamOpKind  # csrc/core/stream_program.h lists both


def copy_padded_ops(ops: list, dst: torch.Tensor, src: int, src_pitch: int, b: int, t: int) -> None:
    """Appends the ops that write a [b, t, ...] source (or a [b] one) at address `src`,
    rows `src_pitch` bytes apart, into the top-left corner of the contiguous `dst`, and
    zeros everywhere else: copy_padded with a pad value of 0 (pydflash/graphs/buckets.py)."""
    base, size = dst.data_ptr(), dst.element_size()
    if dst.dim() >= 2:
        rows, length = dst.shape[0], dst.shape[1]
        inner = math.prod(dst.shape[2:]) * size
        row, width = length * inner, t * inner
        ops.append(
            Op(Kind.COPY, dst=base, dpitch=row, src=src, spitch=src_pitch, width=width, height=b)
        )
        if t < length:
            ops.append(Op(Kind.FILL, dst=base + width, dpitch=row, width=row - width, height=b))
    else:
        rows, row = dst.shape[0], size
        n = b * size
        ops.append(Op(Kind.COPY, dst=base, dpitch=n, src=src, spitch=n, width=n, height=1))
    if b < rows:
        rest = (rows - b) * row
        ops.append(Op(Kind.FILL, dst=base + b * row, dpitch=rest, width=rest, height=1))


def row_pitch(x: torch.Tensor) -> int:
    """Bytes between the rows of a contiguous [B, T, ...] (or [B]) tensor."""
    return (x.stride(0) if x.dim() >= 2 else 1) * x.element_size()


class NativeMicrobatches:
    """Submits a pipeline's microbatches as stream programs where they qualify (see the
    module's note). Used by `Pipeline` on its driving thread."""

    def __init__(
        self,
        targets: Sequence[Any],
        drafter: Any,
        drafter_lanes: Sequence[Lane],
        depth: int,
    ) -> None:
        self._targets = targets
        self._drafter = drafter
        self._slots = depth + 1  # flight events per drafter lane: a flight's is free once it left
        self._events: dict[Lane, list[torch.cuda.Event]] = {}
        self._drafter_lanes = drafter_lanes
        self._handles_ok = True
        self.submitted = 0  # microbatches submitted as programs

    @classmethod
    def of(
        cls,
        targets: Sequence[Any],
        target_lanes: Sequence[Lane],
        drafter: Any,
        drafter_lanes: Sequence[Lane],
        depth: int,
    ) -> NativeMicrobatches | None:
        """The helper for these stages, or None when no microbatch could qualify."""
        if not getattr(drafter, "launches_natively", False):
            return None
        if not all(lane.is_gpu for lane in (*target_lanes, *drafter_lanes)):
            return None
        usable = [getattr(t, "launches_natively", False) for t in targets]
        if not any(usable):
            return None
        return cls(
            [t if ok else None for t, ok in zip(targets, usable, strict=True)],
            drafter,
            drafter_lanes,
            depth,
        )

    def start_run(self, target_lanes: Sequence[Lane]) -> None:
        """A run starts with no previous drafter future per replica, while a stopped run's
        last drafter graphs may still read the static inputs the first programs write:
        every target stream waits for the drafter streams' work issued so far."""
        for d_lane in self._drafter_lanes:
            issued = torch.cuda.Event()
            issued.record(d_lane.stream)
            for t_lane in target_lanes:
                if t_lane.device_index == d_lane.device_index:
                    t_lane.stream.wait_event(issued)

    def submit(
        self,
        k: int,
        t_index: int,
        t_lane: Lane,
        replica: int,
        batch: Any,
        previous: Future | None,
    ) -> tuple[Future, Future, torch.cuda.Event, tuple] | None:
        """(target future, drafter future, flight event, held) of microbatch k submitted
        as stream programs, or None: it does not qualify, and nothing was submitted.
        `previous` is the replica's last drafter future, whose GPU work read the drafter's
        static inputs last. The drafter future's result is the loss, a device tensor.
        `held` is what the programs read (the batch, both graphs' entries): the caller
        keeps it until the event has passed, so the workers never take the GIL for it."""
        stage, d_lane = self._targets[t_index], self._drafter_lanes[replica]
        if stage is None or not self._handles_ok or t_lane.device_index != d_lane.device_index:
            return None
        leaves, spec = flatten(batch)
        if not all(_on(x, t_lane.device_index) for x in leaves if isinstance(x, torch.Tensor)):
            return None
        try:
            b, t = batch_shape(leaves)
        except ValueError:
            return None  # the Python path reports it
        try:
            t_launch = stage.native_launch(t_lane, b, t, spec, signature(leaves))
            if t_launch is None or not all(
                _cut_in_place(x, kind)
                for x, kind in zip(t_launch.outputs, t_launch.out_cuts, strict=True)
            ):
                return None
            d_launch = self._drafter.native_launch(
                d_lane, b, t, t_launch.out_spec, t_launch.out_signature
            )
        except GraphCaptureError:
            self._handles_ok = False  # a torch without raw graph handles: never again
            return None
        if d_launch is None:
            return None

        ops: list[Op] = []
        _copy_in(ops, t_launch.inputs, leaves, b, t)
        ops.append(Op(Kind.GRAPH, src=t_launch.exec_handle))
        ops.append(Op(Kind.WAIT_INPUT))
        _copy_in(ops, d_launch.inputs, t_launch.outputs, b, t)
        (static_loss,) = d_launch.outputs
        loss = torch.empty_like(static_loss)
        loss.record_stream(d_lane.stream)
        event = self._event(d_lane, k)
        d_ops = [Op(Kind.WAIT_INPUT)]
        _fill_lengths(d_ops, d_launch, b, t)
        nbytes = loss.nbytes
        d_ops += [
            Op(Kind.GRAPH, src=d_launch.exec_handle),
            Op(
                Kind.COPY,
                dst=loss.data_ptr(),
                dpitch=nbytes,
                src=static_loss.data_ptr(),
                spitch=nbytes,
                width=nbytes,
                height=1,
            ),
            Op(Kind.RECORD, dst=event.cuda_event),
        ]
        target = t_lane.submit_program(ops, after=previous)
        try:
            drafter = d_lane.submit_program(d_ops, after=target)
        except BaseException:
            target.cancel()
            raise
        drafter.replace_result(loss)
        t_launch.count()
        d_launch.count()
        self.submitted += 1
        return target, drafter, event, (leaves, t_launch.keep, d_launch.keep)

    def _event(self, lane: Lane, k: int) -> torch.cuda.Event:
        """Flight k's event on `lane`: blocking, so the window's wait for it sleeps."""
        events = self._events.get(lane)
        if events is None:
            events = []
            for _ in range(self._slots):
                event = torch.cuda.Event(blocking=True)
                event.record(lane.stream)  # made now, so its handle exists
                events.append(event)
            self._events[lane] = events
        return events[k % self._slots]


def _on(x: torch.Tensor, device: int) -> bool:
    """Whether a copy from `x` may be issued by address: contiguous, and on `device` or
    in pinned host memory."""
    if not x.is_contiguous():
        return False
    if x.is_cuda:
        return x.device.index == device
    return x.is_pinned()


def _cut_in_place(x: Any, kind: int) -> bool:
    """Whether an output's real part is rows of a contiguous tensor: cut in batch and
    length ([B, T, ...]) or in batch ([B])."""
    if not isinstance(x, torch.Tensor):
        return True
    if not x.is_contiguous():
        return False
    return (kind == CUT_BOTH and x.dim() >= 2) or (kind == CUT_BATCH and x.dim() == 1)


def _copy_in(ops: list, buffers: list[Any], sources: list[Any], b: int, t: int) -> None:
    """The ops that copy each tensor of `sources` into its static buffer, padding
    zero-filled."""
    for buffer, x in zip(buffers, sources, strict=True):
        if isinstance(x, torch.Tensor):
            copy_padded_ops(ops, buffer, x.data_ptr(), row_pitch(x), b, t)


def _fill_lengths(ops: list, launch: NativeLaunch, b: int, t: int) -> None:
    """The ops that write the real lengths (Note [Padding contract]): t for b rows, 0 after."""
    lengths = launch.lengths
    if lengths is None:
        return
    ops.append(Op(Kind.FILL_I64, dst=lengths.data_ptr(), width=b, value=t))
    if b < lengths.shape[0]:
        pad = lengths.shape[0] - b
        ops.append(Op(Kind.FILL_I64, dst=lengths.data_ptr() + 8 * b, width=pad, value=0))
