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
so a host running ahead of the GPU would hold more than `depth` microbatches.

Determinism: with one drafter replica the drafter sees the same operations in the same
order as a plain loop, so CPU losses match it exactly. Stages must not draw from torch's
global RNG (the order of draws across threads differs from a loop); put randomness in
the data. With R > 1 replicas the step's gradient is g_0 + ... + g_(R-1) of the replicas'
sums: bit-identical to a loop when accumulate == R, equal up to summation order otherwise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._checks import counted
from ._future import Future
from ._torch_state import match_intra_op_threads
from .errors import PipelineError
from .handoff import hand_to_lane, tensors
from .lane import Lane
from .stages import EagerTarget, TargetStage

STAGES = ("data", "target", "transfer", "drafter", "reduce", "optimizer")


# --- results ------------------------------------------------------------------------------
@dataclass
class StepResult:
    """One optimizer step: its index (counted over the pipeline's life) and microbatches.
    `losses()` and `loss()` wait for the values (a host sync on GPU lanes)."""

    step: int
    microbatches: range
    _drafter_futures: list[Future] = field(default_factory=list, repr=False)
    _step_futures: list[Future] = field(default_factory=list, repr=False)
    _pending: int = field(default=0, repr=False)
    _failed: bool = field(default=False, repr=False)

    def losses(self) -> list[float]:
        """Each microbatch's loss (before the 1/accumulate scaling), in microbatch order."""
        losses = []
        for future in self._drafter_futures:
            loss = future.result()
            if future.event:
                # The read below runs on this thread's stream of the loss's device.
                future.wait_stream(torch.cuda.current_stream(loss.device))
            losses.append(float(loss))
        return losses

    def loss(self) -> float:
        """The mean microbatch loss of the step."""
        losses = self.losses()
        return sum(losses) / len(losses)


class _Upstream(Exception):
    """A task's input failed or was cancelled; the failure is reported by its own stage."""


class _HiddenBytes:
    """The bytes of hidden states a pipeline holds: each microbatch's target result from
    when it is produced, plus its copy on another device, until the microbatch leaves.

    Invariant: `held` is the sum of the microbatches' entries, `peak` the most `held`
    has been, and `per_microbatch` the most one entry has been. A microbatch that left
    before its target finished is closed: its target's bytes, should they arrive, are
    not counted, as no drafter takes them. Not locked: the pipeline calls it under its
    own condition."""

    def __init__(self) -> None:
        self._by_microbatch: dict[int, int] = {}
        self._closed: set[int] = set()
        self._held = 0
        self._peak = 0
        self._per_microbatch = 0

    def hold(self, k: int, nbytes: int) -> None:
        """Counts `nbytes` more for microbatch k, unless it is closed."""
        if nbytes == 0 or k in self._closed:
            return
        held = self._by_microbatch.get(k, 0) + nbytes
        self._by_microbatch[k] = held
        self._per_microbatch = max(self._per_microbatch, held)
        self._held += nbytes
        self._peak = max(self._peak, self._held)

    def release(self, k: int, *, target_may_follow: bool) -> None:
        """Microbatch k left; with target_may_follow (its drafter did not take the
        target's result), it is closed."""
        if target_may_follow:
            self._closed.add(k)
        self._held -= self._by_microbatch.pop(k, 0)

    def release_all(self) -> None:
        """Every microbatch left (the pipeline stopped); all are closed."""
        for k in list(self._by_microbatch):
            self.release(k, target_may_follow=True)

    def new_run(self) -> None:
        """A run starts: microbatch indices after a stop repeat earlier ones, so none is
        closed any more."""
        self._closed.clear()

    def stats(self) -> dict[str, int]:
        return {
            "hidden_bytes_held": self._held,
            "hidden_bytes_peak": self._peak,
            "hidden_bytes_per_microbatch": self._per_microbatch,
        }


# --- the pipeline -------------------------------------------------------------------------
class Pipeline:
    """Target forward on `target_lanes`, drafter forward and backward on `drafter_lanes`,
    an optimizer step every `accumulate` microbatches. See Note [Pipeline order].

    target: a callable fn(batch) -> inputs of the drafter's loss, or a TargetStage; one
        for all target lanes or one per lane. It runs under torch.no_grad().
    drafter: the trained module, one per drafter lane (replicas start identical and stay
        so: each step applies the replicas' summed gradient). A DistributedDataParallel
        module syncs gradients across processes on each step's last microbatch (one
        drafter lane per process then).
    loss: loss(drafter, inputs) -> scalar tensor, run on the drafter lane; `inputs` is the
        target's result on the drafter's device.
    optimizer / scheduler: one per drafter, over that drafter's parameters.
    depth: microbatches in flight at once (target submitted, drafter not done); bounds
        the hidden states held.
    clip_grad_norm: clip the step's gradient to this total norm first.
    """

    def __init__(
        self,
        target_lanes: Sequence[Lane],
        drafter_lanes: Sequence[Lane],
        *,
        target: Callable[[Any], Any] | TargetStage | Sequence[Any],
        drafter: torch.nn.Module | Sequence[torch.nn.Module],
        loss: Callable[[torch.nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        accumulate: int = 1,
        depth: int = 2,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
    ) -> None:
        self._target_lanes = _lanes(target_lanes, "target_lanes")
        self._drafter_lanes = _lanes(drafter_lanes, "drafter_lanes")
        if len(set(map(id, self._drafter_lanes))) != len(self._drafter_lanes):
            raise ValueError("expected distinct drafter lanes, got one lane twice")
        n_targets, n_drafters = len(self._target_lanes), len(self._drafter_lanes)
        self._targets = [
            t if isinstance(t, TargetStage) else EagerTarget(t)
            for t in _per_lane(target, n_targets, "target", "a callable or TargetStage", _is_target)
        ]
        for stage, lane in zip(self._targets, self._target_lanes, strict=True):
            stage.check_lane(lane)

        def per_drafter(value: Any, name: str, kind: str, accepts: Callable[[Any], bool]) -> list:
            return _per_lane(value, n_drafters, name, kind, accepts, one_each="drafter lane")

        self._drafters = per_drafter(drafter, "drafter", "a torch.nn.Module", _is_module)
        self._optimizers = per_drafter(
            optimizer, "optimizer", "a torch.optim.Optimizer", _is_optimizer
        )
        self._schedulers = (
            None
            if scheduler is None
            else per_drafter(scheduler, "scheduler", "an object with step()", _has_step)
        )
        if not callable(loss):
            raise TypeError(f"expected a callable loss(drafter, inputs), got {type(loss).__name__}")
        self._loss = loss
        self.accumulate = counted(accumulate, "accumulate")
        self.depth = counted(depth, "depth")
        if self.accumulate % n_drafters:
            raise ValueError(
                f"expected accumulate to be a multiple of the {n_drafters} drafter lanes, "
                f"got {accumulate}"
            )
        if clip_grad_norm is not None and not (
            isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0
        ):
            raise ValueError(f"expected clip_grad_norm > 0 or None, got {clip_grad_norm!r}")
        self.clip_grad_norm = clip_grad_norm
        self._ddp = [
            isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in self._drafters
        ]
        if any(self._ddp) and n_drafters > 1:
            raise ValueError(
                "expected one drafter lane per process with DistributedDataParallel, "
                f"got {n_drafters}"
            )
        self._params = [[p for p in m.parameters() if p.requires_grad] for m in self._drafters]
        self._check_drafters()

        self._cond = threading.Condition()
        self._threads = torch.get_num_threads()  # the driver's, set again at each run
        self._active = False
        self._failure: PipelineError | None = None
        self._outstanding: dict[Future, tuple[int, bool]] = {}  # -> (order, cancellable)
        self._submitted = 0
        self._in_flight = 0
        self._run_start = 0  # first microbatch of the current run
        self._settled: set[int] = set()  # microbatches whose drafter task has ended
        self._gpu_done: dict[int, Any] = {}  # microbatch -> event after its drafter's kernels
        self._hidden = _HiddenBytes()
        self._microbatches = 0  # trained (forward and backward done)
        self._cancelled = 0  # tasks cancelled by a failure or an early exit
        self._steps = 0  # applied on every replica
        self._next_step = 0  # indices of the next step submitted and its first microbatch
        self._next_microbatch = 0

    # --- checks -----------------------------------------------------------------------
    def _check_drafters(self) -> None:
        shapes = [tuple(p.shape for p in params) for params in self._params]
        for r, (module, lane) in enumerate(zip(self._drafters, self._drafter_lanes, strict=True)):
            if shapes[r] != shapes[0]:
                raise ValueError(
                    f"expected drafter replicas of one shape, drafter {r} differs from 0"
                )
            expected = torch.device(lane.device)
            for p in module.parameters():
                if p.device != expected:
                    raise ValueError(
                        f"expected drafter {r}'s parameters on {expected} (its lane's device), "
                        f"got one on {p.device}"
                    )
            owned = {id(p) for p in module.parameters()}
            for group in self._optimizers[r].param_groups:
                if any(id(p) not in owned for p in group["params"]):
                    raise ValueError(
                        f"expected optimizer {r} over drafter {r}'s parameters, got others"
                    )

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
        if self._failure is not None:
            raise PipelineError(
                "this pipeline stopped after a failure; build a new one", stage=self._failure.stage
            ) from self._failure

    def _drive(self, batches: Iterator[Any], steps: int | None) -> Iterator[StepResult]:
        with self._cond:
            self._check_usable()
            if self._active:
                raise PipelineError("this pipeline is already running")
            self._active = True
            self._hidden.new_run()
            self._settled.clear()
            self._gpu_done.clear()
            self._run_start = self._next_microbatch
        self._threads = torch.get_num_threads()
        finished = False
        pending: deque[StepResult] = deque()
        try:
            for r, lane in enumerate(self._drafter_lanes):
                self._track(lane.submit(self._zero_grad_task, r), "optimizer", None, lane)
            submitted = 0
            while steps is None or submitted < steps:
                record = self._submit_step(batches)
                if record is None:
                    break
                submitted += 1
                pending.append(record)
                while pending and pending[0]._pending == 0:
                    yield self._applied(pending.popleft())
            while pending:
                self._wait_until(lambda: pending[0]._pending == 0)
                yield self._applied(pending.popleft())
            self._wait_until(lambda: not self._outstanding)
            finished = True
        finally:
            if not finished:
                self._stop()
            with self._cond:
                self._active = False

    def _submit_step(self, batches: Iterator[Any]) -> StepResult | None:
        first = self._next_microbatch
        record = StepResult(self._next_step, range(first, first + self.accumulate))
        n_drafters = len(self._drafter_lanes)
        for i in range(self.accumulate):
            k = first + i
            try:
                batch = next(batches)
            except StopIteration:
                return None
            except Exception as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
                self._fail(_stage_error("data", k, None, exc))
                self._raise_failure()
            replica = i % n_drafters
            future = self._submit_microbatch(k, replica, batch, i >= self.accumulate - n_drafters)
            record._drafter_futures.append(future)
        self._next_microbatch += self.accumulate
        self._next_step += 1
        record._step_futures = self._submit_optimizer_step(record.step, record._drafter_futures)
        with self._cond:
            record._pending = len(record._step_futures)
            for future in record._step_futures:
                self._watch_step(future, record)
        return record

    def _submit_microbatch(self, k: int, replica: int, batch: Any, sync: bool) -> Future:
        self._acquire_slot(k)
        t_index = k % len(self._target_lanes)
        t_lane, d_lane = self._target_lanes[t_index], self._drafter_lanes[replica]
        try:
            target = self._targets[t_index].submit(t_lane, batch)
        except BaseException as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
            self._release_slot()
            self._fail(_stage_error("target", k, t_lane, exc))
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
                self._drafter_task, k, replica, target, self._targets[t_index], t_lane, sync
            )
        except BaseException as exc:  # noqa: BLE001 - raised below, as the pipeline's failure
            target.cancel()
            self._release_slot()
            self._fail(_stage_error("drafter", k, d_lane, exc))
            self._raise_failure()
        self._track(drafter, "drafter", k, d_lane, slot=True)
        return drafter

    def _acquire_slot(self, k: int) -> None:
        """Waits until microbatch k - depth has left the pipeline, its GPU work included."""
        oldest = k - self.depth
        if oldest >= self._run_start:
            self._wait_until(lambda: oldest in self._settled)
            with self._cond:
                self._settled.discard(oldest)
                gpu_done = self._gpu_done.pop(oldest, None)
            if gpu_done is not None:
                gpu_done.synchronize()  # releases the GIL; ends even after a failure
        with self._cond:
            self._in_flight += 1

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

    # --- the lane tasks -----------------------------------------------------------------
    def _drafter_task(
        self, k: int, replica: int, target: Future, stage: TargetStage, t_lane: Lane, sync: bool
    ) -> Any:
        lane = self._drafter_lanes[replica]
        match_intra_op_threads(self._threads)
        produced = _input_of(target)
        # A recycled result goes back to its stage once the drafter's GPU work is done.
        recycled = produced if stage.recycles and lane.is_gpu else None
        try:
            inputs, moved_bytes = hand_to_lane(produced, t_lane, target.event, lane)
        except BaseException as exc:
            raise _stage_error("transfer", k, lane, exc) from exc
        finally:
            target.replace_result(None)  # the drafter holds what it needs; see depth
            del produced
        self._hold(k, moved_bytes)
        model = self._drafters[replica]
        try:
            no_sync = (
                model.no_sync() if self._ddp[replica] and not sync else contextlib.nullcontext()
            )
            with no_sync, torch.enable_grad():
                loss = self._loss(model, inputs)
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise TypeError(
                        f"expected loss() to return a scalar tensor, got {_describe(loss)}"
                    )
                # Backward on this thread, so it sees the lane's streams and thread state.
                with torch.autograd.set_multithreading_enabled(False):
                    (loss / self.accumulate).backward()
            if lane.is_gpu:
                gpu_done = torch.cuda.Event()
                gpu_done.record()
                with self._cond:
                    self._gpu_done[k] = gpu_done
                if recycled is not None:
                    stage.release(recycled, gpu_done)
            return loss.detach()
        except BaseException as exc:
            raise _stage_error("drafter", k, lane, exc) from exc

    def _reduce_task(self, step: int, microbatches: list[Future]) -> list[torch.Tensor | None]:
        for future in microbatches:
            _input_of(future)
        match_intra_op_threads(self._threads)
        n_drafters = len(self._drafter_lanes)
        lane0 = self._drafter_lanes[0]
        try:
            total = [None if p.grad is None else p.grad.clone() for p in self._params[0]]
            for r in range(1, n_drafters):
                lane, last = self._drafter_lanes[r], microbatches[r - n_drafters]
                grads, _ = hand_to_lane([p.grad for p in self._params[r]], lane, last.event, lane0)
                for i, grad in enumerate(grads):
                    if grad is None:
                        continue
                    if total[i] is None:
                        total[i] = grad.clone()
                    else:
                        total[i] += grad
            return total
        except _Upstream:
            raise
        except BaseException as exc:
            raise _stage_error("reduce", None, lane0, exc, step=step) from exc

    def _step_task(
        self, step: int, replica: int, reduced: Future | None, microbatches: Sequence[Future]
    ) -> None:
        lane = self._drafter_lanes[replica]
        params = self._params[replica]
        for future in microbatches:
            _input_of(future)
        match_intra_op_threads(self._threads)
        if reduced is not None:
            total = _input_of(reduced)
            try:
                grads, copied = hand_to_lane(total, self._drafter_lanes[0], reduced.event, lane)
            except BaseException as exc:
                raise _stage_error("reduce", None, lane, exc, step=step) from exc
            # The sum is shared by every replica: each takes its own copy.
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad if grad is None or copied else grad.clone()
        try:
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            self._optimizers[replica].step()
            self._optimizers[replica].zero_grad(set_to_none=True)
            if self._schedulers is not None:
                self._schedulers[replica].step()
        except BaseException as exc:
            raise _stage_error("optimizer", None, lane, exc, step=step) from exc

    def _zero_grad_task(self, replica: int) -> None:
        # A run starts a step afresh: an earlier run may have left a partial step.
        for p in self._params[replica]:
            p.grad = None

    # --- bookkeeping --------------------------------------------------------------------
    def _track(
        self,
        future: Future,
        stage: str,
        k: int | None,
        lane: Lane,
        *,
        slot: bool = False,
        step: int | None = None,
        cancellable: bool = True,
        on_result: Callable[[Future], None] | None = None,
    ) -> None:
        with self._cond:
            self._outstanding[future] = (self._submitted, cancellable)
            self._submitted += 1

        def done(f: Future) -> None:
            cancelled = f.cancelled()
            failure = None if cancelled else f.exception()
            if failure is None and not cancelled and on_result is not None:
                on_result(f)
            with self._cond:
                self._outstanding.pop(f, None)
                self._cancelled += cancelled
                if isinstance(failure, PipelineError):
                    self._fail_locked(failure)
                elif failure is not None and not isinstance(failure, _Upstream):
                    self._fail_locked(_stage_error(stage, k, lane, failure, step=step))
                if slot:
                    self._in_flight -= 1
                    self._settled.add(k)
                    trained = failure is None and not cancelled
                    # A drafter that trained took its target's result, so the target's
                    # bytes were counted already; otherwise they may still arrive.
                    self._hidden.release(k, target_may_follow=not trained)
                    self._microbatches += trained
                self._cond.notify_all()

        future.add_done_callback(done)

    def _watch_step(self, future: Future, record: StepResult) -> None:
        def done(f: Future) -> None:
            ok = not f.cancelled() and f.exception() is None
            with self._cond:
                record._failed |= not ok
                record._pending -= 1
                if record._pending == 0 and not record._failed:
                    self._steps += 1
                self._cond.notify_all()

        future.add_done_callback(done)

    def _applied(self, record: StepResult) -> StepResult:
        self._raise_failure()
        return record

    def _hold(self, k: int, nbytes: int) -> None:
        with self._cond:
            self._hidden.hold(k, nbytes)

    def _release_slot(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def _fail(self, error: PipelineError) -> None:
        with self._cond:
            self._fail_locked(error)

    def _fail_locked(self, error: PipelineError) -> None:
        if self._failure is None:
            self._failure = error
        self._cond.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            self._stop()
            raise self._failure

    def _wait_until(self, predicate: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._failure is not None or predicate())
        self._raise_failure()

    def _stop(self) -> None:
        """Cancels queued microbatch work, newest first, and waits for the rest: what runs
        has inputs that are finished or cancelled, so it ends."""
        with self._cond:
            futures = sorted(self._outstanding, key=self._outstanding.__getitem__, reverse=True)
            cancellable = [f for f in futures if self._outstanding[f][1]]
        for future in cancellable:
            future.cancel()
        concurrent.futures.wait(futures)
        with self._cond:
            self._in_flight = 0
            self._next_step = self._steps
            self._next_microbatch = self._steps * self.accumulate
            self._hidden.release_all()

    # --- introspection ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and the hidden-state bytes held: now, at the peak, and the most one
        microbatch held (its target result, plus its copy on another device)."""
        with self._cond:
            return {
                "steps": self._steps,
                "microbatches": self._microbatches,
                "cancelled": self._cancelled,
                "depth": self.depth,
                "accumulate": self.accumulate,
                "in_flight": self._in_flight,
                **self._hidden.stats(),
                "target_lanes": [lane.label for lane in self._target_lanes],
                "drafter_lanes": [lane.label for lane in self._drafter_lanes],
                "peer_copy": _peer_pairs(self._target_lanes, self._drafter_lanes),
            }

    def __repr__(self) -> str:
        return (
            f"<pydflash.Pipeline targets={len(self._target_lanes)} drafters="
            f"{len(self._drafter_lanes)} depth={self.depth} accumulate={self.accumulate}>"
        )


# --- helpers ------------------------------------------------------------------------------
def _input_of(future: Future) -> Any:
    """The result of an earlier stage's future; _Upstream when it failed or was cancelled."""
    try:
        return future.result()
    except BaseException as exc:  # noqa: BLE001 - any upstream failure is _Upstream here
        raise _Upstream(f"an earlier stage failed: {exc!r}") from None


def _stage_error(
    stage: str, k: int | None, lane: Lane | None, exc: BaseException, *, step: int | None = None
) -> PipelineError:
    if isinstance(exc, PipelineError):
        return exc
    where = (
        f" on microbatch {k}" if k is not None else (f" of step {step}" if step is not None else "")
    )
    on = f" on {lane.label}" if lane is not None else ""
    error = PipelineError(
        f"{stage} stage failed{where}{on}: {type(exc).__name__}: {exc}",
        stage=stage,
        microbatch=k,
        lane=None if lane is None else lane.label,
    )
    error.__cause__ = exc
    return error


def _peer_pairs(targets: Sequence[Lane], drafters: Sequence[Lane]) -> dict[str, bool]:
    pairs = {}
    for t in targets:
        for d in drafters:
            if t.is_gpu and d.is_gpu and t.device_index != d.device_index:
                pairs[f"{t.device}->{d.device}"] = torch.cuda.can_device_access_peer(
                    d.device_index, t.device_index
                )
    return pairs


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _lanes(lanes: Any, name: str) -> list[Lane]:
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


def _per_lane(
    value: Any,
    count: int,
    name: str,
    kind: str,
    accepts: Callable[[Any], bool],
    *,
    one_each: str | None = None,
) -> list[Any]:
    """One value per lane: a sequence of `count` values, or a single value shared by all
    lanes. `one_each` names lanes that each need their own: one value is then refused
    for several lanes. `kind` says in errors what `accepts` takes."""
    if accepts(value):
        if count > 1 and one_each is not None:
            raise ValueError(f"expected one {name} per {one_each} ({count}), got one {name}")
        return [value] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"expected {count} {name}s (one per lane), got {len(value)}")
        for item in value:
            if not accepts(item):
                raise TypeError(f"expected each {name} to be {kind}, got {type(item).__name__}")
        return list(value)
    raise TypeError(f"expected {name} to be {kind} or a list of them, got {type(value).__name__}")


def _is_target(value: Any) -> bool:
    return isinstance(value, TargetStage) or (
        callable(value) and not isinstance(value, (list, tuple))
    )


def _is_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module)


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _has_step(value: Any) -> bool:
    return callable(getattr(value, "step", None))
