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
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from .._checks import counted, per_lane
from ..errors import PipelineError
from ..lanes._future import Future
from ..lanes._torch_state import match_intra_op_threads
from ..lanes.handoff import peer_access
from ..lanes.lane import Lane, lanes_of
from ._failures import input_of, stage_error
from ._flight import Flight, StepTasks
from ._tracker import Task, Tracker
from .microbatch import Microbatch, MicrobatchSubmitter
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
        # The loss is divided by it as a torch int64 scalar: larger is an OverflowError there.
        self.accumulate = counted(accumulate, "accumulate", maximum=2**63 - 1)
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
        # What the driver, the lane tasks and their done-callbacks share, under one
        # condition (the comment at Tracker._cond says what it guards).
        self._tracker = Tracker(self.depth, n_drafters)
        native = NativeMicrobatches.of(
            self._targets, self._target_lanes, self._drafter, self._drafter_lanes, self.depth
        )
        self._submitter = MicrobatchSubmitter(self._tracker, self._drafter, native)
        # The driver's alone (the thread iterating run()); lane tasks read _threads only
        # after the submit that follows its write.
        self._threads = torch.get_num_threads()  # the driver's, set again at each run
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
        self._tracker.check_usable()
        return self._drive(batch_iter, steps)

    def _drive(self, batches: Iterator[Any], steps: int | None) -> Iterator[StepResult]:
        self._tracker.start_run()
        self._threads = torch.get_num_threads()
        self._submitter.start_run(self._threads, self._target_lanes)
        finished = False
        pending: deque[tuple[StepResult, StepTasks]] = deque()
        try:
            for r, lane in enumerate(self._drafter_lanes):
                self._tracker.track(lane.submit(self._zero_grad_task, r), Task("optimizer", lane))
            submitted = 0
            while steps is None or submitted < steps:
                submitted_step = self._submit_step(batches)
                if submitted_step is None:
                    break
                submitted += 1
                pending.append(submitted_step)
                while pending and self._tracker.step_ended(pending[0][1]):
                    yield self._applied(pending.popleft()[0])
            while pending:
                self._tracker.wait_step(pending[0][1])
                yield self._applied(pending.popleft()[0])
            self._tracker.wait_idle()
            self._raise_failure()
            finished = True
        finally:
            if not finished:
                self._stop()
            self._tracker.end_run()

    # --- submits ------------------------------------------------------------------------
    def _submit_step(self, batches: Iterator[Any]) -> tuple[StepResult, StepTasks] | None:
        first = self._next_microbatch
        losses = []
        for i in range(self.accumulate):
            try:
                batch = next(batches)
            except StopIteration:
                return None
            except Exception as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
                self._fail(stage_error("data", first + i, None, exc))
            losses.append(self._submit_microbatch(first + i, i, batch))
        step = self._next_step
        self._next_microbatch += self.accumulate
        self._next_step += 1
        record = StepResult(step, range(first, first + self.accumulate), losses)
        tasks = self._tracker.watch_step(self._submit_optimizer_step(step, losses))
        return record, tasks

    def _submit_microbatch(self, k: int, i: int, batch: Any) -> Future:
        """Microbatch k, the step's i-th (Note [Pipeline order])."""
        n_drafters = len(self._drafter_lanes)
        flight = self._enter_window(k)
        t_index, replica = k % len(self._target_lanes), i % n_drafters
        microbatch = Microbatch(
            flight,
            t_index,
            self._targets[t_index],
            self._target_lanes[t_index],
            replica,
            self._drafter_lanes[replica],
            last=i >= self.accumulate - n_drafters,
        )
        try:
            return self._submitter.submit(microbatch, batch)
        except PipelineError as error:
            self._fail(error)

    def _enter_window(self, k: int) -> Flight:
        """Waits until microbatch k - depth has left the window, its GPU work included,
        and enters microbatch k."""
        oldest = self._tracker.oldest_to_leave()
        if oldest is not None:
            self._tracker.wait_ended(oldest)
            self._raise_failure()
            self._tracker.leave_oldest()
            # It left: only this thread touches it now.
            if oldest.event is not None:
                oldest.event.synchronize()  # releases the GIL; ends even after a failure
            oldest.held = None
        return self._tracker.enter(k)

    def _submit_optimizer_step(self, step: int, microbatches: list[Future]) -> list[Future]:
        # Step tasks are never cancelled: each checks that its step's microbatches all
        # trained, so replicas apply a step together or not at all.
        lanes = self._drafter_lanes
        if len(lanes) == 1:
            future = lanes[0].submit(self._step_task, step, 0, None, microbatches)
            self._tracker.track(future, Task("optimizer", lanes[0], step=step, cancellable=False))
            return [future]
        reduced = lanes[0].submit(self._reduce_task, step, microbatches)
        self._tracker.track(reduced, Task("reduce", lanes[0], step=step, cancellable=False))
        futures = []
        for r, lane in enumerate(lanes):
            future = lane.submit(self._step_task, step, r, reduced, ())
            self._tracker.track(future, Task("optimizer", lane, step=step, cancellable=False))
            futures.append(future)
        return futures

    # --- the optimizer's lane tasks (the drafter's: MicrobatchSubmitter) -------------------
    def _zero_grad_task(self, replica: int) -> None:
        self._drafter.zero_grad(replica)

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

    # --- failures and stopping ----------------------------------------------------------
    def _applied(self, record: StepResult) -> StepResult:
        self._raise_failure()
        return record

    def _fail(self, error: PipelineError) -> NoReturn:
        """Stops on `error`, or on an earlier failure if one came first, and raises it."""
        self._tracker.fail(error)
        self._raise_failure()
        raise AssertionError("unreachable: a failure was just recorded")

    def _raise_failure(self) -> None:
        failure = self._tracker.failure
        if failure is not None:
            self._stop()
            raise failure

    def _stop(self) -> None:
        """Cancels queued microbatch work, newest first, and waits for the rest: what runs
        has inputs that are finished or cancelled, so it ends."""
        futures, cancellable = self._tracker.to_stop()
        for future in cancellable:
            future.cancel()
        concurrent.futures.wait(futures)
        if self._tracker.holds_buffers():  # the GPU may still read what stream programs hold
            for device in {lane.device_index for lane in self._target_lanes}:
                torch.cuda.synchronize(device)
        self._next_step = self._tracker.stopped()
        self._next_microbatch = self._next_step * self.accumulate

    # --- introspection ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and the hidden-state bytes held: now, at the peak, and the most one
        microbatch held (its target result, plus its copy on another device).
        "native_microbatches": those submitted as stream programs (Note [Native
        microbatch] in pydflash/pipeline/native_microbatch.py), which hold none of their own."""
        return {
            **self._tracker.stats(),
            "depth": self.depth,
            "accumulate": self.accumulate,
            "native_microbatches": self._submitter.native_submitted,
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
