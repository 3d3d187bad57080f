"""How a pipeline fails: each stage's failure named the same way, and the bookkeeping that
stops the rest of the work after the first one.

A task whose input failed or was cancelled raises `Upstream`: the failure is reported
once, by the stage where it happened. The scheduler keeps the futures it has submitted
and not seen end in `Outstanding`, with the first failure; on a failure or an early exit
it cancels the queued ones, newest first, and waits for the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InputFailedError, PipelineError

if TYPE_CHECKING:
    from ..lanes._future import Future
    from ..lanes.lane import Lane

#: The stages a PipelineError names (its `stage`), in the order a microbatch meets them.
STAGES = ("data", "target", "transfer", "drafter", "reduce", "optimizer")


class Upstream(Exception):
    """A task's input failed or was cancelled; the failure is reported by its own stage."""


def input_of(future: Future) -> Any:
    """The result of an earlier stage's future; Upstream when it failed or was cancelled."""
    try:
        return future.result()
    except BaseException as exc:  # noqa: BLE001 - any upstream failure is Upstream here
        raise Upstream(f"an earlier stage failed: {exc!r}") from None


def stage_error(
    stage: str, k: int | None, lane: Lane | None, exc: BaseException, *, step: int | None = None
) -> PipelineError:
    """`exc` as the PipelineError of `stage` (one of STAGES) on microbatch k or of `step`,
    on `lane`; a PipelineError stays as it is."""
    if isinstance(exc, PipelineError):
        return exc
    assert stage in STAGES, stage
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


def failure_of(
    future: Future, stage: str, k: int | None, lane: Lane, *, step: int | None = None
) -> PipelineError | None:
    """The PipelineError a finished `future` of `stage` reports: None when it succeeded,
    was cancelled, or failed only because its input did (Upstream, or InputFailedError
    for a stream program)."""
    if future.cancelled():
        return None
    failure = future.exception()
    if failure is None or isinstance(failure, (Upstream, InputFailedError)):
        return None
    return stage_error(stage, k, lane, failure, step=step)


class Outstanding:
    """The futures a pipeline has submitted and not seen end, each with its submit order
    and whether a stop may cancel it, and the first failure.

    Invariant: a future is here from its submit until its done callback has run; `failure`
    is set once and kept. Not locked: the pipeline calls it under its own condition."""

    def __init__(self) -> None:
        self._futures: dict[Future, tuple[int, bool]] = {}  # -> (order, cancellable)
        self._submitted = 0
        self.failure: PipelineError | None = None
        self.cancelled = 0  # tasks cancelled by a failure or an early exit

    def add(self, future: Future, *, cancellable: bool) -> None:
        self._futures[future] = (self._submitted, cancellable)
        self._submitted += 1

    def ended(self, future: Future) -> None:
        self._futures.pop(future, None)
        self.cancelled += future.cancelled()

    def fail(self, error: PipelineError) -> None:
        """Keeps `error` unless an earlier failure is kept already."""
        if self.failure is None:
            self.failure = error

    def __bool__(self) -> bool:
        return bool(self._futures)

    def to_stop(self) -> tuple[list[Future], list[Future]]:
        """Every outstanding future and those a stop cancels, newest first."""
        futures = sorted(self._futures, key=lambda f: self._futures[f][0], reverse=True)
        return futures, [f for f in futures if self._futures[f][1]]
