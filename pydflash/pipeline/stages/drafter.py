"""Drafter stages: how the drafter trains on the drafter lanes, one replica per lane.
`Pipeline` builds an `EagerDrafter` from its drafter, loss and optimizer arguments."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..._checks import per_lane
from ...lanes.handoff import hand_to_lane
from ...lanes.lane import Lane
from .._failures import stage_error

if TYPE_CHECKING:
    from ...graphs.bucketed import NativeLaunch

#: Gradients of a replica's trainable parameters, in parameter order (None: no gradient).
Gradients = list[torch.Tensor | None]


class DrafterStage:
    """How the drafter trains: one replica per drafter lane. `Pipeline` runs each method
    as a task on replica r's lane, with that lane's device and stream current, and a lane
    runs its tasks in order (Note [Pipeline order] in pipeline/scheduler.py). Per step:

    - `train` for each of the step's microbatches, on its replica's lane;
    - with several replicas, `reduce` on lane 0, which sums their gradients;
    - `step` on every lane.

    `zero_grad` runs on every lane when a run starts. A failure raises: `reduce` and
    `step` name their stage themselves (`pydflash.pipeline._failures.stage_error`: 'reduce',
    'optimizer'); the pipeline reports a failure of `train` as the 'drafter' stage's."""

    #: The drafter lanes, one per replica, in replica order.
    lanes: list[Lane]

    def train(self, replica: int, inputs: Any, *, all_reduce: bool) -> torch.Tensor:
        """Forward, loss and backward of one microbatch on `replica`, its gradient added
        to the replica's; returns the loss, detached. `inputs` are the target's result
        on the lane's device. `all_reduce`: the step's last microbatch, on which a
        DistributedDataParallel drafter all-reduces gradients across processes."""
        raise NotImplementedError

    def reduce(self, step: int, after: Sequence[Any]) -> Gradients:
        """On lane 0: the sum of every replica's gradient. `after[r]` is the event that
        follows replica r's last backward of the step (None on CPU lanes)."""
        raise NotImplementedError

    def step(self, step: int, replica: int, reduced: tuple[Gradients, Any] | None) -> None:
        """Applies the step on `replica`: with several replicas, `reduced` is the sum from
        `reduce` and the event that follows it; with one, None (its own gradient)."""
        raise NotImplementedError

    def zero_grad(self, replica: int) -> None:
        """Drops `replica`'s gradient: a run starts a step afresh."""
        raise NotImplementedError

    #: Whether `native_launch` may return launches (the graph stage that pads with 0).
    launches_natively = False

    def native_launch(
        self, lane: Lane, b: int, t: int, spec: Any, sig: tuple
    ) -> NativeLaunch | None:
        """What a stream program may launch in place of `train` on `lane` (the replica's)
        for a [b, t] microbatch whose inputs have tree `spec` and signature `sig`, or
        None: submit the task. As `TargetStage.native_launch`."""
        return None

    #: The total gradient norm each step clips to, or None.
    clip_grad_norm: float | None = None

    def check_pipeline(
        self, lanes: Sequence[Lane], accumulate: int, clip_grad_norm: Any = None, **given: Any
    ) -> None:
        """Raises ValueError unless a pipeline over drafter `lanes` with `accumulate` can
        run this stage, given no training arguments of its own (`clip_grad_norm` and the
        `given` ones: this stage holds them)."""
        if list(map(id, lanes)) != list(map(id, self.lanes)):
            raise ValueError("expected the drafter stage's lanes as the pipeline's drafter lanes")
        if accumulate != getattr(self, "accumulate", accumulate):
            raise ValueError(
                f"expected accumulate={self.accumulate}, the drafter stage's, got {accumulate}"
            )
        extra = [k for k, v in {**given, "clip_grad_norm": clip_grad_norm}.items() if v is not None]
        if extra:
            raise ValueError(
                f"expected no {', '.join(extra)} beside a drafter stage (it holds its own)"
            )


@dataclass
class DrafterTraining:
    """What a drafter stage trains, checked, one entry per drafter lane (replica): the
    pieces `EagerDrafter` and `pydflash.DrafterGraphs` share. Made by `of`."""

    lanes: list[Lane]
    drafters: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any] | None
    loss: Callable[..., torch.Tensor]
    accumulate: int
    clip_grad_norm: float | None
    ddp: list[bool]  # a DistributedDataParallel drafter, per replica
    params: list[list[torch.nn.Parameter]]  # each replica's trainable parameters

    @classmethod
    def of(
        cls,
        lanes: Sequence[Lane],
        *,
        drafter: torch.nn.Module | Sequence[torch.nn.Module],
        loss: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        accumulate: int,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
    ) -> DrafterTraining:
        """The arguments of a drafter stage (`EagerDrafter` documents them), checked."""
        lanes = list(lanes)
        count = len(lanes)

        def one_each(value: Any, name: str, kind: str, accepts: Callable[[Any], bool]) -> list:
            return per_lane(value, count, name, kind, accepts, one_each="drafter lane")

        drafters = one_each(drafter, "drafter", "a torch.nn.Module", _is_module)
        optimizers = one_each(optimizer, "optimizer", "a torch.optim.Optimizer", _is_optimizer)
        schedulers = (
            None
            if scheduler is None
            else one_each(scheduler, "scheduler", "an object with step()", _has_step)
        )
        if not callable(loss):
            raise TypeError(f"expected a callable loss(drafter, inputs), got {type(loss).__name__}")
        if clip_grad_norm is not None and not (
            isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0
        ):
            raise ValueError(f"expected clip_grad_norm > 0 or None, got {clip_grad_norm!r}")
        ddp = [isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in drafters]
        if any(ddp) and count > 1:
            raise ValueError(
                f"expected one drafter lane per process with DistributedDataParallel, got {count}"
            )
        params = [[p for p in m.parameters() if p.requires_grad] for m in drafters]
        training = cls(
            lanes, drafters, optimizers, schedulers, loss, accumulate, clip_grad_norm, ddp, params
        )
        training._check_replicas()
        return training

    def _check_replicas(self) -> None:
        shapes = [tuple(p.shape for p in params) for params in self.params]
        for r, (module, lane) in enumerate(zip(self.drafters, self.lanes, strict=True)):
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
            for group in self.optimizers[r].param_groups:
                if any(id(p) not in owned for p in group["params"]):
                    raise ValueError(
                        f"expected optimizer {r} over drafter {r}'s parameters, got others"
                    )

    def step_schedulers(self, replica: int) -> None:
        if self.schedulers is not None:
            self.schedulers[replica].step()


class EagerDrafter(DrafterStage):
    """Trains with plain torch calls: `loss(drafter, inputs)`, then the backward of
    `loss / accumulate` on the lane's thread, then the optimizer step (after clipping to
    `clip_grad_norm`) and the scheduler's.

    Args:
        lanes: the drafter lanes, one replica each.
        drafter: the trained module, one per lane (replicas start identical and stay so:
            each step applies the replicas' summed gradient), on its lane's device.
        loss: loss(drafter, inputs) -> scalar tensor.
        optimizer: one per drafter, over that drafter's parameters.
        accumulate: microbatches per optimizer step.
        clip_grad_norm: clip the step's gradient to this total norm first.
        scheduler: one per drafter, or None; stepped after each optimizer step.
    """

    def __init__(
        self,
        lanes: Sequence[Lane],
        *,
        drafter: torch.nn.Module | Sequence[torch.nn.Module],
        loss: Callable[[torch.nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        accumulate: int,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
    ) -> None:
        self.training = DrafterTraining.of(
            lanes,
            drafter=drafter,
            loss=loss,
            optimizer=optimizer,
            accumulate=accumulate,
            clip_grad_norm=clip_grad_norm,
            scheduler=scheduler,
        )
        self.lanes = self.training.lanes
        self.accumulate = accumulate
        self.clip_grad_norm = clip_grad_norm

    # --- the lane tasks -----------------------------------------------------------------
    def train(self, replica: int, inputs: Any, *, all_reduce: bool) -> torch.Tensor:
        training = self.training
        model = training.drafters[replica]
        ddp = training.ddp[replica]
        no_sync = model.no_sync() if ddp and not all_reduce else contextlib.nullcontext()
        with no_sync, torch.enable_grad():
            loss = training.loss(model, inputs)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise TypeError(f"expected loss() to return a scalar tensor, got {_describe(loss)}")
            # Backward on this thread, so it sees the lane's streams and thread state.
            with torch.autograd.set_multithreading_enabled(False):
                (loss / self.accumulate).backward()
        return loss.detach()

    def reduce(self, step: int, after: Sequence[Any]) -> Gradients:
        lane0 = self.lanes[0]
        try:
            params = self.training.params
            total = [None if p.grad is None else p.grad.clone() for p in params[0]]
            for r in range(1, len(self.lanes)):
                grads = [p.grad for p in params[r]]
                grads, _ = hand_to_lane(grads, self.lanes[r], after[r], lane0)
                for i, grad in enumerate(grads):
                    if grad is None:
                        continue
                    if total[i] is None:
                        total[i] = grad.clone()
                    else:
                        total[i] += grad
            return total
        except BaseException as exc:
            raise stage_error("reduce", None, lane0, exc, step=step) from exc

    def step(self, step: int, replica: int, reduced: tuple[Gradients, Any] | None) -> None:
        lane = self.lanes[replica]
        params = self.training.params[replica]
        optimizer = self.training.optimizers[replica]
        if reduced is not None:
            total, event = reduced
            try:
                grads, copied = hand_to_lane(total, self.lanes[0], event, lane)
            except BaseException as exc:
                raise stage_error("reduce", None, lane, exc, step=step) from exc
            # The sum is shared by every replica: each takes its own copy.
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad if grad is None or copied else grad.clone()
        try:
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.training.step_schedulers(replica)
        except BaseException as exc:
            raise stage_error("optimizer", None, lane, exc, step=step) from exc

    def zero_grad(self, replica: int) -> None:
        for p in self.training.params[replica]:
            p.grad = None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _is_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module)


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _has_step(value: Any) -> bool:
    return callable(getattr(value, "step", None))
