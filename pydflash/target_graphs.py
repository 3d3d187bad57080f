"""A frozen target's forward as CUDA graphs over (batch, length) buckets.

    target = pydflash.TargetGraphs(target_forward)            # fn(batch), as for EagerTarget
    pipe = pydflash.Pipeline(target_lanes, drafter_lanes, target=target, ...)

A target forward launches hundreds of small kernels with the GIL held; replayed as a
CUDA graph it is one launch. Real batches vary in length, so `TargetGraphs` pads each
batch on the right to a bucket, replays the graph captured for that bucket on that lane
(capturing it on first use), and returns the outputs cut back to the real shape.

Note [Bucket padding]: every tensor in the batch is [B, T, ...] (or [B]); it is padded on
the right to [Bb, Tb, ...], the bucket, with `pad_value`. In a causal model no real
position attends to a later one, so the real positions' outputs do not depend on the
padding (kernels may tile a longer sequence differently: equal within the dtype's
rounding, not bit for bit). Outputs shaped [Bb, Tb, ...] are cut to [B, T, ...], those
shaped [Bb, ...] to [B, ...]; others are returned whole. Everything that is not a tensor
is part of the bucket's key: a graph replays what was captured, constants included.

Note [Shared graph pool]: a lane's graphs share one memory pool, so a later capture reuses
the scratch memory of earlier ones. torch calls pool sharing safe for graphs that never
run at once. Here every replay runs on the lane's one stream, and its outputs are copied
out on that stream before the next replay starts, so no graph's outputs are read after
another graph may have written over them. Captures of one bucket on several lanes take
turns in the compile queue: the first lane warms up (compiles and autotunes) alone, the
others find warm caches. Capture uses torch's "thread_local" error mode, so the other
lanes keep allocating and synchronising while one lane captures.

Note [Output ring]: a replay's outputs are copied into one of `ring` buffers of the lane
rather than into a fresh allocation. A buffer is handed out again only once its holder
gave it back with `release(result, event)`, and the copy into it waits on that event on
the GPU, so the next copy cannot overwrite what the consumer still reads. When every
buffer is still held, the copy goes to a fresh allocation (`ring_misses` in stats()).
`Pipeline` releases each result after the drafter's backward.

Fallback: when no graph can serve (a length above the largest bucket, or a capture that
fails because the forward syncs with the host or has data-dependent shapes, like MoE
routing with `nonzero`), the batch runs eagerly, unpadded, and a GraphFallbackWarning
says why, once per reason. A byte cap on a lane's pool (`max_pool_bytes`) refuses a
capture that leaves the pool above it: the bucket then runs eagerly, or raises
GraphMemoryError with on_full="raise". `max_graphs` evicts the least recently used
graphs of a lane. On CPU lanes there are no graphs: batches take the same padded path,
run eagerly.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import compile_queue
from ._future import Future
from ._torch_state import match_intra_op_threads
from .errors import GraphFallbackWarning, GraphMemoryError
from .handoff import tensors, to_lane
from .lane import Lane
from .stages import TargetStage

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_RING = 4
ON_FULL = ("eager", "raise")

# How an output leaf is cut back (Note [Bucket padding]).
_WHOLE, _CUT_BATCH, _CUT_BOTH = 0, 1, 2


@dataclass(frozen=True)
class Bucket:
    """A padded batch shape: `batch` sequences of `length` tokens."""

    batch: int
    length: int


def choose_bucket(
    batch: int, length: int, lengths: Sequence[int], batch_sizes: Sequence[int] | None
) -> Bucket | None:
    """The smallest bucket holding a [batch, length] batch; None when none does.
    `lengths` and `batch_sizes` are sorted; batch_sizes None buckets each batch size alone."""
    i = bisect.bisect_left(lengths, length)
    if i == len(lengths):
        return None
    if batch_sizes is None:
        return Bucket(batch, lengths[i])
    j = bisect.bisect_left(batch_sizes, batch)
    if j == len(batch_sizes):
        return None
    return Bucket(batch_sizes[j], lengths[i])


def batch_shape(leaves: Sequence[Any]) -> tuple[int, int]:
    """(B, T) shared by a batch's tensors: [B, T, ...] ones give both, [B] ones B."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    long = [x for x in tensors if x.dim() >= 2]
    if not long:
        raise ValueError(
            "expected a batch with at least one [batch, length, ...] tensor, got "
            + (f"tensors of shapes {[tuple(x.shape) for x in tensors]}" if tensors else "no tensor")
        )
    b, t = long[0].shape[:2]
    for x in tensors:
        if x.dim() == 0 or x.shape[0] != b or (x.dim() >= 2 and x.shape[1] != t):
            raise ValueError(
                f"expected every tensor of the batch as [{b}, {t}, ...] or [{b}], "
                f"got one of shape {tuple(x.shape)}"
            )
    return int(b), int(t)


def _signature(leaves: Sequence[Any]) -> tuple:
    """What besides the bucket a graph is specific to: dtypes and trailing dims of the
    tensors, and the values of everything else."""
    return tuple(
        (x.dtype, tuple(x.shape[2:]), x.dim()) if isinstance(x, torch.Tensor) else ("const", x)
        for x in leaves
    )


def _pad(x: Any, bucket: Bucket, value: float) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    shape = (bucket.batch, bucket.length, *x.shape[2:]) if x.dim() >= 2 else (bucket.batch,)
    if tuple(x.shape) == shape:
        return x
    out = x.new_full(shape, value)
    _copy_padded(out, x, value)
    return out


def _resize(x: Any, bucket: Bucket, value: float) -> Any:
    """x cut or padded to exactly the bucket's shape."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x[: bucket.batch, : bucket.length] if x.dim() >= 2 else x[: bucket.batch]
    return _pad(x, bucket, value)


def _copy_padded(static: torch.Tensor, x: torch.Tensor, value: float) -> None:
    """Writes x into the top-left corner of `static` and `value` everywhere else."""
    b = x.shape[0]
    if x.dim() >= 2:
        t = x.shape[1]
        static[:b, :t].copy_(x, non_blocking=True)
        if t < static.shape[1]:
            static[:b, t:].fill_(value)
    else:
        static[:b].copy_(x, non_blocking=True)
    if b < static.shape[0]:
        static[b:].fill_(value)


def _cut_kind(out: Any, bucket: Bucket) -> int:
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != bucket.batch:
        return _WHOLE
    if out.dim() >= 2 and out.shape[1] == bucket.length:
        return _CUT_BOTH
    return _CUT_BATCH


def _cut(out: Any, kind: int, b: int, t: int) -> Any:
    if kind == _CUT_BOTH:
        return out[:b, :t]
    if kind == _CUT_BATCH:
        return out[:b]
    return out


# --- per lane ------------------------------------------------------------------------------
@dataclass
class _Graph:
    graph: Any
    static_inputs: list[Any]  # the padded batch's leaves; tensors are the graph's inputs
    static_outputs: list[Any]
    out_spec: Any
    out_cuts: list[int]
    bucket: Bucket


class _Ring:
    """The lane's output buffers (Note [Output ring]). Used on the lane's worker only,
    but for `release`, which may come from any thread: hence the lock."""

    def __init__(self, slots: int) -> None:
        self._lock = threading.Lock()
        self._buffers: list[list[torch.Tensor] | None] = [None] * slots
        self._free: list[bool] = [True] * slots
        self._after: list[Any] = [None] * slots  # event the next copy into the slot waits on
        self._by_ptr: dict[int, int] = {}  # first buffer's data_ptr -> slot
        self._next = 0
        self.misses = 0

    def take(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped like `like`, in a free slot or freshly allocated."""
        with self._lock:
            slot = self._claim()
            if slot is None:
                self.misses += 1
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
            torch.cuda.current_stream().wait_event(after)
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


@dataclass
class _LaneGraphs:
    """One lane's graphs, touched only by that lane's worker (stats under the owner's lock)."""

    ring: _Ring
    pool: Any = None
    graphs: OrderedDict = field(default_factory=OrderedDict)  # key -> _Graph, LRU first
    eager: dict = field(default_factory=dict)  # key -> why it runs eagerly
    captures: int = 0
    replays: int = 0
    eager_runs: int = 0
    evictions: int = 0
    pool_bytes: int = 0


# --- the stage -----------------------------------------------------------------------------
class TargetGraphs(TargetStage):
    """fn(batch), a frozen target's forward, replayed as CUDA graphs per (batch, length)
    bucket on each lane that runs it. See the module's notes.

    lengths: the bucket lengths (default 128 to 8192, powers of two); a longer batch runs
        eagerly. batch_sizes: the bucket batch sizes; None (default) gives each batch size
        its own buckets.
    pad_value: what padding holds, or a dict of it per key of a dict batch (default 0).
    warmup: eager calls before a capture (lazy initialisation, autotuning).
    ring: output buffers per lane (Note [Output ring]); at least a pipeline's depth, so
        no microbatch waits for a fresh allocation; 0 allocates every output afresh.
    max_pool_bytes: the most a lane's graph pool may hold; on_full says what happens to a
        capture past it: "eager" (run that bucket eagerly, warn) or "raise".
    max_graphs: graphs kept per lane; beyond it the least recently used is dropped.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        lengths: Iterable[int] = DEFAULT_LENGTHS,
        batch_sizes: Iterable[int] | None = None,
        pad_value: float | dict[str, float] = 0,
        warmup: int = 2,
        ring: int = DEFAULT_RING,
        max_pool_bytes: int | None = None,
        on_full: str = "eager",
        max_graphs: int | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"expected a callable target, got {type(fn).__name__}")
        self.fn = fn
        self.lengths = _sorted_sizes(lengths, "lengths")
        self.batch_sizes = (
            None if batch_sizes is None else _sorted_sizes(batch_sizes, "batch_sizes")
        )
        if not isinstance(pad_value, (int, float, dict)) or isinstance(pad_value, bool):
            raise TypeError(
                f"expected pad_value as a number or a dict, got {type(pad_value).__name__}"
            )
        self.pad_value = pad_value
        self.warmup_calls = _count(warmup, "warmup", minimum=0)
        self.ring = _count(ring, "ring", minimum=0)
        self.max_pool_bytes = (
            None if max_pool_bytes is None else _count(max_pool_bytes, "max_pool_bytes", minimum=1)
        )
        if on_full not in ON_FULL:
            raise ValueError(f"expected on_full in {ON_FULL}, got {on_full!r}")
        self.on_full = on_full
        self.max_graphs = (
            None if max_graphs is None else _count(max_graphs, "max_graphs", minimum=1)
        )
        self._lock = threading.Lock()
        self._lanes: dict[Lane, _LaneGraphs] = {}
        self._warned: set[str] = set()
        self._fallbacks: dict[str, int] = {}

    # --- TargetStage ----------------------------------------------------------------------
    def submit(self, lane: Lane, batch: Any) -> Future:
        """Runs the forward of `batch` on `lane`; the future's result is fn's output cut
        back to the batch's shape (in a ring buffer: give it back with `release`)."""
        return lane.submit(self._run, lane, batch, torch.get_num_threads())

    run = submit

    @property
    def recycles(self) -> bool:  # type: ignore[override]
        return self.ring > 0

    def release(self, result: Any, event: Any = None) -> None:
        """Gives `result`'s ring buffer back once `event` (a torch.cuda.Event; default:
        one recorded now on the current stream) has passed on the GPU. Results that are
        not in a ring buffer are left alone."""
        first = next(iter(tensors(result)), None)
        if first is None or not first.is_cuda:
            return
        if event is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(first.device))
        with self._lock:
            rings = [state.ring for state in self._lanes.values()]
        for ring in rings:
            if ring.give_back(first, event):
                return

    def warmup(
        self,
        lanes: Sequence[Lane] | Lane,
        example: Any,
        shapes: Iterable[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """Captures ahead: on every lane, the bucket of each (batch, length) in `shapes`
        (default: every length bucket at the example's batch size), from `example` padded
        or cut to that shape. Lanes capture at once; returns stats()."""
        lanes = [lanes] if isinstance(lanes, Lane) else list(lanes)
        leaves, spec = pytree.tree_flatten(example)
        b, _ = batch_shape(leaves)
        if shapes is None:
            shapes = [(b, length) for length in self.lengths]
        pads = self._pads(example, leaves)
        batches = [
            pytree.tree_unflatten(
                [
                    _resize(x, Bucket(batch, length), pad)
                    for x, pad in zip(leaves, pads, strict=True)
                ],
                spec,
            )
            for batch, length in shapes
        ]
        futures = [self.submit(lane, batch) for lane in lanes for batch in batches]
        for future in futures:
            self.release(future.wait_stream() if future.event else future.result())
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Per lane label: the buckets captured (batch, length), captures, replays, eager
        runs, evictions, ring misses and the bytes its graph pool reserves; plus the
        fallback reasons seen, with counts."""
        with self._lock:
            lanes = {
                lane.label: {
                    "buckets": [(g.bucket.batch, g.bucket.length) for g in s.graphs.values()],
                    "captures": s.captures,
                    "replays": s.replays,
                    "eager_runs": s.eager_runs,
                    "evictions": s.evictions,
                    "ring_misses": s.ring.misses,
                    "pool_bytes": s.pool_bytes,
                }
                for lane, s in self._lanes.items()
            }
            return {"lanes": lanes, "fallbacks": dict(self._fallbacks)}

    # --- on the lane's worker ----------------------------------------------------------------
    def _run(self, lane: Lane, batch: Any, threads: int) -> Any:
        match_intra_op_threads(threads)
        with torch.no_grad():
            batch = to_lane(batch, lane)
            leaves, spec = pytree.tree_flatten(batch)
            b, t = batch_shape(leaves)
            state = self._state(lane)
            bucket = choose_bucket(b, t, self.lengths, self.batch_sizes)
            if bucket is None:
                limit = f"{self.lengths[-1]}" + (
                    "" if self.batch_sizes is None else f" x batch {self.batch_sizes[-1]}"
                )
                return self._eager(
                    state,
                    batch,
                    "too long",
                    f"a batch of {b} x {t} is above the largest bucket ({limit})",
                )
            pads = self._pads(batch, leaves)
            key = (bucket, spec, _signature(leaves))
            if key in state.eager:
                return self._eager(state, batch, *state.eager[key])
            if not lane.is_gpu:
                out = self.fn(pytree.tree_unflatten(self._padded(leaves, pads, bucket), spec))
                out_leaves, out_spec = pytree.tree_flatten(out)
                cut = [_cut(x, _cut_kind(x, bucket), b, t) for x in out_leaves]
                return pytree.tree_unflatten(
                    [x.clone() if isinstance(x, torch.Tensor) else x for x in cut], out_spec
                )
            graph = state.graphs.get(key)
            if graph is None:
                padded = self._padded(leaves, pads, bucket)
                graph = self._capture(state, lane, key, bucket, padded, spec)
                if graph is None:
                    return self._eager(state, batch, *state.eager[key])
            else:
                state.graphs.move_to_end(key)
                for static, x, pad in zip(graph.static_inputs, leaves, pads, strict=True):
                    if isinstance(x, torch.Tensor):
                        _copy_padded(static, x, pad)
            graph.graph.replay()
            state.replays += 1
            return self._copy_out(state, graph, b, t)

    @staticmethod
    def _padded(leaves: list[Any], pads: list[float], bucket: Bucket) -> list[Any]:
        # A replay copies straight into the graph's static inputs: only the CPU path and
        # a capture need a padded copy of their own.
        return [_pad(x, bucket, pad) for x, pad in zip(leaves, pads, strict=True)]

    def _copy_out(self, state: _LaneGraphs, graph: _Graph, b: int, t: int) -> Any:
        outputs = zip(graph.static_outputs, graph.out_cuts, strict=True)
        cut = [_cut(x, kind, b, t) for x, kind in outputs]
        tensors = [x for x in cut if isinstance(x, torch.Tensor)]
        copies = iter(state.ring.take(tensors))
        out = []
        for x in cut:
            if isinstance(x, torch.Tensor):
                copy = next(copies)
                copy.copy_(x)
                out.append(copy)
            else:
                out.append(x)
        return pytree.tree_unflatten(out, graph.out_spec)

    def _capture(
        self,
        state: _LaneGraphs,
        lane: Lane,
        key: tuple,
        bucket: Bucket,
        padded: list[Any],
        spec: Any,
    ) -> _Graph | None:
        if self.max_graphs is not None:
            while len(state.graphs) >= self.max_graphs:
                state.graphs.popitem(last=False)
                state.evictions += 1
        if state.pool is None:
            state.pool = torch.cuda.graph_pool_handle()
        # Static inputs live outside the pool: the padded batch is fresh on this lane.
        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in padded]
        name = f"TargetGraphs {id(self):x} {bucket.batch}x{bucket.length}"

        def capture() -> _Graph | str:
            batch = pytree.tree_unflatten(static, spec)
            for _ in range(self.warmup_calls):
                self.fn(batch)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=state.pool, capture_error_mode="thread_local")
            try:
                out = self.fn(batch)
            except Exception as exc:  # noqa: BLE001 - any failure inside capture falls back
                _end_failed_capture(graph)
                return f"capture failed: {type(exc).__name__}: {_first_line(exc)}"
            try:
                graph.capture_end()
            except RuntimeError as exc:
                return f"capture failed: {_first_line(exc)}"
            out_leaves, out_spec = pytree.tree_flatten(out)
            return _Graph(
                graph,
                static,
                out_leaves,
                out_spec,
                [_cut_kind(x, bucket) for x in out_leaves],
                bucket,
            )

        captured = compile_queue.run(f"{name} on {lane.label}", capture, slot=name)
        if isinstance(captured, str):
            state.eager[key] = ("capture", captured)
            return None
        with self._lock:
            state.captures += 1
            state.pool_bytes = pool_bytes(state.pool, lane.device_index)
        if self.max_pool_bytes is not None and state.pool_bytes > self.max_pool_bytes:
            message = (
                f"expected the graph pool of {lane.label} to stay within max_pool_bytes="
                f"{self.max_pool_bytes}, got {state.pool_bytes} bytes after capturing bucket "
                f"{bucket.batch} x {bucket.length}"
            )
            del captured
            if self.on_full == "raise":
                raise GraphMemoryError(message + "; raise max_pool_bytes or use fewer buckets")
            state.eager[key] = ("memory cap", message)
            return None
        state.graphs[key] = captured
        return captured

    def _eager(self, state: _LaneGraphs, batch: Any, kind: str, reason: str) -> Any:
        with self._lock:
            state.eager_runs += 1
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            warnings.warn(
                f"pydflash.TargetGraphs runs eagerly: {reason}", GraphFallbackWarning, stacklevel=2
            )
        return self.fn(batch)

    def _state(self, lane: Lane) -> _LaneGraphs:
        state = self._lanes.get(lane)
        if state is None:
            with self._lock:
                state = self._lanes.setdefault(lane, _LaneGraphs(_Ring(self.ring)))
        return state

    def _pads(self, batch: Any, leaves: list[Any]) -> list[float]:
        if not isinstance(self.pad_value, dict):
            return [self.pad_value] * len(leaves)
        if not isinstance(batch, dict):
            raise TypeError(
                f"expected a dict batch for a dict pad_value, got {type(batch).__name__}"
            )
        pads = []
        for key, value in batch.items():
            pads += [self.pad_value.get(key, 0)] * len(pytree.tree_leaves(value))
        return pads

    def __repr__(self) -> str:
        return f"<pydflash.TargetGraphs of {getattr(self.fn, '__qualname__', self.fn)!s}>"


def pool_bytes(pool: Any, device: int | None) -> int:
    """Bytes the caching allocator reserves for graph pool `pool` on `device`."""
    pool = tuple(pool)
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", ())) == pool and segment.get("device") == device
    )


def _end_failed_capture(graph: Any) -> None:
    # Leaves the lane stream out of capture mode; the capture was invalidated by the failure
    # being reported.
    with contextlib.suppress(RuntimeError):
        graph.capture_end()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _sorted_sizes(values: Iterable[int], name: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted(set(values)))
    except TypeError:
        raise TypeError(f"expected {name} as an iterable of ints, got {values!r}") from None
    if not sizes or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
        raise ValueError(f"expected {name} as positive ints, got {values!r}")
    return sizes


def _count(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected {name} as an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"expected {name} >= {minimum}, got {value}")
    return value
