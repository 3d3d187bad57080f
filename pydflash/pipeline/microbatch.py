"""One microbatch's submission: its target task on a target lane and its drafter task on
a drafter lane, or both as stream programs (Note [Native microbatch] in
native_microbatch.py), each tracked until it ends (Note [Pipeline order] in scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..lanes._future import Future
from ..lanes._torch_state import match_intra_op_threads
from ..lanes.handoff import hand_to_lane, tensors
from ..lanes.lane import Lane
from ._failures import input_of, stage_error
from ._flight import Flight
from ._tracker import Task, Tracker
from .native_microbatch import NativeMicrobatches
from .stages import DrafterStage, TargetStage


@dataclass(frozen=True, slots=True)
class Microbatch:
    """Microbatch `flight.k`: its target stage and lane (the `target_index`th), and the
    drafter replica that trains on it; `last`: the replica's last microbatch of the step
    (its backward all-reduces under DistributedDataParallel)."""

    flight: Flight
    target_index: int
    target: TargetStage
    target_lane: Lane
    replica: int
    drafter_lane: Lane
    last: bool

    @property
    def k(self) -> int:
        return self.flight.k


class MicrobatchSubmitter:
    """Submits microbatches for a pipeline: natively when both stages can (`native`),
    else a target task and a drafter task that waits for it. A submit that fails raises
    the stage's PipelineError after the microbatch left the window."""

    def __init__(
        self,
        tracker: Tracker,
        drafter: DrafterStage,
        native: NativeMicrobatches | None,
    ) -> None:
        self._tracker = tracker
        self._drafter = drafter
        self.native = native  # None: every microbatch takes the Python path
        self.threads = torch.get_num_threads()

    @property
    def native_submitted(self) -> int:
        return 0 if self.native is None else self.native.submitted

    def start_run(self, threads: int, target_lanes: Sequence[Lane]) -> None:
        """A run starts; its lane tasks use `threads` intra-op threads, the driver's."""
        self.threads = threads
        if self.native is not None:
            self.native.start_run(target_lanes)

    def submit(self, mb: Microbatch, batch: Any) -> Future:
        """The drafter future of microbatch `mb`, whose result is its loss."""
        if self.native is not None:
            drafter = self._submit_native(mb, batch)
            if drafter is not None:
                return drafter
        k, t_lane, d_lane = mb.k, mb.target_lane, mb.drafter_lane
        try:
            target = mb.target.submit(t_lane, batch)
        except BaseException as exc:
            self._tracker.cancel_newest()
            raise stage_error("target", k, t_lane, exc) from exc
        self._tracker.track(
            target,
            Task("target", t_lane, k),
            on_result=lambda f: self._tracker.hold(k, sum(t.nbytes for t in tensors(f.result()))),
        )
        try:
            drafter = d_lane.submit(self._drafter_task, mb, target)
        except BaseException as exc:
            target.cancel()
            self._tracker.cancel_newest()
            raise stage_error("drafter", k, d_lane, exc) from exc
        self._submitted(mb, drafter)
        return drafter

    def _submit_native(self, mb: Microbatch, batch: Any) -> Future | None:
        """Microbatch k as two stream programs, or None when it does not qualify (Note
        [Native microbatch]); it then holds no hidden states of its own."""
        try:
            launched = self.native.submit(
                mb.k,
                mb.target_index,
                mb.target_lane,
                mb.replica,
                batch,
                self._tracker.last_drafter(mb.replica),
            )
        except BaseException as exc:
            self._tracker.cancel_newest()
            raise stage_error("target", mb.k, mb.target_lane, exc) from exc
        if launched is None:
            return None
        target, drafter, event, held = launched
        self._tracker.set_event(mb.flight, event, held)
        # The target program gets no callback of its own: its worker would take the GIL
        # for it. The drafter program waits for it, so the drafter's callback ends it.
        self._submitted(mb, drafter, upstream=(target, Task("target", mb.target_lane, mb.k)))
        return drafter

    def _submitted(
        self, mb: Microbatch, drafter: Future, upstream: tuple[Future, Task] | None = None
    ) -> None:
        self._tracker.drafter_submitted(mb.replica, drafter)
        task = Task("drafter", mb.drafter_lane, mb.k, flight=mb.flight)
        self._tracker.track(drafter, task, upstream=upstream)

    # --- the drafter lane's task ------------------------------------------------------------
    def _drafter_task(self, mb: Microbatch, target: Future) -> Any:
        k, lane = mb.k, mb.drafter_lane
        match_intra_op_threads(self.threads)
        produced = input_of(target)
        # A recycled result goes back to its stage once the drafter's GPU work is done.
        recycled = produced if mb.target.recycles and lane.is_gpu else None
        try:
            inputs, moved_bytes = hand_to_lane(produced, mb.target_lane, target.event, lane)
        except BaseException as exc:
            raise stage_error("transfer", k, lane, exc) from exc
        finally:
            target.replace_result(None)  # the drafter holds what it needs; see depth
            del produced
        self._tracker.hold(k, moved_bytes)
        try:
            loss = self._drafter.train(mb.replica, inputs, all_reduce=mb.last)
            if lane.is_gpu:
                # Blocking: the driver's wait for it (Pipeline._enter_window) sleeps.
                gpu_done = torch.cuda.Event(blocking=True)
                gpu_done.record(lane.stream)
                self._tracker.set_event(mb.flight, gpu_done)
                if recycled is not None:
                    mb.target.release(recycled, gpu_done)
            return loss
        except BaseException as exc:
            raise stage_error("drafter", k, lane, exc) from exc
