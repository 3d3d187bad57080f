"""What `Pipeline.run` yields per optimizer step: `StepResult`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..lanes._future import Future


class StepResult:
    """One optimizer step: its index (counted over the pipeline's life) and microbatches.
    `losses()` and `loss()` wait for the values: one read per device, when first asked
    (the drafter tasks return losses as device tensors, so training never waits for them).

    Args:
        step: the step's index.
        microbatches: the indices of its microbatches.
        losses: the futures of its microbatches' drafter tasks, in microbatch order.
    """

    def __init__(self, step: int, microbatches: range, losses: Sequence[Future] = ()) -> None:
        self.step = step
        self.microbatches = microbatches
        self._losses = list(losses)
        self._values: list[float] | None = None

    def losses(self) -> list[float]:
        """Each microbatch's loss (before the 1/accumulate scaling), in microbatch order."""
        if self._values is None:
            losses = [future.result() for future in self._losses]
            by_device: dict[Any, list[int]] = {}
            for i, (future, loss) in enumerate(zip(self._losses, losses, strict=True)):
                if future.event:  # the read below runs on this thread's stream
                    future.wait_stream(torch.cuda.current_stream(loss.device))
                by_device.setdefault(loss.device, []).append(i)
            values = [0.0] * len(losses)
            for indices in by_device.values():
                read = torch.stack([losses[i].reshape(()).double() for i in indices]).tolist()
                for i, value in zip(indices, read, strict=True):
                    values[i] = value
            self._values = values
        return list(self._values)

    def loss(self) -> float:
        """The mean microbatch loss of the step."""
        losses = self.losses()
        return sum(losses) / len(losses)

    def __repr__(self) -> str:
        return f"StepResult(step={self.step}, microbatches={self.microbatches!r})"
