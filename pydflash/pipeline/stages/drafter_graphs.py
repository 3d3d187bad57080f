"""The drafter's training steps as CUDA graphs: the training-side twin of `TargetGraphs`.

    stage = pydflash.DrafterGraphs(drafter_lanes, drafter=models, loss=loss,
                                   optimizer=optimizers, accumulate=4)
    pipe = pydflash.Pipeline(target_lanes, drafter_lanes, target=..., drafter=stage, accumulate=4)

A small drafter's training step is hundreds of small kernel launches per microbatch with
the GIL held: its host time is longer than its GPU time. Replayed as CUDA graphs, each
microbatch is a few launches. Per (batch, length) bucket a replica captures the
microbatch's forward, loss and backward, with gradients accumulating into static
gradient buffers; once per step it replays a second graph: gradient clipping (when asked
for), the optimizer step and the zeroing of the gradients.

Note [Padding contract]: a microbatch's inputs are padded on the right to their bucket
(Note [Bucket padding] in pydflash/graphs/buckets.py), and the loss is called as
`loss(drafter, inputs, lengths)`: `lengths` is an int64 tensor [Bb] on the lane's device
holding each row's real length, T for the batch's B rows and 0 for padding rows. The
loss must give the padded microbatch the loss and gradients of the unpadded one: it
ignores positions at or past a row's length, and normalises by counts taken from
`lengths` on the device, not from shapes. (An eager fallback calls it unpadded with every
row at full length.) Then padding changes nothing but the rounding of kernels that tile a
longer sequence differently. The stage cannot check this: a loss that averages over the
padded shape trains on a different objective. On CPU lanes there are no graphs, and
microbatches take the same padded path eagerly: the CPU tests hold the contract.

Note [Static gradients]: each replica's trainable parameters get their `.grad` as views
into one flat buffer per dtype, allocated once; backward adds into them in place (graph
or not), the reduction across replicas and the all-reduce across processes work on the
flat buffers, and the step graph zeroes them. Never set them to None (`zero_grad()`):
a run re-installs them when it starts.

Note [Capturing a training step]: graphs are captured, kept and dropped by the mechanism
`TargetGraphs` uses (pydflash/graphs/cache.py: one pool per lane, LRU `max_graphs`,
`max_pool_bytes`, the "auto" policy, fallbacks; the capture itself is
`pydflash.graphs.capture_graph`, which pauses the device's other lanes). A bucket's graph
is captured the first time a microbatch of that bucket reaches a replica: `warmup`
forward/backward passes (lazy initialisation, autotuning), then the capture, which runs
nothing; the gradients the warm-up added are restored, and the graph replays the real
microbatch. The step graph is captured at the second step: the first runs eagerly and
creates the optimizer's state outside any graph. Under policy "auto" the step is judged as
a bucket is (Note [A policy for the whole step]): its eager steps are timed from the
third, and it is captured only where the host, not the GPU, limits it; a large drafter's
fused AdamW, GPU-bound, keeps stepping eagerly. It lives in a memory pool of its own
("optimizer step"), so a lane whose bucket graphs the policy all dropped gives their pool
back (Note [Giving a pool back] in pydflash/graphs/cache.py). Autocast's weight cache is
off while the loss is warmed up and captured (a `torch.autocast` inside the loss inherits
that: a cached cast would be freed while the graph still reads it). Optimizers with a
`capturable` option (Adam, AdamW, fused or not, and every other torch optimizer that has
it) get `capturable=True` and a one-element tensor `lr` on the lane's device (Note
[Capturable optimizers] in pydflash/pipeline/stages/_train_state.py), so a scheduler's new rate,
written into that tensor, reaches the replayed step without a new capture. An optimizer
whose state stays on the host after its first step (Adagrad, LBFGS, one of the user's)
cannot be replayed: its step runs eagerly while the microbatch graphs keep replaying,
said once ("optimizer not capturable"). A hyperparameter that is not a tensor is baked
into the step graph: when it changes, the step runs eagerly from then on, with a warning.

Fallback: a length above the largest bucket, a loss or optimizer that cannot be captured
(a host sync such as `.item()`, data-dependent shapes), the device's other lanes not
pausing in time, a graph pool past `max_pool_bytes`, or (policy "auto") a graph no faster
on the GPU than the eager pass runs that microbatch or step eagerly, unpadded, with a
GraphFallbackWarning naming the reason, once per kind; the result is the same.

Replicas and processes: several replicas in one process sum their flat gradients on lane
0 between the last captured backward and the captured step, as the eager stage does. A
DistributedDataParallel drafter is trained through its inner module and its flat
gradients are all-reduced (averaged over the process group) in the step task, before
the step graph: on NCCL between GPUs, on gloo between CPU processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..._tree import flatten
from ...graphs import cache as graph_cache
from ...graphs.bucketed import BucketedGraphs, GraphKey, NativeLaunch
from ...graphs.buckets import (
    WHOLE,
    above_largest,
    batch_shape,
    copy_padded,
    pad,
    pad_values,
)
from ...graphs.cache import Policy
from ...graphs.lane_graph import DEFAULT_QUIET_TIMEOUT
from ...lanes.handoff import hand_to_lane
from ...lanes.lane import Lane
from .._failures import stage_error
from ._train_state import (
    all_reduce_mean,
    flat_gradients,
    host_state,
    lengths_tensor,
    make_capturable,
    plain_hypers,
    restore_tensor_hypers,
    set_lengths,
)
from .drafter import DrafterStage, DrafterTraining, Gradients, _describe

DEFAULT_WARMUP = 3
STEP = "optimizer step"  # the step graph's key, label and pool in the lane's graph cache


@dataclass
class _Static:
    """What a bucket's graph reads: the padded inputs' leaves and the lengths."""

    inputs: list[Any]
    lengths: torch.Tensor
    fresh: bool = True  # captured just now: the inputs are the capturing microbatch's


@dataclass
class _Replica:
    """One replica's training state, used on its lane's worker."""

    lane: Lane
    module: torch.nn.Module  # the module the loss runs (a DDP drafter's inner module)
    params: list[torch.nn.Parameter]
    flats: list[torch.Tensor]  # Note [Static gradients]
    views: list[torch.Tensor]  # params[i].grad: views into flats
    tensor_hypers: list  # (param group, key, tensor) the step graph reads
    process_group: Any = None  # a DDP drafter's: all-reduced in the step
    stepped: bool = False  # the optimizer's state exists
    step_hypers: list | None = None  # the plain hyperparameters the step graph bakes in
    step_checked: bool = False  # host_state() read after the first step
    step_replays: int = 0
    step_eager_runs: int = 0


class DrafterGraphs(DrafterStage):
    """Trains the drafter by replaying captured CUDA graphs: per (batch, length) bucket
    the microbatch's forward, loss and backward; per step the optimizer's. See the
    module's notes, Note [Padding contract] first.

    Args:
        lanes, drafter, optimizer, accumulate, clip_grad_norm, scheduler: as for
            `EagerDrafter`.
        loss: loss(drafter, inputs, lengths) -> scalar tensor; `lengths` [Bb] int64 on
            the lane's device holds each row's real length (Note [Padding contract]).
        lengths: the bucket lengths; a longer microbatch runs eagerly. Default: 128 to
            8192, each doubling split into `granularity` steps (Note [Bucket ladder]).
        granularity: steps per doubling of the default lengths (default 4).
        batch_sizes: the bucket batch sizes; None (default) buckets each batch size alone.
        pad_value: what padding holds, or a dict of it per key of dict inputs (default 0).
        warmup: forward/backward passes before a capture.
        max_pool_bytes, on_full, max_graphs, policy, gpu_bound_ratio, capture_after,
            capture_budget, quiet_timeout: as for `TargetGraphs`, per drafter lane.
    """

    def __init__(
        self,
        lanes: Sequence[Lane],
        *,
        drafter: torch.nn.Module | Sequence[torch.nn.Module],
        loss: Callable[[torch.nn.Module, Any, torch.Tensor], torch.Tensor],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        accumulate: int,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
        lengths: Iterable[int] | None = None,
        granularity: int | None = None,
        batch_sizes: Iterable[int] | None = None,
        pad_value: float | dict[str, float] = 0,
        warmup: int = DEFAULT_WARMUP,
        max_pool_bytes: int | None = None,
        on_full: str = "eager",
        max_graphs: int | None = None,
        policy: Policy | str = Policy.AUTO,
        gpu_bound_ratio: float = graph_cache.DEFAULT_GPU_BOUND_RATIO,
        capture_after: int = 1,
        capture_budget: float | None = None,
        quiet_timeout: float = DEFAULT_QUIET_TIMEOUT,
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
        self._graphs = BucketedGraphs(
            f"pydflash.DrafterGraphs {id(self):x}",
            lengths=lengths,
            granularity=granularity,
            batch_sizes=batch_sizes,
            pad_value=pad_value,
            warmup=warmup,
            max_graphs=max_graphs,
            max_pool_bytes=max_pool_bytes,
            on_full=on_full,
            policy=policy,
            gpu_bound_ratio=gpu_bound_ratio,
            capture_after=capture_after,
            capture_budget=capture_budget,
            quiet_timeout=quiet_timeout,
        )
        self.lengths, self.batch_sizes = self._graphs.lengths, self._graphs.batch_sizes
        self.pad_value = self._graphs.pad_value
        self._replicas = [self._replica(r) for r in range(len(self.lanes))]
        self._replica_of = {id(rep.lane): r for r, rep in enumerate(self._replicas)}

    def _replica(self, r: int) -> _Replica:
        training = self.training
        model, lane = training.drafters[r], self.lanes[r]
        group = None
        if training.ddp[r]:
            group, model = model.process_group, model.module
        params = training.params[r]
        flats, views = flat_gradients(params)
        hypers = (
            make_capturable(training.optimizers[r], torch.device(lane.device))
            if _captures(lane)
            else []
        )
        return _Replica(lane, model, params, flats, views, hypers, process_group=group)

    @property
    def policy(self) -> Policy:
        return self._graphs.policy

    @property
    def launches_natively(self) -> bool:  # type: ignore[override]
        return self._graphs.zero_padded

    # --- DrafterStage ---------------------------------------------------------------------
    def train(self, replica: int, inputs: Any, *, all_reduce: bool) -> torch.Tensor:
        # all_reduce is not needed: a DDP drafter's gradients are all-reduced in step().
        rep = self._replicas[replica]
        leaves, spec = flatten(inputs)
        b, t = batch_shape(leaves)
        cache = self._graphs.lane(rep.lane)
        bucket = self._graphs.bucket(b, t)
        if bucket is None:
            detail = above_largest("a microbatch", b, t, self.lengths, self.batch_sizes)
            cache.fall_back("too long", detail)
            return self._eager(rep, inputs, b, t)
        pads = pad_values(self.pad_value, inputs, leaves)
        if not _captures(rep.lane):
            self._graphs.padded(b, t, bucket)
            padded = [pad(x, bucket, p) for x, p in zip(leaves, pads, strict=True)]
            lengths = lengths_tensor(bucket.batch, b, t, leaves)
            return self._forward_backward(rep, pytree.tree_unflatten(padded, spec), lengths)
        saved: list[torch.Tensor] = []

        def make() -> tuple[Callable[[], torch.Tensor], _Static]:
            # The warm-up adds gradients that are not the microbatch's: put them back after.
            saved.extend(flat.clone() for flat in rep.flats)
            static = [
                x.clone() if isinstance(x, torch.Tensor) else x
                for x in (pad(x, bucket, p) for x, p in zip(leaves, pads, strict=True))
            ]
            lengths = lengths_tensor(bucket.batch, b, t, static)
            batch = pytree.tree_unflatten(static, spec)

            def step() -> torch.Tensor:
                with _autocast_cache_off():
                    return self._forward_backward(rep, batch, lengths)

            return step, _Static(static, lengths)

        key = GraphKey.of(bucket, leaves, spec)
        try:
            entry = cache.get_or_capture(key, make, label=bucket)
        finally:
            for flat, before in zip(rep.flats, saved, strict=False):
                flat.copy_(before)
        if entry is None:
            return cache.run_eagerly(key, partial(self._eager, rep, inputs, b, t))
        static: _Static = entry.data
        if static.fresh:
            static.fresh = False
        else:
            for buffer, x, p in zip(static.inputs, leaves, pads, strict=True):
                if isinstance(x, torch.Tensor):
                    copy_padded(buffer, x, p)
            set_lengths(static.lengths, b, t)
        cache.replay(entry)
        self._graphs.padded(b, t, bucket)
        return entry.outputs.clone()

    def native_launch(
        self, lane: Lane, b: int, t: int, spec: Any, sig: tuple
    ) -> NativeLaunch | None:
        """What a stream program launches in place of `train` on `lane` (Note [Native
        microbatch] in pydflash/pipeline/native_microbatch.py): the bucket's graph, once captured,
        kept by the policy and replayed once here; its `lengths` to fill, its loss as the
        one output. None otherwise. Any thread."""
        if id(lane) not in self._replica_of or not _captures(lane):
            return None
        return self._graphs.native_launch(lane, b, t, spec, sig, _launch_parts)

    def reduce(self, step: int, after: Sequence[Any]) -> Gradients:
        lane0 = self.lanes[0]
        try:
            total = [flat.clone() for flat in self._replicas[0].flats]
            for r in range(1, len(self.lanes)):
                rep = self._replicas[r]
                flats, _ = hand_to_lane(rep.flats, rep.lane, after[r], lane0)
                for t, flat in zip(total, flats, strict=True):
                    t += flat
            return total
        except BaseException as exc:
            raise stage_error("reduce", None, lane0, exc, step=step) from exc

    def step(self, step: int, replica: int, reduced: tuple[Gradients, Any] | None) -> None:
        rep = self._replicas[replica]
        if reduced is not None:
            total, event = reduced
            try:
                grads, _ = hand_to_lane(total, self.lanes[0], event, rep.lane)
                for flat, grad in zip(rep.flats, grads, strict=True):
                    flat.copy_(grad)
            except BaseException as exc:
                raise stage_error("reduce", None, rep.lane, exc, step=step) from exc
        try:
            if rep.process_group is not None:
                all_reduce_mean(rep.flats, rep.process_group)
            self._apply(replica, rep)
            self.training.step_schedulers(replica)
        except BaseException as exc:
            raise stage_error("optimizer", None, rep.lane, exc, step=step) from exc

    def zero_grad(self, replica: int) -> None:
        rep = self._replicas[replica]
        for p, view in zip(rep.params, rep.views, strict=True):
            p.grad = view  # Note [Static gradients]: a caller may have dropped them
        for flat in rep.flats:
            flat.zero_()

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """As `TargetGraphs.stats()` (per lane label: the buckets captured, capture
        attempts and failures, replays, eager runs, evictions, graphs dropped, pool bytes,
        pools given back; fallbacks per kind; eager_buckets; padding_waste; policy), and
        per lane how its optimizer steps ran: "step" is "graph" once the step graph
        replays, and step_replays / step_eager_runs count them."""
        by_label = {rep.lane.label: rep for rep in self._replicas}

        def steps(label: str, s: dict[str, Any]) -> dict[str, Any]:
            rep = by_label[label]
            graph = STEP in s["graphs"]
            return {
                "step": "graph" if graph else ("eager" if rep.step_eager_runs else None),
                "step_replays": rep.step_replays,
                "step_eager_runs": rep.step_eager_runs,
            }

        return self._graphs.stats(steps)

    def __repr__(self) -> str:
        name = getattr(self.training.loss, "__qualname__", self.training.loss)
        return f"<pydflash.DrafterGraphs of {name!s} on {len(self.lanes)} lanes>"

    # --- a microbatch -----------------------------------------------------------------------
    def _forward_backward(self, rep: _Replica, inputs: Any, lengths: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            loss = self.training.loss(rep.module, inputs, lengths)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise TypeError(f"expected loss() to return a scalar tensor, got {_describe(loss)}")
            # Backward on this thread, so it sees the lane's streams and thread state.
            with torch.autograd.set_multithreading_enabled(False):
                (loss / self.accumulate).backward()
        return loss.detach()

    def _eager(self, rep: _Replica, inputs: Any, b: int, t: int) -> torch.Tensor:
        """The microbatch unpadded: every row real."""
        self._graphs.padded(b, t)
        lengths = lengths_tensor(b, b, t, pytree.tree_leaves(inputs))
        return self._forward_backward(rep, inputs, lengths)

    # --- the step ---------------------------------------------------------------------------
    def _apply(self, replica: int, rep: _Replica) -> None:
        """Clipping, the optimizer step and zeroed gradients: replayed, or eagerly."""
        restore_tensor_hypers(rep.tensor_hypers)
        body = partial(self._step_body, replica, rep)
        if _captures(rep.lane) and rep.stepped and self._step_capturable(replica, rep):
            cache = self._graphs.lane(rep.lane)
            hypers = plain_hypers(self.training.optimizers[replica])
            if rep.step_hypers is None or hypers == rep.step_hypers:
                # Under "auto" the step is judged as a bucket is: its eager calls timed
                # first, captured only where the host limits it.
                entry = cache.get_or_capture(
                    STEP,
                    lambda: (body, None),
                    label=STEP,
                    pool=STEP,  # its own: bucket graphs dropped give their pool back
                    warmup=0,  # the first, eager step was the warm-up; none may repeat it
                )
                if entry is not None:
                    rep.step_hypers = hypers
                    cache.replay(entry)
                    rep.step_replays += 1
                    return
            else:
                cache.fall_back(
                    "hyperparameter",
                    "an optimizer hyperparameter that is not a tensor changed after the "
                    "step was captured; the step runs eagerly (make it a tensor to change it)",
                )
            cache.run_eagerly(STEP, body)
        else:
            body()
        rep.stepped = True
        rep.step_eager_runs += 1

    def _step_capturable(self, replica: int, rep: _Replica) -> bool:
        """Whether replica's optimizer step may be captured: read once, after its first
        step created the state (Note [Capturable optimizers]); if not, said once."""
        if not rep.step_checked:
            rep.step_checked = True
            why = host_state(self.training.optimizers[replica], torch.device(rep.lane.device))
            if why is not None:
                self._graphs.lane(rep.lane).refuse(
                    STEP,
                    "optimizer not capturable",
                    f"{why}; its step runs eagerly while the microbatch graphs keep replaying",
                )
                return False
        return True  # a refused step is recorded: get_or_capture runs it eagerly

    def _step_body(self, replica: int, rep: _Replica) -> None:
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(rep.params, self.clip_grad_norm)
        self.training.optimizers[replica].step()
        for flat in rep.flats:
            flat.zero_()

    # --- helpers ----------------------------------------------------------------------------


def _launch_parts(entry: Any) -> tuple | None:
    """DrafterGraphs' part of a NativeLaunch (pydflash.graphs.bucketed.Describe)."""
    static: _Static = entry.data
    if static.fresh:
        return None  # not replayed in Python yet
    return (static.inputs, static.lengths, [entry.outputs], None, [WHOLE], ())


def _captures(lane: Lane) -> bool:
    """Whether the stage captures graphs on `lane`: GPU lanes only."""
    return lane.is_gpu


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast's cast cache off: a cast cached during a capture would be freed while the
    graph still reads it. `torch.autocast(...)` without cache_enabled inherits this."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)
