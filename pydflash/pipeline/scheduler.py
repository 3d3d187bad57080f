"""Online drafter training over lanes: a frozen target model's forward on target lanes,
its hidden states handed to drafter lanes, where a drafter trains on them.

    pipe = Pipeline(dispatcher.lanes[:1], dispatcher.lanes[1:], target=target_forward,
                    drafter=drafter, loss=drafter_loss, optimizer=opt, accumulate=4)
    for step in pipe.run(batches, steps=100):
        print(step.step, step.loss())

Note [Pipeline order]: microbatch k of step s runs its target on target lane
k % len(target_lanes) and trains replica r = (k % accumulate) % len(drafter_lanes) on
drafter lane r. A drafter task waits on the host for its target future (whose Python
returns once the target's kernels are queued), hands the result over (Note
[Hidden-state handoff] in handoff.py), runs `loss(drafter, inputs)` and the backward of
`loss / accumulate`. After a step's last microbatch every drafter lane gets a step task
(with several replicas, lane 0 first sums the replicas' gradients). A lane runs its
tasks in order, so a replica's microbatches, the reduction and the optimizer step never
reorder; cross-lane waits are only on futures submitted earlier, so they cannot form a
cycle. At most `depth` microbatches are between target submit and drafter completion:
that bounds the hidden states alive, and lets the target run ahead of the drafter by
up to depth - 1 microbatches. On GPU lanes "completion" means the drafter's kernels have
run, not just been queued: the caching allocator hands out memory when work is queued,
so a host running ahead of the GPU would hold more than `depth` microbatches. Once both
stages replay graphs for a microbatch's bucket, its two tasks are stream programs instead,
in the same order and issued without Python on the workers (Note [Native microbatch] in
pydflash/pipeline/native_microbatch.py).

Determinism: with one drafter replica the drafter sees the same operations in the same
order as a plain loop, so CPU losses match it exactly. Stages must not draw from torch's
global RNG (the order of draws across threads differs from a loop); put randomness in
the data. With R > 1 replicas the step's gradient is g_0 + ... + g_(R-1) of the replicas'
sums: bit-identical to a loop when accumulate == R, equal up to summation order otherwise.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from .._checks import counted, lanes_of, per_lane
from ..errors import PipelineError
from ..lanes._future import Future
from ..lanes._torch_state import match_intra_op_threads
from ..lanes.handoff import hand_to_lane, peer_access, tensors
from ..lanes.lane import Lane
from ._failures import Outstanding, failure_of, input_of, stage_error
from ._flight import Flight, FlightWindow, HiddenBytes, StepTasks
from .native_microbatch import NativeMicrobatches
from .stages import DrafterStage, EagerDrafter, EagerTarget, TargetStage
from .step_result import StepResult


# --- the pipeline -------------------------------------------------------------------------
class Pipeline:
    """Target forward on `target_lanes`, drafter forward and backward on `drafter_lanes`,
    an optimizer step every `accumulate` microbatches. See Note [Pipeline order].

    Args:
        target_lanes: the lanes that run the target.
        drafter_lanes: the lanes that train the drafter, one replica each.
        target: a callable fn(batch) -> inputs of the drafter's loss, or a TargetStage;
            one for all target lanes or one per lane. It runs under torch.no_grad().
        drafter: the trained module, one per drafter lane (replicas start identical and
            stay so: each step applies the replicas' summed gradient). A
            DistributedDataParallel module all-reduces gradients across processes on each
            step's last microbatch (one drafter lane per process then). Or a DrafterStage
            (pydflash.DrafterGraphs) over `drafter_lanes` with the same `accumulate`: it
            holds loss, optimizer, clip_grad_norm and scheduler, left out here.
        loss: loss(drafter, inputs) -> scalar tensor, run on the drafter lane; `inputs`
            is the target's result on the drafter's device.
        optimizer: one per drafter, over that drafter's parameters.
        accumulate: microbatches per optimizer step; a multiple of the drafter lanes.
        depth: microbatches in flight at once (target submitted, drafter not done);
            bounds the hidden states held.
        clip_grad_norm: clip the step's gradient to this total norm first.
        scheduler: one per drafter, or None; stepped after each optimizer step.
    """

    def __init__(
        self,
        target_lanes: Sequence[Lane],
        drafter_lanes: Sequence[Lane],
        *,
        target: Callable[[Any], Any] | TargetStage | Sequence[Any],
        drafter: torch.nn.Module | Sequence[torch.nn.Module] | DrafterStage,
        loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        accumulate: int = 1,
        depth: int = 2,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
    ) -> None:
        self._target_lanes = lanes_of(target_lanes, "target_lanes")
        self._drafter_lanes = lanes_of(drafter_lanes, "drafter_lanes")
        if len(set(map(id, self._drafter_lanes))) != len(self._drafter_lanes):
            raise ValueError("expected distinct drafter lanes, got one lane twice")
        n_targets, n_drafters = len(self._target_lanes), len(self._drafter_lanes)
        self._targets = [
            t if isinstance(t, TargetStage) else EagerTarget(t)
            for t in per_lane(target, n_targets, "target", "a callable or TargetStage", _is_target)
        ]
        for stage, lane in zip(self._targets, self._target_lanes, strict=True):
            stage.check_lane(lane)
        self.accumulate = counted(accumulate, "accumulate")
        self.depth = counted(depth, "depth")
        if isinstance(drafter, DrafterStage):
            given = dict(loss=loss, optimizer=optimizer, scheduler=scheduler)
            drafter.check_pipeline(self._drafter_lanes, self.accumulate, clip_grad_norm, **given)
            self._drafter = drafter
        else:
            self._drafter = EagerDrafter(
                self._drafter_lanes,
                drafter=drafter,
                loss=loss,
                optimizer=optimizer,
                accumulate=self.accumulate,
                clip_grad_norm=clip_grad_norm,
                scheduler=scheduler,
            )
        if self.accumulate % n_drafters:
            raise ValueError(
                f"expected accumulate to be a multiple of the {n_drafters} drafter lanes, "
                f"got {accumulate}"
            )
        self.clip_grad_norm = self._drafter.clip_grad_norm
        self._native = NativeMicrobatches.of(
            self._targets, self._target_lanes, self._drafter, self._drafter_lanes, self.depth
        )
        # Each replica's latest drafter future: a native target waits for it (Note
        # [Native microbatch] in pydflash/pipeline/native_microbatch.py).
        self._last_drafter: list[Future | None] = [None] * n_drafters

        self._cond = threading.Condition()
        self._threads = torch.get_num_threads()  # the driver's, set again at each run
        self._active = False
        self._outstanding = Outstanding()
        self._window = FlightWindow(self.depth)
        self._hidden = HiddenBytes()
        self._microbatches = 0  # trained (forward and backward done)
        self._steps = 0  # applied on every replica
        self._next_step = 0  # indices of the next step submitted and its first microbatch
        self._next_microbatch = 0

    # --- running ------------------------------------------------------------------------
    def run(self, batches: Iterable[Any], steps: int | None = None) -> Iterator[StepResult]:
        """Trains on `batches` (one microbatch each), yielding each optimizer step once it
        is applied, in order, until `steps` steps or the data end (a trailing partial step
        is not applied). A failure raises PipelineError after queued work is cancelled
        and running work has finished; the pipeline then refuses to run again. Leaving
        the loop early cancels queued work the same way, and the next run starts afresh."""
        if steps is not None:
            counted(steps, "steps")
        try:
            batch_iter = iter(batches)
        except TypeError:
            raise TypeError(
                f"expected an iterable of batches, got {type(batches).__name__}"
            ) from None
        self._check_usable()
        return self._drive(batch_iter, steps)

    def _check_usable(self) -> None:
        failure = self._outstanding.failure
        if failure is not None:
            raise PipelineError(
                "this pipeline stopped after a failure; build a new one", stage=failure.stage
            ) from failure

    def _drive(self, batches: Iterator[Any], steps: int | None) -> Iterator[StepResult]:
        with self._cond:
            self._check_usable()
            if self._active:
                raise PipelineError("this pipeline is already running")
            self._active = True
            self._window.clear()
            self._last_drafter = [None] * len(self._drafter_lanes)
        self._threads = torch.get_num_threads()
        finished = False
        pending: deque[tuple[StepResult, StepTasks]] = deque()
        if self._native is not None:
            self._native.start_run(self._target_lanes)
        try:
            for r, lane in enumerate(self._drafter_lanes):
                future = lane.submit(self._zero_grad_task, r)
                self._track(future, "optimizer", None, lane)
            submitted = 0
            while steps is None or submitted < steps:
                submitted_step = self._submit_step(batches)
                if submitted_step is None:
                    break
                submitted += 1
                pending.append(submitted_step)
                while pending and pending[0][1].ended:
                    yield self._applied(pending.popleft()[0])
            while pending:
                self._wait_until(lambda: pending[0][1].ended)
                yield self._applied(pending.popleft()[0])
            self._wait_until(lambda: not self._outstanding)
            finished = True
        finally:
            if not finished:
                self._stop()
            with self._cond:
                self._active = False

    # --- submits ------------------------------------------------------------------------
    def _submit_step(self, batches: Iterator[Any]) -> tuple[StepResult, StepTasks] | None:
        first = self._next_microbatch
        n_drafters = len(self._drafter_lanes)
        losses = []
        for i in range(self.accumulate):
            k = first + i
            try:
                batch = next(batches)
            except StopIteration:
                return None
            except Exception as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
                self._fail(stage_error("data", k, None, exc))
                self._raise_failure()
            last = i >= self.accumulate - n_drafters  # the replica's last of the step
            losses.append(self._submit_microbatch(k, i % n_drafters, batch, last))
        step = self._next_step
        self._next_microbatch += self.accumulate
        self._next_step += 1
        record = StepResult(step, range(first, first + self.accumulate), losses)
        step_futures = self._submit_optimizer_step(step, losses)
        tasks = StepTasks(len(step_futures))
        with self._cond:
            for future in step_futures:
                self._watch_step(future, tasks)
        return record, tasks

    def _submit_microbatch(self, k: int, replica: int, batch: Any, last: bool) -> Future:
        flight = self._enter_window(k)
        t_index = k % len(self._target_lanes)
        t_lane, d_lane = self._target_lanes[t_index], self._drafter_lanes[replica]
        if self._native is not None:
            drafter = self._submit_native(flight, t_index, t_lane, replica, batch)
            if drafter is not None:
                return drafter
        try:
            target = self._targets[t_index].submit(t_lane, batch)
        except BaseException as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
            self._cancel_flight()
            self._fail(stage_error("target", k, t_lane, exc))
            self._raise_failure()
        self._track(
            target,
            "target",
            k,
            t_lane,
            on_result=lambda f: self._hold(k, sum(t.nbytes for t in tensors(f.result()))),
        )
        try:
            drafter = d_lane.submit(
                self._drafter_task, flight, replica, target, self._targets[t_index], t_lane, last
            )
        except BaseException as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
            target.cancel()
            self._cancel_flight()
            self._fail(stage_error("drafter", k, d_lane, exc))
            self._raise_failure()
        flight.future = drafter
        self._last_drafter[replica] = drafter
        self._track(drafter, "drafter", k, d_lane, flight=flight)
        return drafter

    def _submit_native(
        self, flight: Flight, t_index: int, t_lane: Lane, replica: int, batch: Any
    ) -> Future | None:
        """Microbatch k as two stream programs, or None when it does not qualify (Note
        [Native microbatch]); it then holds no hidden states of its own."""
        k, d_lane = flight.k, self._drafter_lanes[replica]
        try:
            launched = self._native.submit(
                k, t_index, t_lane, replica, batch, self._last_drafter[replica]
            )
        except BaseException as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
            self._cancel_flight()
            self._fail(stage_error("target", k, t_lane, exc))
            self._raise_failure()
        if launched is None:
            return None
        target, drafter, event, held = launched
        with self._cond:
            flight.event, flight.held = event, held
            # No callback of its own: its worker would take the GIL for it. The drafter
            # program waits for it, so the drafter's callback ends it (Note [Native microbatch]).
            self._outstanding.add(target, cancellable=True)
        flight.future = drafter
        self._last_drafter[replica] = drafter
        self._track(drafter, "drafter", k, d_lane, flight=flight, upstream=(target, t_lane))
        return drafter

    def _enter_window(self, k: int) -> Flight:
        """Waits until microbatch k - depth has left the window, its GPU work included,
        and enters microbatch k."""
        with self._cond:
            oldest = self._window.oldest() if self._window.full else None
        if oldest is not None:
            self._wait_until(lambda: oldest.ended)
            with self._cond:
                self._window.leave_oldest()
            if oldest.event is not None:
                oldest.event.synchronize()  # releases the GIL; ends even after a failure
            oldest.held = None
        with self._cond:
            flight = self._window.enter(k)
            self._hidden.open(k)
            return flight

    def _cancel_flight(self) -> None:
        with self._cond:
            self._hidden.release(self._window.cancel_newest().k)
            self._cond.notify_all()

    def _submit_optimizer_step(self, step: int, microbatches: list[Future]) -> list[Future]:
        # Step tasks are never cancelled: each checks that its step's microbatches all
        # trained, so replicas apply a step together or not at all.
        lanes = self._drafter_lanes
        if len(lanes) == 1:
            future = lanes[0].submit(self._step_task, step, 0, None, microbatches)
            self._track(future, "optimizer", None, lanes[0], step=step, cancellable=False)
            return [future]
        reduced = lanes[0].submit(self._reduce_task, step, microbatches)
        self._track(reduced, "reduce", None, lanes[0], step=step, cancellable=False)
        futures = []
        for r, lane in enumerate(lanes):
            future = lane.submit(self._step_task, step, r, reduced, ())
            self._track(future, "optimizer", None, lane, step=step, cancellable=False)
            futures.append(future)
        return futures

    # --- the lane tasks: inputs in, then the drafter stage ------------------------------
    def _zero_grad_task(self, replica: int) -> None:
        self._drafter.zero_grad(replica)

    def _drafter_task(
        self,
        flight: Flight,
        replica: int,
        target: Future,
        stage: TargetStage,
        t_lane: Lane,
        all_reduce: bool,
    ) -> Any:
        k, lane = flight.k, self._drafter_lanes[replica]
        match_intra_op_threads(self._threads)
        produced = input_of(target)
        # A recycled result goes back to its stage once the drafter's GPU work is done.
        recycled = produced if stage.recycles and lane.is_gpu else None
        try:
            inputs, moved_bytes = hand_to_lane(produced, t_lane, target.event, lane)
        except BaseException as exc:
            raise stage_error("transfer", k, lane, exc) from exc
        finally:
            target.replace_result(None)  # the drafter holds what it needs; see depth
            del produced
        self._hold(k, moved_bytes)
        try:
            loss = self._drafter.train(replica, inputs, all_reduce=all_reduce)
            if lane.is_gpu:
                # Blocking: the driver's wait for it (_enter_window) sleeps, not spins.
                gpu_done = torch.cuda.Event(blocking=True)
                gpu_done.record(lane.stream)
                with self._cond:
                    flight.event = gpu_done
                if recycled is not None:
                    stage.release(recycled, gpu_done)
            return loss
        except BaseException as exc:
            raise stage_error("drafter", k, lane, exc) from exc

    def _reduce_task(self, step: int, microbatches: list[Future]) -> Any:
        for future in microbatches:
            input_of(future)
        match_intra_op_threads(self._threads)
        # Each replica's last microbatch of the step, in replica order.
        last = microbatches[-len(self._drafter_lanes) :]
        return self._drafter.reduce(step, [f.event for f in last])

    def _step_task(
        self, step: int, replica: int, reduced: Future | None, microbatches: Sequence[Future]
    ) -> None:
        for future in microbatches:
            input_of(future)
        match_intra_op_threads(self._threads)
        total = None if reduced is None else (input_of(reduced), reduced.event)
        self._drafter.step(step, replica, total)

    # --- bookkeeping --------------------------------------------------------------------
    def _track(
        self,
        future: Future,
        stage: str,
        k: int | None,
        lane: Lane,
        *,
        flight: Flight | None = None,
        step: int | None = None,
        cancellable: bool = True,
        on_result: Callable[[Future], None] | None = None,
        upstream: tuple[Future, Lane] | None = None,
    ) -> None:
        """Counts `future` outstanding until its done callback. `upstream`: a target
        future (and its lane) this one waited for, already outstanding, ended here too:
        first, so that its failure is the one reported."""
        with self._cond:
            self._outstanding.add(future, cancellable=cancellable)

        def done(f: Future) -> None:
            if upstream is not None:
                target, t_lane = upstream
                if target.done():
                    self._ended(target, "target", k, t_lane)
                else:  # cancelled before it waited for the target
                    target.add_done_callback(lambda t: self._ended(t, "target", k, t_lane))
            self._ended(f, stage, k, lane, flight=flight, step=step, on_result=on_result)

        future.add_done_callback(done)

    def _ended(
        self,
        f: Future,
        stage: str,
        k: int | None,
        lane: Lane,
        *,
        flight: Flight | None = None,
        step: int | None = None,
        on_result: Callable[[Future], None] | None = None,
    ) -> None:
        trained = not f.cancelled() and f.exception() is None
        if trained and on_result is not None:
            on_result(f)
        failure = failure_of(f, stage, k, lane, step=step)
        with self._cond:
            self._outstanding.ended(f)
            if failure is not None:
                self._outstanding.fail(failure)
            if flight is not None:
                flight.ended = True
                self._hidden.release(flight.k)
                self._microbatches += trained
            self._cond.notify_all()

    def _watch_step(self, future: Future, tasks: StepTasks) -> None:
        def done(f: Future) -> None:
            ok = not f.cancelled() and f.exception() is None
            with self._cond:
                self._steps += tasks.task_ended(ok)
                self._cond.notify_all()

        future.add_done_callback(done)

    def _applied(self, record: StepResult) -> StepResult:
        self._raise_failure()
        return record

    def _hold(self, k: int, nbytes: int) -> None:
        with self._cond:
            self._hidden.hold(k, nbytes)

    def _fail(self, error: PipelineError) -> None:
        with self._cond:
            self._outstanding.fail(error)
            self._cond.notify_all()

    def _raise_failure(self) -> None:
        failure = self._outstanding.failure
        if failure is not None:
            self._stop()
            raise failure

    def _wait_until(self, predicate: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._outstanding.failure is not None or predicate())
        self._raise_failure()

    def _stop(self) -> None:
        """Cancels queued microbatch work, newest first, and waits for the rest: what runs
        has inputs that are finished or cancelled, so it ends."""
        with self._cond:
            futures, cancellable = self._outstanding.to_stop()
        for future in cancellable:
            future.cancel()
        concurrent.futures.wait(futures)
        with self._cond:
            held = self._window.holds_buffers()
        if held:  # the GPU may still read what stream programs of those flights hold
            for device in {lane.device_index for lane in self._target_lanes}:
                torch.cuda.synchronize(device)
        with self._cond:
            self._window.clear()
            self._next_step = self._steps
            self._next_microbatch = self._steps * self.accumulate
            self._hidden.release_all()

    # --- introspection ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and the hidden-state bytes held: now, at the peak, and the most one
        microbatch held (its target result, plus its copy on another device).
        "native_microbatches": those submitted as stream programs (Note [Native
        microbatch] in pydflash/pipeline/native_microbatch.py), which hold none of their own."""
        with self._cond:
            return {
                "steps": self._steps,
                "microbatches": self._microbatches,
                "cancelled": self._outstanding.cancelled,
                "depth": self.depth,
                "accumulate": self.accumulate,
                "in_flight": self._window.in_flight(),
                "native_microbatches": 0 if self._native is None else self._native.submitted,
                **self._hidden.stats(),
                "target_lanes": [lane.label for lane in self._target_lanes],
                "drafter_lanes": [lane.label for lane in self._drafter_lanes],
                "peer_copy": peer_access(self._target_lanes, self._drafter_lanes),
            }

    def __repr__(self) -> str:
        return (
            f"<pydflash.Pipeline targets={len(self._target_lanes)} drafters="
            f"{len(self._drafter_lanes)} depth={self.depth} accumulate={self.accumulate}>"
        )


def _is_target(value: Any) -> bool:
    return isinstance(value, TargetStage) or (
        callable(value) and not isinstance(value, (list, tuple))
    )
