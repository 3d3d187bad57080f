"""A graph stage's memory pools: torch's handle per pool, the bytes it reserves, and how a
pool whose graphs are all gone gives its memory back. No torch import until one is used.

Note [Giving a pool back]: torch frees a graph pool's memory only when no graph uses it
(`releasePool`, which `CUDAGraph.reset` and its destructor call, brought the pool's use
count to 0), no tensor of it is alive, and cached blocks are freed (`empty_cache`;
c10/cuda/CUDACachingAllocator.cpp). So when the last graph of a pool leaves a lane's
cache (pydflash/graphs/cache.py), the cache drops its references to the pool's graphs and
outputs, moves the pool to `retiring`, and calls `give_back`: once no capture
is open anywhere in the process, `torch.cuda.empty_cache()`. The pool's bytes are read
before and after; `stats()` counts `pools_released` and `released_bytes`. A pool still
held elsewhere (a graph or output someone kept) stays retiring, and `stats()` tries it
again. `empty_cache` frees every unused cached block of the process, not just the pool's:
it runs only when a pool is given back, which the policy does a few times per run.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from . import _cuda_capture

DEFAULT_POOL = "graphs"


@dataclass
class Pool:
    """One of a lane's memory pools: torch's handle and the bytes last measured in it."""

    name: str
    handle: Any
    bytes: int = 0


class _CaptureGate:
    """Captures open in the process, against which a release waits (Note [Giving a pool
    back]): torch's caching allocator asserts that no capture is underway when it frees
    cached blocks, on any device (`synchronize_and_free_events` in
    c10/cuda/CUDACachingAllocator.cpp), so `give_back` waits for pydflash's captures to
    end and holds new ones back while it runs. A capture made outside pydflash is not
    seen: do not capture elsewhere in the process while a graph stage runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0  # captures between capture_begin and the end of their cleanup
        self._releasing = False

    @contextlib.contextmanager
    def capturing(self) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: not self._releasing)
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def releasing(self) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: not self._releasing)
            self._releasing = True
            self._cond.wait_for(lambda: self._open == 0)
        try:
            yield
        finally:
            with self._cond:
                self._releasing = False
                self._cond.notify_all()


OPEN_CAPTURES = _CaptureGate()


def new_pool() -> Any:
    import torch

    return torch.cuda.graph_pool_handle()


def pool_bytes(pool: Any, device: int | None) -> int:
    """Bytes the caching allocator reserves for graph pool `pool` on `device`."""
    import torch

    pool = tuple(pool)
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", ())) == pool and segment.get("device") == device
    )


@dataclass
class Freed:
    pools: int = 0  # pools that held memory and hold none now
    bytes: int = 0


def give_back(retiring: list[Pool], device: int | None, measure: Any) -> Freed:
    """Note [Giving a pool back]: frees what `retiring` pools reserve, reading each one's
    bytes with `measure(handle, device)` before and after; each pool's `bytes` is left
    at what it still holds."""
    freed = Freed()
    with OPEN_CAPTURES.releasing():  # the snapshots too: no capture is open meanwhile
        before = [measure(p.handle, device) for p in retiring]
        _cuda_capture.empty_cache()
        for pool, was in zip(retiring, before, strict=True):
            pool.bytes = measure(pool.handle, device)
            freed.bytes += was - pool.bytes
            freed.pools += bool(was and not pool.bytes)
    return freed
