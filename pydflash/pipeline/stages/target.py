"""Target stages: how one target microbatch runs on a target lane. `Pipeline` takes any
`TargetStage`; a plain callable becomes an `EagerTarget`. `pydflash.TargetGraphs` is the
stage that replays captured CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...lanes._future import Future
from ...lanes._torch_state import match_intra_op_threads
from ...lanes.handoff import map_tensors, to_lane
from ...lanes.lane import Lane

if TYPE_CHECKING:
    from ...graphs.bucketed import NativeLaunch


class TargetStage:
    """How one target microbatch runs on a target lane. `submit(lane, batch)` returns a
    pydflash Future of what the drafter's loss receives after the handoff; its `.event`
    (GPU lanes) must follow the GPU work that produces it."""

    def check_lane(self, lane: Lane) -> None:
        """Raises ValueError when this stage cannot run on `lane`."""

    def submit(self, lane: Lane, batch: Any) -> Future:
        raise NotImplementedError

    #: Whether results come from buffers the stage reuses once `release` gives them back.
    recycles = False

    def release(self, result: Any, event: Any) -> None:
        """Called with a result the drafter is done with once `event` (a torch.cuda.Event)
        has passed on the GPU; only stages that recycle their buffers act on it."""

    #: Whether `native_launch` may return launches (the graph stages that pad with 0).
    launches_natively = False

    def native_launch(
        self, lane: Lane, b: int, t: int, spec: Any, sig: tuple
    ) -> NativeLaunch | None:
        """What a stream program may launch in place of this stage's task for a [b, t]
        microbatch whose inputs have tree `spec` and signature `sig` (pydflash.buckets),
        or None: submit the task. The one interface of Note [Native microbatch]
        (pydflash/pipeline/native_microbatch.py); see pydflash.graphs.bucketed.NativeLaunch."""
        return None


class EagerTarget(TargetStage):
    """Calls fn(batch) on the lane under torch.no_grad(), the batch's tensors first moved
    to the lane's device (non-blocking).

    Args:
        fn: the target's forward, fn(batch) -> inputs of the drafter's loss.
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"expected a callable target, got {type(fn).__name__}")
        self.fn = fn

    def submit(self, lane: Lane, batch: Any) -> Future:
        return lane.submit(_run_target, self.fn, lane, batch, torch.get_num_threads())


class GraphTarget(TargetStage):
    """A target captured as a CUDA graph on one lane. The next replay overwrites the
    graph's static outputs, so a task on the same lane clones them on the lane stream
    first; the clone's future is the stage's result.

    Args:
        captured: the graph, e.g. a pydflash.graphs.CapturedGraph: `captured.run(*inputs)`
            replays it and returns a Future of its static outputs.
        inputs: inputs(batch) -> the replay's arguments; default: the batch itself, or
            its items when it is a tuple.
    """

    def __init__(self, captured: Any, inputs: Callable[[Any], tuple] | None = None) -> None:
        if not callable(getattr(captured, "run", None)):
            raise TypeError(
                "expected a captured graph with a run(*inputs) method, "
                f"got {type(captured).__name__}"
            )
        if inputs is not None and not callable(inputs):
            raise TypeError(
                f"expected inputs to be a callable or None, got {type(inputs).__name__}"
            )
        self.captured = captured
        self.inputs = inputs

    def check_lane(self, lane: Lane) -> None:
        own = getattr(self.captured, "lane", None)
        if own is not None and own is not lane:
            raise ValueError(
                f"expected the graph's own lane ({own!r}) as its target lane, got {lane!r}"
            )

    def submit(self, lane: Lane, batch: Any) -> Future:
        if self.inputs is not None:
            args = tuple(self.inputs(batch))
        else:
            args = batch if isinstance(batch, tuple) else (batch,)
        replay = self.captured.run(*args)
        return lane.submit(_clone_replay, replay)


def _run_target(fn: Callable[[Any], Any], lane: Lane, batch: Any, threads: int) -> Any:
    match_intra_op_threads(threads)
    with torch.no_grad():
        return fn(to_lane(batch, lane))


def _clone_replay(replay: Future) -> Any:
    outputs = replay.result()
    with torch.no_grad():
        return map_tensors(torch.Tensor.clone, outputs)
