"""The allocator: `triton.set_allocator` is per thread, so a lane thread would start with
none. While the guard is on, lane threads get the allocator last set on any thread."""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any

from ..lanes._lane_runtime import register_thread_hook
from .checks import Checker
from .patching import Change, Patch

_on = False
_carried: Any = None  # what triton.set_allocator last set, on any thread, while _on


class _ProcessAllocator:
    """Lane threads' Triton allocator: the carried one (Triton's NullAllocator, which
    raises, when there is none or the guard is off)."""

    def __call__(self, size: int, alignment: int, stream: Any) -> Any:
        allocator = _carried
        if allocator is None:
            from triton.runtime._allocation import NullAllocator

            allocator = NullAllocator()
        return allocator(size, alignment, stream)


def _lane_thread_setup(device: int) -> None:
    if not _on:
        return
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        _allocation._allocator.set(_ProcessAllocator())


@dataclass
class _Carrying:
    """Carrying on, starting from `first` (set on the installing thread before the guard)."""

    first: Any

    def apply(self) -> None:
        global _on, _carried
        _on, _carried = True, self.first
        register_thread_hook(_lane_thread_setup)

    def undo(self) -> None:
        global _on, _carried
        _on, _carried = False, None


def plan(check: Checker) -> list[Change]:
    try:
        from triton.runtime import _allocation
    except ImportError:  # older than per-thread allocators: nothing to carry
        return []
    ok = check.has_attr("triton.runtime._allocation", _allocation, "_allocator")
    if ok and not isinstance(_allocation._allocator, contextvars.ContextVar):
        return []  # one per process already (Triton < 3.5)
    ok &= check.has_attr("triton.runtime._allocation", _allocation, "set_allocator")
    ok &= check.has_attr("triton.runtime._allocation", _allocation, "NullAllocator")
    if not ok:
        return []
    import triton

    original = _allocation.set_allocator
    current = _allocation._allocator.get()
    first = None if isinstance(current, (_allocation.NullAllocator, _ProcessAllocator)) else current

    def set_allocator(allocator: Any) -> None:
        global _carried
        if _on:
            _carried = allocator
        original(allocator)

    functools.update_wrapper(set_allocator, original)
    patches: list[Change] = [_Carrying(first), Patch(_allocation, "set_allocator", set_allocator)]
    if getattr(triton, "set_allocator", None) is original:
        patches.append(Patch(triton, "set_allocator", set_allocator))
    return patches
