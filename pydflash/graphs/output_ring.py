"""A lane's output buffers for replayed graphs.

Note [Output ring]: a replay's outputs are copied into one of `slots` buffers of the lane
rather than into a fresh allocation. A buffer is handed out again only once its holder
gave it back with `give_back(first_tensor, event)`, and the copy into it waits on that
event on the GPU, so the next copy cannot overwrite what the consumer still reads. When
every buffer is still held, the copy goes to a fresh allocation (`misses`).
`pydflash.TargetGraphs` gives its results back through `release(result, event)`, and
`Pipeline` calls that after the drafter's backward.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class OutputRing:
    """Used on the lane's worker only, but for `give_back`, which may come from any
    thread: hence the lock."""

    def __init__(self, slots: int) -> None:
        self._lock = threading.Lock()
        self._buffers: list[list[torch.Tensor] | None] = [None] * slots
        self._free: list[bool] = [True] * slots
        self._after: list[Any] = [None] * slots  # event the next copy into the slot waits on
        self._by_ptr: dict[int, int] = {}  # first buffer's data_ptr -> slot
        self._next = 0
        self._misses = 0

    @property
    def misses(self) -> int:
        """Copies that found every buffer held and went to a fresh allocation."""
        with self._lock:
            return self._misses

    def take(self, like: list[torch.Tensor], stream: Any) -> list[torch.Tensor]:
        """Tensors shaped like `like`, in a free slot or freshly allocated; `stream`, the
        lane's, is where the copy into them will run."""
        with self._lock:
            slot = self._claim()
            if slot is None:
                self._misses += 1
                return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in like]
            buffers = self._buffers[slot]
            if buffers is None or not _fits(buffers, like):
                if buffers is not None:
                    self._by_ptr.pop(buffers[0].data_ptr(), None)
                buffers = [torch.empty(x.numel(), dtype=x.dtype, device=x.device) for x in like]
                self._buffers[slot] = buffers
                self._by_ptr[buffers[0].data_ptr()] = slot
            after, self._after[slot] = self._after[slot], None
        if after is not None:
            stream.wait_event(after)
        return [buf[: x.numel()].view(x.shape) for buf, x in zip(buffers, like, strict=True)]

    def _claim(self) -> int | None:
        for step in range(len(self._free)):
            slot = (self._next + step) % len(self._free)
            if self._free[slot]:
                self._free[slot] = False
                self._next = slot + 1
                return slot
        return None

    def give_back(self, first: torch.Tensor, event: Any) -> bool:
        """Frees the slot whose first buffer is `first`'s storage, once `event` passes;
        False when `first` is not this ring's."""
        with self._lock:
            slot = self._by_ptr.get(first.data_ptr())
            if slot is None or self._free[slot]:
                return False
            self._after[slot] = event
            self._free[slot] = True
            return True


def _fits(buffers: list[torch.Tensor], like: list[torch.Tensor]) -> bool:
    return len(buffers) == len(like) and all(
        buf.dtype == x.dtype and buf.device == x.device and buf.numel() >= x.numel()
        for buf, x in zip(buffers, like, strict=True)
    )
